"""The Dagster follow job (issue 35, part 2): one step checkpoints each batch as it lands and reports
every checkpoint on the pipeline's assets as the checkpoint job does; its failure is healed by the
recovery sensor (recover, then the follow job again); the input sensor launches no batch run while
a follow run of the pipeline is in progress. A user's own pipeline (`tests.support.follow_pipeline`),
real Dagster instances, real Spark (the session fixture's `local[2]`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import dagster as dg
import pandas as pd
import pytest

from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.checkpoint.sweep import sweep_orphans
from sparkpoint.factory import PipelineDefs, pipeline_defs
from sparkpoint.resources import SparkResource
from sparkpoint.resources.scope import FAILED_RUN_TAG, PIPELINE_TAG
from sparkpoint.sensors import FOLLOWS_AFTER_TAG
from sparkpoint.state.extract import operator_states
from tests.support import follow_pipeline as rain
from tests.support.waiting import wait_for
from tests.test_pipeline_runs_in_flight import in_flight

pytestmark = pytest.mark.spark
FOLLOW_OP = "rain_follow_op"


def rain_defs(tmp_path: Path) -> PipelineDefs:
    # The session fixture's JVM is shared by the whole test session: the job must not stop it.
    return pipeline_defs(rain.rain_in(tmp_path, num_retained=10),
                         resources={"spark": SparkResource(stop_on_teardown=False)})


def storage_of(tmp_path: Path) -> CheckpointStorage:
    return CheckpointStorage(str(tmp_path / "ckpt"), "rain")


def follow_config(**config: Any) -> dict[str, Any]:
    return {"ops": {FOLLOW_OP: {"config": {"poll_seconds": 0.05, **config}}}}


def in_background(work: Callable[[], None]) -> threading.Thread:
    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    return thread


def wait_for_checkpoint(storage: CheckpointStorage, checkpoint_id: int, timeout: float = 120) -> None:
    wait_for(lambda: checkpoint_id in storage.completed_checkpoint_ids(), timeout, 0.05, f"chk-{checkpoint_id}")


def materialized(result: dg.ExecuteInProcessResult, key: dg.AssetKey) -> list[dg.AssetMaterialization]:
    return [e.materialization for e in result.get_asset_materialization_events() if e.materialization.asset_key == key]


def state_of(storage: CheckpointStorage) -> pd.DataFrame:
    latest = CompletedCheckpointStore(storage).latest()
    assert latest is not None
    with operator_states(storage, latest, rain.rain_per_station.name) as backends:
        return pd.concat([rain.rain_per_station.export(b) for b in backends], ignore_index=True)


def test_the_follow_job_reports_every_checkpoint_it_commits_as_storage_holds_it(spark, tmp_path: Path):
    parts = rain_defs(tmp_path)
    job = parts.definitions().resolve_job_def("rain_follow")
    storage = storage_of(tmp_path)
    rain.land(tmp_path, 0)
    rain.land(tmp_path, 1)

    def land_while_it_runs() -> None:
        wait_for_checkpoint(storage, 2)
        for index in (2, 3):
            time.sleep(0.3)
            rain.land(tmp_path, index)

    landing = in_background(land_while_it_runs)
    instance = dg.DagsterInstance.ephemeral()
    result = job.execute_in_process(instance=instance, run_config=follow_config(idle_seconds=3.0))
    landing.join()
    assert result.success

    on_storage = {m.checkpoint_id: m for m in CompletedCheckpointStore(storage).load_all().checkpoints}
    assert sorted(on_storage) == [1, 2, 3, 4], "one checkpoint per landed file"
    reported = {int(m.metadata["checkpoint_id"].value): m for m in materialized(result, parts.scope.checkpoint_key)}
    assert sorted(reported) == sorted(on_storage), "one materialization per committed checkpoint, no other"
    for cid, meta in on_storage.items():
        facts = reported[cid].metadata
        assert str(facts["path"].value).endswith(f"/ckpt/rain/{meta.metadata_path}")
        assert (facts["state_size_bytes"].value, facts["checkpointed_size_bytes"].value) == (
            meta.stats.state_size, meta.stats.checkpointed_size)
        assert facts["batch"].value == [f"rain-{cid - 1:05d}.parquet"]
        assert reported[cid].tags["dagster/data_version"] == str(cid)
    for key in parts.scope.sstable_keys.values():
        assert sorted(int(m.metadata["checkpoint_id"].value) for m in materialized(result, key)) == [1, 2, 3, 4]
    outputs = materialized(result, parts.scope.output_key)
    assert sorted(int(m.metadata["checkpoint_id"].value) for m in outputs) == [1, 2, 3, 4]
    latest = instance.get_latest_materialization_event(parts.scope.checkpoint_key)
    assert latest is not None and latest.asset_materialization is not None
    assert latest.asset_materialization.metadata["checkpoint_id"].value == 4, "the UI shows the latest checkpoint"
    (step,) = [e for e in result.all_events if e.event_type_value == "STEP_OUTPUT"]
    assert step.event_specific_data.metadata["checkpoints"].value == 4
    rain.assert_state(state_of(storage), rain.landed(tmp_path))


def test_a_failed_follow_run_is_recovered_then_the_follow_job_runs_again(spark, tmp_path: Path):
    parts = rain_defs(tmp_path)
    defs = parts.definitions()
    follow_job, recover_job = defs.resolve_job_def("rain_follow"), defs.resolve_job_def("rain_recover")
    sensor = parts.sensor("recovery_sensor")
    storage = storage_of(tmp_path)
    outage = tmp_path / "outage"
    rain.land(tmp_path, 0)
    rain.land(tmp_path, 1)

    def outage_after_two() -> None:
        wait_for_checkpoint(storage, 2)
        outage.write_text("down")  # the rain service goes down: the next batch fails in its Spark task
        rain.land(tmp_path, 2)

    landing = in_background(outage_after_two)
    instance = dg.DagsterInstance.ephemeral()
    failed = follow_job.execute_in_process(instance=instance, run_config=follow_config(idle_seconds=2.0),
                                           raise_on_error=False)
    landing.join()
    assert not failed.success and "the rain service is down" in str(failed.all_events)
    assert storage.completed_checkpoint_ids() == [1, 2]
    outage.unlink()  # the service is back

    tick = dg.build_sensor_context(instance=instance)
    recover = sensor(tick)
    assert isinstance(recover, dg.RunRequest) and recover.job_name == "rain_recover", recover
    assert recover.tags[FAILED_RUN_TAG] == failed.run_id
    healed = recover_job.execute_in_process(run_config=recover.run_config, tags=recover.tags, instance=instance)
    assert healed.success and storage.completed_checkpoint_ids()[-1] == 3, "recovery processed the failed batch"

    again = sensor(dg.build_sensor_context(instance=instance, cursor=tick.cursor))
    assert isinstance(again, dg.RunRequest) and again.job_name == "rain_follow", again
    assert again.run_key == f"follow-after-{failed.run_id}" and again.tags[FOLLOWS_AFTER_TAG] == failed.run_id
    rain.land(tmp_path, 3)
    followed = follow_job.execute_in_process(run_config=again.run_config, tags=again.tags, instance=instance)
    assert followed.success
    after = sensor(dg.build_sensor_context(instance=instance, cursor=tick.cursor))
    assert isinstance(after, dg.SkipReason), "the follow job is launched again once per failure"

    assert storage.completed_checkpoint_ids()[-1] == 4
    records = instance.fetch_materializations(parts.scope.checkpoint_key, limit=100, ascending=True).records
    reported = [(r.run_id, int(r.asset_materialization.metadata["checkpoint_id"].value)) for r in records
                if r.asset_materialization is not None]
    assert reported == [(failed.run_id, 1), (failed.run_id, 2), (healed.run_id, 3), (followed.run_id, 4)], (
        "every checkpoint reported once, by the run that committed it")
    rain.assert_state(state_of(storage), rain.landed(tmp_path))
    rain.assert_output(pd.read_parquet(tmp_path / "out"), rain.landed(tmp_path))
    assert sweep_orphans(storage, grace_seconds=0, dry_run=True).orphans == (), "the failed batch left no upload"


def test_the_input_sensor_launches_no_batch_run_while_a_follow_run_is_in_progress(tmp_path: Path):
    parts = rain_defs(tmp_path)
    instance = dg.DagsterInstance.ephemeral()
    rain.land(tmp_path, 0)
    sensor = parts.sensor("input_sensor")
    needed = {k: v for k, v in parts.resources.items() if k in sensor.required_resource_keys}
    following = in_flight(instance, tags={PIPELINE_TAG: "rain"}, job="rain_follow")
    with dg.build_sensor_context(instance=instance, resources=needed) as context:
        result = sensor(context)
    assert isinstance(result, dg.SkipReason)
    assert f"follow run {following.run_id} (STARTED) of pipeline 'rain'" in (result.skip_message or "")
    assert "no batch run is launched" in (result.skip_message or "")
