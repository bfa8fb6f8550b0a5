"""A user's own pipeline for the bootstrap tests: account balances with a history, started from an
initial table of opening transactions.

`balances` keeps per account a value state (the balance) and a list state (every amount, in
order). Its `bootstrap` writes both from the opening transactions and registers a processing-time
"welcome" timer per account, due at once: it fires after the job's first batch, and `on_timer`
marks the account welcomed and emits one row for it. `audit` is a second operator without
`bootstrap` (it counts transactions per account): it starts empty.

`accounts` is what the CLI loads (`--pipeline tests.support.accounts_pipeline:accounts`); its locations
(under `ACCOUNTS_ROOT`, default a temporary directory) are overridden by the tests' flags.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pandas as pd

from sparkpoint import JsonCodec, KeyedOperator, Pipeline, StructCodec
from sparkpoint.state.backend import RocksDBStateBackend

BALANCE = StructCodec[tuple[float]]("<d")
AMOUNTS = JsonCodec()
WELCOMED = JsonCodec()
COUNT = StructCodec[tuple[int]]("<q")


def _add(state: RocksDBStateBackend, rows: pd.DataFrame) -> pd.DataFrame:
    sums = rows.groupby("account", sort=True)["amount"].sum()
    balance = state.value_state("balance", BALANCE)
    old = balance.get_many(sums.index.tolist())
    new = [float(s) + (o[0] if o else 0.0) for s, o in zip(sums, old)]
    balance.put_many((a, (b,)) for a, b in zip(sums.index, new))
    state.list_state("amounts", AMOUNTS).add_many(zip(rows["account"], rows["amount"].astype(float)))
    return pd.DataFrame({"account": sums.index, "event": "balance", "value": new})


def opening(table: pd.DataFrame, state: RocksDBStateBackend) -> None:
    """The initial state: each account's opening transactions, and a welcome due at once."""
    if table.empty:
        return
    _add(state, table)
    state.timers.register_many((a, 0) for a in table["account"].unique())


def process(batch: pd.DataFrame, state: RocksDBStateBackend) -> pd.DataFrame:
    return _add(state, batch)


def welcome(fired: pd.DataFrame, state: RocksDBStateBackend) -> pd.DataFrame:
    welcomed = state.value_state("welcomed", WELCOMED)
    welcomed.put_many((k, True) for k in fired["key"])
    return pd.DataFrame({"account": fired["key"], "event": "welcome", "value": 0.0})


def export(state: RocksDBStateBackend) -> pd.DataFrame:
    amounts = dict(state.list_state("amounts", AMOUNTS).items())
    welcomed = dict(state.value_state("welcomed", WELCOMED).items())
    rows = [(k.decode(), v[0], [float(x) for x in amounts.get(k, [])], bool(welcomed.get(k, False)))
            for k, v in state.value_state("balance", BALANCE).items()]
    return pd.DataFrame(rows, columns=["account", "balance", "amounts", "welcomed"])


balances = KeyedOperator("balances", key="account", columns=("amount",), process=process, export=export,
                         emits=True, on_timer=welcome, bootstrap=opening)


def count(batch: pd.DataFrame, state: RocksDBStateBackend) -> None:
    sizes = batch.groupby("account").size()
    counts = state.value_state("count", COUNT)
    old = counts.get_many(sizes.index.tolist())
    counts.put_many((a, (int(n) + (o[0] if o else 0),)) for a, n, o in zip(sizes.index, sizes, old))


def export_counts(state: RocksDBStateBackend) -> pd.DataFrame:
    rows = [(k.decode(), v[0]) for k, v in state.value_state("count", COUNT).items()]
    return pd.DataFrame(rows, columns=["account", "transactions"])


audit = KeyedOperator("audit", key="account", process=count, export=export_counts)


def accounts_pipeline(root: Path, **changes: object) -> Pipeline:
    return Pipeline("accounts", [balances, audit], input_url=str(root / "in"), checkpoints_url=str(root / "ckpt"),
                    output_url=str(root / "out"), local_dir=str(root / "local"), parallelism=2,
                    max_parallelism=32).with_(**changes)


def refuse(table: pd.DataFrame, state: RocksDBStateBackend) -> None:
    raise ValueError("opening transactions refused")


accounts = accounts_pipeline(Path(os.environ.get("ACCOUNTS_ROOT") or tempfile.gettempdir()) / "sparkpoint-accounts")
