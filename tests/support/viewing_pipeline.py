"""A user's own pipeline with an Iceberg output, for the erase command's tests: watch time per viewer.

`watch` keys plays by `viewer`; it keeps a map state (minutes per title) and a value state (the
device last seen), and emits per viewer and batch the titles watched so far, the minutes so far
and the device. Its output is an Iceberg table (`media.watch`) in pyiceberg's SQL catalog on
SQLite. `viewing` is what the CLI loads (`--pipeline tests.support.viewing_pipeline:viewing`):
its directories and catalog under `VIEWING_ROOT`.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pandas as pd

from sparkpoint import IcebergTable, JsonCodec, KeyedOperator, Pipeline
from sparkpoint.state.backend import RocksDBStateBackend

TABLE = "media.watch"
COLUMNS = {"viewer": "string", "titles": "int64", "minutes": "int64", "device": "string"}


def process(batch: pd.DataFrame, state: RocksDBStateBackend) -> pd.DataFrame:
    per_title = batch.groupby(["viewer", "title"], sort=True)["minutes"].sum()
    watched = state.map_state("minutes", JsonCodec())
    old = watched.get_many(list(per_title.index))
    watched.put_many((v, t, (o or 0) + int(m)) for (v, t), m, o in zip(per_title.index, per_title, old))
    viewers = sorted(set(batch["viewer"]))
    devices = batch.groupby("viewer", sort=True)["device"].last()
    state.value_state("device", JsonCodec()).put_many(zip(viewers, devices))
    totals = [dict(watched.entries(v)) for v in viewers]
    return pd.DataFrame({"viewer": viewers, "titles": pd.Series([len(t) for t in totals], dtype="int64"),
                         "minutes": pd.Series([sum(t.values()) for t in totals], dtype="int64"),
                         "device": devices.tolist()})


def export(state: RocksDBStateBackend) -> pd.DataFrame:
    devices = dict(state.value_state("device", JsonCodec()).items())
    minutes: dict[bytes, int] = {}
    for viewer, _, n in state.map_state("minutes", JsonCodec()).items():
        minutes[viewer] = minutes.get(viewer, 0) + n
    keys = sorted(set(devices) | set(minutes))
    return pd.DataFrame([(k.decode(), devices.get(k), minutes.get(k, 0)) for k in keys],
                        columns=["viewer", "device", "minutes"])


watch = KeyedOperator("watch", key="viewer", columns=("title", "minutes", "device"), process=process,
                      export=export, emits=True, schema=COLUMNS, uid="watch-by-viewer")


def catalog(root: Path) -> dict[str, str]:
    return {"name": "lake", "type": "sql", "uri": f"sqlite:///{root}/catalog.db", "warehouse": f"file://{root}/wh"}


def viewing_pipeline(root: Path, **changes: object) -> Pipeline:
    return Pipeline("viewing", [watch], input_url=str(root / "in"), checkpoints_url=str(root / "ckpt"),
                    output=IcebergTable(TABLE, catalog=catalog(root)), local_dir=str(root / "local"),
                    parallelism=2, max_parallelism=16, num_retained=3).with_(**changes)


def land(directory: Path, batch: int, viewers: list[str]) -> pd.DataFrame:
    """One input file: every viewer plays two titles."""
    directory.mkdir(parents=True, exist_ok=True)
    rows = pd.DataFrame({"viewer": [v for v in viewers for _ in (0, 1)],
                         "title": [f"t{(i + batch + j) % 5}" for i, _ in enumerate(viewers) for j in (0, 1)],
                         "minutes": [5 * batch + j for _ in viewers for j in (0, 1)],
                         "device": [f"tv-{batch % 2}" for _ in viewers for _ in (0, 1)]})
    rows.to_parquet(directory / f"plays-{batch:03d}.parquet", index=False)
    return rows


viewing = viewing_pipeline(Path(os.environ.get("VIEWING_ROOT") or Path(tempfile.gettempdir()) / "sparkpoint-viewing"))
