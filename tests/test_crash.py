"""`sparkpoint run` killed (SIGKILL, whole process group) at random moments, then resumed.

`make test` kills one run (its Spark with it) and resumes on the tests' shared Spark; `make soak`
kills three runs in a row, each resumed by the next (the same check, more kill moments)."""

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
from tests.support.crashkit import run_in_process

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


@pytest.mark.parametrize("kills", [1, pytest.param(3, marks=pytest.mark.soak)])  # one kill in make test
def test_killed_runs_resume_to_the_uninterrupted_result(spark, tmp_path: Path, kills: int):
    batches_in = 3 * kills + 2  # each run is killed after 1 or 2 of its checkpoints: 2 or more remain
    generate(str(tmp_path / "in"), batches=batches_in, events_per_batch=4000, users=500, items=80, seed=5)
    rng = random.Random(2026)
    cmd = run_command(tmp_path)
    for _ in range(kills):
        lines = run_and_kill(cmd, rng.randint(1, 2), rng.uniform(0.0, 0.1), tmp_path)
        assert any(line.startswith("chk-") for line in lines), f"each run made progress before it was killed: {lines}"
    assert run_in_process(spark, cmd), "the resume took the batches the killed runs left"

    batches = oracle.read_batches(str(tmp_path / "in"))
    events = pd.concat(batches, ignore_index=True)
    storage = CheckpointStorage(f"file://{tmp_path}/ckpt", "job")
    store = CompletedCheckpointStore(storage)
    latest = store.load(store.checkpoint_ids()[0])
    assert len(latest.source_offsets["source"]["consumed"]) == batches_in
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
    assert len(per_checkpoint) == batches_in, "every batch is in the output exactly once"
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
