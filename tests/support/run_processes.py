"""The processes of one run, found by a marker in their environment (the driver's variables reach
the launcher script, the JVM and PySpark's workers, whatever group or session they are in), and
the moment of the start a signal lands in."""

from __future__ import annotations

import os
import platform
import signal
import subprocess
import time
import uuid
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.waiting import wait_for

MARKER = "SPARKPOINT_TEST_RUN"
# The system call a thread blocked reading stdin shows in /proc/<pid>/task/<tid>/syscall: the
# driver JVM's main thread once its start is done (it exits when the driver's end closes its stdin).
_READ = {"x86_64": 0, "aarch64": 63}.get(platform.machine())


@dataclass(frozen=True)
class Process:
    pid: int
    name: str  # /proc's comm: python3.11, bash, java
    ppid: int


def run_processes(marker: str) -> list[Process]:
    """The live processes (zombies are gone: only their exit status waits) carrying `marker`."""
    needle = f"{MARKER}={marker}".encode()
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if needle not in environ.read_bytes().split(b"\0"):
                continue
            stat = (environ.parent / "stat").read_text()
        except OSError:  # ended while we looked, or not ours to read
            continue
        name, _, rest = stat.partition(" (")[2].rpartition(")")
        fields = rest.split()
        if fields and fields[0] != "Z":
            found.append(Process(int(environ.parent.name), name, int(fields[1])))
    return found


def wait_gone(marker: str, seconds: float) -> list[Process]:
    """Wait up to `seconds` for the processes carrying `marker` to end (a JVM whose driver has
    gone ends by itself once it sees its stdin closed); those still there."""
    with suppress(AssertionError):
        wait_for(lambda: not run_processes(marker), seconds, 0.1, f"the processes of {marker} to end")
    return run_processes(marker)


def java_pids() -> set[int]:
    """Every live JVM on the machine (whoever started it)."""
    pids = set()
    for comm in Path("/proc").glob("[0-9]*/comm"):
        try:
            if comm.read_text().strip() != "java":
                continue
            if (comm.parent / "stat").read_text().rpartition(")")[2].split()[0] != "Z":
                pids.add(int(comm.parent.name))
        except (OSError, IndexError):
            continue
    return pids


def _watches_stdin(pid: int) -> bool:
    for syscall in Path(f"/proc/{pid}/task").glob("*/syscall"):
        try:
            fields = syscall.read_text().split()
        except OSError:
            continue
        if len(fields) > 1 and fields[0] == str(_READ) and int(fields[1], 16) == 0:
            return True
    return False


def start_phase(marker: str, driver: int) -> str:
    """Where the start is: `before` (no process but the driver), `launching` (the launcher script
    or a JVM not yet watching its stdin: the window where an interrupt used to leak the JVM),
    `up` (a JVM watching its stdin), `ended` (the driver is gone)."""
    processes = run_processes(marker)
    if not any(p.pid == driver for p in processes):
        return "ended"
    others = [p for p in processes if p.pid != driver]
    if not others:
        return "before"
    if _READ is not None and any(p.name == "java" and _watches_stdin(p.pid) for p in others):
        return "up"
    return "launching" if _READ is not None else "started"


@dataclass
class Try:
    """One run interrupted `delay` seconds after its spawn (or after its launch began)."""

    delay: float
    sent_at: float  # seconds from the spawn to the signal
    signal: str
    twice: bool  # the signal was sent a second time
    phase: str  # at the moment of the signal (`start_phase`)
    returncode: int | None
    stderr: str
    left: list[Process] = field(default_factory=list)  # the run's processes still there after the wait
    gone_after: float = 0.0  # seconds from the driver's exit until no process of the run was left


def interrupt_run(cmd: Sequence[str], cwd: Path, env: dict[str, str], delay: float, *, signum: int = signal.SIGINT,
                  group: bool = True, after_launch: bool = False, again: float | None = None,
                  linger: float = 60.0) -> Try:
    """Start `cmd` in a session of its own (its output to files: a full pipe would stall it), send
    `signum` `delay` seconds after the spawn (to its whole group, as a terminal does, or to the
    driver alone, as Dagster's run termination does), wait for it to exit, then up to `linger`
    seconds for every process of the run to be gone. Whatever is still there is killed.
    `after_launch`: `delay` counts from the moment the run's first process besides the driver
    (the launcher script) is seen, wherever a loaded machine puts it. `again`: the same signal
    once more that many seconds later (a user pressing Ctrl-C twice)."""
    marker = uuid.uuid4().hex
    out_path = cwd / f"stdout-{marker}.txt"
    err_path = cwd / f"stderr-{marker}.txt"
    with out_path.open("wb") as out, err_path.open("wb") as err:
        spawned = time.monotonic()
        proc = subprocess.Popen(list(cmd), cwd=cwd, env={**env, MARKER: marker}, stdout=out, stderr=err,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            start = spawned
            if after_launch:
                wait_for(lambda: start_phase(marker, proc.pid) != "before", 300, 0.02, "the run's launcher")
                start = time.monotonic()
            time.sleep(max(0.0, start + delay - time.monotonic()))
            phase = start_phase(marker, proc.pid)
            sent_at = time.monotonic() - spawned
            for pause in (0.0,) if again is None else (0.0, again):
                time.sleep(pause)
                if proc.poll() is None:
                    (os.killpg if group else os.kill)(proc.pid, signum)
            proc.wait(timeout=300)
        finally:
            if proc.poll() is None:  # a test that failed while it ran
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    exited = time.monotonic()
    left = wait_gone(marker, linger)
    gone_after = time.monotonic() - exited
    for p in left:  # never leave a JVM behind, even when the test fails
        try:
            os.kill(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return Try(delay=delay, sent_at=round(sent_at, 2), signal=signal.Signals(signum).name, twice=again is not None,
               phase=phase, returncode=proc.returncode, stderr=err_path.read_text(errors="replace"), left=left,
               gone_after=round(gone_after, 1))

