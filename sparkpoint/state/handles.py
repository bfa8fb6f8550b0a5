"""Keyed state over one RocksDB column family per named state.

Every RocksDB key starts with its key group as two big-endian bytes, so that one subtask's
key-group range is one contiguous byte range: a rescale clips a database with two range
deletes and copies a neighbour's range with one bounded scan.

    value state:  kg(2) | key                         -> codec(value)
    map state:    kg(2) | len(key)(4) | key | user key -> codec(value)
    list state:   kg(2) | len(key)(4) | key | seq(8)   -> codec(element)
    reducing:     kg(2) | key                         -> codec(the reduced value)

A list element is one RocksDB entry under a sequence number that only grows for its key, so an
append is one seek (the key's last sequence number) and one put, however long the list is; no
merge operator is needed (rocksdict has none). Every write goes through `_write`, `_put`,
`_delete` or `_delete_range`, which the changelog records: each kind of state is checkpointed,
rescaled (by its key-group prefix) and restored the same way.

Reads and writes come one at a time or in batches; the batched paths (`get_many`,
`put_many`, `update_many`) use RocksDB's multi-get and one WriteBatch, which is what keeps a
read-modify-write of a whole micro-batch close to RocksDB's own batched throughput.
"""

from __future__ import annotations

import logging
import operator
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import cache
from typing import Any, Generic, TypeVar, cast

import numpy as np
from rocksdict import Rdict, ReadOptions, WriteBatch

from sparkpoint.checkpoint.errors import StateBackendError
from sparkpoint.checkpoint.metadata import KeyGroupRange
from sparkpoint.state.changelog import ChangeLog
from sparkpoint.state.codecs import Codec
from sparkpoint.state.keygroups import MAX_KEY_GROUPS, key_bytes, key_group_of_raw, key_groups_of_raw, raw_keys
from sparkpoint.state.record import RecordCodec
from sparkpoint.state.ttl import STAMP, StateTtl

V = TypeVar("V")
log = logging.getLogger(__name__)
_LEN = struct.Struct(">I")
MULTI_GET_SLICE = 4096  # keys per RocksDB multi-get: what one pins stays near 16 MB of 4 KB blocks


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


def _wall_clock(kind: str) -> int | None:
    import time

    return int(time.time() * 1_000_000) if kind == "processing" else None


class _KeyedState(Generic[V]):
    """What every kind of state shares: the column family, the codec, the key-group prefix and,
    with a TTL, the time stamp before each stored entry (`sparkpoint.state.ttl`)."""

    KIND = "state"  # what `inspect` and the orchestrator call it

    def __init__(
        self,
        db: Rdict,
        name: str,
        codec: Codec[V],
        max_parallelism: int,
        kg_range: KeyGroupRange,
        on_write: Callable[[], None] = lambda: None,
        log: ChangeLog | None = None,
        ttl: StateTtl | None = None,
        clock: Clock = _wall_clock,
    ):
        self.name = name
        self._log = log  # the changelog of the subtask, when it keeps one
        self.codec = codec
        self._on_write = on_write
        self._db = db
        self._cf = db.get_column_family(name)
        self._handle = db.get_column_family_handle(name)
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
            self._sweep_from = self._cf.get(SWEEP_KEY)
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
        stamped = self._cf.get(FORMAT_KEY) is not None
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
        opts = ReadOptions()
        opts.set_iterate_upper_bound(upper)
        it = self._cf.iter(opts)
        try:
            it.seek(lower)
            while it.valid():
                yield it.key(), it.value()
                it.next()
            it.status()  # raises on corruption instead of ending the scan early and silently
        finally:
            del it  # a live iterator holds the database open (and its LOCK), even from a traceback

    def release(self) -> None:
        """Let go of the database: its column-family handle holds it open (and its LOCK) for as
        long as this object lives, wherever it is still referenced. Any later use raises."""
        try:
            self._cf.close()
        except Exception as e:  # noqa: BLE001  rocksdict raises bare Exception (a corrupt database)
            log.warning("closing column family %s: %s", self.name, e)
        del self._handle  # holds the database too, and cannot be closed

    def _multi_get(self, keys: list[bytes]) -> list[bytes | None]:
        # In slices: a multi-get pins the data block of every key it reads until it returns, over
        # the cache's capacity if need be (measured: 100,000 keys of a 5 GB state held 430 MB).
        if len(keys) <= MULTI_GET_SLICE:
            return cast(list[bytes | None], self._cf.get(cast(Any, keys))) if keys else []
        found: list[bytes | None] = []
        for start in range(0, len(keys), MULTI_GET_SLICE):
            found += cast(list[bytes | None], self._cf.get(cast(Any, keys[start : start + MULTI_GET_SLICE])))
        return found

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
        batch = WriteBatch(raw_mode=True)
        handle = self._handle
        for k, v in puts:
            batch.put(k, v, handle)
        for k in deletes:
            batch.delete(k, handle)
        self._on_write()
        self._db.write(batch)
        if self._log is not None:
            self._log.write_batch(self.name, puts, deletes)
        return len(puts) + len(deletes)

    def _put(self, key: bytes, value: bytes) -> None:
        self._on_write()
        self._cf.put(key, value)
        if self._log is not None:
            self._log.put(self.name, key, value)

    def _put_values(self, keys: list[bytes], values: Iterable[V]) -> int:
        encode = self.codec.encode
        return self._write(zip(keys, self._stamp([encode(v) for v in values])))

    def _delete(self, key: bytes) -> None:
        self._on_write()
        self._cf.delete(key)
        if self._log is not None:
            self._log.delete(self.name, key)

    def _delete_range(self, lower: bytes, upper: bytes) -> None:
        self._on_write()
        self._cf.delete_range(lower, upper)
        if self._log is not None:
            self._log.delete_range(self.name, lower, upper)

    def clear(self) -> None:
        """Delete every entry of this state in this subtask's key-group range (one range delete).

        Example:
            ```python
            state.value_state("totals", TOTALS).clear()   # this subtask's totals are gone
            ```
        """
        self._delete_range(*key_group_bounds(self._kg_range))


class ValueState(_KeyedState[V]):
    """One value per key (Flink's ValueState): what `state.value_state(name, codec)` returns.

    Keys are `str` or `bytes` (a `str` is stored as its UTF-8 bytes); reads give keys back as `bytes`.
    A value is whatever the codec encodes. With a TTL (`ttl=StateTtl(...)`), a value expires that
    long after its last write (or read) and is never returned again.

    Example:
        ```python
        totals = state.value_state("totals", StructCodec("<q"))
        totals.put("ann", (3,))
        totals.get("ann")           # (3,)
        totals.get("bob")           # None: no value
        ```
    """

    KIND = "value"

    def get(self, key: bytes | str) -> V | None:
        """The value of `key`, or None when it has none (or it expired).

        Example:
            ```python
            clicks = totals.get("ann")          # (3,) or None
            ```

        Args:
            key: the key, `str` or `bytes`.

        Returns:
            The decoded value, or None.
        """
        (data,) = self._read([self._prefixed(key)])
        return None if data is None else self.codec.decode(data)

    def put(self, key: bytes | str, value: V) -> None:
        """Set the value of `key` (replacing any value it had).

        Example:
            ```python
            totals.put("ann", (4,))
            ```

        Args:
            key: the key, `str` or `bytes`.
            value: what the codec encodes.
        """
        self._put_values([self._prefixed(key)], [value])

    def delete(self, key: bytes | str) -> None:
        """Delete the value of `key` (nothing happens when it has none).

        Example:
            ```python
            totals.delete("ann")
            ```

        Args:
            key: the key, `str` or `bytes`.
        """
        self._delete(self._prefixed(key))

    def get_many(self, keys: Sequence[bytes | str]) -> list[V | None]:
        """The values of many keys at once, in the order given (one RocksDB multi-get).

        Example:
            ```python
            old = totals.get_many(["ann", "bob"])     # [(3,), None]
            ```

        Args:
            keys: the keys, `str` or `bytes`.

        Returns:
            One value per key, None where a key has none.
        """
        if not keys:
            return []
        found = self._read(self._prefixed_many(keys))
        decode = self.codec.decode
        return [None if d is None else decode(d) for d in found]

    def put_many(self, items: Iterable[tuple[bytes | str, V]]) -> int:
        """Set the values of many keys in one write.

        Example:
            ```python
            totals.put_many([("ann", (4,)), ("bob", (1,))])
            totals.put_many(zip(batch["user"], batch["page"]))      # any iterable of pairs
            ```

        Args:
            items: (key, value) pairs; a key given twice keeps its last value.

        Returns:
            The entries written.
        """
        pairs = list(items)
        return self._put_values(self._prefixed_many(k for k, _ in pairs), [v for _, v in pairs])

    def get_many_table(self, keys: Any) -> Any:
        """The values of many keys as one Arrow table, a row per key in order (a key without a
        value: a row of nulls), for a codec with a columnar form (`RecordCodec`). One multi-get;
        decoded without a Python loop over the rows.

        Example:
            ```python
            old = totals.get_many_table(batch["user"])           # pyarrow.Table
            clicks = pc.add(pc.fill_null(old["clicks"], 0), batch_clicks)
            ```

        Args:
            keys: str or bytes keys (a list, a NumPy array, a pandas Series or an Arrow array).

        Returns:
            A `pyarrow.Table` with the codec's fields (`.to_pandas()` for a DataFrame).

        Raises:
            TypeError: the state's codec has no columnar form (it is not a `RecordCodec`).
        """
        decode_table = _columnar(self.codec, "decode_table")
        keys = _key_list(keys)
        return decode_table(self._read(self._prefixed_many(keys)) if keys else [])

    def put_many_table(self, keys: Any, table: Any) -> int:
        """Write row i of `table` as the value of `keys[i]`, all in one WriteBatch (a columnar
        codec: `RecordCodec`). A field the table lacks is its default, else null.

        Example:
            ```python
            totals.put_many_table(["ann", "bob"], {"clicks": [4, 1], "spend": [2.5, 0.0]})
            ```

        Args:
            keys: str or bytes keys, one per row.
            table: a `pyarrow.Table`, a pandas DataFrame or a dict of columns.

        Returns:
            The entries written.

        Raises:
            TypeError: the state's codec has no columnar form (it is not a `RecordCodec`).
            ValueError: the table has another number of rows than there are keys.
        """
        encode_table = _columnar(self.codec, "encode_table")
        keys = _key_list(keys)
        encoded = encode_table(table)
        if len(encoded) != len(keys):
            raise ValueError(f"put_many_table: {len(keys)} keys, but the table has {len(encoded)} rows")
        return self._write(zip(self._prefixed_many(keys), self._stamp(encoded)))

    def update_many_encoded(
        self, keys: Sequence[bytes | str], fn: Callable[[list[bytes | None]], Sequence[bytes | None]]
    ) -> int:
        """Read-modify-write of many keys in one call of `fn`, over the values as stored (encoded).

        `fn` gets the old values as stored (None: absent or expired), in key order, and returns the new
        ones (None: delete the key). For operators that decode and encode whole batches at once, such as
        with `StructCodec.decode_many` / `encode_many` (NumPy records): one multi-get, one write, no
        Python call per key.

        Example:
            ```python
            COUNT = StructCodec("<q")
            counts = batch.groupby("user").size()

            def add(stored):                          # the stored values, None where a key has none
                old, present = COUNT.decode_many(stored)
                old["f0"] += counts.to_numpy()        # absent keys decode as zeros
                return COUNT.encode_many(old)

            state.value_state("count", COUNT).update_many_encoded(counts.index.tolist(), add)
            ```

        Args:
            keys: the keys, `str` or `bytes`.
            fn: takes the list of stored values and returns a sequence of new ones, as long.

        Returns:
            The entries written or deleted.

        Raises:
            ValueError: `fn` returned another number of values than there are keys.
        """
        prefixed, order = self._prefixed_in_order(keys)  # read and written in RocksDB's order
        found = np.empty(len(order), dtype=object)
        found[order] = np.fromiter(self._live(self._multi_get(prefixed)), dtype=object, count=len(order))
        new = fn(found.tolist())  # in the caller's order
        if len(new) != len(prefixed):
            raise ValueError(f"update_many_encoded: {len(prefixed)} keys, but fn returned {len(new)} values")
        values = [new[i] for i in order]
        try:
            encoded = [v if type(v) is bytes else bytes(cast(Any, v)) for v in values]
        except TypeError:  # deletes (None) among them
            pass
        else:
            return self._write(zip(prefixed, self._stamp(encoded)))
        kept = [(pk, bytes(v)) for pk, v in zip(prefixed, values) if v is not None]
        puts = list(zip([pk for pk, _ in kept], self._stamp([v for _, v in kept])))
        return self._write(puts, [pk for pk, v in zip(prefixed, values) if v is None])

    def update_many(self, keys: Sequence[bytes | str], fn: Callable[[bytes | str, V | None], V | None]) -> int:
        """Read-modify-write of many keys: one multi-get, one WriteBatch, `fn` called once per key.

        Example:
            ```python
            counts = batch.groupby("user").size()
            totals.update_many(counts.index.tolist(),
                               lambda key, old: ((old[0] if old else 0) + int(counts[key]),))
            ```

        Args:
            keys: the keys, `str` or `bytes` (as given, they are what `fn` receives).
            fn: `fn(key, old)` returns the new value, or None to delete the key; `old` is None for a key
                without a value.

        Returns:
            The entries written or deleted.
        """
        prefixed = self._prefixed_many(keys)
        old = self._live(self._multi_get(prefixed))
        decode, encode = self.codec.decode, self.codec.encode
        puts: list[tuple[bytes, bytes]] = []
        deletes: list[bytes] = []
        for key, pk, data in zip(keys, prefixed, old):
            new = fn(key, None if data is None else decode(data))
            if new is None:
                deletes.append(pk)
            else:
                puts.append((pk, encode(new)))
        return self._write(zip([k for k, _ in puts], self._stamp([v for _, v in puts])), deletes)

    def items(self) -> Iterator[tuple[bytes, V]]:
        """Every (key, value) of this subtask, in key-group order (expired values left out).

        Example:
            ```python
            def export(state):
                return pd.DataFrame([(k.decode(), v[0]) for k, v in state.value_state("totals", TOTALS).items()],
                                    columns=["user", "clicks"])
            ```

        Yields:
            (key as `bytes`, value) pairs.
        """
        decode = self.codec.decode
        for k, v in self._all():
            yield k[2:], decode(v)


class MapState(_KeyedState[V]):
    """Per key a map of user key -> value (Flink's MapState): what `state.map_state(name, codec)` returns.

    Each (key, user key) entry is one RocksDB entry, so a read or a write touches one entry, however
    large the key's map is. With a TTL each entry expires on its own.

    Example:
        ```python
        pages = state.map_state("pages", JsonCodec())
        pages.put("ann", "/cart", 2)
        pages.get("ann", "/cart")          # 2
        dict(pages.entries("ann"))         # {b"/cart": 2}
        ```
    """

    KIND = "map"

    def _map_prefix(self, key: bytes | str) -> bytes:
        prefixed = self._prefixed(key)
        return prefixed[:2] + _LEN.pack(len(prefixed) - 2) + prefixed[2:]

    def _entry_key(self, key: bytes | str, user_key: bytes | str) -> bytes:
        return self._map_prefix(key) + key_bytes(user_key)

    def _entry_keys(self, pairs: Iterable[tuple[bytes | str, bytes | str]]) -> list[bytes]:
        """`_entry_key` of many pairs: each distinct key's prefix computed once, all in one batch."""
        pairs = list(pairs)
        keys = raw_keys(k for k, _ in pairs)  # bytes: hashable (a bytearray key is not)
        distinct = list(dict.fromkeys(keys))
        prefixes = {
            raw: p[:2] + _LEN.pack(len(raw)) + raw for raw, p in zip(distinct, self._prefixed_many(distinct))
        }
        return [prefixes[k] + u for k, u in zip(keys, raw_keys(u for _, u in pairs))]

    def get(self, key: bytes | str, user_key: bytes | str) -> V | None:
        """The value of one entry of `key`'s map, or None when the map lacks `user_key`.

        Example:
            ```python
            visits = pages.get("ann", "/cart")
            ```

        Args:
            key: the key, `str` or `bytes`.
            user_key: the entry's key in the map, `str` or `bytes`.

        Returns:
            The decoded value, or None.
        """
        (data,) = self._read([self._entry_key(key, user_key)])
        return None if data is None else self.codec.decode(data)

    def contains(self, key: bytes | str, user_key: bytes | str) -> bool:
        """Whether `key`'s map has `user_key` (an expired entry counts as absent).

        Example:
            ```python
            if not pages.contains("ann", "/cart"):
                ...
            ```

        Args:
            key: the key, `str` or `bytes`.
            user_key: the entry's key in the map.

        Returns:
            True when the entry is there.
        """
        return self._live([self._cf.get(self._entry_key(key, user_key))])[0] is not None

    def put(self, key: bytes | str, user_key: bytes | str, value: V) -> None:
        """Set one entry of `key`'s map.

        Example:
            ```python
            pages.put("ann", "/cart", 3)
            ```

        Args:
            key: the key, `str` or `bytes`.
            user_key: the entry's key in the map.
            value: what the codec encodes.
        """
        self._put_values([self._entry_key(key, user_key)], [value])

    def delete(self, key: bytes | str, user_key: bytes | str) -> None:
        """Delete one entry of `key`'s map (the rest of the map stays).

        Example:
            ```python
            pages.delete("ann", "/cart")
            ```

        Args:
            key: the key, `str` or `bytes`.
            user_key: the entry's key in the map.
        """
        self._delete(self._entry_key(key, user_key))

    def get_many(self, pairs: Sequence[tuple[bytes | str, bytes | str]]) -> list[V | None]:
        """The values of many entries at once, in the order given (one multi-get).

        Example:
            ```python
            pages.get_many([("ann", "/"), ("bob", "/cart")])      # [1, None]
            ```

        Args:
            pairs: (key, user key) pairs.

        Returns:
            One value per pair, None where the map lacks the entry.
        """
        if not pairs:
            return []
        found = self._read(self._entry_keys(pairs))
        decode = self.codec.decode
        return [None if d is None else decode(d) for d in found]

    def put_many(self, entries: Iterable[tuple[bytes | str, bytes | str, V]]) -> int:
        """Set many entries in one write.

        Example:
            ```python
            pages.put_many([("ann", "/", 1), ("ann", "/cart", 2)])
            ```

        Args:
            entries: (key, user key, value) triples.

        Returns:
            The entries written.
        """
        triples = list(entries)
        return self._put_values(self._entry_keys((k, u) for k, u, _ in triples), [v for _, _, v in triples])

    def put_absent(self, entries: Iterable[tuple[bytes | str, bytes | str, V]]) -> list[bool]:
        """Put each (key, user key, value) whose user key the key's map lacks; one multi-get and one write.

        A "seen before?" set in one pass: a pair given twice is put once, the first time.

        Example:
            ```python
            SEEN = BytesCodec()
            pairs = batch[["user", "page"]].drop_duplicates()
            new = state.map_state("pages", SEEN).put_absent((u, p, b"") for u, p in zip(pairs["user"], pairs["page"]))
            first_visits = pairs[new]
            ```

        Args:
            entries: (key, user key, value) triples.

        Returns:
            One bool per triple: True where it was put (the entry was new).
        """
        triples = list(entries)
        entry_keys = self._entry_keys((k, u) for k, u, _ in triples)
        added, keys, values, seen = [], [], [], set()
        for entry_key, found, (_, _, value) in zip(entry_keys, self._live(self._multi_get(entry_keys)), triples):
            new = found is None and entry_key not in seen
            if new:
                seen.add(entry_key)
                keys.append(entry_key)
                values.append(value)
            added.append(new)
        self._put_values(keys, values)
        return added

    def entries(self, key: bytes | str) -> Iterator[tuple[bytes, V]]:
        """The (user key, value) pairs of one key's map, in user-key order.

        Example:
            ```python
            visited = {page.decode(): n for page, n in pages.entries("ann")}
            ```

        Args:
            key: the key, `str` or `bytes`.

        Yields:
            (user key as `bytes`, value) pairs; none for a key without a map.
        """
        prefix = self._map_prefix(key)
        decode = self.codec.decode
        for k, v in self._live_entries(self._scan(prefix, _next_prefix(prefix))):
            yield k[len(prefix) :], decode(v)

    def remove_key(self, key: bytes | str) -> None:
        """Delete the whole map of one key (one range delete, however many entries it has).

        Example:
            ```python
            pages.remove_key("ann")
            ```

        Args:
            key: the key, `str` or `bytes`.
        """
        prefix = self._map_prefix(key)
        self._delete_range(prefix, _next_prefix(prefix))

    def items(self) -> Iterator[tuple[bytes, bytes, V]]:
        """Every (key, user key, value) of this subtask, in key-group order.

        Example:
            ```python
            rows = [(k.decode(), u.decode(), v) for k, u, v in pages.items()]
            ```

        Yields:
            (key, user key, value) triples, keys as `bytes`.
        """
        decode = self.codec.decode
        for k, v in self._all():
            (n,) = _LEN.unpack_from(k, 2)
            yield k[6 : 6 + n], k[6 + n :], decode(v)


_SEQ = struct.Struct(">Q")


class ListState(_KeyedState[V]):
    """Per key a list of values (Flink's ListState): what `state.list_state(name, codec)` returns.

    An append is one write, whatever the list's length (each element is its own RocksDB entry under a
    sequence number); with a TTL each element expires on its own.

    Example:
        ```python
        clicks = state.list_state("clicks", JsonCodec())
        clicks.add("ann", ["2026-01-01T10:00", "/"])
        clicks.add_many([("ann", ["2026-01-01T10:05", "/cart"]), ("bob", ["2026-01-01T10:06", "/"])])
        clicks.get("ann")          # both of ann's clicks, oldest first
        ```
    """

    KIND = "list"

    def _list_prefix(self, prefixed: bytes) -> bytes:
        return prefixed[:2] + _LEN.pack(len(prefixed) - 2) + prefixed[2:]

    def _last_seq(self, prefix: bytes) -> int:
        """The key's highest sequence number, -1 for an empty list: one seek, whatever its length."""
        it = self._cf.iter(ReadOptions())
        try:
            it.seek_for_prev(prefix + b"\xff" * _SEQ.size)
            if it.valid():
                key = it.key()
                if key.startswith(prefix) and len(key) == len(prefix) + _SEQ.size:
                    return int(_SEQ.unpack_from(key, len(prefix))[0])
            it.status()
            return -1
        finally:
            del it

    def _appends(self, pairs: list[tuple[bytes | str, V]]) -> list[tuple[bytes, bytes]]:
        """The entries that append `pairs` in order: each distinct key's last number read once."""
        prefixes = [self._list_prefix(p) for p in self._prefixed_many(k for k, _ in pairs)]
        following: dict[bytes, int] = {}
        keys = []
        for prefix in prefixes:
            seq = following.get(prefix)
            if seq is None:
                seq = self._last_seq(prefix) + 1
            following[prefix] = seq + 1
            keys.append(prefix + _SEQ.pack(seq))
        encode = self.codec.encode
        return list(zip(keys, self._stamp([encode(v) for _, v in pairs])))

    def add(self, key: bytes | str, value: V) -> None:
        """Append `value` to the key's list (one write).

        Example:
            ```python
            clicks.add("ann", ["2026-01-01T10:00", "/"])
            ```

        Args:
            key: the key, `str` or `bytes`.
            value: what the codec encodes.
        """
        self._write(self._appends([(key, value)]))

    def add_many(self, pairs: Iterable[tuple[bytes | str, V]]) -> int:
        """Append every (key, value), in the order given; one write.

        Example:
            ```python
            clicks.add_many(zip(batch["user"], batch[["clicked_at", "page"]].astype(str).values.tolist()))
            ```

        Args:
            pairs: (key, value) pairs; a key's values are appended in their order here.

        Returns:
            The elements written.
        """
        return self._write(self._appends(list(pairs)))

    def get(self, key: bytes | str) -> list[V]:
        """The key's list, oldest first ([] when it has none).

        Example:
            ```python
            history = clicks.get("ann")
            ```

        Args:
            key: the key, `str` or `bytes`.

        Returns:
            The decoded elements (expired ones left out).
        """
        prefix = self._list_prefix(self._prefixed(key))
        entries = list(self._live_entries(self._scan(prefix, _next_prefix(prefix))))
        self._touch([k for k, _ in entries], [v for _, v in entries])
        decode = self.codec.decode
        return [decode(v) for _, v in entries]

    def get_many(self, keys: Sequence[bytes | str]) -> list[list[V]]:
        """The lists of many keys, in the order given.

        Example:
            ```python
            a, b = clicks.get_many(["ann", "bob"])
            ```

        Args:
            keys: the keys, `str` or `bytes`.

        Returns:
            One list per key ([] for a key without one).
        """
        return [self.get(k) for k in keys]

    def put(self, key: bytes | str, values: Iterable[V]) -> None:
        """Replace the key's list with `values` (an empty `values` leaves no list).

        Example:
            ```python
            clicks.put("ann", [c for c in clicks.get("ann") if c[1] != "/"])
            ```

        Args:
            key: the key, `str` or `bytes`.
            values: the new elements, in order.
        """
        prefix = self._list_prefix(self._prefixed(key))
        self._delete_range(prefix, _next_prefix(prefix))
        values = list(values)
        self._put_values([prefix + _SEQ.pack(i) for i in range(len(values))], values)

    def delete(self, key: bytes | str) -> None:
        """Delete the key's whole list (one range delete).

        Example:
            ```python
            clicks.delete("ann")
            ```

        Args:
            key: the key, `str` or `bytes`.
        """
        prefix = self._list_prefix(self._prefixed(key))
        self._delete_range(prefix, _next_prefix(prefix))

    def items(self) -> Iterator[tuple[bytes, list[V]]]:
        """Every (key, list) of this subtask, in key-group order.

        Example:
            ```python
            lengths = {k.decode(): len(v) for k, v in clicks.items()}
            ```

        Yields:
            (key as `bytes`, list of elements) pairs.
        """
        decode = self.codec.decode
        current: bytes | None = None
        values: list[V] = []
        for k, v in self._all():
            (n,) = _LEN.unpack_from(k, 2)
            key = k[6 : 6 + n]
            if key != current:
                if current is not None:
                    yield current, values
                current, values = key, []
            values.append(decode(v))
        if current is not None:
            yield current, values


class ReducingState(_KeyedState[V]):
    """Per key one value that every `add` folds into (Flink's ReducingState).

    What `state.reducing_state(name, codec, reduce)` returns. A batch's values of one key are
    reduced in memory first (`reduce(old, new)`), then read, merged and written with one multi-get
    and one write.

    Example:
        ```python
        latest = state.reducing_state("latest", JsonCodec(), max)
        latest.add("ann", "2026-01-01T10:00")
        latest.add("ann", "2026-01-01T09:00")
        latest.get("ann")             # "2026-01-01T10:00"
        ```
    """

    KIND = "reducing"

    def __init__(self, *args: Any, reduce: Callable[[V, V], V], **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.reduce = reduce

    def add(self, key: bytes | str, value: V) -> None:
        """Fold `value` into the key's value (it becomes the value when the key has none).

        Example:
            ```python
            latest.add("ann", "2026-01-01T10:00")
            ```

        Args:
            key: the key, `str` or `bytes`.
            value: what the codec encodes.
        """
        self.add_many([(key, value)])

    def add_many(self, pairs: Iterable[tuple[bytes | str, V]]) -> int:
        """Fold every (key, value) into the keys' values, in the order given; one multi-get, one write.

        Example:
            ```python
            spend = state.reducing_state("spend", StructCodec("<d"), lambda a, b: (a[0] + b[0],))
            spend.add_many((u, (a,)) for u, a in zip(batch["user"], batch["amount"]))
            ```

        Args:
            pairs: (key, value) pairs.

        Returns:
            The entries written (one per distinct key).
        """
        folded: dict[bytes, V] = {}
        pairs = list(pairs)
        for pk, (_, value) in zip(self._prefixed_many(k for k, _ in pairs), pairs):
            folded[pk] = self.reduce(folded[pk], value) if pk in folded else value
        keys = list(folded)
        decode = self.codec.decode
        merged = [folded[pk] if old is None else self.reduce(decode(old), folded[pk])
                  for pk, old in zip(keys, self._live(self._multi_get(keys)))]
        return self._put_values(keys, merged)

    def get(self, key: bytes | str) -> V | None:
        """The key's reduced value, or None when it has none (or it expired).

        Example:
            ```python
            latest.get("ann")
            ```

        Args:
            key: the key, `str` or `bytes`.

        Returns:
            The decoded value, or None.
        """
        (data,) = self._read([self._prefixed(key)])
        return None if data is None else self.codec.decode(data)

    def get_many(self, keys: Sequence[bytes | str]) -> list[V | None]:
        """The reduced values of many keys, in the order given (one multi-get).

        Example:
            ```python
            latest.get_many(["ann", "bob"])
            ```

        Args:
            keys: the keys, `str` or `bytes`.

        Returns:
            One value per key, None where a key has none.
        """
        if not keys:
            return []
        decode = self.codec.decode
        return [None if d is None else decode(d) for d in self._read(self._prefixed_many(keys))]

    def delete(self, key: bytes | str) -> None:
        """Delete the key's value.

        Example:
            ```python
            latest.delete("ann")
            ```

        Args:
            key: the key, `str` or `bytes`.
        """
        self._delete(self._prefixed(key))

    def items(self) -> Iterator[tuple[bytes, V]]:
        """Every (key, value) of this subtask, in key-group order.

        Example:
            ```python
            dict(latest.items())
            ```

        Yields:
            (key as `bytes`, value) pairs.
        """
        decode = self.codec.decode
        for k, v in self._all():
            yield k[2:], decode(v)


def _columnar(codec: Any, method: str) -> Callable[..., Any]:
    fn = getattr(codec, method, None)
    if fn is None:
        raise TypeError(f"{type(codec).__name__} has no columnar form: tables need a RecordCodec")
    return cast(Callable[..., Any], fn)


def _key_list(keys: Any) -> list[Any]:
    """Keys from a list, a NumPy array, a pandas Series or an Arrow array, as a list."""
    if hasattr(keys, "to_pylist"):
        return list(keys.to_pylist())
    if hasattr(keys, "tolist"):
        return list(keys.tolist())
    return list(keys)


def _next_prefix(prefix: bytes) -> bytes:
    """The smallest byte string greater than every string starting with `prefix`."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        raise ValueError("a prefix of only 0xff bytes has no upper bound")
    return stripped[:-1] + bytes([stripped[-1] + 1])

