"""Phase timings of one subtask (restore, download, process, timers, snapshot, upload, ...), taken
where the work happens and carried back as plain data, so the driver can draw them as nested
spans with their real start and end times (`sparkpoint.pipeline.traces`): no tracing library in
the tasks, no context to propagate into executors.

    with recording() as phases:
        with phase("restore"):
            with phase("download"):
                ...
    phases.to_json()  # [["restore", -1, t0, t1], ["download", 0, t0', t1']]

Outside `recording()` a `phase` costs one context-variable lookup.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

# (name, parent index or -1, start, end): seconds since the epoch, as the spans' times.
Phase = tuple[str, int, float, float]


@dataclass
class PhaseLog:
    """The phases recorded so far, in the order they started; `_open` the indexes of those running."""

    phases: list[Phase] = field(default_factory=list)
    _open: list[int] = field(default_factory=list)

    def to_json(self) -> list[list[object]]:
        return [list(p) for p in self.phases]


_current: ContextVar[PhaseLog | None] = ContextVar("sparkpoint_phases", default=None)


@contextmanager
def recording() -> Iterator[PhaseLog]:
    """Record the phases run in this context (and nested calls) into a new log."""
    log = PhaseLog()
    token = _current.set(log)
    try:
        yield log
    finally:
        _current.reset(token)


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Time the block as phase `name`, nested in the phase running around it (if recording)."""
    log = _current.get()
    if log is None:
        yield
        return
    index = len(log.phases)
    log.phases.append((name, log._open[-1] if log._open else -1, time.time(), 0.0))
    log._open.append(index)
    try:
        yield
    finally:
        log._open.pop()
        name_, parent, start, _ = log.phases[index]
        log.phases[index] = (name_, parent, start, time.time())


def phases_from_json(raw: object) -> tuple[Phase, ...]:
    """Phases as `PhaseLog.to_json` wrote them; anything malformed gives none (they only inform)."""
    if not isinstance(raw, list):
        return ()
    out = []
    for item in raw:
        if (not isinstance(item, list) or len(item) != 4 or not isinstance(item[0], str)
                or not isinstance(item[1], int) or not all(isinstance(t, (int, float)) for t in item[2:])):
            return ()
        out.append((item[0], item[1], float(item[2]), float(item[3])))
    return tuple(out)
