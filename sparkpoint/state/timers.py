"""Timers in RocksDB, under their key's key group (Flink's timer service on RocksDB).

Two indexes in one column family (`__timers__`), both behind the key's key-group prefix, so that
timers are checkpointed with the state, go through the changelog like any write, and follow their
key on a rescale:

    by time:  kg(2) | "t" | clock(1) | time(8) | key          -> b""
    by key:   kg(2) | "k" | len(key)(4) | key | clock(1) | time(8) -> b""

`time` is microseconds since the epoch, UTC, offset by 2**63 so that the bytes sort as the
numbers do. The due timers of a subtask are one bounded scan per key group of its range, merged in
time order; firing a timer deletes both entries in the same write as the next ones.
"""

from __future__ import annotations

import builtins
import heapq
import struct
from collections.abc import Iterable, Iterator
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sparkpoint.checkpoint.errors import StateBackendError
from sparkpoint.lazy import lazy_module
from sparkpoint.state.kinds.base import LEN, KeyedState, next_prefix

if TYPE_CHECKING:
    import numpy as np
    import pandas as pd
else:
    np = lazy_module("numpy")
    pd = lazy_module("pandas")

TIMERS = "__timers__"  # the column family; no state of a user's may take the name
CLOCK_BYTES = {"event": b"e", "processing": b"p"}
_TIME = struct.Struct(">Q")
_OFFSET = 1 << 63


def micros(timestamp: Any) -> int:
    """A timer's time as int microseconds since the epoch, UTC: an int (already microseconds), a
    pandas or NumPy datetime, or a `datetime` (naive ones are taken as UTC)."""
    if isinstance(timestamp, bool):
        raise TypeError(f"a timer's time must be a datetime or int microseconds, got {timestamp!r}")
    if isinstance(timestamp, (int, np.integer)):
        return int(timestamp)
    if isinstance(timestamp, (datetime, np.datetime64, pd.Timestamp)):
        ts = pd.Timestamp(timestamp)
        if ts.tzinfo is not None:
            ts = ts.tz_convert("UTC").tz_localize(None)
        return int(ts.value // 1000)
    raise TypeError(f"a timer's time must be a datetime or int microseconds, got {type(timestamp).__name__}")


class TimerService(KeyedState[bytes]):
    """A subtask's timers (Flink's timer service on RocksDB): what `state.timers` gives.

    A timer is a (key, time) pair on a clock: "event" (it fires once the watermark reaches its time) or
    "processing" (once the batch's processing time does); by default event time when the pipeline has
    an `event_time`, processing time otherwise. After each batch's `process`, every timer the batch
    makes due fires once, in timestamp order, into the operator's `on_timer(fired, state)`. Timers live
    in RocksDB under their key's key group: they are checkpointed, restored and follow their key on a
    rescale. Registering the same (key, time) twice leaves one timer. `on_timer` gets each fired
    timer's key back as `str` (`bytes` when it is not UTF-8) and its time as a
    `datetime64[us, UTC]` Timestamp, whatever type it was registered with; `list` gives int
    microseconds.

    Example:
        ```python
        def process(batch, state):
            last = batch.groupby("user")["clicked_at"].max()
            state.timers.register_many((u, t + pd.Timedelta(minutes=30)) for u, t in last.items())

        def on_timer(fired, state):            # key: str, timestamp: datetime64[us, UTC]; in timestamp order
            return fired.rename(columns={"key": "user", "timestamp": "idle_since"})
        ```
    """

    KIND = "timers"
    default_clock = "processing"
    fired = 0  # timers fired through this handle (this batch's: a handle lives one batch)
    event_time = False  # whether event-time timers can fire here (a watermark will come)
    registered = 0  # timers registered through this handle (an operator without on_timer is refused)

    def _clock_byte(self, clock: str | None) -> bytes:
        kind = clock or self.default_clock
        try:
            return CLOCK_BYTES[kind]
        except KeyError:
            raise ValueError(f"a timer's clock is 'event' or 'processing', got {kind!r}") from None

    def _register_clock(self, clock: str | None) -> bytes:
        byte = self._clock_byte(clock)
        if byte == CLOCK_BYTES["event"] and not self.event_time:
            raise StateBackendError(
                "an event-time timer would never fire here: no watermark reaches this operator (the pipeline "
                "has no event_time); register it with clock='processing'"
            )
        return byte

    def _entries(self, prefixed: bytes, clock: bytes, at: int) -> tuple[bytes, bytes]:
        kg, raw, when = prefixed[:2], prefixed[2:], _TIME.pack(at + _OFFSET)
        return kg + b"t" + clock + when + raw, kg + b"k" + LEN.pack(len(raw)) + raw + clock + when

    def register(self, key: bytes | str, timestamp: Any, *, clock: str | None = None) -> None:
        """Register a timer for `key` at `timestamp`.

        Example:
            ```python
            state.timers.register("ann", pd.Timestamp("2026-01-01 10:30", tz="UTC"))
            ```

        Args:
            key: the key, `str` or `bytes`; `on_timer` gets it back as `str` (bytes that are not UTF-8 as `bytes`).
            timestamp: a datetime (naive ones are UTC), a pandas or NumPy datetime, or int microseconds since the epoch.
            clock: "event" or "processing"; default: event time when the pipeline has an `event_time`.

        Raises:
            StateBackendError: an event-time timer in a pipeline without `event_time` (it would never fire).
        """
        self.register_many([(key, timestamp)], clock=clock)

    def register_many(self, pairs: Iterable[tuple[bytes | str, Any]], *, clock: str | None = None) -> int:
        """Register a timer for each (key, timestamp) pair, in one write.

        Example:
            ```python
            state.timers.register_many(zip(ends.index, ends.values), clock="event")
            ```

        Args:
            pairs: (key, timestamp) pairs, as `register` takes them.
            clock: "event" or "processing"; default as for `register`.

        Returns:
            The RocksDB entries written (two per timer: one by time, one by key).

        Raises:
            StateBackendError: an event-time timer in a pipeline without `event_time`.
        """
        pairs = list(pairs)
        byte = self._register_clock(clock)
        puts = []
        for prefixed, (_, at) in zip(self._prefixed_many(k for k, _ in pairs), pairs):
            by_time, by_key = self._entries(prefixed, byte, micros(at))
            puts += [(by_time, b""), (by_key, b"")]
        self.registered += len(pairs)
        return self._write(puts)

    def delete(self, key: bytes | str, timestamp: Any, *, clock: str | None = None) -> None:
        """Delete the timer of `key` at `timestamp` on that clock (nothing happens when there is none).

        Example:
            ```python
            for at in state.timers.list("ann"):
                state.timers.delete("ann", at)         # ann's timers are all gone
            ```

        Args:
            key: the key, `str` or `bytes`.
            timestamp: the timer's time, as `register` took it.
            clock: "event" or "processing"; default as for `register`.
        """
        by_time, by_key = self._entries(self._prefixed(key), self._clock_byte(clock), micros(timestamp))
        self._write((), [by_time, by_key])

    def list(self, key: bytes | str, *, clock: str | None = None) -> list[int]:
        """The key's pending timers on that clock, earliest first.

        Example:
            ```python
            pending = state.timers.list("ann")       # e.g. [1767261000000000]
            ```

        Args:
            key: the key, `str` or `bytes`.
            clock: "event" or "processing"; default as for `register`.

        Returns:
            Their times as int microseconds since the epoch, UTC.
        """
        prefixed = self._prefixed(key)
        prefix = prefixed[:2] + b"k" + LEN.pack(len(prefixed) - 2) + prefixed[2:] + self._clock_byte(clock)
        return [_TIME.unpack_from(k, len(prefix))[0] - _OFFSET for k, _ in self._scan(prefix, next_prefix(prefix))]

    def _due_in(self, kg: int, clock: bytes, upto: int) -> Iterator[tuple[int, bytes]]:
        lower = kg.to_bytes(2, "big") + b"t" + clock
        upper = lower + _TIME.pack(upto + _OFFSET + 1) if upto + _OFFSET + 1 < (1 << 64) else next_prefix(lower)
        for k, _ in self._scan(lower, upper):
            yield _TIME.unpack_from(k, 4)[0] - _OFFSET, k[12:]

    def due(self, clock: str, upto: int) -> builtins.list[tuple[int, bytes]]:
        """(time, key) of every timer on `clock` at or before `upto`, in time order."""
        byte = self._clock_byte(clock)
        runs = [self._due_in(kg, byte, upto) for kg in range(self._kg_range.start, self._kg_range.end + 1)]
        return list(heapq.merge(*runs))

    def pop_due(self, *, processing: int | None, event: int | None) -> pd.DataFrame:
        """Every timer due by these clocks, deleted and returned as the `fired` table: `key` and
        `timestamp` (datetime64[us, UTC]), one row per timer, in timestamp order."""
        fired: builtins.list[tuple[int, bytes, bytes]] = []
        for clock, upto in (("processing", processing), ("event", event)):
            if upto is not None:
                fired += [(at, raw, CLOCK_BYTES[clock]) for at, raw in self.due(clock, upto)]
        fired.sort(key=lambda f: (f[0], f[1]))
        deletes = []
        for at, raw, byte in fired:
            prefixed = self._prefixed(raw)
            deletes += list(self._entries(prefixed, byte, at))
        self._write((), deletes)
        self.fired += len(fired)
        keys = [_text(raw) for _, raw, _ in fired]
        return pd.DataFrame({
            "key": pd.Series(keys, dtype=object),
            "timestamp": pd.Series(pd.to_datetime([at for at, _, _ in fired], unit="us", utc=True),
                                   dtype="datetime64[us, UTC]"),
        })

    def pending(self, *, exact_up_to: int | None = None) -> tuple[int, int | None]:
        """(timers pending in this subtask, the earliest one's time). With `exact_up_to`, a
        subtask holding more is counted by RocksDB's estimate (two index entries per timer), and
        only the earliest of each key group is read."""
        estimate = self._store.estimate_keys() // 2
        exact = exact_up_to is None or estimate <= exact_up_to
        count, earliest = 0, None
        for kg in range(self._kg_range.start, self._kg_range.end + 1):
            for byte in CLOCK_BYTES.values():
                prefix = kg.to_bytes(2, "big") + b"t" + byte
                for k, _ in self._scan(prefix, next_prefix(prefix)):
                    count += 1
                    at = _TIME.unpack_from(k, 4)[0] - _OFFSET
                    earliest = at if earliest is None else min(earliest, at)
                    if not exact:
                        break  # the first of a key group and clock is its earliest
        return (count if exact else estimate), earliest


def _text(raw: bytes) -> str | bytes:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw


def no_timers_without_on_timer(operator: str, service: TimerService | None, has_on_timer: bool) -> None:
    """Timers registered by an operator that cannot be told when they fire are refused."""
    if service is not None and service.registered and not has_on_timer:
        raise StateBackendError(
            f"operator {operator!r} registered {service.registered} timer(s) but has no on_timer: give its "
            "KeyedOperator on_timer=fn(fired, state), or do not register timers"
        )
