"""A user's own operators on a real Spark standalone cluster (master + worker on 127.0.0.1): the
example project's `clicks` pipeline, run by `sparkpoint run --pipeline` from the project's
directory. The project is on no worker's path: its package reaches the executors because the
driver ships it (`addPyFile` of the zipped package)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.clickstream_project import clicks_state, copy_project
from tests.support.cluster import standalone_cluster

pytestmark = pytest.mark.spark


def test_own_operators_run_on_a_standalone_cluster_shipped_by_the_driver(tmp_path: Path):
    project, env = copy_project(tmp_path, landed=3)
    with standalone_cluster(tmp_path / "cluster", workers=1) as cluster:
        # The workers' Python path holds sparkpoint (the test's directory), never the project.
        assert str(project) not in os.environ.get("PYTHONPATH", "") and Path.cwd() != project
        done = subprocess.run(
            [sys.executable, "-m", "sparkpoint.cli", "run", "--pipeline", "clickstream.pipelines:clicks",
             "--input", "landing", "--master", cluster.master_url, "--parallelism", "2"],
            cwd=project, env={**env, **cluster.env()}, capture_output=True, text=True, timeout=600,
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert [line.split()[0] for line in done.stdout.splitlines() if line.startswith("chk-")] == ["chk-1", "chk-2",
                                                                                                  "chk-3"]
    state, expected = clicks_state(project)
    assert state == expected
