"""`make run`: the sample pipeline on embedded defaults, then a check of its latest checkpoint.

Local Spark, `file://` checkpoint storage under `.sparkpoint/` in the project. Every run lands
two more batches of sample events and processes whatever is unconsumed, resuming from the
latest completed checkpoint; then it restores that checkpoint's state and compares it with a
plain recomputation over every consumed file.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from sparkpoint.core.inspect import operator_states
from sparkpoint.core.storage import CheckpointStorage
from sparkpoint.core.store import CompletedCheckpointStore
from sparkpoint.spark.generate import generate
from sparkpoint.spark.operators import item_reach, user_totals
from sparkpoint.spark.runtime import PipelineConfig, StatefulPipeline
from sparkpoint.spark.session import spark_session

HOME = Path(os.environ.get("SPARKPOINT_HOME", ".sparkpoint")).resolve()
BATCHES_PER_RUN = 2


def main() -> int:
    input_dir = HOME / "demo" / "input"
    existing = len(list(input_dir.glob("batch-*.parquet"))) if input_dir.exists() else 0
    generate(str(input_dir), batches=BATCHES_PER_RUN, events_per_batch=20_000, users=5_000, items=500, seed=42,
             first=existing)
    config = PipelineConfig(
        input_url=str(input_dir), checkpoints_url=(HOME / "checkpoints").as_uri(), job_id="demo",
        output_url=(HOME / "demo" / "output").as_uri(), local_dir=str(HOME / "local"), parallelism=2,
        num_retained=2,
    )
    print(f"sparkpoint demo: input {input_dir}, checkpoints {config.checkpoints_url}/demo")
    spark = spark_session("local[2]")
    try:
        StatefulPipeline(spark, config).run(on_checkpoint=lambda r: print(r.line(), flush=True))
    finally:
        spark.stop()
    return check_latest(config)


def check_latest(config: PipelineConfig) -> int:
    storage = CheckpointStorage(config.checkpoints_url, config.job_id)
    store = CompletedCheckpointStore(storage)
    meta = store.load(store.checkpoint_ids()[0])
    consumed = meta.source_offsets["source"]["consumed"]
    events = pd.concat([pd.read_parquet(Path(config.input_url) / name) for name in consumed], ignore_index=True)
    ok = True
    for op, expected in [(user_totals, _totals(events)), (item_reach, _reach(events))]:
        with operator_states(storage, meta, op.name) as backends:
            got = pd.concat([op.export(b) for b in backends]).sort_values(op.key).reset_index(drop=True)
        same = _same(got, expected)
        ok &= same
        print(f"chk-{meta.checkpoint_id} {op.name}: {len(got)} keys, {'matches' if same else 'DIFFERS FROM'} "
              f"a recomputation over {len(consumed)} files")
    return 0 if ok else 1


def _totals(events: pd.DataFrame) -> pd.DataFrame:
    return events.groupby("user_id").agg(
        count=("event_id", "size"), amount_sum=("amount", "sum"), amount_min=("amount", "min"),
        amount_max=("amount", "max"), last_ts=("ts", "max"),
    ).reset_index()


def _reach(events: pd.DataFrame) -> pd.DataFrame:
    reach = events.groupby("item_id").agg(events=("event_id", "size"), distinct_users=("user_id", "nunique"))
    return reach.reset_index()


def _same(got: pd.DataFrame, expected: pd.DataFrame) -> bool:
    expected = expected.sort_values(expected.columns[0]).reset_index(drop=True)
    if list(got.columns) != list(expected.columns) or len(got) != len(expected):
        return False
    for column in got.columns:
        a, b = got[column], expected[column]
        if column == "amount_sum":
            if not np.allclose(a.to_numpy(float), b.to_numpy(float), rtol=1e-9):
                return False
        elif column == "last_ts":
            if not (pd.to_datetime(a, utc=True) == pd.to_datetime(b, utc=True)).all():
                return False
        elif list(a.astype(str)) != list(b.astype(str)):
            return False
    return True


if __name__ == "__main__":
    sys.exit(main())
