"""A user's own pipeline for the continuous-mode tests (`run --follow`, the Dagster follow job):
weather stations report `station`, `mm` (rain) and the `outage` file of the service their
operator calls; `rain_per_station` sums rain and counts reports per station and emits each
station's new totals. While the outage file exists the operator fails (a service that is down,
then back): what a recovery heals. Batches are landed whole (a rename), as a writer should."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pandas as pd

from sparkpoint import KeyedOperator, Pipeline, StructCodec

TOTALS = StructCodec[tuple[float, int]]("<dq")


def add(batch: pd.DataFrame, state: Any) -> pd.DataFrame:
    down = [p for p in batch["outage"].unique() if os.path.exists(p)]
    if down:
        raise RuntimeError(f"the rain service is down ({down[0]} exists)")
    grouped = batch.groupby("station")["mm"].agg(["sum", "count"])
    keys = [str(k) for k in grouped.index]
    handle = state.value_state("rain", TOTALS)
    new = [(float(s) + (o[0] if o else 0.0), int(c) + (o[1] if o else 0))
           for s, c, o in zip(grouped["sum"], grouped["count"], handle.get_many(keys))]
    handle.put_many(zip(keys, new))
    return pd.DataFrame({"station": keys, "mm": [n[0] for n in new], "reports": [n[1] for n in new]})


def export(state: Any) -> pd.DataFrame:
    rows = [(k.decode(), v[0], v[1]) for k, v in state.value_state("rain", TOTALS).items()]
    return pd.DataFrame(rows, columns=["station", "mm", "reports"])


rain_per_station = KeyedOperator("rain_per_station", key="station", key_type="string", columns=("mm", "outage"),
                                 process=add, export=export, emits=True,
                                 schema={"station": "string", "mm": "float64", "reports": "int64"})

# What `sparkpoint run --pipeline tests.support.follow_pipeline:rain` loads; the tests give its locations as flags.
rain = Pipeline("rain", [rain_per_station], parallelism=2)


def rain_in(tmp_path: Path, **settings: Any) -> Pipeline:
    (tmp_path / "in").mkdir(exist_ok=True)
    return rain.with_(input_url=str(tmp_path / "in"), checkpoints_url=str(tmp_path / "ckpt"),
                      output_url=str(tmp_path / "out"), local_dir=str(tmp_path / "local"), **settings)


def land(tmp_path: Path, index: int, stations: int = 5) -> pd.DataFrame:
    """Batch `index`, landed whole (written aside, then renamed into the input); its rows."""
    rows = pd.DataFrame({"station": [f"s{(index * 3 + i) % stations}" for i in range(stations + index % 3)],
                         "mm": [round(0.5 + index + i * 0.25, 2) for i in range(stations + index % 3)]})
    rows["outage"] = str(tmp_path / "outage")
    aside = tmp_path / "in" / f"_rain-{index:05d}.parquet"
    rows.to_parquet(aside)
    os.rename(aside, tmp_path / "in" / f"rain-{index:05d}.parquet")
    return rows


def landed(tmp_path: Path) -> list[pd.DataFrame]:
    return [pd.read_parquet(p) for p in sorted((tmp_path / "in").glob("rain-*.parquet"))]


def expected(batches: list[pd.DataFrame]) -> pd.DataFrame:
    """What the state must hold after `batches`, recomputed with pandas."""
    rows = pd.concat(batches, ignore_index=True)
    out = rows.groupby("station")["mm"].agg(mm="sum", reports="count").reset_index()
    return out.sort_values("station").reset_index(drop=True)


def assert_state(state: pd.DataFrame, batches: list[pd.DataFrame]) -> None:
    got = state.sort_values("station").reset_index(drop=True)
    want = expected(batches)
    assert got["station"].tolist() == want["station"].tolist()
    assert got["reports"].tolist() == want["reports"].tolist(), "every report counted exactly once"
    assert [round(v, 6) for v in got["mm"]] == [round(v, 6) for v in want["mm"]]


def assert_output(output: pd.DataFrame, batches: list[pd.DataFrame]) -> None:
    """The output holds one set of rows per checkpoint, and each station's last emitted totals
    equal the recomputation: nothing emitted twice, nothing lost."""
    assert output.groupby("checkpoint_id").size().size == len(batches), "one set of output rows per batch"
    last = output.sort_values("checkpoint_id").groupby("station").tail(1)
    assert_state(last[["station", "mm", "reports"]], batches)
