"""What the sample pipeline must produce, computed the plain way (pandas over all input)."""

from __future__ import annotations

import glob
import os

import numpy as np
import pandas as pd

TOTALS = ["user_id", "count", "amount_sum", "amount_min", "amount_max", "last_ts"]


def read_batches(input_dir: str) -> list[pd.DataFrame]:
    return [pd.read_parquet(p) for p in sorted(glob.glob(os.path.join(input_dir, "batch-*.parquet")))]


def user_totals(events: pd.DataFrame) -> pd.DataFrame:
    g = events.groupby("user_id").agg(
        count=("event_id", "size"), amount_sum=("amount", "sum"), amount_min=("amount", "min"),
        amount_max=("amount", "max"), last_ts=("ts", "max"),
    )
    return g.reset_index().sort_values("user_id").reset_index(drop=True)


def item_reach(events: pd.DataFrame) -> pd.DataFrame:
    g = events.groupby("item_id").agg(events=("event_id", "size"), distinct_users=("user_id", "nunique"))
    return g.reset_index().sort_values("item_id").reset_index(drop=True)


def sink_rows(batches: list[pd.DataFrame]) -> list[pd.DataFrame]:
    """Per batch: the user_totals rows it changed, with the totals as of that batch."""
    out = []
    for i, batch in enumerate(batches):
        totals = user_totals(pd.concat(batches[: i + 1], ignore_index=True))
        out.append(totals[totals["user_id"].isin(set(batch["user_id"]))].reset_index(drop=True))
    return out


def assert_totals_equal(actual: pd.DataFrame, expected: pd.DataFrame) -> None:
    actual = actual.sort_values("user_id").reset_index(drop=True)
    expected = expected.sort_values("user_id").reset_index(drop=True)
    assert list(actual["user_id"].astype(str)) == list(expected["user_id"].astype(str))
    assert list(actual["count"]) == list(expected["count"])
    np.testing.assert_allclose(actual["amount_sum"], expected["amount_sum"], rtol=1e-9)
    assert list(actual["amount_min"]) == list(expected["amount_min"])
    assert list(actual["amount_max"]) == list(expected["amount_max"])
    assert list(_utc(actual["last_ts"])) == list(_utc(expected["last_ts"]))


def assert_reach_equal(actual: pd.DataFrame, expected: pd.DataFrame) -> None:
    actual = actual.sort_values("item_id").reset_index(drop=True)
    expected = expected.sort_values("item_id").reset_index(drop=True)
    assert list(actual["item_id"].astype(str)) == list(expected["item_id"].astype(str))
    assert list(actual["events"]) == list(expected["events"])
    assert list(actual["distinct_users"]) == list(expected["distinct_users"])


def _utc(ts: pd.Series) -> pd.Series:
    ts = pd.to_datetime(ts)
    if ts.dt.tz is None:
        ts = ts.dt.tz_localize("UTC")
    return ts.dt.tz_convert("UTC").astype("datetime64[us, UTC]")
