"""`sparkpoint erase` racing runs, on local Spark with a user's operator (`tests.support.members_pipeline`:
a value state with a TTL, a map, a list and timers per club member; Parquet output).

A `sparkpoint run` started while an erase (a `sparkpoint erase` process, stopped mid-way holding its
lock) holds the job is refused, naming the erase's process, and starts nothing; the erase then
finishes. An erase started while a run's attempt is pending (a two-step run whose second step was
killed with SIGKILL before its `_metadata`) is refused, naming the attempt and the recover job, and
changes nothing. After the recovery and the erase, `sparkpoint verify` passes and both keys are
gone from every retained checkpoint and from the output."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from sparkpoint.checkpoint.crash import CRASH_AT, CRASH_DIR
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.cli import main
from sparkpoint.pipeline.attempt import pending_attempts, start_step
from sparkpoint.pipeline.driver import StatefulPipeline
from sparkpoint.pipeline.eraselock import LOCK
from sparkpoint.pipeline.maintenance import recover
from tests.support import members_pipeline as mp
from tests.support.waiting import wait_for

GONE, AGAIN = "m-007", "m-011"
MEMBERS = [f"m-{i:03d}" for i in range(24)]
CLI = "tests.support.members_pipeline:members"

# Step 2 of a two-step run (what an orchestrator's checkpoint step calls), in a process of its own.
FINISH_STEP = """
import sys
from sparkpoint.pipeline.attempt import finish_step
from sparkpoint.pipeline.driver import StatefulPipeline
from tests.support.members_pipeline import members
finish_step(StatefulPipeline(None, members.config(), members.operators), [sys.argv[1]])
"""


def _env(root: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKPOINT_CRASH")}
    return {**env, "MEMBERS_ROOT": str(root), "PYTHONPATH": os.getcwd(), **extra}


def _erase(root: Path, *keys: str) -> list[str]:
    report = root / f"erase-{'-'.join(keys)}.json"
    given = [a for k in keys for a in ("--key", k)]
    return [sys.executable, "-m", "sparkpoint.cli", "erase", "--pipeline", CLI, *given, "--report", str(report)]


def _retained(storage: CheckpointStorage) -> list[int]:
    return sorted(m.checkpoint_id for m in CompletedCheckpointStore(storage).load_all().checkpoints)


def _lock_held(storage: CheckpointStorage) -> dict[str, object] | None:
    try:
        return dict(json.loads(storage.read_bytes(LOCK)))
    except (FileNotFoundError, ValueError):
        return None


def _output(root: Path) -> pd.DataFrame:
    return pd.concat([pd.read_parquet(f) for f in sorted((root / "out").glob("part-*.parquet"))], ignore_index=True)


@pytest.mark.spark
def test_a_run_and_an_erase_refuse_each_other_and_the_keys_leave_every_checkpoint_and_the_output(
        spark, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    pipeline = mp.members_pipeline(tmp_path)
    config = pipeline.config()
    storage = CheckpointStorage(config.checkpoints_url, config.job_id)
    for b in (1, 2):
        mp.land(tmp_path / "in", b, MEMBERS)
    assert [r.checkpoint_id for r in StatefulPipeline(spark, config, pipeline.operators).run()] == [1, 2]

    # A run started while `sparkpoint erase` holds the job is refused, before Spark, naming the erase.
    erase = subprocess.Popen(_erase(tmp_path, GONE), env=_env(tmp_path), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        held = wait_for(lambda: _lock_held(storage), 120, 0.02, "the erase to take its lock",
                        stop=lambda: None if erase.poll() is None else "the erase ended before it was seen")
        os.kill(erase.pid, signal.SIGSTOP)
        assert held["pid"] == erase.pid
        mp.land(tmp_path / "in", 3, [m for m in MEMBERS if m != GONE])
        code = main(["run", "--pipeline", CLI, "--input", str(tmp_path / "in"), "--checkpoints",
                     config.checkpoints_url, "--output", str(tmp_path / "out"), "--local-dir", str(tmp_path / "local")])
        said = capsys.readouterr().err
        assert code == 2, said[-3000:]
        assert f"cannot start: an erase of keys by process {erase.pid} on " in said and LOCK in said
        assert "Let it finish; if it died, run the same `sparkpoint erase` again" in said
    finally:
        os.kill(erase.pid, signal.SIGCONT)
    out, err = erase.communicate(timeout=300)
    assert erase.returncode == 0, err[-3000:]
    assert "VERIFIED" in out and _lock_held(storage) is None
    assert _retained(storage) == [3, 4], "the copies of 1 and 2; the refused run committed nothing"
    assert [r.checkpoint_id for r in StatefulPipeline(spark, config, pipeline.operators).run()] == [5]  # batch 3

    # An erase started while a run's attempt is pending (its second step killed) is refused.
    mp.land(tmp_path / "in", 4, [m for m in MEMBERS if m != GONE])
    attempt = start_step(StatefulPipeline(spark, config, pipeline.operators), "run-4")
    assert attempt is not None and attempt.checkpoint_id == 6
    killed = subprocess.run([sys.executable, "-c", FINISH_STEP, "run-4"], capture_output=True, text=True, timeout=300,
                            env=_env(tmp_path, **{CRASH_AT: "before-metadata", CRASH_DIR: str(tmp_path / "crash")}),
                            start_new_session=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert [a.attempt_id for a in pending_attempts(storage)] == ["run-4"] and _retained(storage) == [3, 4, 5]
    refused = subprocess.run(_erase(tmp_path, AGAIN), env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "a run is in progress (attempt run-4 of checkpoint 6 is pending" in refused.stderr
    assert "if its run died, run the pipeline's recover job), then erase" in refused.stderr
    assert _retained(storage) == [3, 4, 5] and _lock_held(storage) is None and not storage.exists(LOCK)
    assert AGAIN in set(_output(tmp_path)["member"])

    # What the message says: the recover job (batch 4 processed again), then the erase goes through.
    recovered = recover(StatefulPipeline(spark, config, pipeline.operators), failed_attempts=("run-4",))
    assert recovered.batch is not None and not pending_attempts(storage)
    done = subprocess.run(_erase(tmp_path, AGAIN, GONE), env=_env(tmp_path), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / f"erase-{AGAIN}-{GONE}.json").read_text())
    assert report["verified"] and report["keys"] == 2
    assert all(c["entries_removed"] > 0 for c in report["checkpoints"]), "each retained one held AGAIN"
    assert main(["verify", "--checkpoints", config.checkpoints_url, "--job-id", config.job_id]) == 0
    kept = _retained(storage)
    assert len(kept) == 3 and kept == sorted(v["checkpoint_id"] for v in report["verification"])
    for cid in kept:
        members = set(pipeline.read_state("memberships", checkpoint=cid)["member"])
        assert GONE not in members and AGAIN not in members and "m-001" in members, cid
    rows = _output(tmp_path)
    assert not rows["member"].isin([GONE, AGAIN]).any() and (rows["member"] == "m-001").sum() == 4
