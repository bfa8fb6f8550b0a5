"""A user's own pipeline over an input table (issue 45, table sources): a shop's orders, `customer`,
`amount`, `ordered_at` and `region` (a Delta partition column, absent from the data files), land in
a Delta or Iceberg table. `spend_per_customer` sums amounts per customer (a ValueState), and
`regions_per_customer` keeps the regions each customer ordered from (a MapState: the partition
values must reach it); `balance` reads the change data feed (`_change_type`) and keeps each
customer's balance as inserts add and deletes take away. The pandas recomputations the state
must equal, and helpers that write the table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa

from sparkpoint import BytesCodec, KeyedOperator, Pipeline, StructCodec
from sparkpoint.checkpoint.store import CompletedCheckpointStore

SPEND = StructCodec[tuple[float, int]]("<dq")
SEEN = BytesCodec()
T0 = pd.Timestamp("2026-05-01T00:00:00Z")
SIGN = {"insert": 1.0, "update_postimage": 1.0, "delete": -1.0, "update_preimage": -1.0}


def add_spend(batch: pd.DataFrame, state: Any) -> None:
    sums = batch.groupby("customer")["amount"].agg(["sum", "count"])
    keys = [str(k) for k in sums.index]
    handle = state.value_state("spend", SPEND)
    old = handle.get_many(keys)
    handle.put_many((k, (float(s) + (o[0] if o else 0.0), int(n) + (o[1] if o else 0)))
                    for k, s, n, o in zip(keys, sums["sum"], sums["count"], old))


def export_spend(state: Any) -> pd.DataFrame:
    rows = [(k.decode(), v[0], v[1]) for k, v in state.value_state("spend", SPEND).items()]
    return pd.DataFrame(rows, columns=["customer", "spent", "orders"])


def note_regions(batch: pd.DataFrame, state: Any) -> None:
    pairs = batch[["customer", "region"]].drop_duplicates()
    state.map_state("regions", SEEN).put_absent((c, str(r), b"") for c, r in zip(pairs["customer"], pairs["region"]))


def export_regions(state: Any) -> pd.DataFrame:
    rows = [(c.decode(), r.decode() if isinstance(r, bytes) else str(r))
            for c, r, _ in state.map_state("regions", SEEN).items()]
    return pd.DataFrame(rows, columns=["customer", "region"])


def apply_changes(batch: pd.DataFrame, state: Any) -> None:
    signed = batch.assign(signed=batch["amount"] * batch["_change_type"].map(SIGN))
    sums = signed.groupby("customer")["signed"].sum()
    keys = [str(k) for k in sums.index]
    handle = state.value_state("balance", SPEND)
    handle.put_many((k, (float(s) + (o[0] if o else 0.0), 0)) for k, s, o in zip(keys, sums, handle.get_many(keys)))


def export_balance(state: Any) -> pd.DataFrame:
    rows = [(k.decode(), v[0]) for k, v in state.value_state("balance", SPEND).items()]
    return pd.DataFrame(rows, columns=["customer", "balance"])


spend_per_customer = KeyedOperator("spend_per_customer", key="customer", key_type="string",
                                   columns=("amount",), process=add_spend, export=export_spend)
regions_per_customer = KeyedOperator("regions_per_customer", key="customer", columns=("region",),
                                     process=note_regions, export=export_regions)
balance = KeyedOperator("balance", key="customer", columns=("amount", "_change_type"), process=apply_changes,
                        export=export_balance)


def shop(tmp_path: Path, table: Any, *operators: KeyedOperator, **settings: Any) -> Pipeline:
    return Pipeline("shop", list(operators or (spend_per_customer, regions_per_customer)), input=table,
                    checkpoints_url=str(tmp_path / "ckpt"), local_dir=str(tmp_path / "local"), parallelism=2,
                    **settings)


def orders(batch: int, rows: int = 40) -> pa.Table:
    """Batch `batch` of orders: customers c0..c8, two regions, a timestamp each."""
    return pa.table({
        "customer": [f"c{(batch * 5 + i) % 9}" for i in range(rows)],
        "amount": [float(batch * 100 + i) / 4 for i in range(rows)],
        "ordered_at": pa.array([T0 + pd.Timedelta(minutes=batch * 60 + i) for i in range(rows)],
                               pa.timestamp("us", tz="UTC")),
        "region": ["north" if (batch + i) % 3 else "south" for i in range(rows)],
    })


def spend(frames: list[pd.DataFrame]) -> dict[str, tuple[float, int]]:
    rows = pd.concat(frames, ignore_index=True)
    sums = rows.groupby("customer")["amount"].agg(["sum", "count"])
    return {str(c): (float(s), int(n)) for c, s, n in zip(sums.index, sums["sum"], sums["count"])}


def regions(frames: list[pd.DataFrame]) -> set[tuple[str, str]]:
    rows = pd.concat(frames, ignore_index=True)
    return set(zip(rows["customer"], rows["region"]))


def state_of(pipeline: Pipeline, operator: str = "spend_per_customer") -> pd.DataFrame:
    return pipeline.read_state(operator)


def source_offsets(pipeline: Pipeline) -> dict[str, Any]:
    latest = CompletedCheckpointStore(pipeline.storage()).latest()
    assert latest is not None
    offsets: dict[str, Any] = latest.source_offsets["source"]
    return offsets
