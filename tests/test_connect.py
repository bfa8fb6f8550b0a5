"""Runs attached to a Spark that is already up, through Spark Connect (a real server on 127.0.0.1,
started and stopped here): the same exactly-once results as a Spark of the run's own, a driver
killed mid-run and resumed by a new client, a user's own operators shipped to the server as
artifacts, and a wrong URL said in one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.spark.generate import generate
from tests.clickstream_project import clicks_state, copy_project
from tests.connect_server import ConnectServer, connect_server
from tests.crashkit import assert_pipeline_result, assert_storage_settled, run_command

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
    client resumes from the latest checkpoint to the uninterrupted result."""
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
    done = subprocess.run(remote_run(tmp_path, server), capture_output=True, text=True, env=env(), timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
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
