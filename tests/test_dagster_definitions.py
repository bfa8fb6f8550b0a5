"""The code location without Spark: recovery sensor decisions, resource errors, concurrency pool."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest

from sparkpoint.assets import ASSET_CHECKS, ASSETS, CHECKPOINT_KEY, POOL, checkpoint
from sparkpoint.definitions import defs
from sparkpoint.ops import FAILED_RUN_TAG, JOBS, recover_job
from sparkpoint.ops.instance import prepare_dagster_home
from sparkpoint.resources import CheckpointRegistryResource, CheckpointStorageResource, InputResource
from sparkpoint.sensors import recovery_decision, recovery_sensor, retention_sensor
from tests.dagster_setup import resources


def failing_checkpoint_run(
    tmp_path: Path, instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch, **tags: str
) -> dg.ExecuteInProcessResult:
    """A run of the UI's kind (asset job) whose checkpoint step starts and fails while it works
    (storage answers with an I/O error)."""
    import sparkpoint.assets

    def storage_fails(*args: object, **kwargs: object) -> None:
        raise OSError(5, "Input/output error")

    (tmp_path / "in").mkdir(exist_ok=True)
    monkeypatch.setattr(sparkpoint.assets, "finish_step", storage_fails)
    return dg.materialize([*ASSETS], selection=[CHECKPOINT_KEY], resources=resources(tmp_path), instance=instance,
                          tags=tags or None, raise_on_error=False)


def misconfigured_run(tmp_path: Path, instance: dg.DagsterInstance) -> dg.ExecuteInProcessResult:
    """A run that fails on its configuration before any upload: its input directory is missing."""
    res = resources(tmp_path)
    res["source"] = InputResource(input_url=str(tmp_path / "missing"), output_url="")
    return dg.materialize([*ASSETS], selection=[CHECKPOINT_KEY], resources=res, instance=instance,
                          raise_on_error=False)


def evaluate(instance: dg.DagsterInstance, run: dg.ExecuteInProcessResult) -> dg.RunRequest | dg.SkipReason:
    context = dg.build_run_status_sensor_context(
        sensor_name=recovery_sensor.name, dagster_event=run.get_run_failure_event(), dagster_instance=instance,
        dagster_run=run.dagster_run,
    ).for_run_failure()
    return recovery_sensor(context)


@pytest.mark.parametrize(
    "job, tags, steps, recover",
    [
        ("__ASSET_JOB", {}, {"sstables"}, True),
        ("checkpoint_job", {}, {"sparkpoint__checkpoint"}, True),
        ("__ASSET_JOB", {"dagster/will_retry": "true"}, {"sstables"}, False),
        ("recover", {}, {"recover_op"}, False),
        ("verify", {}, {"verify_op"}, False),
    ],
)
def test_recovery_decision_table(job, tags, steps, recover):
    assert (recovery_decision(job, tags, steps) is None) == recover


def test_recovery_sensor_launches_once_per_failed_asset_job_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    instance = dg.DagsterInstance.ephemeral()
    failed = failing_checkpoint_run(tmp_path, instance, monkeypatch)
    assert not failed.success and failed.dagster_run.job_name == "__ephemeral_asset_job__"
    request = evaluate(instance, failed)
    assert isinstance(request, dg.RunRequest)
    assert request.run_key == failed.run_id and request.tags[FAILED_RUN_TAG] == failed.run_id
    # The recovery run launched (it fails here too: the same missing input) and is not healed in turn.
    res = resources(tmp_path)
    res["source"] = InputResource(input_url=str(tmp_path / "missing"), output_url="")
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
    res["registry"] = CheckpointRegistryResource(storage=res["storage"], **registry)
    result = dg.materialize([*ASSETS], selection=[CHECKPOINT_KEY], resources=res, raise_on_error=False)
    assert not result.success
    assert message in str(result.all_events)


def test_bad_storage_options_fail_clearly(tmp_path: Path):
    res = resources(tmp_path)
    res["storage"] = CheckpointStorageResource(checkpoints_url=f"file://{tmp_path}/c", storage_options="{not json")
    res["registry"] = CheckpointRegistryResource(storage=res["storage"])
    result = dg.materialize([*ASSETS], selection=[CHECKPOINT_KEY], resources=res, raise_on_error=False)
    assert "storage_options must be a JSON object" in str(result.all_events)


def test_resource_fields_come_from_environment_variables(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("SP_TEST_URL", f"file://{tmp_path}/from-env")
    monkeypatch.setenv("SP_TEST_RETAIN", "0")
    storage = CheckpointStorageResource(checkpoints_url=dg.EnvVar("SP_TEST_URL"), job_id="envjob")
    res = resources(tmp_path)
    res["storage"] = storage
    res["registry"] = CheckpointRegistryResource(storage=storage, num_retained=dg.EnvVar.int("SP_TEST_RETAIN"))
    result = dg.materialize([*ASSETS], selection=[CHECKPOINT_KEY], resources=res, raise_on_error=False)
    assert "num_retained must be at least 1, got 0" in str(result.all_events)


def test_every_sparkpoint_step_is_in_one_pool_limited_to_one_run(tmp_path: Path):
    assert {a.op.pool for a in ASSETS} == {POOL}
    ops = [node for job in JOBS if isinstance(job, dg.JobDefinition) for node in job.graph.node_defs]
    assert len(ops) == 5 and {op.pool for op in ops} == {POOL}
    home = prepare_dagster_home(tmp_path / "dagster")
    with dg.DagsterInstance.from_config(str(home)) as instance:
        pools = instance.get_concurrency_config().pool_config
        assert pools.default_pool_limit == 1
        assert pools.pool_granularity.value == "run"


def test_definitions_hold_the_documented_names():
    repo = defs.get_repository_def()
    assert {"recover", "prune", "verify", "rebuild_registry", "savepoint"} <= {j.name for j in repo.get_all_jobs()}
    assert {s.name for s in repo.sensor_defs} == {recovery_sensor.name, retention_sensor.name}
    schedule = repo.schedule_defs[0]
    assert schedule.default_status == dg.DefaultScheduleStatus.STOPPED
    assert checkpoint.op.name == "sparkpoint__checkpoint" and len(ASSET_CHECKS) == 2


def test_retention_sensor_prunes_once_after_each_new_checkpoint():
    instance = dg.DagsterInstance.ephemeral()
    context = dg.build_sensor_context(instance=instance)
    assert isinstance(retention_sensor(context), dg.SkipReason)
    instance.report_runless_asset_event(dg.AssetMaterialization(CHECKPOINT_KEY, metadata={"checkpoint_id": 1}))
    first = retention_sensor(context)
    assert isinstance(first, list) and len(first) == 1 and isinstance(first[0], dg.RunRequest)
    assert isinstance(retention_sensor(dg.build_sensor_context(instance=instance, cursor=context.cursor)),
                      dg.SkipReason)
