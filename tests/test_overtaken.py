"""A run that loses the commit race to another writer of its job ends cleanly and says so (issue
37, item 2): its checkpoint step aborts its own attempt and reports "overtaken by chk-N of run X;
nothing committed" without failing; a recovery that finds the failed batch committed by another
writer, or whose own re-processing is overtaken, succeeds and says by which checkpoint.

Real Spark, RocksDB, files and Dagster runs in process. The other writer is the seam's two steps
under its own attempt id (what another Dagster run of the pipeline does), run at the moment that
loses the race for this run: between its SSTable step and its commit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dagster as dg
import pytest

import sparkpoint.assets.steps
import sparkpoint.pipeline.maintenance
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.checkpoint.sweep import sweep_orphans
from sparkpoint.pipeline.attempt import finish_step, list_attempts, start_step
from sparkpoint.pipeline.driver import StatefulPipeline
from sparkpoint.resources import SparkResource
from sparkpoint.resources.scope import FAILED_RUN_TAG, INJECT_TAG, OVERTAKEN_TAG
from tests.support.orders_pipeline import land, orders, orders_pipeline, totals

pytestmark = pytest.mark.spark


class Setup:
    def __init__(self, spark: Any, tmp_path: Path):
        self.pipeline = orders_pipeline(tmp_path)
        self.parts = orders(tmp_path, landing_sensor=False, resources={"spark": SparkResource(stop_on_teardown=False)})
        self.other = StatefulPipeline(spark, self.pipeline.config(), self.pipeline.operators)
        self.instance = dg.DagsterInstance.ephemeral()
        self.rows = [land(tmp_path, f"o{i}.parquet") for i in range(2)]

    def other_run_commits(self, attempt_id: str = "run-b") -> int:
        """Another run of the pipeline processes the next batch and commits it."""
        assert start_step(self.other, attempt_id) is not None
        done = finish_step(self.other, [attempt_id])
        assert done is not None
        return done[1].checkpoint_id

    def materialize(self, **kwargs: Any) -> dg.ExecuteInProcessResult:
        return dg.materialize([*self.parts.assets, *self.parts.checks], resources=self.parts.resources,
                              instance=self.instance, **kwargs)

    def recover(self, failed: dg.ExecuteInProcessResult) -> dg.ExecuteInProcessResult:
        request = self.parts.sensor("recovery_sensor")(dg.build_sensor_context(instance=self.instance))
        assert isinstance(request, dg.RunRequest) and request.tags == {FAILED_RUN_TAG: failed.run_id}, request
        return self.parts.jobs.recover.execute_in_process(run_config=request.run_config, tags=request.tags,
                                                          instance=self.instance, resources=self.parts.resources)

    def assert_exactly_once(self, batches: int) -> None:
        storage = self.other.storage
        latest = CompletedCheckpointStore(storage).latest()
        assert latest is not None
        assert latest.source_offsets["source"]["consumed"] == [f"o{i}.parquet" for i in range(batches)]
        state = self.pipeline.read_state("spend_per_customer")
        assert dict(zip(state["customer"], state["total"])) == totals(self.rows[:batches])
        assert list_attempts(storage).attempts == (), "no attempt is left pending"
        assert sweep_orphans(storage, grace_seconds=0, dry_run=True).orphans == (), "no upload is left behind"


def recovery_summary(run: dg.ExecuteInProcessResult) -> dict[str, Any]:
    [output] = [e for e in run.all_events if e.event_type_value == "STEP_OUTPUT"]
    return {k: v.value for k, v in output.event_specific_data.metadata.items()}


def test_a_run_whose_checkpoint_another_run_committed_first_ends_green_and_says_so(spark, tmp_path: Path,
                                                                                   monkeypatch: pytest.MonkeyPatch):
    setup = Setup(spark, tmp_path)
    real = sparkpoint.assets.steps.finish_step_or_overtaken

    def another_run_commits_first(*args: Any, **kwargs: Any) -> Any:
        assert setup.other_run_commits() == 1  # the same batch, from the same (empty) start
        return real(*args, **kwargs)

    monkeypatch.setattr(sparkpoint.assets.steps, "finish_step_or_overtaken", another_run_commits_first)
    result = setup.materialize()
    assert result.success
    line = "overtaken by chk-1 of run run-b; nothing committed"
    assert setup.instance.get_run_by_id(result.run_id).tags[OVERTAKEN_TAG] == line
    materialized = {e.asset_key for e in result.get_asset_materialization_events()}
    assert materialized == {setup.parts.scope.sstable_keys["spend_per_customer"]}, "the checkpoint asset got none"
    [observed] = [e.event_specific_data.asset_observation for e in result.all_events
                  if e.event_type_value == "ASSET_OBSERVATION"]
    assert observed.asset_key == setup.parts.scope.checkpoint_key and observed.description == line
    assert observed.metadata["overtaken_by"].value == 1 and observed.metadata["by_run"].value == "run-b"
    assert not [e for e in result.all_events if e.event_type_value == "ASSET_CHECK_EVALUATION"], \
        "no check ran for a checkpoint this run did not make"
    storage = setup.other.storage
    assert storage.completed_checkpoint_ids() == [1]
    assert CompletedCheckpointStore(storage).load(1).source_offsets["attempt"] == "run-b"
    setup.assert_exactly_once(1)

    monkeypatch.setattr(sparkpoint.assets.steps, "finish_step_or_overtaken", real)
    assert setup.materialize().success  # and the pipeline goes on with the next batch
    setup.assert_exactly_once(2)


def test_a_recovery_finds_the_failed_batch_committed_by_another_run_and_succeeds(spark, tmp_path: Path):
    setup = Setup(spark, tmp_path)
    failed = setup.materialize(tags={INJECT_TAG: "after-upload"}, raise_on_error=False)
    assert not failed.success
    assert setup.other_run_commits() == 1  # the failed run's batch, o0
    healed = setup.recover(failed)
    assert healed.success
    facts = recovery_summary(healed)
    assert "the failed batch o0.parquet was already committed by chk-1 of run run-b" in facts["summary"], facts
    assert facts["failed_batch_committed_by"] == 1
    assert "re-processed o1.parquet as checkpoint 2" in facts["summary"], facts
    setup.assert_exactly_once(2)


def test_a_recovery_whose_own_commit_is_overtaken_succeeds_and_says_so(spark, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch):
    setup = Setup(spark, tmp_path)
    failed = setup.materialize(tags={INJECT_TAG: "after-upload"}, raise_on_error=False)
    assert not failed.success
    real = sparkpoint.pipeline.maintenance.complete_attempt

    def another_run_commits_first(*args: Any, **kwargs: Any) -> Any:
        assert setup.other_run_commits() == 1  # the batch the recovery re-processes, o0
        return real(*args, **kwargs)

    monkeypatch.setattr(sparkpoint.pipeline.maintenance, "complete_attempt", another_run_commits_first)
    healed = setup.recover(failed)
    assert healed.success, "the recovery run is green"
    facts = recovery_summary(healed)
    assert "re-processed o0.parquet: overtaken by chk-1 of run run-b; nothing committed" in facts["summary"], facts
    assert "the failed batch o0.parquet was already committed by chk-1 of run run-b" in facts["summary"], facts
    assert facts["overtaken_by"] == 1
    assert not healed.get_asset_materialization_events(), "no checkpoint of the recovery's to report"
    setup.assert_exactly_once(1)
