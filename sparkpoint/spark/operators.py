"""Keyed operators: a function over one subtask's pandas batch and its RocksDB state.

A user writes their own the same way the two sample operators below are written:

    def process(batch: pd.DataFrame, state: RocksDBStateBackend) -> pd.DataFrame | None
    def export(state: RocksDBStateBackend) -> pd.DataFrame

`process` sees only rows whose key belongs to the subtask; it pre-aggregates with pandas, then
reads and writes the state in batches. What it returns are the rows it changed (the sink's
input, for operators that emit). `export` turns the subtask's state back into a table.
Nothing here imports Spark: `sparkpoint state` exports a checkpoint without a JVM.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import pandas as pd

from sparkpoint.core.backend import RocksDBStateBackend
from sparkpoint.core.paths import validate_name
from sparkpoint.core.serde import BytesCodec, StructCodec
from sparkpoint.core.state import ValueState

T = TypeVar("T")

ProcessFn = Callable[[pd.DataFrame, RocksDBStateBackend], "pd.DataFrame | None"]
ExportFn = Callable[[RocksDBStateBackend], pd.DataFrame]


@dataclass(frozen=True)
class KeyedOperator:
    name: str
    key: str  # the input column the state is keyed by
    process: ProcessFn
    export: ExportFn
    columns: tuple[str, ...] = ()  # other input columns `process` reads
    emits: bool = False  # its changed rows go to the exactly-once sink

    def __post_init__(self) -> None:
        validate_name(self.name, "operator name")  # it names directories and output files

    def input_columns(self) -> list[str]:
        return [self.key, *[c for c in self.columns if c != self.key]]


def to_micros(ts: pd.Series) -> np.ndarray:
    """Timestamps as int64 microseconds since the epoch, UTC (naive values are taken as UTC)."""
    if isinstance(ts.dtype, pd.DatetimeTZDtype):
        ts = ts.dt.tz_convert("UTC").dt.tz_localize(None)
    return np.asarray(ts.astype("datetime64[us]").astype("int64"))


def from_micros(values: list[int] | np.ndarray) -> pd.Series:
    return pd.Series(pd.to_datetime(np.asarray(values, dtype="int64"), unit="us", utc=True)).astype(
        "datetime64[us, UTC]"
    )


# --- user_totals: per user count, sum, min, max of amount and the latest ts ----------------------

Totals = tuple[int, float, float, float, int]  # count, amount sum, min, max, latest ts (µs)
TOTALS = StructCodec[Totals]("<qdddq")
TOTALS_COLUMNS = ["user_id", "count", "amount_sum", "amount_min", "amount_max", "last_ts"]


def _user_totals_process(batch: pd.DataFrame, state: RocksDBStateBackend) -> pd.DataFrame:
    frame = pd.DataFrame({"user_id": batch["user_id"], "amount": batch["amount"], "ts": to_micros(batch["ts"])})
    agg = frame.groupby("user_id", sort=True).agg(
        count=("amount", "size"), amount_sum=("amount", "sum"), amount_min=("amount", "min"),
        amount_max=("amount", "max"), last_ts=("ts", "max"),
    )
    keys = agg.index.tolist()
    rows = zip(
        agg["count"].tolist(), agg["amount_sum"].tolist(), agg["amount_min"].tolist(), agg["amount_max"].tolist(),
        agg["last_ts"].tolist(),
    )
    merged: list[Totals] = []

    def merge(_key: bytes | str, old: Totals | None) -> Totals:
        c, s, lo, hi, ts = next(rows)  # update_many calls merge once per key, in order
        new = (c, s, lo, hi, ts)
        if old is not None:
            new = (old[0] + c, old[1] + s, min(old[2], lo), max(old[3], hi), max(old[4], ts))
        merged.append(new)
        return new

    state.value_state("totals", TOTALS).update_many(keys, merge)
    return _totals_frame(keys, merged)


def _totals_frame(keys: list[str], rows: list[Totals]) -> pd.DataFrame:
    columns = list(zip(*rows)) if rows else [[], [], [], [], []]
    return pd.DataFrame(
        {
            "user_id": pd.Series(keys, dtype="string"),
            "count": pd.Series(columns[0], dtype="int64"),
            "amount_sum": pd.Series(columns[1], dtype="float64"),
            "amount_min": pd.Series(columns[2], dtype="float64"),
            "amount_max": pd.Series(columns[3], dtype="float64"),
            "last_ts": from_micros(list(columns[4])),
        }
    )


def _user_totals_export(state: RocksDBStateBackend) -> pd.DataFrame:
    return _totals_frame(*_keys_and_values(state.value_state("totals", TOTALS)))


user_totals = KeyedOperator(
    name="user_totals",
    key="user_id",
    process=_user_totals_process,
    export=_user_totals_export,
    columns=("amount", "ts"),
    emits=True,
)


# --- item_reach: per item the number of events and of distinct users (exact) -------------------

REACH = StructCodec[tuple[int, int]]("<qq")
SEEN = BytesCodec()
REACH_COLUMNS = ["item_id", "events", "distinct_users"]


def _item_reach_process(batch: pd.DataFrame, state: RocksDBStateBackend) -> pd.DataFrame:
    users = state.map_state("users", SEEN)
    reach = state.value_state("reach", REACH)
    pairs = batch[["item_id", "user_id"]].drop_duplicates()
    seen = users.get_many(list(zip(pairs["item_id"].tolist(), pairs["user_id"].tolist())))
    new_pairs = pairs[[s is None for s in seen]]
    users.put_many((i, u, b"") for i, u in zip(new_pairs["item_id"].tolist(), new_pairs["user_id"].tolist()))
    events: Mapping[str, int] = batch.groupby("item_id").size().to_dict()
    new_users: Mapping[str, int] = new_pairs.groupby("item_id").size().to_dict()
    keys = sorted(events)
    rows = []
    for key, old in zip(keys, reach.get_many(keys)):
        e, d = (0, 0) if old is None else old
        rows.append((e + int(events[key]), d + int(new_users.get(key, 0))))
    reach.put_many(zip(keys, rows))
    return _reach_frame(keys, rows)


def _reach_frame(keys: list[str], rows: list[tuple[int, int]]) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "item_id": pd.Series(keys, dtype="string"),
            "events": pd.Series([r[0] for r in rows], dtype="int64"),
            "distinct_users": pd.Series([r[1] for r in rows], dtype="int64"),
        }
    )


def _item_reach_export(state: RocksDBStateBackend) -> pd.DataFrame:
    return _reach_frame(*_keys_and_values(state.value_state("reach", REACH)))


def _keys_and_values(state: ValueState[T]) -> tuple[list[str], list[T]]:
    keys, values = [], []
    for k, v in state.items():
        keys.append(k.decode("utf-8"))
        values.append(v)
    return keys, values


item_reach = KeyedOperator(
    name="item_reach",
    key="item_id",
    process=_item_reach_process,
    export=_item_reach_export,
    columns=("user_id",),
)

SAMPLE_OPERATORS = (user_totals, item_reach)


def operator_by_name(name: str, operators: tuple[KeyedOperator, ...] = SAMPLE_OPERATORS) -> KeyedOperator:
    for op in operators:
        if op.name == name:
            return op
    raise KeyError(f"unknown operator {name!r}; this pipeline has {', '.join(o.name for o in operators)}")
