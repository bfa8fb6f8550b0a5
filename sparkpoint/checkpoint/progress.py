"""Progress of long transfers, reported to an optional callback (the CLI draws it; the core never does).

A callback receives (bytes done, bytes in total) after each file or chunk; it is called under a
lock, one call at a time, whatever thread finished the work.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from sparkpoint.checkpoint.storage import CheckpointStorage

ProgressFn = Callable[[int, int], None]


class ProgressCounter:
    """Bytes done out of a known total; `add` is safe from any thread."""

    def __init__(self, total: int, callback: ProgressFn | None):
        self.total = total
        self.done = 0
        self._callback = callback
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        if self._callback is None:
            return
        with self._lock:
            self.done += n
            self._callback(self.done, self.total)


class ReportingStorage(CheckpointStorage):
    """The same job directory, reporting the bytes of each finished download to a counter.

    Lets the restore code (which downloads through `CheckpointStorage.download`) report progress
    without a parameter of its own.
    """

    counter: ProgressCounter

    def download(self, pairs: Sequence[tuple[str, str]]) -> list[tuple[int, int]]:
        def one(pair: tuple[str, str]) -> tuple[int, int]:
            (size, crc), = CheckpointStorage.download(self, [pair])
            self.counter.add(size)
            return size, crc

        return self.parallel(one, list(pairs), workers=self._copy_workers)


def reporting(storage: CheckpointStorage, counter: ProgressCounter) -> CheckpointStorage:
    """`storage` itself when nobody listens, else a copy of it that reports downloads to `counter`."""
    if counter._callback is None:
        return storage
    copy = ReportingStorage.__new__(ReportingStorage)
    copy.__dict__.update(storage.__dict__)
    copy.counter = counter
    return copy
