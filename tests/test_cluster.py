"""The pipeline on a real Spark standalone cluster (master + two workers on 127.0.0.1), one worker
killed mid-batch.

Each worker is a "machine" of its own: its own work dir, Spark local dir and sparkpoint task-local
directory (`SPARKPOINT_LOCAL_DIR` in the worker's environment). Once a subtask holds its lock on
worker 1 (mid-batch), every process of worker 1 is SIGKILLed (the worker, its executor JVM and
Python workers). Spark reschedules the lost tasks on worker 2 (or, if the job fails, a rerun
resumes from the latest checkpoint); the state and the output then equal the recomputation.

The run reports, per subtask and batch, where its state came from: `working`/`local` (this
worker's disk still had it) or `primary` (downloaded from checkpoint storage). Spark gives Python
tasks no preferred locations, so a subtask lands on whichever executor is free: the test
measures how often it finds its task-local state again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from sparkpoint.spark.generate import generate
from tests.support.cluster import standalone_cluster
from tests.support.crashkit import assert_pipeline_result, assert_storage_settled, run_command
from tests.support.waiting import wait_for

pytestmark = pytest.mark.spark

TASK_LOCAL = ("working", "local")


def cluster_run(tmp_path: Path, batches: int, kill_after: int, routing: str = "auto") -> dict[str, object]:
    """Run `batches` batches on the cluster, kill worker 1 mid-batch once `kill_after` completed."""
    generate(str(tmp_path / "in"), batches=batches, events_per_batch=1000, users=200, items=40, seed=11)
    ckpt, out = f"file://{tmp_path}/ckpt", f"file://{tmp_path}/out"
    reports: list[dict[str, object]] = []
    with standalone_cluster(tmp_path / "cluster") as cluster:
        cmd = [*run_command(str(tmp_path / "in"), ckpt, out, tmp_path / "driver-local", master=cluster.master_url),
               "--json", "--routing", routing]
        env = {**os.environ, **cluster.env()}
        stderr = open(tmp_path / "run.err", "w")  # noqa: SIM115
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env,
                                start_new_session=True)

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith("{"):
                    reports.append(json.loads(line))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            killed_in = wait_and_kill(cluster, proc, reports, kill_after)
            proc.wait(timeout=900)
            reader.join(timeout=30)
            first_rc = proc.returncode
            if first_rc != 0:  # the job failed instead of retrying: a rerun resumes from the latest checkpoint
                rerun = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
                assert rerun.returncode == 0, rerun.stderr[-3000:]
                reports += [json.loads(line) for line in rerun.stdout.splitlines() if line.startswith("{")]
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            stderr.close()
    assert_pipeline_result(str(tmp_path / "in"), ckpt, out, tmp_path)
    assert assert_storage_settled(ckpt, "job") == 2
    before = [s for r in reports if r["checkpoint_id"] <= killed_in for s in r["restored_by_subtask"]]
    after = [s for r in reports if r["checkpoint_id"] > killed_in for s in r["restored_by_subtask"]]
    return {
        "batches": batches, "killed_in_checkpoint": killed_in, "recovered_by": "task retry" if first_rc == 0 else
        "rerun", "before_kill": dict(Counter(before)), "after_kill": dict(Counter(after)),
        "task_local_share_before_kill": share(before), "task_local_share_after_kill": share(after),
        "routes": sorted({str(r["routing"]) for r in reports}),
    }


def share(sources: list[str]) -> float:
    """Of the subtasks that restored a checkpoint, the share that found it on their machine."""
    restored = [s for s in sources if s != "empty"]
    return round(sum(s in TASK_LOCAL for s in restored) / len(restored), 3) if restored else 0.0


def wait_and_kill(cluster, proc, reports, kill_after: int) -> int:  # type: ignore[no-untyped-def]
    """Once `kill_after` checkpoints completed, kill worker 1 while it runs a subtask; returns the
    id of the checkpoint that was in flight."""
    deadline = time.monotonic() + 600

    def ended() -> str | None:
        return None if proc.poll() is None else f"the run ended ({proc.returncode}) after {len(reports)} checkpoints"

    wait_for(lambda: len(reports) >= kill_after, deadline - time.monotonic(), 0.2, f"{kill_after} checkpoints",
             stop=ended)
    wait_for(lambda: cluster.busy("worker1"), deadline - time.monotonic(), 0.01, "worker 1 to run another subtask",
             stop=ended)
    in_flight = int(reports[-1]["checkpoint_id"]) + 1
    cluster.kill_machine("worker1")
    return in_flight


# The shuffle route in make test (its kill also takes shuffle output); the read-all route in make soak.
@pytest.mark.parametrize("routing", [pytest.param("read-all", marks=pytest.mark.soak), "shuffle"])
def test_worker_killed_mid_batch_on_a_standalone_cluster(tmp_path: Path, routing: str):
    # On the shuffle route the kill also takes the reading stage's shuffle output kept on worker 1:
    # Spark reads those pieces again (or the rerun does), and the result is still exact.
    figures = cluster_run(tmp_path, batches=5, kill_after=2, routing=routing)
    print(json.dumps(figures))
    assert figures["routes"] == [routing]
    restored = figures["before_kill"] | figures["after_kill"]  # type: ignore[operator]
    assert set(restored) <= {"empty", "working", "local", "primary"}
    assert figures["after_kill"], "batches ran after the kill"


@pytest.mark.soak
def test_soak_worker_killed_mid_batch_task_local_share(tmp_path: Path):
    batches = int(os.environ.get("SPARKPOINT_SOAK_CLUSTER_BATCHES", "24"))
    started = time.monotonic()
    figures = cluster_run(tmp_path, batches=batches, kill_after=batches // 2)
    figures["seconds"] = round(time.monotonic() - started, 1)
    out = Path("build/soak")
    out.mkdir(parents=True, exist_ok=True)
    (out / "cluster.json").write_text(json.dumps({"name": "cluster", "failures": 0, **figures}, indent=1))
    print(f"\ncluster: {batches} batches, worker 1 killed in checkpoint {figures['killed_in_checkpoint']}, "
          f"recovered by {figures['recovered_by']}, 0 failures, {figures['seconds']}s")
    for when in ("before_kill", "after_kill"):
        print(f"  {when:<12} restores {figures[when]}  task-local share {figures[f'task_local_share_{when}']}")
