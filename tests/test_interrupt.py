"""One Ctrl-C stops `sparkpoint run` and `make run`'s demo within seconds, in one line, exit 130;
a rerun resumes to the right result. The signal goes to the whole process group, as a terminal
sends it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from sparkpoint.cli import main
from sparkpoint.spark.generate import generate
from tests.support import oracle
from tests.support.crashkit import run_in_process

pytestmark = pytest.mark.spark
ROOT = Path(__file__).resolve().parent.parent


def interrupt_after(cmd: list[str], cwd: Path, prefix: str, nth: int, delay: float) -> tuple[int, str, str, float]:
    """Start `cmd` in a group of its own; after the nth stdout line starting with `prefix` (and
    `delay` seconds), send SIGINT to the group; (exit code, stdout, stderr, seconds to stop)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd, env=env,
                            start_new_session=True)
    assert proc.stdout is not None
    seen, lines = 0, []
    for line in proc.stdout:
        lines.append(line)
        seen += line.startswith(prefix)
        if seen == nth:
            time.sleep(delay)
            break
    sent = time.monotonic()
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, "".join(lines) + out, err, time.monotonic() - sent


# One moment in make test; the moments around it (before Spark is up, mid-batch) in make soak.
@pytest.mark.parametrize("delay", [pytest.param(0.0, marks=pytest.mark.soak), 0.15,
                                   pytest.param(0.4, marks=pytest.mark.soak)])
def test_one_ctrl_c_stops_run_in_one_line_and_a_rerun_resumes(spark, tmp_path: Path, delay: float):
    """The rerun resumes on the tests' shared Spark: the resume, not another Spark start, is checked."""
    generate(str(tmp_path / "in"), batches=5, events_per_batch=8000, users=3000, items=200, seed=4)
    cmd = [sys.executable, "-m", "sparkpoint.cli", "run", "--input", str(tmp_path / "in"), "--checkpoints",
           str(tmp_path / "ckpt"), "--job-id", "j", "--local-dir", str(tmp_path / "local"), "--output",
           str(tmp_path / "out")]
    code, out, err, seconds = interrupt_after(cmd, tmp_path, "chk-", 2, delay)
    assert code == 130, (out, err)
    assert seconds < 15
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "interrupted; last committed checkpoint: chk-" in lines[0], err
    assert "a rerun resumes" in lines[0] and "Traceback" not in err
    assert run_in_process(spark, cmd), "the rerun took the batches the interrupted run left"
    events = pd.concat(oracle.read_batches(str(tmp_path / "in")), ignore_index=True)
    assert main(["state", "--checkpoints", str(tmp_path / "ckpt"), "--job-id", "j", "--operator", "user_totals",
                 "--format", "parquet", "--out", str(tmp_path / "totals.parquet")]) == 0
    oracle.assert_totals_equal(pd.read_parquet(tmp_path / "totals.parquet"), oracle.user_totals(events))


def test_one_ctrl_c_stops_the_demo_and_it_starts_nothing_more(tmp_path: Path):
    cmd = [sys.executable, "-m", "sparkpoint.demo"]
    code, out, err, seconds = interrupt_after(cmd, tmp_path, "materialize", 1, 0.0)  # as run 2 starts
    assert code == 130, (out, err)
    assert seconds < 30
    assert "Traceback" not in err and "FAILED: ?" not in out, err
    assert "sparkpoint demo: interrupted; last committed checkpoint: chk-" in err
    runs = [line for line in out.splitlines() if line.startswith(("materialize", "recover"))]
    assert len(runs) <= 3 and not any(line.startswith("materialize:") for line in runs[1:]), out
    assert "matches a recomputation" not in out, "the demo stopped instead of going on to its checks"
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0 and "matches a recomputation" in done.stdout, done.stdout + done.stderr[-2000:]


def test_the_cancel_thread_is_silent_when_the_jvm_is_already_gone(monkeypatch: pytest.MonkeyPatch):
    """Ctrl-C while the driver is stopping: the session lookup itself asks the dead JVM and fails
    (CI saw 38 lines of a py4j trace from the cancel thread beside the one-line message)."""
    import threading

    from pyspark.sql import SparkSession

    from sparkpoint.spark import session

    def gone() -> None:
        raise ConnectionError("Answer from Java side is empty")

    raised: list[BaseException] = []
    monkeypatch.setattr(SparkSession, "getActiveSession", staticmethod(gone))
    monkeypatch.setattr(threading, "excepthook", lambda args: raised.append(args.exc_value))
    monkeypatch.setattr(session._interrupted, "set", lambda: None)  # keep the flag of this process clear
    session.request_interrupt()
    for thread in threading.enumerate():
        if thread.name == "spark-cancel":
            thread.join(5)
    assert raised == []


def test_an_interrupt_that_lands_in_a_finalizer_is_delivered_again_without_a_trace(tmp_path: Path):
    """Ctrl-C while a file object is being collected: Python would print the KeyboardInterrupt as
    'ignored' and drop it. The run must still stop, with no trace on stderr."""
    code = (
        "import os, signal, sys, time\n"
        "from sparkpoint.spark import session\n"
        "signal.signal(signal.SIGINT, lambda s, f: (_ for _ in ()).throw(KeyboardInterrupt()))\n"
        "session._keep_interrupts_out_of_finalizers()\n"
        "class Closing:\n"
        "    def __del__(self):\n"
        "        raise KeyboardInterrupt\n"
        "Closing()\n"
        "try:\n"
        "    time.sleep(5)\n"
        "except KeyboardInterrupt:\n"
        "    print('stopped', flush=True)\n"
        "    sys.exit(130)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).parent.parent)
    assert done.returncode == 130 and done.stdout.strip() == "stopped", (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr and "KeyboardInterrupt" not in done.stderr, done.stderr


HANGING_STOP = """
import os, sys, time
from sparkpoint.spark import session

spark = session.spark_session("local[1]")
assert spark.range(5).mapInPandas(lambda it: it, "id long").count() == 5  # PySpark's daemon is up
jvm = session._launched_jvm
daemons = session._groups_led_by_children_of(jvm.pid)

class StopThatHangs:  # Spark's stop waiting on a task that never answers its cancellation
    def stop(self):
        time.sleep(600)

started = time.monotonic()
session.stop_quietly(StopThatHangs(), grace=float(sys.argv[1]))
seconds = time.monotonic() - started
code = jvm.wait(timeout=30)

def alive(pid):  # a zombie is gone: only its exit status waits for a parent that may never reap it
    try:
        return open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False

deadline = time.monotonic() + 30
while any(alive(pid) for pid in daemons) and time.monotonic() < deadline:
    time.sleep(0.1)
left = [pid for pid in daemons if alive(pid)]
print(round(seconds, 1), code, len(daemons), len(left), flush=True)
"""


def test_an_interrupted_spark_that_does_not_stop_in_time_has_its_jvm_killed(tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if k != "SPARKPOINT_VERBOSE"}
    done = subprocess.run([sys.executable, "-c", HANGING_STOP, "2"], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env={**env, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    seconds, returncode, daemons, left = done.stdout.split()
    assert returncode == str(-signal.SIGKILL), "the JVM was killed, not left running"
    assert int(daemons) >= 1 and left == "0", "PySpark's daemon (a process group of its own) went with it"
    assert 2 <= float(seconds) < 60, "it waited out the grace, then stopped waiting"
    assert done.stderr.strip() == "", "the kill prints nothing of its own"
