"""A real Spark Connect server on 127.0.0.1, started from the pyspark distribution
(`SparkConnectServer` through spark-submit, `local[2]`), in a process group of its own, killed on
the way out. Its Python workers run this interpreter (sparkpoint installed); the project under
test is on their path only through `extra_path` (a user's project is not: it is shipped)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from tests.support.cluster import SPARK_HOME, free_port, wait_for_log


@dataclass
class ConnectServer:
    url: str
    log: Path
    proc: subprocess.Popen[bytes]


@contextmanager
def connect_server(root: Path, *, master: str = "local[2]", timeout: float = 180,
                   extra_path: str | None = None, own_local_dir: bool = True) -> Iterator[ConnectServer]:
    """`own_local_dir`: the server's executors keep task-local state in a directory of their own
    (`SPARKPOINT_LOCAL_DIR`, as a real server's disks do); without it they use each run's
    `--local-dir`."""
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = root / "connect-server.log"
    env = {**os.environ, "SPARK_HOME": SPARK_HOME, "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable,
           "SPARK_LOG_DIR": str(root), "SPARK_LOCAL_DIRS": str(root / "spark-local")}
    if own_local_dir:
        env["SPARKPOINT_LOCAL_DIR"] = str(root / "sparkpoint-local")
    else:
        env.pop("SPARKPOINT_LOCAL_DIR", None)
    if extra_path is not None:
        env["PYTHONPATH"] = extra_path
    cmd = [os.path.join(SPARK_HOME, "bin", "spark-submit"), "--class",
           "org.apache.spark.sql.connect.service.SparkConnectServer", "--master", master,
           "--conf", f"spark.connect.grpc.binding.port={port}",
           "--conf", "spark.connect.grpc.binding.address=127.0.0.1",
           "--conf", "spark.driver.host=127.0.0.1", "--conf", "spark.driver.bindAddress=127.0.0.1",
           "--conf", "spark.ui.enabled=false", "--conf", "spark.sql.session.timeZone=UTC", "spark-internal"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                cwd=root)
    try:
        wait_for_log(log, r"Spark Connect server started", 1, timeout, proc)
        yield ConnectServer(f"sc://127.0.0.1:{port}", log, proc)
    finally:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
