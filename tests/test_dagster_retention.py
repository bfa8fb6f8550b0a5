"""Retention with real checkpoints: a prune only when the checkpoint said something is due or the
orphan sweep's grace period passed, and that prune doing what was due; the checkpoint run prunes
after its commit itself (tagged `sparkpoint/pruned`), and the retention sensor launches a prune
run only for checkpoints whose run did not (another configuration's, never pruned)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from sparkpoint.pipeline.attempt import list_attempts
from sparkpoint.resources.scope import INJECT_TAG, PRUNED_TAG
from tests.support.dagster_setup import (
    CHECKPOINT_KEY,
    JOBS,
    SCOPE,
    make_input,
    materialize,
    prune_job,
    resources,
    retention_sensor,
    storage_of,
)

pytestmark = pytest.mark.spark

BECAUSE = "sparkpoint/prune-because"


def checkpoint_meta(result: dg.ExecuteInProcessResult) -> dict[str, Any]:
    (m,) = [e.materialization for e in result.get_asset_materialization_events()
            if e.materialization.asset_key == CHECKPOINT_KEY]
    return {k: v.value for k, v in m.metadata.items()}


def look(instance: dg.DagsterInstance, cursor: str | None) -> tuple[list[dg.RunRequest] | dg.SkipReason, str | None]:
    context = dg.build_sensor_context(instance=instance, cursor=cursor)
    return retention_sensor(context), context.cursor


def prune(tmp_path: Path, instance: dg.DagsterInstance, request: dg.RunRequest) -> dict[str, Any]:
    result = prune_job.execute_in_process(run_config=request.run_config, tags=request.tags, instance=instance,
                                          resources=resources(tmp_path))
    assert result.success
    (event,) = [e for e in result.all_events if e.event_type_value == "STEP_OUTPUT"]
    return {k: v.value for k, v in event.event_specific_data.metadata.items()}  # type: ignore[union-attr]


def pruned_in_run(instance: dg.DagsterInstance, result: dg.ExecuteInProcessResult) -> bool:
    """Whether the checkpoint run pruned after its commit (the tag it adds once it has)."""
    run = instance.get_run_by_id(result.run_id)
    return run is not None and run.tags.get(PRUNED_TAG) == SCOPE.pipeline.name


def test_no_prune_after_ordinary_checkpoints_while_the_last_prune_is_recent(spark, tmp_path: Path):
    make_input(tmp_path, batches=4)
    instance = dg.DagsterInstance.ephemeral()
    storage = storage_of(tmp_path)
    storage.write_bytes("shared/user_totals/0/orphan.sst", b"left by a killed task")
    first = materialize(tmp_path, instance, orphan_grace_seconds=0)
    assert checkpoint_meta(first)["prune_due"] == []
    assert pruned_in_run(instance, first), "the orphan sweep never ran for this job: the checkpoint run swept"
    assert not storage.exists("shared/user_totals/0/orphan.sst"), "its sweep took the orphan"
    skip, cursor = look(instance, None)
    assert isinstance(skip, dg.SkipReason) and "nothing to prune" in (skip.skip_message or ""), \
        "the checkpoint's own run pruned: no prune run"

    second = materialize(tmp_path, instance)  # chk-2, an ordinary one
    got = checkpoint_meta(second)
    assert got["prune_due"] == [] and got["retained"] == [2, 1]
    assert not pruned_in_run(instance, second), "the last prune is recent"
    skip, cursor = look(instance, cursor)
    assert isinstance(skip, dg.SkipReason) and "nothing to prune" in (skip.skip_message or "")

    # A savepoint kept in the job's directory is never subsumed: it makes nothing due.
    assert JOBS.savepoint.execute_in_process(instance=instance, resources=resources(tmp_path)).success
    got = checkpoint_meta(materialize(tmp_path, instance))  # chk-4 (chk-3 is the savepoint)
    assert got["retained"] == [4, 3, 2] and got["prune_due"] == [], got["prune_due"]
    skip, cursor = look(instance, cursor)
    assert isinstance(skip, dg.SkipReason) and "nothing to prune" in (skip.skip_message or "")
    assert instance.get_run_records(dg.RunsFilter(job_name=prune_job.name)) == [], "no prune run at all"
    assert len(instance.get_run_records(dg.RunsFilter(tags={PRUNED_TAG: SCOPE.pipeline.name}))) == 1, \
        "the first checkpoint run's prune only"


def test_a_prune_runs_when_a_checkpoint_reports_something_due_and_settles_it(spark, tmp_path: Path):
    make_input(tmp_path, batches=4)
    instance = dg.DagsterInstance.ephemeral()
    storage = storage_of(tmp_path)
    assert pruned_in_run(instance, materialize(tmp_path, instance))  # chk-1, the first sweep: now recent
    skip, cursor = look(instance, None)
    assert isinstance(skip, dg.SkipReason), skip

    # A run fails after its upload and is not recovered; the next run completes past its attempt,
    # says the prune it makes due and settles it after its commit.
    failed = materialize(tmp_path, instance, tags={INJECT_TAG: "after-upload"}, raise_on_error=False)
    assert not failed.success
    (stale,) = list_attempts(storage).attempts
    done = materialize(tmp_path, instance)
    got = checkpoint_meta(done)
    assert got["checkpoint_id"] == stale.checkpoint_id == 2
    assert got["prune_due"] == ["1 attempt(s) at or below chk-2 can never complete"]
    assert pruned_in_run(instance, done)
    assert list_attempts(storage).attempts == (), "the checkpoint run's prune settled the attempt that was due"
    assert storage.completed_checkpoint_ids() == [1, 2]
    skip, cursor = look(instance, cursor)
    assert isinstance(skip, dg.SkipReason), "settled in the checkpoint run: no prune run"

    # The sensor's own prune of what was due, for a checkpoint whose run did not prune (a run
    # that reports a materialization without the checkpoint job's step: here, the UI's event).
    instance.report_runless_asset_event(dg.AssetMaterialization(
        CHECKPOINT_KEY, metadata={"checkpoint_id": 2, "prune_due": dg.MetadataValue.json(["due elsewhere"])}))
    due, cursor = look(instance, cursor)
    assert isinstance(due, list) and len(due) == 1, due
    assert due[0].tags[BECAUSE] == "due elsewhere"
    report = prune(tmp_path, instance, due[0])
    assert report["stale_attempts"] == 0 and report["subsumed"] == []

    # num_retained lowered through the run config: the checkpoint step applies it itself, so the
    # checkpoint reports nothing due and only the new configuration's first orphan sweep runs.
    lowered = {"resources": {SCOPE.resource_key("registry"): {"config": {"num_retained": 1}}}}
    got = checkpoint_meta(materialize(tmp_path, instance, run_config=lowered))
    assert got["retained"] == [3] and got["prune_due"] == []
    assert storage.completed_checkpoint_ids() == [3]
    sweep, cursor = look(instance, cursor)
    assert isinstance(sweep, list) and len(sweep) == 1
    assert sweep[0].tags[BECAUSE] == "orphan sweep due", "a configuration never pruned before"
    assert sweep[0].run_config["resources"][SCOPE.resource_key("registry")] == {"config": {"num_retained": 1}}
    assert prune(tmp_path, instance, sweep[0])["subsumed"] == []
    got = checkpoint_meta(materialize(tmp_path, instance, run_config=lowered))
    assert got["retained"] == [4] and got["prune_due"] == []
    skip, cursor = look(instance, cursor)
    assert isinstance(skip, dg.SkipReason), "nothing due, the last prune of this configuration is recent"
