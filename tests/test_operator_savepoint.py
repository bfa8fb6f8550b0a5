"""Savepoints of a real Spark job: a job started from one, in CLAIM and NO_CLAIM mode, after the
original job's directory is gone, reaches the same state as the original's uninterrupted run."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest

import sparkpoint
from sparkpoint.cli import main
from sparkpoint.pipeline.driver import StatefulPipeline
from sparkpoint.pipeline.runtime import PipelineConfig
from sparkpoint.spark.generate import generate
from sparkpoint.state.sample import SAMPLE_OPERATORS

pytestmark = pytest.mark.spark
OPERATORS = ("user_totals", "item_reach")


def config(tmp_path: Path, job_id: str, **kw) -> PipelineConfig:
    return PipelineConfig(
        input_url=str(tmp_path / "in"), checkpoints_url=f"file://{tmp_path}/ckpt", job_id=job_id,
        local_dir=str(tmp_path / "local"), num_retained=1, parallelism=2, **kw,
    )


def states(url: str, job_id: str, checkpoint: int | None = None) -> dict[str, pd.DataFrame]:
    return {op: sparkpoint.read_state(url, job_id, op, checkpoint) for op in OPERATORS}


def test_jobs_started_from_a_savepoint_reach_the_state_of_the_uninterrupted_run(spark, tmp_path: Path):
    generate(str(tmp_path / "in"), batches=3, events_per_batch=1000, users=300, items=40, seed=11)
    ckpt = f"file://{tmp_path}/ckpt"
    original = config(tmp_path, "orig")
    first = StatefulPipeline(spark, replace(original, max_batches=2), SAMPLE_OPERATORS).run()
    assert [r.checkpoint_id for r in first] == [1, 2]

    savepoints = f"file://{tmp_path}/savepoints"
    assert main(["savepoint", "--checkpoints", ckpt, "--job-id", "orig", "--to", f"{savepoints}/sp"]) == 0
    assert main(["savepoint", "--checkpoints", ckpt, "--job-id", "orig"]) == 0  # chk-3, in the job directory

    # The original goes on to the end; retention (one checkpoint) subsumes 1 and 2, never the savepoint.
    assert [r.checkpoint_id for r in StatefulPipeline(spark, original, SAMPLE_OPERATORS).run()] == [4]
    listed = sparkpoint.list_checkpoints(ckpt, "orig")
    assert list(zip(listed["checkpoint_id"], listed["kind"])) == [(4, "checkpoint"), (3, "savepoint")]
    expected = states(ckpt, "orig")
    shutil.rmtree(tmp_path / "ckpt" / "orig")

    for mode in ("CLAIM", "NO_CLAIM"):
        job = f"from-savepoint-{mode.lower()}"
        started = config(tmp_path, job, from_checkpoint=f"{savepoints}/sp/chk-2", restore_mode=mode)
        assert [r.checkpoint_id for r in StatefulPipeline(spark, started, SAMPLE_OPERATORS).run()] == [1], mode
        for op, frame in states(ckpt, job).items():
            pd.testing.assert_frame_equal(frame, expected[op], obj=f"{op} after {mode}")
        lineage = sparkpoint.list_checkpoints(ckpt, job)[["restored_from", "claim_mode"]].to_dict("records")
        assert lineage == [{"restored_from": f"{savepoints}/sp/chk-2/_metadata", "claim_mode": mode}]
    # Neither job touched the savepoint: it still verifies, for the next one.
    assert main(["verify", "--checkpoints", savepoints, "--job-id", "sp"]) == 0
