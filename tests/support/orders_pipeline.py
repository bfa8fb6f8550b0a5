"""A user's own pipeline for the tests of runs of one pipeline (issue 37): `orders` sums `amount` per
`customer`; its batches are small Parquet files landed in `<tmp>/<name>/`."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pandas as pd

from sparkpoint import KeyedOperator, Pipeline, StructCodec
from sparkpoint.factory import PipelineDefs, pipeline_defs

TOTAL = StructCodec[tuple[float]]("<d")


def add(batch: pd.DataFrame, state: Any) -> None:
    sums = batch.groupby("customer")["amount"].sum()
    handle = state.value_state("total", TOTAL)
    old = handle.get_many(sums.index.tolist())
    handle.put_many((c, (float(s) + (o[0] if o else 0.0),)) for c, s, o in zip(sums.index, sums, old))


def export(state: Any) -> pd.DataFrame:
    rows = [(k.decode(), v[0]) for k, v in state.value_state("total", TOTAL).items()]
    return pd.DataFrame(rows, columns=["customer", "total"])


spend = KeyedOperator("spend_per_customer", key="customer", columns=("amount",), process=add, export=export)


def orders_pipeline(tmp_path: Path, name: str = "orders") -> Pipeline:
    (tmp_path / name).mkdir(exist_ok=True)
    return Pipeline(name, [spend], input_url=str(tmp_path / name), checkpoints_url=str(tmp_path / "ckpt"),
                    job_id=name, local_dir=str(tmp_path / "local"), parallelism=2)


def orders(tmp_path: Path, name: str = "orders", **kwargs: Any) -> PipelineDefs:
    return pipeline_defs(orders_pipeline(tmp_path, name), **kwargs)


def land(tmp_path: Path, name: str, into: str = "orders", customers: int = 3) -> pd.DataFrame:
    """A settled batch file (written a minute ago); returns its rows."""
    number = int("".join(c for c in name if c.isdigit()) or 0)
    rows = pd.DataFrame({"customer": [f"c{i}" for i in range(customers)],
                         "amount": [float(number + 1 + i) for i in range(customers)]})
    path = tmp_path / into / name
    rows.to_parquet(path)
    os.utime(path, (time.time() - 60, time.time() - 60))
    return rows


def totals(rows: list[pd.DataFrame]) -> dict[str, float]:
    """What the state must hold after `rows`, recomputed with pandas."""
    return pd.concat(rows).groupby("customer")["amount"].sum().to_dict()
