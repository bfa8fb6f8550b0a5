"""Consumed input cleaned up on a real Spark run of a pipeline of its own (smart meters, kWh per
meter; not the sample's operators): the archive gets exactly the files every retained checkpoint
consumed, a rollback to an older checkpoint keeps the batches it replays, and the replay after it
puts every reading in the state and the output exactly once. The rest is on the core
(tests/test_input_cleanup.py)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from sparkpoint.pipeline.cleanup import InputCleanup
from sparkpoint.pipeline.driver import StatefulPipeline
from sparkpoint.pipeline.maintenance import prune
from sparkpoint.pipeline.rollback import rollback
from tests.support.meters_pipeline import good, meters, state_of, totals


def test_a_run_archives_what_every_retained_checkpoint_consumed_and_a_rollback_replays_the_rest(
        tmp_path: Path, spark):
    archive = tmp_path / "archive"
    pipeline = meters(tmp_path, num_retained=2, input_cleanup=f"archive:{archive}")
    frames = {f"r-{i:03d}.parquet": good(tmp_path, f"r-{i:03d}.parquet", 10 * i) for i in range(4)}
    landed = {name: (tmp_path / "in" / name).read_bytes() for name in frames}
    config = pipeline.config()

    reports = StatefulPipeline(spark, config, pipeline.operators).run()
    assert [r.checkpoint_id for r in reports] == [1, 2, 3, 4]
    cleaned = prune(pipeline.storage(), num_retained=2, input_cleanup=InputCleanup.of(config)).input

    # chk-3 and chk-4 are retained: chk-3 consumed r-000..r-002, so r-003 (chk-4's batch) stays.
    assert cleaned is not None and cleaned.cleaned == ("r-000.parquet", "r-001.parquet", "r-002.parquet")
    assert sorted(p.name for p in (tmp_path / "in").iterdir()) == ["r-003.parquet"]
    assert {p.name: p.read_bytes() for p in archive.iterdir()} == {n: landed[n] for n in cleaned.cleaned}

    rollback(config, 3, operators=pipeline.operators)  # r-003's batch is processed again from chk-3
    again = prune(pipeline.storage(), num_retained=2, input_cleanup=InputCleanup.of(config)).input
    assert again is not None and again.cleaned == () and (tmp_path / "in" / "r-003.parquet").exists()

    replayed = StatefulPipeline(spark, config, pipeline.operators).run()
    assert [r.files for r in replayed] == [("r-003.parquet",)]
    assert state_of(pipeline) == pytest.approx(totals(list(frames.values())))
    output = pd.read_parquet(tmp_path / "out")
    last = output.sort_values("checkpoint_id").groupby("meter")["kwh"].last().to_dict()
    assert last == pytest.approx(totals(list(frames.values())))
    assert len(output) == sum(f["meter"].nunique() for f in frames.values()), "each batch's rows once"
