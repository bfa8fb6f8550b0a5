"""A user's own pipeline for the erase-by-key-group test on Spark: newsletter subscriptions, keyed by
`account`, at parallelism 2 of 128 key groups.

`subscriptions` keeps per account a value state (its profile as last sent), a map state (the
newsletters it reads, with a count) and a reminder timer a month ahead (it never fires in a test);
it emits one row per account and batch. A batch whose rows say `compact` has the operator compact
its state after its writes, as RocksDB's background compaction does to a long-running job's state:
its files are then cut at about a key group's bytes (`RocksDBOptions.min_file_mb`, scaled down to
this small state).
"""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd

from sparkpoint import JsonCodec, KeyedOperator, Pipeline
from sparkpoint.state.backend import RocksDBStateBackend
from sparkpoint.state.engine.rocksdb import RocksDBOptions

MONTH_US = 30 * 24 * 3600 * 1_000_000


def process(batch: pd.DataFrame, state: RocksDBStateBackend) -> pd.DataFrame:
    last = batch.groupby("account", sort=True).last()
    accounts = last.index.tolist()
    state.value_state("profile", JsonCodec()).put_many(zip(accounts, last["profile"]))
    reads = state.map_state("reads", JsonCodec())
    per = batch.groupby(["account", "newsletter"]).size()
    old = reads.get_many(list(per.index))
    reads.put_many((a, n, (o or 0) + int(c)) for (a, n), c, o in zip(per.index, per, old))
    now = state.clock("processing") or 0
    state.timers.register_many((a, pd.Timestamp(now + MONTH_US, unit="us", tz="UTC")) for a in accounts)
    if bool(batch["compact"].any()):
        state.compact()
    return pd.DataFrame({"account": accounts, "newsletters": batch.groupby("account", sort=True).size().tolist()})


def remind(fired: pd.DataFrame, state: RocksDBStateBackend) -> None:
    return None


def export(state: RocksDBStateBackend) -> pd.DataFrame:
    profiles = dict(state.value_state("profile", JsonCodec()).items())
    reads: dict[bytes, dict[str, int]] = {}
    for account, newsletter, n in state.map_state("reads", JsonCodec()).items():
        reads.setdefault(account, {})[newsletter.decode()] = n
    keys = sorted(set(profiles) | set(reads))
    rows = [(k.decode(), profiles.get(k), reads.get(k, {}), len(state.timers.list(k))) for k in keys]
    return pd.DataFrame(rows, columns=["account", "profile", "reads", "reminders"])


subscriptions = KeyedOperator("subscriptions", key="account", columns=("profile", "newsletter", "compact"),
                              process=process, export=export, emits=True, on_timer=remind, key_type="string")


def subscriptions_pipeline(root: Path) -> Pipeline:
    return Pipeline("subscriptions", [subscriptions], input_url=str(root / "in"), checkpoints_url=str(root / "ckpt"),
                    output_url=str(root / "out"), local_dir=str(root / "local"), parallelism=2,
                    max_parallelism=128, num_retained=3, rocksdb=RocksDBOptions(min_file_mb=1 / 256))


def land(directory: Path, batch: int, accounts: list[str], *, compact: bool = False) -> None:
    """One input file: every account reads two newsletters; its profile is ~300 bytes (random hex:
    RocksDB's zstd cannot make it nothing)."""
    directory.mkdir(parents=True, exist_ok=True)
    pd.DataFrame({"account": [a for a in accounts for _ in (0, 1)],
                  "profile": [f"{a}:{batch}:" + os.urandom(140).hex() for a in accounts for _ in (0, 1)],
                  "newsletter": [f"letter-{(i + batch + j) % 5}" for i, _ in enumerate(accounts) for j in (0, 1)],
                  "compact": [compact for _ in accounts for _ in (0, 1)]}
                 ).to_parquet(directory / f"reads-{batch:03d}.parquet", index=False)
