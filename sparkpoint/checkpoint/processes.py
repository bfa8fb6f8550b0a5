"""Naming one process so that another can tell later whether it still lives: its pid with its
start time (a pid is reused), on this boot and in this PID namespace (a host name alone is shared
by the pods of a `hostNetwork` node). Read from /proc; None where /proc does not say."""

from __future__ import annotations

import os


def _read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


def boot_id() -> str | None:
    return _read_text("/proc/sys/kernel/random/boot_id")


def pid_namespace() -> str | None:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return None


def process_start(pid: int) -> str | None:
    """When process `pid` started (clock ticks since boot, from /proc): with the pid, it names one
    process even after the pid is reused. None where /proc does not say."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()
    return fields[19] if len(fields) > 19 else None  # field 22 of the line, 20th after the name


def same_process_lives(pid: int, started: str | None) -> bool:
    """Whether the process recorded as (`pid`, `started`) on this boot and namespace still runs
    (a zombie, exited but not yet reaped by its parent, does not)."""
    if pid <= 0 or started is None or process_start(pid) != started:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] != b"Z"
    except (OSError, IndexError):
        return False
