"""State time-to-live: per entry, on processing time or on event time (the watermark).

An entry of a state with a TTL (a value, each map entry, each list element) is stored behind the
time of its last write (or read, with `update="on_read_and_write"`) as eight big-endian bytes of
microseconds since the epoch, UTC. It is expired once the state's clock passes that time plus
`seconds` (at exactly that time it is still live; one microsecond later it is gone): reads,
`items()` and exports skip it from then on, and it is removed physically by the
bounded sweep every batch runs (`expire`), whose deletes go through the changelog like any write,
so checkpoints stop growing; RocksDB's compactions then drop the deleted entries from the SSTs.

rocksdict exposes no compaction filter (Flink's cleanup in RocksDB), hence the sweep.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

STAMP = struct.Struct(">q")  # microseconds since the epoch, UTC
UPDATES = ("on_write", "on_read_and_write")
CLOCKS = ("processing", "event")


@dataclass(frozen=True)
class StateTtl:
    """How long an entry of a state lives after its last write (or read).

    An entry written (or renewed) at time `t` is returned while the clock is at most
    `t + seconds` and is expired from the next microsecond on, both the time and the clock read
    in whole microseconds. On processing time, `t` and the clock are batches' processing times
    (the driver's clock when a batch starts, the same for all its subtasks, standing still while
    it runs), not the wall clock at the moment of the read; on event time, the watermarks the
    batches advance to. An export (`read_state`, `sparkpoint state`) reads with the checkpoint's
    clocks: its commit time and its watermark.

        from sparkpoint import StateTtl
        seen = state.value_state("seen", JsonCodec(), ttl=StateTtl(30 * 24 * 3600))

    Args:
        seconds: the time to live, a finite number above 0.
        update: "on_write" (default) or "on_read_and_write": which accesses renew an entry.
        clock: "processing" (the batch's processing time, default) or "event" (the pipeline's
            watermark: a write's time is the watermark its batch advances to).

    Raises:
        ValueError: a TTL that is not finite and positive, or an unknown update or clock.
    """

    seconds: float
    update: str = "on_write"
    clock: str = "processing"

    def __post_init__(self) -> None:
        if isinstance(self.seconds, bool) or not isinstance(self.seconds, (int, float)) or not (
            math.isfinite(self.seconds) and self.seconds > 0
        ):
            raise ValueError(f"a state TTL must be a finite number of seconds above 0, got {self.seconds!r}")
        if self.update not in UPDATES:
            raise ValueError(f"StateTtl update must be one of {', '.join(UPDATES)}, got {self.update!r}")
        if self.clock not in CLOCKS:
            raise ValueError(f"StateTtl clock must be one of {', '.join(CLOCKS)}, got {self.clock!r}")

    @property
    def micros(self) -> int:
        """The time to live in whole microseconds (what entries' time stamps are compared in)."""
        return int(round(self.seconds * 1_000_000))
