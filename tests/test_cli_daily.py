"""Rough edges a new user hit in the CLI: `list --pipeline` names the pipeline's job, and `gc
--dry-run` says how many unreferenced files it kept for being younger than the grace period and
how to include them. A user's own pipeline (tests.support.interleavings' balances), not the sample's."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from sparkpoint import Pipeline
from sparkpoint.cli import main
from tests.support.interleavings import BALANCES, InProcessPipeline


def test_list_with_a_pipeline_names_its_job_and_gc_says_what_the_grace_period_kept(tmp_path: Path, capsys,
                                                                                   monkeypatch):
    (tmp_path / "in").mkdir()
    pd.DataFrame({"acct": ["a", "b"], "amount": [5, 7]}).to_parquet(tmp_path / "in" / "b0.parquet")
    spec = Pipeline("ledger", [BALANCES], input_url=str(tmp_path / "in"), checkpoints_url=str(tmp_path / "ckpt"),
                    local_dir=str(tmp_path / "local"), parallelism=1, max_parallelism=8)
    InProcessPipeline(None, spec.config(), spec.operators).run()
    (tmp_path / "ledger_module.py").write_text(
        "from sparkpoint import Pipeline\nfrom tests.support.interleavings import BALANCES\n"
        f"ledger = Pipeline('ledger', [BALANCES], checkpoints_url={str(tmp_path / 'ckpt')!r}, max_parallelism=8)\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    assert main(["list", "--pipeline", "ledger_module:ledger"]) == 0
    out = capsys.readouterr().out
    assert "1 retained checkpoint(s) of ledger" in out and "None" not in out

    orphan = tmp_path / "ckpt" / "ledger" / "shared" / "balances" / "0" / "left-behind.sst"
    orphan.write_bytes(b"x" * 3000)  # as a killed writer leaves it: just now
    assert main(["gc", "--pipeline", "ledger_module:ledger", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would delete 0 orphan files" in out
    assert "kept 1 unreferenced files (2.9 KiB) younger than the grace period (3600 s)" in out
    assert "--grace 0" in out and orphan.exists()
    assert main(["gc", "--pipeline", "ledger_module:ledger", "--dry-run", "--grace", "0", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["orphans"] == ["shared/balances/0/left-behind.sst"] and report["young"] == []
