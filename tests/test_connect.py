"""Runs attached to a Spark that is already up, through Spark Connect (a real server on 127.0.0.1,
started and stopped here): the same exactly-once results as a Spark of the run's own, a driver
killed mid-run and resumed by a new client, a user's own operators shipped to the server as
artifacts, runs of the same code sharing a server session (changed code in one of its own), and a
wrong URL said in one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.spark.generate import generate
from sparkpoint.spark.session import connect_session, job_group, shared_session_id
from tests.support.clickstream_project import clicks_state, copy_project
from tests.support.connect_server import ConnectServer, connect_server
from tests.support.crashkit import assert_pipeline_result, assert_storage_settled, run_command

pytestmark = pytest.mark.spark
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ConnectServer]:
    # The server's Python workers find sparkpoint (this checkout), never a user's project.
    with connect_server(tmp_path_factory.mktemp("connect"), extra_path=str(ROOT)) as running:
        yield running


def remote_run(tmp_path: Path, server: ConnectServer, *extra: str) -> list[str]:
    cmd = run_command(str(tmp_path / "in"), f"file://{tmp_path}/ckpt", f"file://{tmp_path}/out", tmp_path / "local")
    return [*cmd, "--remote", server.url, *extra]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def test_a_run_on_spark_connect_gives_the_same_exactly_once_result(tmp_path: Path, server: ConnectServer):
    generate(str(tmp_path / "in"), batches=3, events_per_batch=2000, users=300, items=40, seed=5)
    done = subprocess.run(remote_run(tmp_path, server), capture_output=True, text=True, env=env(), timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert [line.split()[0] for line in done.stdout.splitlines() if line.startswith("chk-")] == ["chk-1", "chk-2",
                                                                                                  "chk-3"]
    assert_pipeline_result(str(tmp_path / "in"), f"file://{tmp_path}/ckpt", f"file://{tmp_path}/out", tmp_path)
    assert_storage_settled(f"file://{tmp_path}/ckpt", "job")


def test_a_driver_killed_mid_run_is_resumed_by_a_new_client(tmp_path: Path, server: ConnectServer):
    """SIGKILL of the client after its second checkpoint (the server and its tasks go on): a new
    client, on the other route, resumes from the latest checkpoint to the uninterrupted result."""
    generate(str(tmp_path / "in"), batches=6, events_per_batch=2000, users=300, items=40, seed=6)
    proc = subprocess.Popen(remote_run(tmp_path, server), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env(), start_new_session=True)
    assert proc.stdout is not None
    seen = 0
    for line in proc.stdout:
        seen += line.startswith("chk-")
        if seen == 2:
            break
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert seen == 2, proc.stderr.read() if proc.stderr else ""
    storage = CheckpointStorage(f"file://{tmp_path}/ckpt", "job")
    assert max(storage.completed_checkpoint_ids()) < 6
    # The new client takes the shuffle route (the killed one read-all): the route changes with the client.
    done = subprocess.run(remote_run(tmp_path, server, "--routing", "shuffle"), capture_output=True, text=True,
                          env=env(), timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("chk-")]
    assert lines and all(" route=shuffle read=" in line for line in lines), lines
    assert max(storage.completed_checkpoint_ids()) == 6
    assert_pipeline_result(str(tmp_path / "in"), f"file://{tmp_path}/ckpt", f"file://{tmp_path}/out", tmp_path)
    time.sleep(1)  # the killed client's last tasks may still be finishing on the server
    assert_storage_settled(f"file://{tmp_path}/ckpt", "job")


def test_own_operators_reach_the_server_as_artifacts(tmp_path: Path, server: ConnectServer):
    project, project_env = copy_project(tmp_path, landed=2)
    done = subprocess.run(
        [sys.executable, "-m", "sparkpoint.cli", "run", "--pipeline", "clickstream.pipelines:clicks",
         "--input", "landing", "--conf", f"spark.remote={server.url}"],
        cwd=project, env=project_env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    state, expected = clicks_state(project)
    assert state == expected


def test_a_wrong_connect_url_is_said_in_one_line(tmp_path: Path):
    generate(str(tmp_path / "in"), batches=1, events_per_batch=100, users=10, items=5, seed=1)
    cmd = run_command(str(tmp_path / "in"), f"file://{tmp_path}/ckpt", f"file://{tmp_path}/out", tmp_path / "local")
    for url, message in (("http://127.0.0.1:1", "must start with sc://"),
                         ("sc://127.0.0.1:1", "cannot reach the Spark Connect server at sc://127.0.0.1:1"),
                         ("sc://127.0.0.1:1/;token=s3cret", "server at sc://127.0.0.1:1: ")):
        done = subprocess.run([*cmd, "--remote", url], capture_output=True, text=True, env=env(), timeout=300)
        assert done.returncode == 2, done.stderr
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and message in lines[0], done.stderr
        assert "s3cret" not in done.stderr, "a token in the URL is never printed"


def _session_key(project: Path, project_env: dict[str, str]) -> str:
    code = ("from clickstream.pipelines import clicks; from sparkpoint.spark.session import session_key; "
            "print(session_key(clicks.effective_job_id, clicks.operators))")
    return subprocess.run([sys.executable, "-c", code], cwd=project, env=project_env, capture_output=True, text=True,
                          check=True).stdout.strip()


def _imports_clickstream(url: str) -> bool:
    """Whether a UDF on the session at `url` can import the project (shipped to that session only)."""
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    def probe(frames: Iterator[Any]) -> Iterator[Any]:
        import importlib.util

        import pandas as pd

        for _ in frames:
            yield pd.DataFrame({"found": [importlib.util.find_spec("clickstream") is not None]})

    spark = ConnectSession.builder.remote(url).create()
    spark.release_session_on_close = False
    try:
        return bool(spark.range(0, 1, 1, 1).mapInPandas(probe, "found boolean").collect()[0]["found"])
    finally:
        spark.stop()


def test_runs_of_the_same_code_share_a_session_and_changed_code_runs_in_its_own(tmp_path: Path, server: ConnectServer):
    """A run's server session outlives it for the next run of the same job and code (its Python
    workers stay warm, the package it ships is the same artifact again); changed operator code
    attaches to a session of its own, so no worker runs a module the earlier version imported:
    the third batch counts ten per click."""
    project, project_env = copy_project(tmp_path, landed=3)
    run = [sys.executable, "-m", "sparkpoint.cli", "run", "--pipeline", "clickstream.pipelines:clicks",
           "--input", "landing", "--conf", f"spark.remote={server.url}", "--max-batches", "1"]
    for _ in range(2):  # the second run ships the same package again, to the same session
        done = subprocess.run(run, cwd=project, env=project_env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    first = _session_key(project, project_env)
    shared = f"{server.url}/;session_id={shared_session_id(first)}"
    assert _imports_clickstream(shared), "the run's session, with the project it shipped, is there for the next"
    assert not _imports_clickstream(server.url), "a session of its own has none of it"

    operators = project / "clickstream" / "operators.py"
    v1 = "(int(n) + (o[0] if o else 0), max(int(t), o[1] if o else int(t)))"
    assert v1 in operators.read_text()
    operators.write_text(operators.read_text().replace(v1, v1.replace("(int(n) +", "(10 * int(n) +")))
    assert _session_key(project, project_env) != first
    done = subprocess.run(run, cwd=project, env=project_env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    state, _ = clicks_state(project)
    batches = [pd.read_parquet(p).groupby("user").size() for p in sorted((project / "landing").glob("*.parquet"))]
    expected = batches[0].add(batches[1], fill_value=0).add(10 * batches[2], fill_value=0).astype(int).to_dict()
    assert state == expected, "the third batch ran the changed code, the first two the code before"


def test_a_session_id_the_server_closed_is_passed_over(server: ConnectServer):
    key = f"closed-{uuid.uuid4().hex}"
    first = connect_session(server.url, share=key)
    first_id = first.client._session_id
    first.release_session_on_close = True
    first.stop()  # released: the server keeps the id closed
    second = connect_session(server.url, share=key)
    try:
        assert second.client._session_id != first_id
        assert second.range(3).count() == 3
    finally:
        second.stop()


def test_an_interrupted_client_stops_its_job_in_a_session_that_outlives_it(tmp_path: Path, server: ConnectServer):
    """Stopping a shared session's client leaves the session to the next run: a Ctrl-C (here an
    alarm raising KeyboardInterrupt in the driver) must interrupt the job itself, or it runs on."""
    spark = connect_session(server.url, share=f"interrupt-{uuid.uuid4().hex}")
    marker = str(tmp_path / "the job ran to its end")

    def slow(frames: Iterator[Any]) -> Iterator[Any]:
        import time

        for frame in frames:
            time.sleep(12)
            with open(marker, "a") as out:
                out.write("done\n")
            yield frame

    spark.range(0, 1, 1, 1).mapInPandas(slow, "id long").collect()
    assert Path(marker).read_text() == "done\n", "the job, left alone, runs to its end"

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.alarm(5)
    try:
        with pytest.raises(KeyboardInterrupt), job_group(spark, "sparkpoint-test", "interrupted"):
            spark.range(0, 1, 1, 1).mapInPandas(slow, "id long").collect()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        spark.stop()
    time.sleep(15)
    assert Path(marker).read_text() == "done\n", "the job ran on after its client was interrupted"
