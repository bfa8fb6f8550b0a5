"""A Spark standalone cluster on 127.0.0.1, started from the pyspark distribution: one master and
workers that each look like a separate machine (own work dir, own Spark local dir, own sparkpoint
task-local dir through SPARKPOINT_LOCAL_DIR), each in a process group of its own."""

from __future__ import annotations

import fcntl
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import pyspark

from tests.support.waiting import wait_for

SPARK_HOME = os.path.dirname(pyspark.__file__)
# Every process of a "machine" carries it, as `<cluster root>:<name>`: killing one kills all of that
# cluster's machine, never a machine of the same name in another test's cluster running beside it.
MACHINE = "SPARKPOINT_TEST_MACHINE"


@dataclass
class Cluster:
    root: Path
    master_url: str
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def machine(self, name: str) -> str:
        return f"{self.root}:{name}"

    def local_dir(self, worker: str) -> Path:
        return self.root / worker / "sparkpoint-local"

    def env(self) -> dict[str, str]:
        """For the driver: Spark's conf dir (executor memory, retries), loopback only."""
        return {"SPARK_CONF_DIR": str(self.root / "conf"), "SPARK_LOCAL_IP": "127.0.0.1", "SPARK_HOME": SPARK_HOME}

    def busy(self, worker: str) -> bool:
        """A subtask runs on `worker` right now (it holds the lock of its task-local directory)."""
        for lock in self.local_dir(worker).glob("*/*/*/.lock"):
            with open(lock) as f:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return True
                fcntl.flock(f, fcntl.LOCK_UN)
        return False

    def kill_machine(self, name: str) -> int:
        """SIGKILL every process of `name`: the daemon's group and whatever it started (the executor
        JVM, Spark's Python daemon and workers, which run in groups of their own)."""
        with suppress(ProcessLookupError):
            os.killpg(self.procs[name].pid, signal.SIGKILL)
        victims = machine_pids(self.machine(name))
        for pid in victims:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.procs[name].wait(timeout=30)
        return len(victims) + 1


def machine_pids(name: str) -> list[int]:
    tag = f"{MACHINE}={name}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with suppress(OSError):
                if tag in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_log(path: Path, pattern: str, count: int, timeout: float, proc: subprocess.Popen[bytes]) -> None:
    """Until `pattern` appears `count` times in the log of `proc`, which must not exit meanwhile."""

    def text() -> str:
        return path.read_text(errors="replace") if path.exists() else ""

    wait_for(lambda: len(re.findall(pattern, text())) >= count, timeout, 0.3, f"{pattern!r} x{count} in {path.name}",
             stop=lambda: None if proc.poll() is None else f"the process exited ({proc.returncode})",
             last=lambda: text()[-2000:])


@contextmanager
def standalone_cluster(root: Path, workers: int = 2, *, timeout: float = 180) -> Iterator[Cluster]:
    """Master + `workers` workers (1 core, 1 GB each); every process is killed on the way out."""
    (root / "conf").mkdir(parents=True)
    # The JVM options the tests give drivers (tests/conftest.py), to the executors and daemons too.
    jvm_options = os.environ.get("SPARK_SUBMIT_OPTS", "")
    (root / "conf" / "spark-defaults.conf").write_text(
        "spark.executor.memory 512m\nspark.executor.cores 1\nspark.task.maxFailures 4\n"
        "spark.driver.host 127.0.0.1\nspark.driver.bindAddress 127.0.0.1\n"
        + (f"spark.executor.extraJavaOptions {jvm_options}\n" if jvm_options else "")
    )
    port = free_port()
    cluster = Cluster(root, f"spark://127.0.0.1:{port}")
    spark_class = os.path.join(SPARK_HOME, "bin", "spark-class")
    base = {**os.environ, **cluster.env(), "PYSPARK_PYTHON": sys.executable, "SPARK_DAEMON_JAVA_OPTS": jvm_options,
            "PYTHONPATH": os.pathsep.join(p for p in [os.getcwd(), os.environ.get("PYTHONPATH", "")] if p)}

    def start(name: str, args: list[str], extra: dict[str, str]) -> subprocess.Popen[bytes]:
        log = open(root / f"{name}.log", "wb")  # noqa: SIM115  (the process owns it)
        proc = subprocess.Popen([spark_class, *args], stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**base, **extra, MACHINE: cluster.machine(name)})
        cluster.procs[name] = proc
        return proc

    try:
        master = start("master", ["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port",
                                  str(port), "--webui-port", str(free_port())], {})
        wait_for_log(root / "master.log", r"I have been elected leader", 1, timeout, master)
        for i in range(1, workers + 1):
            name = f"worker{i}"
            (root / name).mkdir()
            start(name, ["org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1", "--cores", "1", "--memory",
                         "1g", "--work-dir", str(root / name / "work"), "--webui-port", str(free_port()),
                         cluster.master_url],
                  {"SPARK_LOCAL_DIRS": str(root / name / "spark-local"),
                   "SPARKPOINT_LOCAL_DIR": str(cluster.local_dir(name))})
        wait_for_log(root / "master.log", r"Registering worker 127\.0\.0\.1", workers, timeout, master)
        yield cluster
    finally:
        for name in reversed(list(cluster.procs)):
            with suppress(ProcessLookupError):
                cluster.kill_machine(name)
