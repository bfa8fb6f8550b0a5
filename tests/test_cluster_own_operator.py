"""A user's own operators on a real Spark standalone cluster (master + worker on 127.0.0.1): the
example project's `clicks` pipeline, run by `sparkpoint run --pipeline` from the project's
directory. The project is on no worker's path: its package reaches the executors because the
driver ships it (`addPyFile` of the zipped package)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.state.extract import state_table
from tests.cluster import standalone_cluster

pytestmark = pytest.mark.spark
ROOT = Path(__file__).resolve().parent.parent


def test_own_operators_run_on_a_standalone_cluster_shipped_by_the_driver(tmp_path: Path):
    project = tmp_path / "project"
    shutil.copytree(ROOT / "examples" / "clickstream", project, ignore=shutil.ignore_patterns(".sparkpoint",
                                                                                              "__pycache__"))
    env = {**os.environ, "PYTHONPATH": f"{project}{os.pathsep}{ROOT}"}
    subprocess.run([sys.executable, "-m", "clickstream.land", "--batches", "3", "--into", "landing"], cwd=project,
                   env=env, check=True, capture_output=True)
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
    storage = CheckpointStorage(f"file://{project}/.sparkpoint/clicks/checkpoints", "clicks")
    sys.path.insert(0, str(project))
    try:
        from clickstream.operators import clicks_per_user

        _, state = state_table(storage, clicks_per_user)
    finally:
        sys.path.remove(str(project))
        for name in [m for m in sys.modules if m == "clickstream" or m.startswith("clickstream.")]:
            del sys.modules[name]
    events = pd.concat([pd.read_parquet(p) for p in sorted((project / "landing").glob("*.parquet"))])
    expected = events.groupby("user").size()
    assert dict(zip(state["user"], state["clicks"])) == expected.to_dict()
