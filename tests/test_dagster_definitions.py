"""The code location without Spark: recovery sensor decisions, resource errors, concurrency pool,
retention only when something is to prune."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest

from sparkpoint.definitions import defs
from sparkpoint.ops.instance import prepare_dagster_home
from sparkpoint.resources import CheckpointRegistryResource, CheckpointStorageResource, InputResource
from sparkpoint.resources.scope import FAILED_RUN_TAG
from sparkpoint.sensors import recovery_decision
from tests.support.dagster_setup import (
    ASSET_CHECKS,
    ASSETS,
    CHECKPOINT_KEY,
    JOBS,
    SCOPE,
    recover_job,
    recovery_sensor,
    resources,
    retention_sensor,
)

STORAGE, REGISTRY, SOURCE = (SCOPE.resource_key(r) for r in ("storage", "registry", "source"))


def failing_checkpoint_run(
    tmp_path: Path, instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch, **tags: str
) -> dg.ExecuteInProcessResult:
    """A run of the UI's kind (asset job) whose checkpoint step starts and fails while it works
    (storage answers with an I/O error)."""
    import sparkpoint.assets.steps

    def storage_fails(*args: object, **kwargs: object) -> None:
        raise OSError(5, "Input/output error")

    (tmp_path / "in").mkdir(exist_ok=True)
    monkeypatch.setattr(sparkpoint.assets.steps, "finish_step_or_overtaken", storage_fails)
    return dg.materialize([*ASSETS], selection=[CHECKPOINT_KEY], resources=resources(tmp_path), instance=instance,
                          tags=tags or None, raise_on_error=False)


def misconfigured_run(tmp_path: Path, instance: dg.DagsterInstance) -> dg.ExecuteInProcessResult:
    """A run that fails on its configuration before any upload: its input directory is missing."""
    res = resources(tmp_path)
    res[SOURCE] = InputResource(input_url=str(tmp_path / "missing"), output_url="")
    return dg.materialize([*ASSETS], selection=[CHECKPOINT_KEY], resources=res, instance=instance,
                          raise_on_error=False)


def evaluate(instance: dg.DagsterInstance, run: dg.ExecuteInProcessResult) -> dg.RunRequest | dg.SkipReason:
    """A tick of the recovery sensor that has not looked at the instance yet (it looks back an hour)."""
    assert not run.success
    return recovery_sensor(dg.build_sensor_context(instance=instance))


@pytest.mark.parametrize(
    "job, tags, steps, recover",
    [
        ("__ASSET_JOB", {}, {"sparkpoint_sstables"}, True),
        ("sparkpoint_checkpoint", {}, {"sparkpoint_complete"}, True),
        ("__ASSET_JOB", {"dagster/will_retry": "true"}, {"sparkpoint_sstables"}, False),
        ("sparkpoint_recover", {}, {"sparkpoint_recover_op"}, False),
        ("sparkpoint_verify", {}, {"sparkpoint_verify_op"}, False),
        ("__ASSET_JOB", {}, {"clicks_sstables", "clicks_complete"}, False),  # another pipeline's steps
    ],
)
def test_recovery_decision_table(job, tags, steps, recover):
    assert (recovery_decision(SCOPE, job, tags, steps) is None) == recover


def test_recovery_sensor_launches_once_per_failed_asset_job_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    instance = dg.DagsterInstance.ephemeral()
    failed = failing_checkpoint_run(tmp_path, instance, monkeypatch)
    assert not failed.success and failed.dagster_run.job_name == "__ephemeral_asset_job__"
    request = evaluate(instance, failed)
    assert isinstance(request, dg.RunRequest)
    assert request.run_key == failed.run_id and request.tags[FAILED_RUN_TAG] == failed.run_id
    # The recovery run launched (it fails here too: the same missing input) and is not healed in turn.
    res = resources(tmp_path)
    res[SOURCE] = InputResource(input_url=str(tmp_path / "missing"), output_url="")
    recovery = recover_job.execute_in_process(run_config=request.run_config, tags=request.tags, instance=instance,
                                              resources=res, raise_on_error=False)
    assert not recovery.success
    assert isinstance(evaluate(instance, failed), dg.SkipReason), "a second evaluation launches nothing"
    skip = evaluate(instance, recovery)
    assert isinstance(skip, dg.SkipReason) and "recover" in skip.skip_message


def test_recovery_sensor_launches_nothing_for_a_run_that_failed_on_its_configuration(tmp_path: Path):
    instance = dg.DagsterInstance.ephemeral()
    failed = misconfigured_run(tmp_path, instance)
    assert not failed.success
    skip = evaluate(instance, failed)
    assert isinstance(skip, dg.SkipReason) and "configuration" in (skip.skip_message or ""), skip


def test_recovery_sensor_skips_runs_dagster_will_retry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    instance = dg.DagsterInstance.ephemeral()
    failed = failing_checkpoint_run(tmp_path, instance, monkeypatch, **{"dagster/will_retry": "true"})
    skip = evaluate(instance, failed)
    assert isinstance(skip, dg.SkipReason) and "retry" in skip.skip_message


@pytest.mark.parametrize(
    "registry, message",
    [
        ({"num_retained": 0}, "num_retained must be at least 1"),
        ({"retention": "KEEP_SOMETIMES"}, "retention 'KEEP_SOMETIMES' is not one of"),
        ({"claim_mode": "claim-ish"}, "claim_mode 'claim-ish' is not one of"),
    ],
)
def test_bad_registry_config_fails_with_a_message_naming_the_field(tmp_path: Path, registry, message):
    res = resources(tmp_path)
    res[REGISTRY] = CheckpointRegistryResource(storage=res[STORAGE], **registry)
    result = dg.materialize([*ASSETS], selection=[CHECKPOINT_KEY], resources=res, raise_on_error=False)
    assert not result.success
    assert message in str(result.all_events)


def test_bad_storage_options_fail_clearly(tmp_path: Path):
    res = resources(tmp_path)
    res[STORAGE] = CheckpointStorageResource(checkpoints_url=f"file://{tmp_path}/c", storage_options="{not json")
    res[REGISTRY] = CheckpointRegistryResource(storage=res[STORAGE])
    result = dg.materialize([*ASSETS], selection=[CHECKPOINT_KEY], resources=res, raise_on_error=False)
    assert "storage_options must be a JSON object" in str(result.all_events)


def test_resource_fields_come_from_environment_variables(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("SP_TEST_URL", f"file://{tmp_path}/from-env")
    monkeypatch.setenv("SP_TEST_RETAIN", "0")
    storage = CheckpointStorageResource(checkpoints_url=dg.EnvVar("SP_TEST_URL"), job_id="envjob")
    res = resources(tmp_path)
    res[STORAGE] = storage
    res[REGISTRY] = CheckpointRegistryResource(storage=storage, num_retained=dg.EnvVar.int("SP_TEST_RETAIN"))
    result = dg.materialize([*ASSETS], selection=[CHECKPOINT_KEY], resources=res, raise_on_error=False)
    assert "num_retained must be at least 1, got 0" in str(result.all_events)


def test_every_step_of_a_pipeline_is_in_its_pool_limited_to_one_run(tmp_path: Path):
    assert {a.op.pool for a in ASSETS if isinstance(a, dg.AssetsDefinition) and a.is_materializable} == {SCOPE.pool}
    ops = [node for job in JOBS.all() if isinstance(job, dg.JobDefinition) for node in job.graph.node_defs]
    assert len(ops) == 7 and {op.pool for op in ops} == {SCOPE.pool} == {"sparkpoint"}
    home = prepare_dagster_home(tmp_path / "dagster")
    with dg.DagsterInstance.from_config(str(home)) as instance:
        pools = instance.get_concurrency_config().pool_config
        assert pools.default_pool_limit == 1
        assert pools.pool_granularity.value == "run"
        # A run an input sensor requests starts within a second, not Dagster's default five.
        assert instance.run_coordinator.dequeue_interval_seconds == 1  # type: ignore[union-attr]


def test_every_job_of_a_pipeline_runs_its_steps_in_the_runs_own_process():
    """No new Python process per step (each would import Dagster, Spark's client and the user's
    code again): seconds off every checkpoint's latency."""
    repo = defs.get_repository_def()
    names = {f"sparkpoint_{j}" for j in ("checkpoint", "follow", "recover", "prune", "verify", "rebuild_registry",
                                         "savepoint")}
    assert {repo.get_job(name).executor_def.name for name in names} == {dg.in_process_executor.name}


def test_definitions_hold_the_documented_names():
    repo = defs.get_repository_def()
    assert {f"sparkpoint_{j}" for j in ("checkpoint", "recover", "prune", "verify", "rebuild_registry", "savepoint")} \
        <= {j.name for j in repo.get_all_jobs()}
    assert {s.name for s in repo.sensor_defs} == {"sparkpoint_recovery_sensor", "sparkpoint_retention_sensor",
                                                  "sparkpoint_input_sensor"}
    assert repo.get_sensor_def("sparkpoint_input_sensor").default_status == dg.DefaultSensorStatus.STOPPED
    schedule = repo.schedule_defs[0]
    assert schedule.name == "sparkpoint_checkpoint_schedule"
    assert schedule.default_status == dg.DefaultScheduleStatus.STOPPED
    assert sorted(c.check_key.name for c in ASSET_CHECKS) == ["checkpoint_verifies", "registry_matches_metadata",
                                                             "skipped_files", "upgrade_preflight"]


def checkpoint_event(instance: dg.DagsterInstance, cid: int, due: list[str]) -> None:
    instance.report_runless_asset_event(dg.AssetMaterialization(
        CHECKPOINT_KEY, metadata={"checkpoint_id": cid, "prune_due": dg.MetadataValue.json(due)}))


def test_retention_sensor_prunes_only_when_something_is_due():
    instance = dg.DagsterInstance.ephemeral()
    context = dg.build_sensor_context(instance=instance)
    assert isinstance(retention_sensor(context), dg.SkipReason)
    checkpoint_event(instance, 1, [])
    first = retention_sensor(context)  # the orphan sweep was never run: due
    assert isinstance(first, list) and len(first) == 1 and isinstance(first[0], dg.RunRequest)
    assert first[0].tags["sparkpoint/prune-because"] == "orphan sweep due"
    context = dg.build_sensor_context(instance=instance, cursor=context.cursor)
    assert isinstance(retention_sensor(context), dg.SkipReason), "nothing new"
    checkpoint_event(instance, 2, [])
    skip = retention_sensor(context)
    assert isinstance(skip, dg.SkipReason) and "nothing to prune" in (skip.skip_message or ""), \
        "an ordinary checkpoint within the grace period: no prune run"
    context = dg.build_sensor_context(instance=instance, cursor=context.cursor)
    checkpoint_event(instance, 3, ["4 checkpoints retained, num_retained is 2"])
    due = retention_sensor(context)
    assert isinstance(due, list) and len(due) == 1
    assert "num_retained is 2" in due[0].tags["sparkpoint/prune-because"]


def test_retention_sensor_reads_the_cursor_an_earlier_version_left():
    instance = dg.DagsterInstance.ephemeral()
    checkpoint_event(instance, 1, [])
    first = instance.fetch_materializations(CHECKPOINT_KEY, limit=1).records[0].storage_id
    checkpoint_event(instance, 2, ["2 attempt(s) at or below chk-2 can never complete"])
    requests = retention_sensor(dg.build_sensor_context(instance=instance, cursor=str(first)))
    assert isinstance(requests, list) and len(requests) == 1  # only what came after the old cursor
