"""An attempt id an abort has claimed is fenced for good at that checkpoint: a step started again
under it is refused at once, before any Spark work, and a new id goes on to commit the batch."""

from __future__ import annotations

from pathlib import Path

import pytest

from sparkpoint.pipeline.attempt import AttemptIdReused, finish_step, list_attempts, start_step
from sparkpoint.pipeline.driver import StatefulPipeline
from sparkpoint.sample import pipeline as sample
from sparkpoint.spark.faults import InjectedFailure
from sparkpoint.spark.generate import generate
from sparkpoint.spark.session import spark_session

pytestmark = pytest.mark.spark


def test_a_step_under_an_aborted_id_is_refused_before_spark_and_a_new_id_commits(tmp_path: Path):
    generate(str(tmp_path / "in"), batches=2, events_per_batch=800, users=100, items=20, seed=5)
    spec = sample.with_(input_url=str(tmp_path / "in"), checkpoints_url=str(tmp_path / "ckpt"), job_id="job",
                        output=None, output_url=None, local_dir=str(tmp_path / "local"))
    driver = StatefulPipeline(spark_session("local[2]"), spec.config(), spec.operators)
    with pytest.raises(InjectedFailure):
        start_step(driver, "try-1", inject_failure="after-upload")
    assert [a.attempt_id for a in list_attempts(driver.storage).attempts] == ["try-1"]

    spark_jobs = []
    run_spark = driver.run_spark
    driver.run_spark = lambda *args: spark_jobs.append(args) or run_spark(*args)  # type: ignore[method-assign]
    with pytest.raises(AttemptIdReused, match="attempt try-1 was aborted at checkpoint 1"):
        start_step(driver, "try-1")
    assert spark_jobs == [], "refused before any Spark work"
    assert list_attempts(driver.storage).attempts == (), "the earlier attempt of the id was aborted"

    attempt = start_step(driver, "try-2")
    assert attempt is not None and attempt.checkpoint_id == 1
    done = finish_step(driver, ["try-2"])
    assert done is not None and done[1].checkpoint_id == 1
    assert start_step(driver, "try-1") is not None, "past that checkpoint the id is free again"


def test_a_pending_attempt_whose_id_is_a_path_is_refused():
    from sparkpoint.pipeline.attempt import AttemptError, PendingAttempt

    raw = {"format": "sparkpoint-pending-attempt", "version": 1, "job_id": "job", "checkpoint_id": 3,
           "attempt_id": "x/../../chk-2/_metadata", "expected": {}, "handles": [], "staged": [],
           "source_offsets": {"version": 1, "consumed": []}, "files": [], "subtasks": [], "rows": 0,
           "started_at": 0.0}
    with pytest.raises(AttemptError, match="attempt id"):
        PendingAttempt.from_json(raw)
