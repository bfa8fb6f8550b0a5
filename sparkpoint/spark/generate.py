"""The sample event stream: skewed users and items, deterministic for a seed."""

from __future__ import annotations

from typing import Any

import fsspec
import numpy as np
import pandas as pd

from sparkpoint.checkpoint.storage import move_file

START = pd.Timestamp("2026-01-01T00:00:00Z")


def _skewed(rng: np.random.Generator, n: int, size: int, exponent: float) -> np.ndarray:
    """Indices 0..size-1 with Zipf-like popularity (a few hot keys, a long tail)."""
    weights = 1.0 / np.arange(1, size + 1) ** exponent
    order = rng.permutation(size)  # hot keys are not simply the smallest ids
    return order[rng.choice(size, size=n, p=weights / weights.sum())]


def generate_batch(index: int, events: int, users: int, items: int, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng([seed, index])
    user_idx = _skewed(rng, events, users, 1.1)
    item_idx = _skewed(rng, events, items, 0.9)
    offsets = np.sort(rng.integers(0, 3_600_000_000, size=events))  # one hour of events, in µs
    ts = START + pd.to_timedelta(index * 3_600_000_000 + offsets, unit="us")
    return pd.DataFrame(
        {
            "event_id": np.arange(index * events, (index + 1) * events, dtype="int64"),
            "user_id": pd.array([f"u{i:07d}" for i in user_idx], dtype="string"),
            "item_id": pd.array([f"i{i:06d}" for i in item_idx], dtype="string"),
            "amount": np.round(rng.gamma(2.0, 20.0, size=events), 2),
            "ts": pd.Series(ts).astype("datetime64[us, UTC]"),
        }
    )


def generate(
    out: str,
    *,
    batches: int,
    events_per_batch: int,
    users: int,
    items: int,
    seed: int = 0,
    first: int = 0,
    storage_options: dict[str, Any] | None = None,
) -> list[str]:
    """Write `batches` Parquet files `batch-000000.parquet`… under `out`; returns their URLs."""
    for name, value in (("batches", batches), ("events per batch", events_per_batch), ("users", users),
                        ("items", items)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    fs, root = fsspec.core.url_to_fs(out, **(storage_options or {}))
    fs.makedirs(root, exist_ok=True)
    written = []
    for index in range(first, first + batches):
        path = f"{root.rstrip('/')}/batch-{index:06d}.parquet"
        partial = f"{root.rstrip('/')}/_batch-{index:06d}.parquet.tmp"  # the source skips `_` names
        frame = generate_batch(index, events_per_batch, users, items, seed)
        with fs.open(partial, "wb") as f:
            frame.to_parquet(f, index=False)
        move_file(fs, partial, path)  # a reader never sees half a file
        written.append(str(fs.unstrip_protocol(path)))
    return written
