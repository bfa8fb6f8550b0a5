"""Rewriting a state's entries when its RecordCodec's fields changed compatibly (added, removed,
widened, reordered, made nullable): at restore, before the operator runs, in batches, through
the changelog like any write (Flink's RocksDB backend migrates state values on restore the same
way). TTL stamps are kept as they were; the next checkpoint records the new fields."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sparkpoint.checkpoint.metadata import KeyGroupRange
from sparkpoint.lazy import lazy_module
from sparkpoint.state.keygroups import MAX_KEY_GROUPS
from sparkpoint.state.kinds.base import FORMAT_KEY, StateStore, key_group_bounds
from sparkpoint.state.record import RecordCodec
from sparkpoint.state.ttl import STAMP

if TYPE_CHECKING:
    import pyarrow as pa
else:
    pa = lazy_module("pyarrow")

BATCH = 20_000


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


def migrate_records(store: StateStore, old: RecordCodec, new: Any) -> int:
    """Rewrite every entry of a state's `store` from `old`'s fields into `new`'s; returns how many."""
    stamped = store.get(FORMAT_KEY) is not None
    cut = STAMP.size if stamped else 0
    done = 0
    keys: list[bytes] = []
    values: list[bytes] = []
    for k, v in store.scan(*key_group_bounds(KeyGroupRange(0, MAX_KEY_GROUPS - 1))):
        keys.append(k)
        values.append(v)
        if len(keys) >= BATCH:
            done += _rewrite(store, keys, values, cut, old, new)
            keys, values = [], []
    return done + _rewrite(store, keys, values, cut, old, new)


def _rewrite(store: StateStore, keys: list[bytes], values: list[bytes], cut: int, old: RecordCodec,
             new: RecordCodec) -> int:
    if not keys:
        return 0
    table = old.decode_table([v[cut:] for v in values])
    encoded = new.encode_table(evolve_table(table, new))
    store.write(list(zip(keys, [v[:cut] + e for v, e in zip(values, encoded, strict=True)])), [])
    return len(keys)
