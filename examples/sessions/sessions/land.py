"""Land click batches in the pipeline's input: `python -m sessions.land --batches 6 [--into DIR] [--seed S]`.

Batch `n` holds the clicks of ten minutes of event time (after every fourth batch the site is
idle for half an hour), not in time order; some clicks arrive up to 8 minutes delayed (a few of
them behind the watermark: late), and some are delivered again, in the same batch or the next,
with the same `event_id`; after an idle half hour the last clicks before it are sent once more.
The same seed and number give the same batch.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd

START = pd.Timestamp("2026-11-01", tz="UTC")
CLICKS, USERS, PAGES = 120, 60, 12
DELAYED, REDELIVERED = 0.10, 0.08  # shares of a batch's clicks


def batch_start(number: int) -> pd.Timestamp:
    return START + pd.Timedelta(minutes=10 * number + 30 * (number // 4))


def _fresh(number: int, seed: int) -> pd.DataFrame:
    """The clicks first sent in batch `number`."""
    rng = np.random.default_rng([seed, number])
    offsets = rng.integers(0, 600_000_000, CLICKS)  # µs into the batch's ten minutes
    delayed = rng.random(CLICKS) < DELAYED
    offsets = offsets - delayed * rng.integers(0, 480_000_000, CLICKS)
    return pd.DataFrame({
        "event_id": [f"e{number:05d}-{i:04d}" for i in range(CLICKS)],
        "user": [f"u{i:02d}" for i in rng.integers(0, USERS, CLICKS)],
        "page": [f"/p/{i}" for i in rng.integers(0, PAGES, CLICKS)],
        "clicked_at": batch_start(number) + pd.to_timedelta(offsets, "us"),
    })


def clicks_batch(number: int, seed: int = 0) -> pd.DataFrame:
    """Batch `number`: its fresh clicks and copies of some of this batch's and the previous one's."""
    fresh = _fresh(number, seed)
    before = _fresh(number - 1, seed) if number else fresh.iloc[:0]
    rng = np.random.default_rng([seed, number, 1])
    earlier = pd.concat([before, fresh])
    copies = earlier.iloc[rng.choice(len(earlier), int(CLICKS * REDELIVERED), replace=False)]
    resent = before.nlargest(3, "clicked_at") if number % 4 == 0 else before.iloc[:0]  # after the idle time
    rows = pd.concat([fresh, copies, resent], ignore_index=True)
    rows = rows.iloc[rng.permutation(len(rows))].reset_index(drop=True)
    return rows.astype({"clicked_at": "datetime64[us, UTC]"})


def land(into: str | Path, batches: int, first: int | None = None, seed: int = 0) -> list[Path]:
    """Write `batches` files after the ones already there (clicks-000000.parquet, ...)."""
    target = Path(into)
    target.mkdir(parents=True, exist_ok=True)
    start = first if first is not None else len(list(target.glob("clicks-*.parquet")))
    written = []
    for number in range(start, start + batches):
        path = target / f"clicks-{number:06d}.parquet"
        tmp = target / f".{path.name}.tmp"  # hidden until whole: the source skips dot files
        clicks_batch(number, seed).to_parquet(tmp, index=False)
        tmp.rename(path)
        written.append(path)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=6)
    parser.add_argument("--into", default=".sparkpoint/visits/input")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for path in land(args.into, args.batches, seed=args.seed):
        print(path)


if __name__ == "__main__":
    main()
