"""What every kind of state shares (`KeyedState`), and the one thing it needs of the storage
engine (`StateStore`): the only module of `sparkpoint.state.kinds` its kinds import.

Every stored key starts with its key group as two big-endian bytes, so that one subtask's
key-group range is one contiguous byte range: a rescale clips a database with two range
deletes and copies a neighbour's range with one bounded scan. Each kind lays out its keys
behind that prefix (`value`, `map`, `list`, `reducing`); every write goes through `_write`,
`_put`, `_delete` or `_delete_range`, hence through the store.

Reads and writes come one at a time or in batches; the batched paths (`get_many`,
`put_many`, `update_many`) use one multi-get and one atomic write, which is what keeps a
read-modify-write of a whole micro-batch close to RocksDB's own batched throughput.
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import cache
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from sparkpoint.checkpoint.errors import StateBackendError
from sparkpoint.checkpoint.metadata import KeyGroupRange
from sparkpoint.lazy import lazy_module
from sparkpoint.state.codecs import Codec
from sparkpoint.state.keygroups import MAX_KEY_GROUPS, key_bytes, key_group_of_raw, key_groups_of_raw, raw_keys
from sparkpoint.state.record import RecordCodec
from sparkpoint.state.ttl import STAMP, StateTtl

if TYPE_CHECKING:
    import numpy as np
else:
    np = lazy_module("numpy")

V = TypeVar("V")
LEN = struct.Struct(">I")


@cache
def _group_prefixes() -> tuple[bytes, ...]:
    """The two-byte big-endian prefix of every key group (at most 32,768)."""
    return tuple(g.to_bytes(2, "big") for g in range(MAX_KEY_GROUPS))


def key_group_prefix(key_group: int) -> bytes:
    return key_group.to_bytes(2, "big")


def key_group_bounds(kg_range: KeyGroupRange) -> tuple[bytes, bytes]:
    """[lower, upper) byte bounds of every RocksDB key in `kg_range`."""
    return key_group_prefix(kg_range.start), (kg_range.end + 1).to_bytes(2, "big")


Clock = Callable[[str], "int | None"]  # "processing" | "event" -> microseconds now (None: no time yet)
FORMAT_KEY = b"\xff\xffsparkpoint.ttl"  # beyond every key group: no scan, clip or rescale copy sees it
SIDECAR_KEYS = (FORMAT_KEY,)  # a rescale copies them; counts of entries leave them out
SWEEP_KEY = b"\xff\xffsparkpoint.sweep"  # where the TTL sweep goes on in the next batch (not copied on rescale)
SWEEP_LIMIT = 20_000  # entries the TTL sweep looks at per state and batch


class StateStore(Protocol):
    """Where one named state keeps its entries: raw keys, sorted bytewise, to raw values.

    All a kind of state sees of the storage engine. The engine's store (one RocksDB column
    family, `sparkpoint.state.engine.stores`) also marks the working database changed before
    each write and records the write in the subtask's changelog, so every kind is checkpointed,
    rescaled and restored the same way.
    """

    def get(self, key: bytes) -> bytes | None:
        """The value at `key` (None: absent)."""

    def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        """The values at `keys`, in their order (None where absent)."""

    def write(self, puts: list[tuple[bytes, bytes]], deletes: list[bytes]) -> None:
        """Put and delete in one atomic batch."""

    def put(self, key: bytes, value: bytes) -> None:
        """One put."""

    def delete(self, key: bytes) -> None:
        """One delete."""

    def delete_range(self, lower: bytes, upper: bytes) -> None:
        """Delete every key in [lower, upper)."""

    def scan(self, lower: bytes, upper: bytes) -> Iterator[tuple[bytes, bytes]]:
        """Every (key, value) in [lower, upper), in key order; raises on corruption rather than ending early."""

    def floor_key(self, key: bytes) -> bytes | None:
        """The greatest key at or before `key` (None: there is none)."""

    def estimate_keys(self) -> int:
        """The engine's estimate of the number of keys (cheap, not exact)."""

    def release(self) -> None:
        """Let go of the storage; any later use raises."""


def _wall_clock(kind: str) -> int | None:
    import time

    return int(time.time() * 1_000_000) if kind == "processing" else None


class KeyedState(Generic[V]):
    """What every kind of state shares: its store (`StateStore`), the codec, the key-group prefix
    and, with a TTL, the time stamp before each stored entry (`sparkpoint.state.ttl`)."""

    KIND = "state"  # what `inspect` and the orchestrator call it

    def __init__(
        self,
        store: StateStore,
        name: str,
        codec: Codec[V],
        max_parallelism: int,
        kg_range: KeyGroupRange,
        ttl: StateTtl | None = None,
        clock: Clock = _wall_clock,
    ):
        self.name = name
        self.codec = codec
        self._store = store
        self._max_parallelism = max_parallelism
        self._kg_range = kg_range
        self.ttl = ttl
        self._clock = clock
        self._sweep_from: bytes | None = None
        self.expired_removed = 0  # entries the sweep removed since this handle was made

    # --- time stamps (TTL) ---------------------------------------------------------------------

    def _now(self) -> int | None:
        assert self.ttl is not None
        return self._clock(self.ttl.clock)

    def _write_time(self) -> int:
        now = self._now()
        if now is None:
            raise StateBackendError(
                f"state {self.name!r} has an event-time TTL, but there is no watermark yet: an event-time TTL "
                "needs the pipeline's event_time column"
            )
        return now

    def _stamp(self, encoded: list[bytes]) -> list[bytes]:
        if self.ttl is None:
            return encoded
        stamp = STAMP.pack(self._write_time())
        return [stamp + e for e in encoded]

    def _expired_before(self) -> int | None:
        """Entries stamped before this are expired (None: nothing is)."""
        if self.ttl is None:
            return None
        now = self._now()
        return None if now is None else now - self.ttl.micros

    def _live(self, stored: list[bytes | None]) -> list[bytes | None]:
        """The payloads of stored entries: stamps stripped, expired ones None."""
        if self.ttl is None:
            return stored
        limit = self._expired_before()
        out: list[bytes | None] = []
        for data in stored:
            if data is None or (limit is not None and STAMP.unpack_from(data)[0] < limit):
                out.append(None)
            else:
                out.append(data[STAMP.size:])
        return out

    def _live_entries(self, entries: Iterator[tuple[bytes, bytes]]) -> Iterator[tuple[bytes, bytes]]:
        """(key, payload) of the entries of a scan that are not expired."""
        if self.ttl is None:
            yield from entries
            return
        limit = self._expired_before()
        for k, data in entries:
            if limit is None or STAMP.unpack_from(data)[0] >= limit:
                yield k, data[STAMP.size:]

    def _touch(self, keys: list[bytes], payloads: list[bytes | None]) -> None:
        """With `update="on_read_and_write"`, a read renews what it found."""
        if self.ttl is None or self.ttl.update != "on_read_and_write":
            return
        found = [(k, p) for k, p in zip(keys, payloads) if p is not None]
        if found:
            self._write(zip([k for k, _ in found], self._stamp([p for _, p in found])))

    def expire(self, limit: int = SWEEP_LIMIT) -> int:
        """Delete expired entries among the next `limit` the sweep has not looked at (it goes round
        the subtask's key groups batch after batch); returns how many it deleted."""
        threshold = self._expired_before()
        if threshold is None:
            return 0
        lower, upper = key_group_bounds(self._kg_range)
        if self._sweep_from is None:  # a handle lives one batch: the sweep goes on where the last one stopped
            self._sweep_from = self._store.get(SWEEP_KEY)
        start = self._sweep_from if self._sweep_from is not None and lower <= self._sweep_from < upper else lower
        doomed: list[bytes] = []
        seen = 0
        last = None
        for k, data in self._scan(start, upper):
            seen += 1
            last = k
            if STAMP.unpack_from(data)[0] < threshold:
                doomed.append(k)
            if seen >= limit:
                break
        self._sweep_from = None if last is None or seen < limit else last + b"\x00"
        cursor = self._sweep_from or lower
        self._write([(SWEEP_KEY, cursor)] if cursor != start else [], doomed)
        self.expired_removed += len(doomed)
        return len(doomed)

    def settle_format(self) -> int:
        """Make the stored entries match this handle's TTL: stamp every entry with the time now
        when a TTL was turned on since they were written, strip the stamps when it was turned off
        (Flink refuses either with a StateMigrationException). Returns the entries rewritten."""
        stamped = self._store.get(FORMAT_KEY) is not None
        if stamped == (self.ttl is not None):
            return 0
        rewritten = 0
        batch: list[tuple[bytes, bytes]] = []
        stamp = b""
        if self.ttl is not None:  # an event-time TTL before any watermark: the processing time stands in
            now = self._now()
            stamp = STAMP.pack(now if now is not None else self._clock("processing") or 0)
        for k, data in self._scan(*key_group_bounds(KeyGroupRange(0, MAX_KEY_GROUPS - 1))):
            batch.append((k, stamp + data if self.ttl is not None else data[STAMP.size:]))
            if len(batch) >= 10_000:
                rewritten += self._write(batch)
                batch = []
        rewritten += self._write(batch)
        if self.ttl is not None:
            self._put(FORMAT_KEY, b"1")
        else:
            self._delete(FORMAT_KEY)
        return rewritten

    def declaration(self) -> dict[str, Any]:
        """The state's kind and TTL as the operator declared them (what `inspect` shows), and a
        RecordCodec's fields: a restore reads them to evolve a state the operator did not declare."""
        ttl = None if self.ttl is None else {"seconds": self.ttl.seconds, "update": self.ttl.update,
                                              "clock": self.ttl.clock}
        if isinstance(self.codec, RecordCodec):
            return {"kind": self.KIND, "ttl": ttl, "codec": self.codec.spec()}
        return {"kind": self.KIND, "ttl": ttl}

    # --- keys ------------------------------------------------------------------------------------

    def _prefixed(self, key: bytes | str) -> bytes:
        """One key behind the two-byte prefix of its key group (the scalar path: no array set-up)."""
        raw = key.encode("utf-8") if type(key) is str else key_bytes(key)
        kg = key_group_of_raw(raw, self._max_parallelism)
        self._check_range(raw, kg)
        return kg.to_bytes(2, "big") + raw

    def _prefixed_many(self, keys: Iterable[bytes | str]) -> list[bytes]:
        """Each key behind the two-byte prefix of its key group: the hot loop of every batch, with the
        hash finalizer vectorized (tests/test_backend.py checks it against `key_group_for`)."""
        raws, groups = self._raws_and_groups(keys)
        prefixes = _group_prefixes()
        return [prefixes[g] + raw for g, raw in zip(groups.tolist(), raws)]

    def _raws_and_groups(self, keys: Iterable[bytes | str]) -> tuple[list[bytes], np.ndarray]:
        """The keys' bytes and key groups, every group checked to be this subtask's."""
        raws = raw_keys(keys)
        groups = key_groups_of_raw(raws, self._max_parallelism)
        outside = (groups < self._kg_range.start) | (groups > self._kg_range.end)
        if outside.any():
            first = int(np.argmax(outside))
            self._check_range(raws[first], int(groups[first]))
        return raws, groups

    def _prefixed_in_order(self, keys: Sequence[bytes | str]) -> tuple[list[bytes], list[int]]:
        """The prefixed keys sorted as RocksDB sorts them, and `order`: the i-th of them is
        `keys[order[i]]` (a stable sort: a key given twice keeps the order it was given in).

        Reads and writes in key order cost less: a multi-get walks each data block once, a sorted
        WriteBatch goes into the memtable in order, and the changelog's sort of the batch's
        entries finds them sorted. Keys that come sorted (a groupby's index) are ordered by their
        key group alone, without comparing bytes."""
        raws, groups = self._raws_and_groups(keys)
        prefixes = _group_prefixes()
        if all(map(operator.le, raws, raws[1:])):  # (group, key) order is then the groups' stable order
            order = np.argsort(groups, kind="stable").tolist()
            group_list = groups.tolist()
            return [prefixes[group_list[i]] + raws[i] for i in order], order
        prefixed = [prefixes[g] + raw for g, raw in zip(groups.tolist(), raws)]
        order = sorted(range(len(prefixed)), key=prefixed.__getitem__)
        return [prefixed[i] for i in order], order

    def _check_range(self, raw: bytes, kg: int) -> None:
        start, end = self._kg_range.start, self._kg_range.end
        if not start <= kg <= end:
            raise KeyError(
                f"key {raw!r} belongs to key group {kg}, outside this subtask's range "
                f"[{start}, {end}]: rows were routed to the wrong subtask"
            )

    def _scan(self, lower: bytes, upper: bytes) -> Iterator[tuple[bytes, bytes]]:
        return self._store.scan(lower, upper)

    def release(self) -> None:
        """Let go of the store: it holds the database open (and its LOCK) for as long as this
        object lives, wherever it is still referenced. Any later use raises."""
        self._store.release()

    def _multi_get(self, keys: list[bytes]) -> list[bytes | None]:
        return self._store.get_many(keys) if keys else []

    def _read(self, keys: list[bytes]) -> list[bytes | None]:
        """The live payloads at `keys` (None: absent or expired), renewed when reads renew."""
        found = self._live(self._multi_get(keys))
        self._touch(keys, found)
        return found

    def _all(self) -> Iterator[tuple[bytes, bytes]]:
        """Every live (RocksDB key, payload) of this subtask."""
        return self._live_entries(self._scan(*key_group_bounds(self._kg_range)))

    def _write(self, puts: Iterable[tuple[bytes, bytes]], deletes: Iterable[bytes] = ()) -> int:
        puts, deletes = list(puts), list(deletes)
        if not puts and not deletes:
            return 0
        self._store.write(puts, deletes)
        return len(puts) + len(deletes)

    def _put(self, key: bytes, value: bytes) -> None:
        self._store.put(key, value)

    def _put_values(self, keys: list[bytes], values: Iterable[V]) -> int:
        encode = self.codec.encode
        return self._write(zip(keys, self._stamp([encode(v) for v in values])))

    def _delete(self, key: bytes) -> None:
        self._store.delete(key)

    def _delete_range(self, lower: bytes, upper: bytes) -> None:
        self._store.delete_range(lower, upper)

    def clear(self) -> None:
        """Delete every entry of this state in this subtask's key-group range (one range delete).

        Example:
            ```python
            state.value_state("totals", TOTALS).clear()   # this subtask's totals are gone
            ```
        """
        self._delete_range(*key_group_bounds(self._kg_range))


def next_prefix(prefix: bytes) -> bytes:
    """The smallest byte string greater than every string starting with `prefix`."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        raise ValueError("a prefix of only 0xff bytes has no upper bound")
    return stripped[:-1] + bytes([stripped[-1] + 1])

