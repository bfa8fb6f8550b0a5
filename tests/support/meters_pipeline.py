"""A user's own pipeline for the bad-input-file tests (issue 34, item 2): smart meters report
`meter` (a string: the operator declares its key type), `kwh` and `read_at`; `kwh_per_meter` sums
kWh per meter and emits each meter's new total to the exactly-once output. Bad files of every
kind the checks know, and the pandas recomputation the state must equal."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from sparkpoint import KeyedOperator, Pipeline, StructCodec

TOTAL = StructCodec[tuple[float]]("<d")
T0 = pd.Timestamp("2026-03-01T00:00:00Z")


def add(batch: pd.DataFrame, state: Any) -> pd.DataFrame:
    sums = batch.groupby("meter")["kwh"].sum()
    keys = [str(k) for k in sums.index]
    handle = state.value_state("kwh", TOTAL)
    new = [float(s) + (o[0] if o else 0.0) for s, o in zip(sums, handle.get_many(keys))]
    handle.put_many((k, (v,)) for k, v in zip(keys, new))
    return pd.DataFrame({"meter": keys, "kwh": new})


def export(state: Any) -> pd.DataFrame:
    rows = [(k.decode(), v[0]) for k, v in state.value_state("kwh", TOTAL).items()]
    return pd.DataFrame(rows, columns=["meter", "kwh"])


kwh_per_meter = KeyedOperator("kwh_per_meter", key="meter", key_type="string", columns=("kwh",), process=add,
                              export=export, emits=True, schema={"meter": "string", "kwh": "float64"})


def meters(tmp_path: Path, **settings: Any) -> Pipeline:
    (tmp_path / "in").mkdir(exist_ok=True)
    return Pipeline("meters", [kwh_per_meter], input_url=str(tmp_path / "in"),
                    checkpoints_url=str(tmp_path / "ckpt"), output_url=str(tmp_path / "out"),
                    local_dir=str(tmp_path / "local"), parallelism=2, **settings)


def good(tmp_path: Path, name: str, first: int = 0) -> pd.DataFrame:
    """A good batch file: meters m1..m3 with their readings (and a timestamp); returns its rows."""
    rows = pd.DataFrame({"meter": ["m1", "m2", "m3", "m1"], "kwh": [first + 1.0, first + 2.5, first + 4.0, 0.5],
                         "read_at": [T0 + pd.Timedelta(minutes=first + i) for i in range(4)]})
    rows.to_parquet(tmp_path / "in" / name)
    return rows


def _null_keys(path: Path) -> None:
    pd.DataFrame({"meter": ["m1", None, "mX"], "kwh": [100.0, 100.0, 100.0],
                  "read_at": [T0] * 3}).to_parquet(path)


def _null_keys_no_statistics(path: Path) -> None:
    table = pa.table({"meter": pa.array(["mX", None], pa.string()), "kwh": [100.0, 100.0]})
    pq.write_table(table, path, write_statistics=False)  # the footer cannot tell: the key column is read


def _missing_column(path: Path) -> None:
    pd.DataFrame({"meter": ["mX"], "energy": [100.0], "read_at": [T0]}).to_parquet(path)


def _wrong_key_type(path: Path) -> None:
    pd.DataFrame({"meter": [7, 8], "kwh": [100.0, 100.0], "read_at": [T0, T0]}).to_parquet(path)


def _not_parquet(path: Path) -> None:
    path.write_text("meter,kwh\nmX,100.0\n")


# name -> (how to write such a file, the check it fails)
BAD: dict[str, tuple[Callable[[Path], None], str]] = {
    "null keys": (_null_keys, "null_keys"),
    "null keys, no statistics": (_null_keys_no_statistics, "null_keys"),
    "missing column": (_missing_column, "columns"),
    "wrong key type": (_wrong_key_type, "types"),
    "not parquet": (_not_parquet, "parquet"),
}


def bad(tmp_path: Path, name: str, kind: str) -> str:
    """A bad batch file of `kind` (a key of BAD), landed whole a while ago (settled: a check's
    verdict on it counts); returns the check it fails."""
    write, check = BAD[kind]
    write(tmp_path / "in" / name)
    settled(tmp_path / "in" / name)
    return check


def settled(path: Path, seconds_ago: float = 3600.0) -> None:
    """Date `path`'s modification `seconds_ago`: a file landed whole that long ago."""
    when = time.time() - seconds_ago
    os.utime(path, (when, when))


def totals(frames: list[pd.DataFrame]) -> dict[str, float]:
    """What the state must hold after the good batches `frames`, recomputed with pandas."""
    return pd.concat(frames).groupby("meter")["kwh"].sum().to_dict()


def state_of(pipeline: Pipeline) -> dict[str, float]:
    table = pipeline.read_state("kwh_per_meter")
    return dict(zip(table["meter"], table["kwh"]))
