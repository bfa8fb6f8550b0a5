"""`sparkpoint run` killed (SIGKILL, whole process group) at random moments, then resumed."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.checkpoint.sweep import sweep_orphans
from sparkpoint.cli import main
from sparkpoint.spark.generate import generate
from tests.support import oracle

pytestmark = pytest.mark.spark


def run_command(tmp_path: Path) -> list[str]:
    return [
        sys.executable, "-m", "sparkpoint.cli", "run", "--input", str(tmp_path / "in"),
        "--checkpoints", f"file://{tmp_path}/ckpt", "--job-id", "job", "--retain", "2", "--parallelism", "2",
        "--output", f"file://{tmp_path}/out", "--local-dir", str(tmp_path / "local"), "--master", "local[2]",
    ]


def run_and_kill(cmd: list[str], after: int, delay: float, tmp_path: Path) -> list[str]:
    """Start the run and SIGKILL its group `delay` seconds after its `after`-th checkpoint line:
    the moment depends on progress, not on how fast the machine is. Returns its output lines as
    soon as it is killed or ends by itself (its standard error follows them)."""
    err = tmp_path / f"run-{time.monotonic_ns()}.err"
    with open(err, "w") as stderr:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True)
        assert proc.stdout is not None
        lines: list[str] = []
        for line in proc.stdout:  # ends at once when the run ends
            lines.append(line.strip())
            if sum(seen.startswith("chk-") for seen in lines) == after:
                time.sleep(delay)  # mid-way into the next batch (each takes longer than this)
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                break
        proc.wait(timeout=60)
    return lines + [f"stderr: {line}" for line in err.read_text().splitlines()]


def test_killed_runs_resume_to_the_uninterrupted_result(tmp_path: Path):
    generate(str(tmp_path / "in"), batches=9, events_per_batch=4000, users=500, items=80, seed=5)
    rng = random.Random(2026)
    cmd = run_command(tmp_path)
    for _ in range(3):  # each killed after 1 or 2 of its checkpoints: at least 3 of the 9 batches remain
        lines = run_and_kill(cmd, rng.randint(1, 2), rng.uniform(0.0, 0.1), tmp_path)
        assert any(line.startswith("chk-") for line in lines), f"each run made progress before it was killed: {lines}"
    final = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert final.returncode == 0, final.stderr[-3000:]

    batches = oracle.read_batches(str(tmp_path / "in"))
    events = pd.concat(batches, ignore_index=True)
    storage = CheckpointStorage(f"file://{tmp_path}/ckpt", "job")
    store = CompletedCheckpointStore(storage)
    latest = store.load(store.checkpoint_ids()[0])
    assert len(latest.source_offsets["source"]["consumed"]) == 9
    for operator, expected, check in [
        ("user_totals", oracle.user_totals(events), oracle.assert_totals_equal),
        ("item_reach", oracle.item_reach(events), oracle.assert_reach_equal),
    ]:
        out = tmp_path / f"{operator}.parquet"
        assert main(["state", "--checkpoints", f"file://{tmp_path}/ckpt", "--job-id", "job", "--operator", operator,
                     "--format", "parquet", "--out", str(out)]) == 0
        check(pd.read_parquet(out), expected)

    output = pd.read_parquet(tmp_path / "out")
    expected_sink = oracle.sink_rows(batches)
    per_checkpoint = [g for _, g in sorted(output.groupby("checkpoint_id"), key=lambda t: t[0])]
    assert len(per_checkpoint) == 9, "every batch is in the output exactly once"
    for got, expected in zip(per_checkpoint, expected_sink):
        oracle.assert_totals_equal(got, expected)
    assert not list((tmp_path / "out" / "_staging").glob("chk-*"))

    assert main(["verify", "--checkpoints", f"file://{tmp_path}/ckpt", "--job-id", "job"]) == 0
    assert main(["gc", "--checkpoints", f"file://{tmp_path}/ckpt", "--job-id", "job", "--grace", "0"]) == 0
    referenced = set()
    for meta in store.load_all().checkpoints:
        referenced |= meta.paths() | {meta.metadata_path}
    on_storage = {f.path for f in storage.walk("shared")}
    on_storage |= {f.path for cid in storage.checkpoint_dirs() for f in storage.walk(f"chk-{cid}")}
    assert on_storage == referenced, "after gc --grace 0 every file left is referenced"
    assert sweep_orphans(storage, grace_seconds=0, dry_run=True).orphans == ()
