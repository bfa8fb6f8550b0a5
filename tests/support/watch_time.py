"""A user's own pipeline for the rollback tests: seconds of watch time per video, summed in a value
state; each batch emits the changed videos' totals. Batches are small Parquet files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from sparkpoint import KeyedOperator, Pipeline, StructCodec

SECONDS = StructCodec[tuple[int]]("<q")


def add_seconds(batch: pd.DataFrame, state: Any) -> pd.DataFrame:
    sums = batch.groupby("video")["seconds"].sum()
    totals = state.value_state("watched", SECONDS)
    keys = [str(k) for k in sums.index]
    new = [(old[0] if old else 0) + int(s) for old, s in zip(totals.get_many(keys), sums.tolist())]
    totals.put_many((k, (v,)) for k, v in zip(keys, new))
    return pd.DataFrame({"video": keys, "watched_s": pd.Series(new, dtype="int64")})


def export_seconds(state: Any) -> pd.DataFrame:
    rows = [(k.decode(), v[0]) for k, v in state.value_state("watched", SECONDS).items()]
    return pd.DataFrame(rows, columns=["video", "watched_s"]).sort_values("video").reset_index(drop=True)


watch_time = KeyedOperator("watch_time", key="video", columns=("seconds",), process=add_seconds,
                           export=export_seconds, emits=True, uid="watch-time-v1")


def watch_pipeline(root: Path, **settings: Any) -> Pipeline:
    """The pipeline over `<root>/in`, its checkpoints and Parquet output under `root` (5 retained)."""
    (root / "in").mkdir(parents=True, exist_ok=True)
    given: dict[str, Any] = {"input_url": str(root / "in"), "checkpoints_url": str(root / "ckpt"),
                             "output_url": str(root / "out"), "local_dir": str(root / "local"), "parallelism": 2,
                             "max_parallelism": 8, "num_retained": 5}
    return Pipeline("views", [watch_time], **{**given, **settings})


def land_batches(root: Path, count: int) -> list[pd.DataFrame]:
    """`count` batch files of 12 views over 5 videos; returns their rows in order."""
    (root / "in").mkdir(parents=True, exist_ok=True)
    frames = []
    for i in range(count):
        frame = pd.DataFrame({"video": [f"v{(3 * i + j) % 5}" for j in range(12)],
                              "seconds": [(7 * i + 5 * j) % 40 + 1 for j in range(12)]})
        frame.to_parquet(root / "in" / f"views-{i:03d}.parquet")
        frames.append(frame)
    return frames


def emitted(batches: list[pd.DataFrame]) -> list[tuple[str, int]]:
    """Every row the operator emits over `batches` (video, total after the batch), recomputed in pandas."""
    totals: dict[str, int] = {}
    rows = []
    for frame in batches:
        for video, seconds in frame.groupby("video")["seconds"].sum().items():
            totals[str(video)] = totals.get(str(video), 0) + int(seconds)
            rows.append((str(video), totals[str(video)]))
    return sorted(rows)
