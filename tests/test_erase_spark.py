"""`sparkpoint erase` on Spark: a user's operator (value with a TTL, map, list, timers) run across
a savepoint and a rescale, a key erased through the command line from every retained checkpoint,
the savepoint, the task-local copies and the output (Parquet parts, a Delta table), with the report's proof; then the
job runs on from the erased checkpoints, and `sparkpoint verify` passes."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pandas as pd
import pytest

import sparkpoint
from sparkpoint.checkpoint.savepoint import take_savepoint
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.cli import main
from sparkpoint.pipeline.driver import StatefulPipeline
from sparkpoint.pipeline.erase import ERASED_FROM
from tests.support import members_pipeline as mp

GONE = "m-007"
MEMBERS = [f"m-{i:03d}" for i in range(24)]


def output_rows(out: Path) -> pd.DataFrame:
    """The visible output: the Parquet directory's part files, or the Delta table's current version."""
    if (out / "_delta_log").is_dir():
        from deltalake import DeltaTable

        return DeltaTable(str(out)).to_pandas()
    return pd.concat([pd.read_parquet(f) for f in sorted(out.glob("part-*.parquet"))], ignore_index=True)


@pytest.mark.spark
@pytest.mark.parametrize("output", ["parquet", "delta"])
def test_a_key_is_erased_from_checkpoints_savepoint_local_copies_and_output_and_the_job_runs_on(
        spark, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], output: str):
    pipeline = mp.members_pipeline(tmp_path)
    if output == "delta":
        monkeypatch.setenv("MEMBERS_OUTPUT", "delta")
        pipeline = pipeline.with_(output_url=f"delta+file://{tmp_path}/out")
    for b in (1, 2):
        mp.land(tmp_path / "in", b, MEMBERS)
    assert [r.checkpoint_id for r in StatefulPipeline(spark, pipeline.config(), pipeline.operators).run()] == [1, 2]
    storage = CheckpointStorage(str(tmp_path / "ckpt"), "members")
    assert take_savepoint(storage).metadata.checkpoint_id == 3  # an upgrade's savepoint, kept in the job
    mp.land(tmp_path / "in", 3, MEMBERS)
    rescaled = pipeline.with_(parallelism=3)
    assert [r.checkpoint_id for r in StatefulPipeline(spark, rescaled.config(), rescaled.operators).run()] == [4]
    before = rescaled.read_state("memberships").set_index("member")
    assert before.loc[GONE, "renewals"] == 3 and len(before.loc[GONE, "visits"]) == 6
    assert (output_rows(tmp_path / "out")["member"] == GONE).sum() == 3
    local = tmp_path / "local" / "members" / "memberships"
    assert any(local.iterdir())

    monkeypatch.setenv("MEMBERS_ROOT", str(tmp_path))
    importlib.reload(mp)
    dry = sparkpoint.erase_keys(mp.members, [GONE], dry_run=True)
    assert [(c.original_id, c.entries_found > 0) for c in dry.checkpoints] == [(c, True) for c in (1, 2, 3, 4)]
    assert [o["rows_removed"] for o in dry.output] == [3] and (output_rows(tmp_path / "out")["member"] == GONE).sum()
    report_path = tmp_path / "erase-report.json"
    code = main(["erase", "--pipeline", "tests.support.members_pipeline:members", "--key", GONE,
                 "--report", str(report_path)])
    captured = capsys.readouterr()
    printed = captured.out
    assert code == 0, captured.err[-3000:]
    assert "VERIFIED" in printed
    report = json.loads(report_path.read_text())
    assert report["verified"] and report["keys"] == 1 and GONE not in report_path.read_text()
    rewritten = {c["original"]: c for c in report["checkpoints"]}
    assert [rewritten[c]["new"] for c in (1, 2, 3, 4)] == [5, 6, 7, 8]  # new ids, in the originals' order
    assert all(c["entries_removed"] > 0 and c["files_rewritten"] > 0 for c in rewritten.values())
    assert report["retired"] == [1, 2, 3, 4]
    assert [o["rows_removed"] for o in report["output"]] == [3]
    kept = {m.checkpoint_id: m for m in CompletedCheckpointStore(storage).load_all().checkpoints}
    assert sorted(kept) == [5, 6, 7, 8] and kept[7].kind == "savepoint"
    assert kept[8].source_offsets[ERASED_FROM]["checkpoint_id"] == 4

    # The key is gone from the state (every kind, timers too), the rest is as it was.
    after = rescaled.read_state("memberships").set_index("member")
    assert GONE not in after.index
    pd.testing.assert_frame_equal(after, before.drop(index=GONE))
    assert GONE not in set(output_rows(tmp_path / "out")["member"])
    assert report["local_dropped"] and not any(Path(d).exists() for d in report["local_dropped"])
    assert main(["verify", "--pipeline", "tests.support.members_pipeline:members"]) == 0

    # The job runs on from the erased copy of chk-4, above the copies' ids; the sink takes its output.
    mp.land(tmp_path / "in", 4, [m for m in MEMBERS if m != GONE])
    assert [r.checkpoint_id for r in StatefulPipeline(spark, rescaled.config(), rescaled.operators).run()] == [9]
    final = rescaled.read_state("memberships").set_index("member")
    assert GONE not in final.index and final.loc["m-001", "renewals"] == 4
    assert len(final.loc["m-001", "visits"]) == 8
    out = output_rows(tmp_path / "out")
    assert (out["member"] == "m-001").sum() == 4 and GONE not in set(out["member"])

    # A rollback to the erased copy of chk-2 undoes the output the sink recorded above 2 (batches 3
    # and 4, under the original id 4 and under 9), though the copy's own id is 6.
    assert main(["rollback", "--pipeline", "tests.support.members_pipeline:members", "--to", "6"]) == 0
    assert (output_rows(tmp_path / "out")["member"] == "m-001").sum() == 2
