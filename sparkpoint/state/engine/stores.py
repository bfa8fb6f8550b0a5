"""One state's RocksDB column family as the kinds of state see it (`sparkpoint.state.kinds.StateStore`).

Every write passes here: it first marks the working database changed (`on_write`: the working
database no longer equals the checkpoint its marker names), then goes to RocksDB, then to the
subtask's changelog when it keeps one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, cast

from sparkpoint.lazy import lazy_module
from sparkpoint.state.engine.changelog import ChangeLog

if TYPE_CHECKING:
    import rocksdict
    from rocksdict import Rdict
else:
    rocksdict = lazy_module("rocksdict")

log = logging.getLogger(__name__)
MULTI_GET_SLICE = 4096  # keys per RocksDB multi-get: what one pins stays near 16 MB of 4 KB blocks


class ColumnFamilyStore:
    """The entries of state `name`: its column family of `db`, written through `on_write` and `log`."""

    def __init__(self, db: Rdict, name: str, *, on_write: Callable[[], None] = lambda: None,
                 log: ChangeLog | None = None):
        self.name = name
        self._db = db
        self._cf = db.get_column_family(name)
        self._handle = db.get_column_family_handle(name)
        self._on_write = on_write
        self._log = log

    def get(self, key: bytes) -> bytes | None:
        return cast("bytes | None", self._cf.get(key))

    def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        # In slices: a multi-get pins the data block of every key it reads until it returns, over
        # the cache's capacity if need be (measured: 100,000 keys of a 5 GB state held 430 MB).
        if len(keys) <= MULTI_GET_SLICE:
            return cast(list[bytes | None], self._cf.get(cast(Any, keys)))
        found: list[bytes | None] = []
        for start in range(0, len(keys), MULTI_GET_SLICE):
            found += cast(list[bytes | None], self._cf.get(cast(Any, keys[start : start + MULTI_GET_SLICE])))
        return found

    def write(self, puts: list[tuple[bytes, bytes]], deletes: list[bytes]) -> None:
        batch = rocksdict.WriteBatch(raw_mode=True)
        handle = self._handle
        for k, v in puts:
            batch.put(k, v, handle)
        for k in deletes:
            batch.delete(k, handle)
        self._on_write()
        self._db.write(batch)
        if self._log is not None:
            self._log.write_batch(self.name, puts, deletes)

    def put(self, key: bytes, value: bytes) -> None:
        self._on_write()
        self._cf.put(key, value)
        if self._log is not None:
            self._log.put(self.name, key, value)

    def delete(self, key: bytes) -> None:
        self._on_write()
        self._cf.delete(key)
        if self._log is not None:
            self._log.delete(self.name, key)

    def delete_range(self, lower: bytes, upper: bytes) -> None:
        self._on_write()
        self._cf.delete_range(lower, upper)
        if self._log is not None:
            self._log.delete_range(self.name, lower, upper)

    def scan(self, lower: bytes, upper: bytes) -> Iterator[tuple[bytes, bytes]]:
        opts = rocksdict.ReadOptions()
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

    def floor_key(self, key: bytes) -> bytes | None:
        it = self._cf.iter(rocksdict.ReadOptions())
        try:
            it.seek_for_prev(key)
            if it.valid():
                return cast(bytes, it.key())
            it.status()
            return None
        finally:
            del it

    def estimate_keys(self) -> int:
        return int(self._cf.property_int_value("rocksdb.estimate-num-keys") or 0)

    def release(self) -> None:
        """Let go of the database: the column family's handle holds it open (and its LOCK) for as
        long as this object lives. Any later use raises."""
        try:
            self._cf.close()
        except Exception as e:  # noqa: BLE001  rocksdict raises bare Exception (a corrupt database)
            log.warning("closing column family %s: %s", self.name, e)
        del self._handle  # holds the database too, and cannot be closed
