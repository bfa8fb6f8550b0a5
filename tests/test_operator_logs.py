"""Quiet by default, Spark's own start-up logs with --verbose (the quiet side is also checked by
the README quick start, whose `sparkpoint run` must write nothing to standard error)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sparkpoint.spark.session import _CHATTER

pytestmark = pytest.mark.spark


def test_verbose_run_shows_sparks_start_up_logs(tmp_path: Path):
    (tmp_path / "in").mkdir()  # no batch: the JVM starts, nothing is processed
    env = {k: v for k, v in os.environ.items() if k != "SPARKPOINT_VERBOSE"}
    done = subprocess.run(
        [sys.executable, "-m", "sparkpoint.cli", "run", "--verbose", "--input", str(tmp_path / "in"),
         "--checkpoints", f"file://{tmp_path}/ckpt", "--job-id", "j", "--local-dir", str(tmp_path / "local"),
         "--master", "local[1]"],
        capture_output=True, text=True, timeout=300, env=env, stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "no unconsumed batch" in done.stdout
    chatter = [line for line in done.stderr.splitlines() if _CHATTER.match(line)]
    assert chatter, f"--verbose hid Spark's start-up logs: {done.stderr[:2000]}"


@pytest.mark.parametrize(
    "line, chatter",
    [
        ("WARNING: Using incubator modules: jdk.incubator.vector", True),
        ("Using Spark's default log4j profile: org/apache/spark/log4j2-defaults.properties", True),
        ("26/11/23 15:05:54 WARN Utils: Your hostname, vm, resolves to a loopback address", True),
        ("26/11/23 15:05:56 ERROR Executor: Exception in task 0.0 in stage 1.0 (TID 1)", False),
        ("java.lang.OutOfMemoryError: Java heap space", False),
    ],
)
def test_only_start_up_chatter_is_filtered_from_the_jvms_stderr(line: str, chatter: bool):
    assert bool(_CHATTER.match(line)) is chatter
