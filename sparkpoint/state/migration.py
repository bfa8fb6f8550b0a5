"""Rewriting a state's entries when its RecordCodec's fields changed compatibly (added, removed,
widened, reordered, made nullable): at restore, before the operator runs, in batches, through
the changelog like any write (Flink's RocksDB backend migrates state values on restore the same
way). TTL stamps are kept as they were; the next checkpoint records the new fields."""

from __future__ import annotations

from typing import Any, Protocol

import pyarrow as pa
from rocksdict import Rdict

from sparkpoint.checkpoint.metadata import KeyGroupRange
from sparkpoint.state.codecs import BytesCodec
from sparkpoint.state.handles import FORMAT_KEY, _KeyedState, key_group_bounds
from sparkpoint.state.keygroups import MAX_KEY_GROUPS
from sparkpoint.state.record import RecordCodec
from sparkpoint.state.ttl import STAMP

BATCH = 20_000


class _Backend(Protocol):
    """What a migration needs of a subtask's state (`SubtaskState`, which imports this module)."""

    max_parallelism: int
    key_group_range: KeyGroupRange
    _log: Any

    def _before_write(self) -> None: ...

    def state_names(self) -> list[str]: ...

    def _open_db(self) -> Rdict: ...


def evolve_table(table: pa.Table, new: RecordCodec) -> pa.Table:
    """Rows of an old RecordCodec in `new`'s fields: removed fields dropped, widened ones cast
    (int -> float rounds as Arrow does), added ones left out (`encode_table` gives them their
    default or null)."""
    columns, names = [], []
    for f in new.fields:
        if f.name in table.column_names:
            columns.append(table.column(f.name).cast(f.arrow_type, safe=False))
            names.append(f.name)
    return pa.Table.from_arrays(columns, names=names)


def migrate_records(backend: _Backend, name: str, old: RecordCodec, new: Any) -> int:
    """Rewrite every entry of state `name` from `old`'s fields into `new`'s; returns how many."""
    if name not in backend.state_names():
        return 0
    db = backend._open_db()
    raw = _KeyedState(db, name, BytesCodec(), backend.max_parallelism, backend.key_group_range,
                      on_write=backend._before_write, log=backend._log)
    try:
        stamped = raw._cf.get(FORMAT_KEY) is not None
        cut = STAMP.size if stamped else 0
        done = 0
        keys: list[bytes] = []
        values: list[bytes] = []
        for k, v in raw._scan(*key_group_bounds(KeyGroupRange(0, MAX_KEY_GROUPS - 1))):
            keys.append(k)
            values.append(v)
            if len(keys) >= BATCH:
                done += _rewrite(raw, keys, values, cut, old, new)
                keys, values = [], []
        return done + _rewrite(raw, keys, values, cut, old, new)
    finally:
        raw.release()


def _rewrite(raw: _KeyedState[bytes], keys: list[bytes], values: list[bytes], cut: int, old: RecordCodec,
             new: RecordCodec) -> int:
    if not keys:
        return 0
    table = old.decode_table([v[cut:] for v in values])
    encoded = new.encode_table(evolve_table(table, new))
    return raw._write(zip(keys, [v[:cut] + e for v, e in zip(values, encoded, strict=True)]))
