"""Named crash points: a test stops the whole process (SIGKILL, no cleanup) at a named point.

Unlike `sparkpoint.spark.faults` (which raises), a crash point leaves exactly what a power cut or
an OOM kill would: half-written uploads, a `_metadata` without its registry update, a sink not
yet committed. The protocol must then recover on the next start. Nothing happens unless the
environment asks for it:

    SPARKPOINT_CRASH_AT=<point>[:<n>]   die the n-th time (default 1) the run reaches <point>
    SPARKPOINT_CRASH_DIR=<dir>          optional: count hits in files there, shared by every
                                        process of the run (the driver and Spark's Python
                                        workers), and write `crashed.json` there (fsynced)
                                        right before the kill, so a test can tell where it died
    SPARKPOINT_CRASH_PGID=<pgid>        the run's process group (`arm` sets it in the driver):
                                        Spark's Python workers run in a group of their own, so
                                        a worker kills the driver's group as well as its own

Without SPARKPOINT_CRASH_DIR each process counts its own hits.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import time

CRASH_AT = "SPARKPOINT_CRASH_AT"
CRASH_DIR = "SPARKPOINT_CRASH_DIR"
CRASH_PGID = "SPARKPOINT_CRASH_PGID"

# In protocol order; where each one sits:
CRASH_POINTS = (
    "after-native-checkpoint",  # a subtask's local snapshot (native checkpoint or changelog file) exists, no upload
    "mid-upload",  # one file of a snapshot uploaded (the n-th file of the run), others maybe not
    "after-upload",  # a subtask uploaded everything and wrote its handle, the coordinator has not seen it
    "before-metadata",  # every handle acknowledged, `_metadata` not written
    "after-metadata-before-registry",  # `_metadata` committed, registry not updated, nothing subsumed
    "mid-subsumption-deletes",  # a subsumed checkpoint's `_metadata` deleted, its files not yet
    "after-metadata-before-sink-commit",  # checkpoint complete, the sink's staged rows not yet visible
    "before-table-commit",  # a table sink read the table and the staged files' footers, delta-rs not yet called
    "after-table-commit",  # the table holds checkpoint N; the committer recorded nothing after it
    "mid-restore",  # a subtask's RocksDB files are in place, the changelog chain not replayed, no marker
    "mid-task-local-copy",  # the task-local copy of a changelog checkpoint is partly linked
)

# Points only a table output (a Delta table) reaches: a run writing Parquet never hits them.
TABLE_POINTS = ("before-table-commit", "after-table-commit")

# Points of the maintenance beside the protocol (`prune`'s input cleanup), never reached by a run:
MAINTENANCE_POINTS = (
    "after-archive-copy",  # an input file copied to the archive and checked, not yet deleted from the input
)

# Points of `sparkpoint erase` (`sparkpoint.pipeline.erase`), in its order; a run never reaches them:
ERASE_POINTS = (
    "erase-mid-rewrite",  # a subtask's rewritten files uploaded, the copy's `_metadata` not written
    "erase-after-copy",  # one erased copy committed (the n-th), the later ones not yet
    "erase-before-retire",  # every copy committed and verified, no original retired
    "erase-mid-retire",  # the retired ids noted and some originals' `_metadata` deleted (the n-th), files not yet
    "erase-before-output",  # the state erased (originals retired, task-local copies dropped), the output not yet
)

_hits: dict[str, int] = {}
_jvm_groups: set[int] = set()  # this process's JVM, in a session of its own (sparkpoint.spark.session)


def kill_with_this_process(pgid: int) -> None:
    """A crash point here kills process group `pgid` too (never inherited by a child process)."""
    _jvm_groups.add(pgid)


def parse(spec: str) -> tuple[str, int]:
    """`<point>[:<n>]` -> (point, n); ValueError for an unknown point or a bad count."""
    point, _, count = spec.partition(":")
    known = CRASH_POINTS + MAINTENANCE_POINTS + ERASE_POINTS
    if point not in known:
        raise ValueError(f"unknown crash point {point!r} in {CRASH_AT}; use one of {', '.join(known)}")
    n = int(count) if count else 1
    if n < 1:
        raise ValueError(f"{CRASH_AT}={spec!r}: the count must be at least 1")
    return point, n


def arm() -> dict[str, str]:
    """In the driver, before Spark starts: validate the request and record this process group.

    Returns the variables Spark executors need (for `spark.executorEnv.*`); empty when no crash
    point is asked for."""
    spec = os.environ.get(CRASH_AT)
    if not spec:
        return {}
    parse(spec)
    os.environ.setdefault(CRASH_PGID, str(os.getpgid(0)))
    return {k: os.environ[k] for k in (CRASH_AT, CRASH_DIR, CRASH_PGID) if os.environ.get(k)}


def crash_point(name: str) -> None:
    """SIGKILL the run's process group(s) if this is the requested point's n-th hit."""
    spec = os.environ.get(CRASH_AT)
    if not spec or spec.partition(":")[0] != name:
        return
    point, n = parse(spec)
    directory = os.environ.get(CRASH_DIR)
    hit = _count_in(directory, point) if directory else _count_here(point)
    if hit != n:
        return
    if directory:
        _write_marker(directory, {"point": point, "hit": hit, "pid": os.getpid(), "time": time.time()})
    groups = {os.getpgid(0), *_jvm_groups}
    if os.environ.get(CRASH_PGID, "").isdigit():
        groups.add(int(os.environ[CRASH_PGID]))
    for group in sorted(groups, key=lambda g: g == os.getpgid(0)):  # our own group last
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os.kill(os.getpid(), signal.SIGKILL)  # not reached unless every killpg failed


def _count_here(point: str) -> int:
    _hits[point] = _hits.get(point, 0) + 1
    return _hits[point]


def _count_in(directory: str, point: str) -> int:
    """One byte per hit, appended under a lock: the file's size is the run-wide count."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, f"{point}.hits"), "ab") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(b"x")
        f.flush()
        return os.fstat(f.fileno()).st_size


def _write_marker(directory: str, record: dict[str, object]) -> None:
    path = os.path.join(directory, "crashed.json")
    with open(path, "w") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
