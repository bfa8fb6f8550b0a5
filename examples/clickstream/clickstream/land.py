"""Land click batches in a pipeline's input: `python -m clickstream.land --batches 3 [--into DIR]`."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd


def clicks_batch(number: int, rows: int = 2_000, users: int = 300, pages: int = 40) -> pd.DataFrame:
    rng = np.random.default_rng(number)
    start = pd.Timestamp("2026-11-01", tz="UTC") + pd.Timedelta(minutes=number)
    return pd.DataFrame({
        "user": [f"u{i}" for i in rng.integers(0, users, rows)],
        "page": [f"/p/{i}" for i in rng.integers(0, pages, rows)],
        "clicked_at": start + pd.to_timedelta(np.sort(rng.integers(0, 60_000_000, rows)), "us"),
    })


def land(into: str | Path, batches: int, first: int | None = None) -> list[Path]:
    """Write `batches` files after the ones already there (clicks-000000.parquet, ...)."""
    target = Path(into)
    target.mkdir(parents=True, exist_ok=True)
    start = first if first is not None else len(list(target.glob("clicks-*.parquet")))
    written = []
    for number in range(start, start + batches):
        path = target / f"clicks-{number:06d}.parquet"
        tmp = target / f".{path.name}.tmp"  # hidden until whole: the source skips dot files
        clicks_batch(number).to_parquet(tmp, index=False)
        tmp.rename(path)
        written.append(path)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--into", action="append", help="input directory (repeatable); default: both pipelines'")
    args = parser.parse_args()
    for into in args.into or [".sparkpoint/clicks/input", ".sparkpoint/pages/input"]:
        for path in land(into, args.batches):
            print(path)


if __name__ == "__main__":
    main()
