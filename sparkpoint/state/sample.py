"""The sample pipeline's two keyed operators, written as a user writes their own (see
`sparkpoint.state.operators`): `user_totals` (per user: count, sum, min and max of amount, the
latest ts; a ValueState; it emits its changed rows to the sink) and `item_reach` (per item: events
and distinct users; a MapState of the users seen).
"""


from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat
from typing import TYPE_CHECKING, Any, TypeVar

from sparkpoint.lazy import lazy_module
from sparkpoint.state.backend import RocksDBStateBackend
from sparkpoint.state.codecs import BytesCodec, StructCodec
from sparkpoint.state.kinds import ValueState
from sparkpoint.state.operators import KeyedOperator, from_micros, to_micros

if TYPE_CHECKING:
    import numpy as np
    import pandas as pd
else:
    np = lazy_module("numpy")
    pd = lazy_module("pandas")

T = TypeVar("T")

Totals = tuple[int, float, float, float, int]  # count, amount sum, min, max, latest ts (µs)


TOTALS = StructCodec[Totals]("<qdddq")


TOTALS_COLUMNS = ["user_id", "count", "amount_sum", "amount_min", "amount_max", "last_ts"]


def _user_totals_process(batch: pd.DataFrame, state: RocksDBStateBackend) -> pd.DataFrame:
    frame = pd.DataFrame({"user_id": batch["user_id"], "amount": batch["amount"], "ts": to_micros(batch["ts"])})
    # One reduction per column over one grouping (a third of the time of a named `agg`), every
    # result indexed by the sorted user ids.
    by_user = frame.groupby("user_id", sort=True)
    amount = by_user["amount"]
    count = by_user.size()
    new = [count.to_numpy(), amount.sum().to_numpy(), amount.min().to_numpy(), amount.max().to_numpy(),
           by_user["ts"].max().to_numpy()]
    keys = count.index.tolist()
    merged = np.empty(len(keys), dtype=TOTALS.dtype)

    def merge(stored: list[bytes | None]) -> list[bytes]:
        # The whole batch at once: decode every old value, combine column by column, encode.
        old, present = TOTALS.decode_many(stored)
        merged["f0"] = np.where(present, old["f0"] + new[0], new[0])
        merged["f1"] = np.where(present, old["f1"] + new[1], new[1])
        merged["f2"] = np.where(present, np.fmin(old["f2"], new[2]), new[2])  # fmin/fmax: NaN-skipping, as pandas
        merged["f3"] = np.where(present, np.fmax(old["f3"], new[3]), new[3])
        merged["f4"] = np.where(present, np.maximum(old["f4"], new[4]), new[4])
        return TOTALS.encode_many(merged)

    state.value_state("totals", TOTALS).update_many_encoded(keys, merge)
    return _totals_frame(keys, [merged[f] for f in ("f0", "f1", "f2", "f3", "f4")])


def _totals_frame(keys: list[str], columns: Sequence[Sequence[Any] | np.ndarray]) -> pd.DataFrame:
    """user_totals rows from the keys and the five value columns (count, sum, min, max, latest ts)."""
    return pd.DataFrame(
        {
            "user_id": pd.Series(keys, dtype="string"),
            "count": pd.Series(columns[0], dtype="int64"),
            "amount_sum": pd.Series(columns[1], dtype="float64"),
            "amount_min": pd.Series(columns[2], dtype="float64"),
            "amount_max": pd.Series(columns[3], dtype="float64"),
            "last_ts": from_micros(np.asarray(columns[4], dtype="int64")),
        }
    )


def _user_totals_export(state: RocksDBStateBackend) -> pd.DataFrame:
    keys, rows = _keys_and_values(state.value_state("totals", TOTALS))
    return _totals_frame(keys, list(zip(*rows)) if rows else [[], [], [], [], []])


user_totals = KeyedOperator(
    name="user_totals",
    key="user_id",
    process=_user_totals_process,
    export=_user_totals_export,
    columns=("amount", "ts"),
    emits=True,
    schema={"user_id": "string", "count": "int64", "amount_sum": "float64", "amount_min": "float64",
            "amount_max": "float64", "last_ts": "timestamp[us, UTC]"},
)


# --- item_reach: per item the number of events and of distinct users (exact) -------------------


REACH = StructCodec[tuple[int, int]]("<qq")


SEEN = BytesCodec()


REACH_COLUMNS = ["item_id", "events", "distinct_users"]


def _item_reach_process(batch: pd.DataFrame, state: RocksDBStateBackend) -> pd.DataFrame:
    users = state.map_state("users", SEEN)
    reach = state.value_state("reach", REACH)
    pairs = batch[["item_id", "user_id"]].drop_duplicates()
    items = pairs["item_id"].tolist()
    added = users.put_absent(zip(items, pairs["user_id"].tolist(), repeat(b"")))
    per_item = pd.DataFrame({"item_id": items, "new": added}).groupby("item_id", sort=True)["new"].sum()
    events = batch.groupby("item_id", sort=True).size()  # same index as per_item: the batch's items
    keys = events.index.tolist()
    merged = np.empty(len(keys), dtype=REACH.dtype)

    def merge(stored: list[bytes | None]) -> list[bytes]:
        old, _ = REACH.decode_many(stored)  # absent: (0, 0)
        merged["f0"] = old["f0"] + events.to_numpy()
        merged["f1"] = old["f1"] + per_item.reindex(events.index).to_numpy()
        return REACH.encode_many(merged)

    reach.update_many_encoded(keys, merge)
    return _reach_frame(keys, list(zip(merged["f0"].tolist(), merged["f1"].tolist())))


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
    schema={"item_id": "string", "events": "int64", "distinct_users": "int64"},
)


SAMPLE_OPERATORS = (user_totals, item_reach)
