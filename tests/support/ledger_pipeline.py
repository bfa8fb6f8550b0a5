"""A user's own pipeline for the Delta sink tests: spending per customer, into a Delta table
partitioned by region.

`spend` keys purchases by customer and keeps two value states: the running total and purchase
count, and the highest store code the customer bought at. For each customer of a batch it emits
the customer's region, total, purchases and top store (declared in `schema`, which the sink
checks the table against before Spark starts).

`ledger` is what the CLI loads (`--pipeline tests.support.ledger_pipeline:ledger`); the tests'
flags name its locations. `land` writes batches and `expected_rows` recomputes what each
checkpoint must have emitted, in pandas; `ledger_run` is the `sparkpoint run` command of the tests
and `assert_table_exactly_once` what they check of the table.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

import fsspec
import pandas as pd
import pyarrow as pa
from deltalake import DeltaTable as Table

from sparkpoint import DeltaTable, JsonCodec, KeyedOperator, Pipeline, StructCodec
from sparkpoint.state.backend import RocksDBStateBackend

SPENT = StructCodec[tuple[float, int]]("<dq")
TOP = JsonCodec()
REGIONS = ("emea", "amer", "apac")
COLUMNS = {"customer": "string", "region": "string", "total": "float64", "purchases": "int64", "top_store": "string"}


def process(batch: pd.DataFrame, state: RocksDBStateBackend) -> pd.DataFrame:
    by = batch.groupby("customer", sort=True)
    sums, counts, tops, regions = by["amount"].sum(), by.size(), by["store"].max(), by["region"].first()
    customers = sums.index.tolist()
    spent, top = state.value_state("spent", SPENT), state.value_state("top", TOP)
    old, old_top = spent.get_many(customers), top.get_many(customers)
    totals = [(round(float(s) + (o[0] if o else 0.0), 2), int(n) + (o[1] if o else 0))
              for s, n, o in zip(sums, counts, old)]
    best = [max(str(t), o) if o else str(t) for t, o in zip(tops, old_top)]
    spent.put_many(zip(customers, totals))
    top.put_many(zip(customers, best))
    return pd.DataFrame({"customer": customers, "region": regions.tolist(), "total": [t for t, _ in totals],
                         "purchases": pd.Series([n for _, n in totals], dtype="int64"), "top_store": best})


def export(state: RocksDBStateBackend) -> pd.DataFrame:
    tops = {k.decode(): v for k, v in state.value_state("top", TOP).items()}
    rows = [(k.decode(), v[0], v[1], tops.get(k.decode())) for k, v in state.value_state("spent", SPENT).items()]
    return pd.DataFrame(rows, columns=["customer", "total", "purchases", "top_store"])


spend = KeyedOperator("spend", key="customer", columns=("amount", "store", "region"), process=process,
                      export=export, emits=True, schema=COLUMNS, uid="spend-by-customer")

ledger = Pipeline("ledger", [spend], output=DeltaTable(".sparkpoint/ledger/table", partition_by=["region"]),
                  parallelism=2)


def land(directory: Path, batches: int, *, first: int = 0, seed: int = 5) -> None:
    """`batches` Parquet files of 40 purchases over 24 customers (a customer's region is fixed)."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed + first)
    for i in range(first, first + batches):
        customers = [f"cust-{rng.randrange(24):03d}" for _ in range(40)]
        frame = pd.DataFrame({"customer": customers,
                              "amount": [round(rng.uniform(1, 90), 2) for _ in customers],
                              "store": [f"store-{rng.randrange(9)}" for _ in customers],
                              "region": [REGIONS[int(c[-3:]) % 3] for c in customers]})
        frame.to_parquet(directory / f"purchases-{i:04d}.parquet")


def expected_rows(directory: Path) -> list[pd.DataFrame]:
    """What each batch's checkpoint emits, in batch order, recomputed without sparkpoint."""
    out, seen = [], pd.DataFrame()
    for path in sorted(directory.glob("purchases-*.parquet")):
        batch = pd.read_parquet(path)
        seen = pd.concat([seen, batch], ignore_index=True)
        mine = seen[seen["customer"].isin(batch["customer"])]
        by = mine.groupby("customer", sort=True)
        out.append(pd.DataFrame({"customer": by["amount"].sum().index, "region": by["region"].first().tolist(),
                                 "total": by["amount"].sum().round(2).tolist(), "purchases": by.size().tolist(),
                                 "top_store": by["store"].max().tolist()}))
    return out


def assert_rows_equal(got: pd.DataFrame, want: pd.DataFrame) -> None:
    columns = ["customer", "region", "total", "purchases", "top_store"]
    got = got[columns].sort_values("customer").reset_index(drop=True)
    want = want[columns].sort_values("customer").reset_index(drop=True)
    assert got["customer"].tolist() == want["customer"].tolist()
    assert got["region"].tolist() == want["region"].tolist()
    assert got["purchases"].tolist() == want["purchases"].tolist()
    assert got["top_store"].tolist() == want["top_store"].tolist()
    assert all(abs(a - b) < 1e-6 for a, b in zip(got["total"], want["total"]))


# --- running it and reading its table ----------------------------------------------------------------

PIPELINE = "tests.support.ledger_pipeline:ledger"
APP_ID = "ledger/spend-by-customer"  # job id / the operator's uid


def ledger_run(root: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "sparkpoint.cli", "run", "--pipeline", PIPELINE, "--input", str(root / "in"),
            "--checkpoints", f"file://{root}/ckpt", "--output", f"delta+file://{root}/table",
            "--local-dir", str(root / "local"), "--master", "local[2]", "--retain", "2", *extra]


def commit_infos(where: str, options: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The table's commit infos, read from its log with fsspec (delta-rs' `history()` holds the GIL
    while it waits, so it never gets an answer from a moto server in the same process)."""
    fs, log = fsspec.core.url_to_fs(f"{where}/_delta_log", **(options or {}))
    infos = []
    for path in sorted(p for p in fs.ls(log, detail=False) if p.endswith(".json")):
        for line in fs.cat_file(path).decode().splitlines():
            if line.strip() and "commitInfo" in (entry := json.loads(line)):
                infos.append(entry["commitInfo"])
    return infos


def assert_table_exactly_once(root: Path, foreign_rows: int = 0, *, at: str | None = None,
                              delta: dict[str, str] | None = None, options: dict[str, Any] | None = None) -> None:
    """Each batch's rows of `root / "in"` once, in one table version per checkpoint (its commit info
    names it), the app transaction at the latest checkpoint, partitioned by region; and on a local
    table, every file the job wrote into it is one the table holds. `at`: a table elsewhere (its
    delta-rs and fsspec options)."""
    where = at or str(root / "table")
    table = Table(where, storage_options=delta)
    got = table.to_pyarrow_table().to_pandas()
    ours = got[got["checkpoint_id"].notna()]
    ids = sorted(int(c) for c in set(ours["checkpoint_id"]))
    want = expected_rows(root / "in")
    assert len(ids) == len(want), f"checkpoints with rows {ids}, batches {len(want)}"
    for cid, rows in zip(ids, want):
        assert_rows_equal(ours[ours["checkpoint_id"] == cid], rows)
    committed = [h["sparkpoint.checkpoint-id"] for h in commit_infos(where, options) if "sparkpoint.checkpoint-id" in h]
    assert sorted(committed) == ids, f"one table version per checkpoint: {sorted(committed)}"
    assert table.transaction_version(APP_ID) == ids[-1]
    assert table.metadata().partition_columns == ["region"]
    assert (got["checkpoint_id"].isna()).sum() == foreign_rows
    if where.startswith("s3://"):
        return
    held = set(pa.table(table.get_add_actions(flatten=True)).column("path").to_pylist())
    written = {p.relative_to(root / "table").as_posix() for p in (root / "table" / "sparkpoint-ledger").rglob("*")
               if p.is_file()}
    assert written == {p for p in held if p.startswith("sparkpoint-ledger/")}, "no file the table does not hold"
