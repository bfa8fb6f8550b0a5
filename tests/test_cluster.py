"""Pipelines on a real Spark standalone cluster (master + two workers on 127.0.0.1): a user's own
operators shipped by the driver, then the sample pipeline with one worker killed mid-batch. The
module's tests share one cluster (its JVMs start once), the kill last; `make soak`'s variants start
clusters of their own.

A user's own operators: the example project's `clicks` pipeline, run by `sparkpoint run
--pipeline` from the project's directory. The project is on no worker's path: its package reaches
the executors because the driver ships it (`addPyFile` of the zipped package).

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
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from sparkpoint.spark.generate import generate
from tests.support.clickstream_project import clicks_state, copy_project
from tests.support.cluster import Cluster, standalone_cluster
from tests.support.crashkit import assert_pipeline_result, assert_storage_settled, run_command
from tests.support.waiting import wait_for

pytestmark = pytest.mark.spark

TASK_LOCAL = ("working", "local")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """The module's cluster: the test that kills worker 1 comes last (the cluster is not whole after)."""
    with standalone_cluster(tmp_path_factory.mktemp("shared") / "cluster") as started:
        yield started


def test_own_operators_run_on_a_standalone_cluster_shipped_by_the_driver(tmp_path: Path, cluster: Cluster):
    project, env = copy_project(tmp_path, landed=3)
    # The workers' Python path holds sparkpoint (the test's directory), never the project.
    assert str(project) not in os.environ.get("PYTHONPATH", "") and Path.cwd() != project
    conf = tmp_path / "conf"  # one executor to ship to, as on a one-worker cluster (not a JVM per worker)
    conf.mkdir()
    defaults = (cluster.root / "conf" / "spark-defaults.conf").read_text()
    (conf / "spark-defaults.conf").write_text(defaults + "spark.cores.max 1\n")
    done = subprocess.run(
        [sys.executable, "-m", "sparkpoint.cli", "run", "--pipeline", "clickstream.pipelines:clicks",
         "--input", "landing", "--master", cluster.master_url, "--parallelism", "2"],
        cwd=project, env={**env, **cluster.env(), "SPARK_CONF_DIR": str(conf)}, capture_output=True, text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert [line.split()[0] for line in done.stdout.splitlines() if line.startswith("chk-")] == ["chk-1", "chk-2",
                                                                                                  "chk-3"]
    state, expected = clicks_state(project)
    assert state == expected


def cluster_run(tmp_path: Path, cluster: Cluster, batches: int, kill_after: int,
                routing: str = "auto") -> dict[str, object]:
    """Run `batches` batches on `cluster`, kill its worker 1 mid-batch once `kill_after` completed."""
    generate(str(tmp_path / "in"), batches=batches, events_per_batch=1000, users=200, items=40, seed=11)
    ckpt, out = f"file://{tmp_path}/ckpt", f"file://{tmp_path}/out"
    reports: list[dict[str, object]] = []
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


# The shuffle route in make test (its kill also takes shuffle output), on the module's cluster; the
# read-all route in make soak, on a cluster of its own.
def test_worker_killed_mid_batch_on_a_standalone_cluster(tmp_path: Path, cluster: Cluster):
    """The module's last test: worker 1 stays dead."""
    # On the shuffle route the kill also takes the reading stage's shuffle output kept on worker 1:
    # Spark reads those pieces again (or the rerun does), and the result is still exact.
    assert_worker_kill_survived(cluster_run(tmp_path, cluster, batches=5, kill_after=2, routing="shuffle"), "shuffle")


@pytest.mark.soak
def test_soak_worker_killed_mid_batch_on_the_read_all_route(tmp_path: Path):
    """The same kill as `test_worker_killed_mid_batch_on_a_standalone_cluster` (make test), on the other route."""
    with standalone_cluster(tmp_path / "cluster") as own:
        assert_worker_kill_survived(cluster_run(tmp_path, own, batches=5, kill_after=2, routing="read-all"),
                                    "read-all")


def assert_worker_kill_survived(figures: dict[str, object], routing: str) -> None:
    print(json.dumps(figures))
    assert figures["routes"] == [routing]
    restored = figures["before_kill"] | figures["after_kill"]  # type: ignore[operator]
    assert set(restored) <= {"empty", "working", "local", "primary"}
    assert figures["after_kill"], "batches ran after the kill"


@pytest.mark.soak
def test_soak_worker_killed_mid_batch_task_local_share(tmp_path: Path):
    batches = int(os.environ.get("SPARKPOINT_SOAK_CLUSTER_BATCHES", "24"))
    started = time.monotonic()
    with standalone_cluster(tmp_path / "cluster") as own:
        figures = cluster_run(tmp_path, own, batches=batches, kill_after=batches // 2)
    figures["seconds"] = round(time.monotonic() - started, 1)
    out = Path("build/soak")
    out.mkdir(parents=True, exist_ok=True)
    (out / "cluster.json").write_text(json.dumps({"name": "cluster", "failures": 0, **figures}, indent=1))
    print(f"\ncluster: {batches} batches, worker 1 killed in checkpoint {figures['killed_in_checkpoint']}, "
          f"recovered by {figures['recovered_by']}, 0 failures, {figures['seconds']}s")
    for when in ("before_kill", "after_kill"):
        print(f"  {when:<12} restores {figures[when]}  task-local share {figures[f'task_local_share_{when}']}")
