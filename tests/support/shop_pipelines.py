"""A user's own pipeline in versions, for the upgrade tests: `shop` keeps per customer the money
spent (`spend`) and the purchases made (`visits`); the later versions rename `spend` keeping its uid
(`renamed`), rename it and lose the uid (`renamed_without_uid`), drop `visits` (`dropped`), or add
`largest`, the largest purchase (`added`). Locations come from the tests' flags."""

from __future__ import annotations

import pandas as pd

from sparkpoint import KeyedOperator, Pipeline, StructCodec
from sparkpoint.state.backend import RocksDBStateBackend

SUM = StructCodec[tuple[float]]("<d")
COUNT = StructCodec[tuple[int]]("<q")


def _merge(state: RocksDBStateBackend, name: str, codec: StructCodec, values: pd.Series, how: str) -> None:  # type: ignore[type-arg]
    handle = state.value_state(name, codec)
    old = handle.get_many(values.index.tolist())
    combine = {"sum": lambda a, b: a + b, "max": max}[how]
    handle.put_many((k, (combine(v, o[0]) if o else v,)) for k, v, o in zip(values.index, values.tolist(), old))


def add_spend(batch: pd.DataFrame, state: RocksDBStateBackend) -> None:
    _merge(state, "spend", SUM, batch.groupby("customer")["amount"].sum().astype(float), "sum")


def count_visits(batch: pd.DataFrame, state: RocksDBStateBackend) -> None:
    _merge(state, "visits", COUNT, batch.groupby("customer").size().astype(int), "sum")


def keep_largest(batch: pd.DataFrame, state: RocksDBStateBackend) -> None:
    _merge(state, "largest", SUM, batch.groupby("customer")["amount"].max().astype(float), "max")


def _table(state: RocksDBStateBackend, name: str, codec: StructCodec, column: str) -> pd.DataFrame:  # type: ignore[type-arg]
    rows = [(k.decode(), v[0]) for k, v in state.value_state(name, codec).items()]
    return pd.DataFrame(rows, columns=["customer", column])


def export_spend(state: RocksDBStateBackend) -> pd.DataFrame:
    return _table(state, "spend", SUM, "spend")


def export_visits(state: RocksDBStateBackend) -> pd.DataFrame:
    return _table(state, "visits", COUNT, "visits")


def export_largest(state: RocksDBStateBackend) -> pd.DataFrame:
    return _table(state, "largest", SUM, "largest")


spend = KeyedOperator("spend", key="customer", columns=("amount",), process=add_spend, export=export_spend)
visits = KeyedOperator("visits", key="customer", process=count_visits, export=export_visits)
largest = KeyedOperator("largest", key="customer", columns=("amount",), process=keep_largest, export=export_largest)
customer_spend = KeyedOperator("customer_spend", key="customer", columns=("amount",), process=add_spend,
                               export=export_spend, uid="spend")

shop = Pipeline("shop", [spend, visits])
renamed = Pipeline("shop", [customer_spend, visits])
renamed_without_uid = Pipeline("shop", [KeyedOperator("customer_spend", key="customer", columns=("amount",),
                                                      process=add_spend, export=export_spend), visits])
dropped = Pipeline("shop", [spend])
added = Pipeline("shop", [spend, visits, largest])
