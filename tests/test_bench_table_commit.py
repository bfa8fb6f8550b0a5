"""The table commit benchmark's smoke run (--quick, in a process of its own, against its counting moto
server): its figures make sense (every table got every checkpoint's rows, the sinks add subtasks ×
partition values files per checkpoint, the commits are counted by the server), never checked for speed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.s3
def test_quick_run_counts_each_writers_requests_and_the_files_per_checkpoint(tmp_path: Path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_table_commit", "--quick", "--out", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Cost per checkpoint" in proc.stdout and "optimize.compact()" in proc.stdout
    result = json.loads((tmp_path / "table_commit_quick.json").read_text())
    a = result["args"]
    checkpoints, files = a["checkpoints"], a["subtasks"] * a["regions"]
    assert result["files_per_checkpoint"] == files

    points = result["points"]
    assert set(points) == {"delta sink", "delta write_deltalake", "iceberg sink", "iceberg append"}
    for name in ("delta sink", "iceberg sink"):
        assert [p["checkpoint"] for p in points[name]] == list(range(1, checkpoints + 1)), name
        for p in points[name]:
            assert p["files"] == files, name
            assert p["stage"]["requests"] >= files and p["stage"]["bytes"] > 0, name  # a PUT per staged file
            assert p["commit"]["requests"] >= 2 and p["commit"]["seconds"] > 0, name  # read the record, commit
    for name in ("delta write_deltalake", "iceberg append"):
        assert all(p["write"]["requests"] >= 2 and p["write"]["bytes"] > 0 for p in points[name]), name

    readers = result["delta_readers"]
    assert readers["before"]["rows"] == readers["after"]["rows"] == checkpoints * a["subtasks"] * a["rows"]
    assert readers["before"]["files"] == checkpoints * files
    assert readers["after"]["files"] == a["regions"], "compaction leaves one file per partition"
    assert {r["writer"] for r in result["summary"]} == set(points)
    assert all(kinds.get("PUT", 0) > 0 for kinds in result["kinds"].values())
    assert result["machine"]["date"]
