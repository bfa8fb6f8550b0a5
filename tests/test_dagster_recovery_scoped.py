"""Recovery and retention act on the job the failed (or materializing) run was configured for,
not on the code location's defaults: two job ids in flight in one Dagster instance."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest

from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.pipeline.attempt import list_attempts
from sparkpoint.resources.scope import INJECT_TAG
from tests.support.dagster_setup import (
    JOB,
    SCOPE,
    make_input,
    materialize,
    prune_job,
    recover_job,
    recovery_sensor,
    resources,
    retention_sensor,
    storage_of,
)

pytestmark = pytest.mark.spark

OTHER = "other-job"
STORAGE, REGISTRY, SOURCE = (SCOPE.resource_key(r) for r in ("storage", "registry", "source"))


def other_config(tmp_path: Path, **registry: object) -> dict[str, dict[str, object]]:
    """What a launchpad run for another job id carries (a resource's config given at launch
    starts from the resource's class defaults, so the location is given too)."""
    resources: dict[str, object] = {
        STORAGE: {"config": {"checkpoints_url": f"file://{tmp_path}/ckpt", "job_id": OTHER}}
    }
    if registry:
        resources[REGISTRY] = {"config": registry}
    return {"resources": resources}


def failure_context(instance: dg.DagsterInstance, failed: dg.ExecuteInProcessResult) -> dg.SensorEvaluationContext:
    """A tick of the recovery sensor after `failed` (a first tick looks back an hour)."""
    assert not failed.success
    return dg.build_sensor_context(instance=instance)


def test_recovery_heals_the_failed_runs_own_job_and_leaves_the_default_job_alone(spark, tmp_path: Path):
    make_input(tmp_path, batches=4)
    instance = dg.DagsterInstance.ephemeral()
    materialize(tmp_path, instance)  # the default job: chk-1
    default, other = storage_of(tmp_path), CheckpointStorage(f"file://{tmp_path}/ckpt", OTHER)
    failed = materialize(tmp_path, instance, tags={INJECT_TAG: "after-upload"}, raise_on_error=False,
                         run_config=other_config(tmp_path))
    assert not failed.success
    assert [a.checkpoint_id for a in list_attempts(other).attempts] == [1], "the other job's attempt is pending"

    request = recovery_sensor(failure_context(instance, failed))
    assert isinstance(request, dg.RunRequest), request
    assert request.run_config["resources"] == other_config(tmp_path)["resources"]
    healed = recover_job.execute_in_process(
        run_config=request.run_config, tags=request.tags, instance=instance, resources=resources(tmp_path)
    )
    assert healed.success
    assert other.completed_checkpoint_ids() == [1], "the failed job got its checkpoint"
    assert list_attempts(other).attempts == (), "and no attempt of it is left pending"
    assert default.completed_checkpoint_ids() == [1], "the default job was not touched"

    # Retention prunes the job each materialization wrote to, with that run's settings.
    orphans = {name: CheckpointStorage(f"file://{tmp_path}/ckpt", name) for name in (JOB, OTHER)}
    for st in orphans.values():
        st.write_bytes("shared/user_totals/0/orphan.sst", b"left by a killed task")
    materialize(tmp_path, instance, run_config=other_config(tmp_path, orphan_grace_seconds=0))
    requests = retention_sensor(dg.build_sensor_context(instance=instance))
    assert isinstance(requests, list)
    configs = [r.run_config.get("resources", {}) for r in requests]
    assert any(c.get(STORAGE) == other_config(tmp_path)["resources"][STORAGE] for c in configs), configs
    for r in requests:
        assert prune_job.execute_in_process(
            run_config=r.run_config, instance=instance, resources=resources(tmp_path)
        ).success
    assert not orphans[OTHER].exists("shared/user_totals/0/orphan.sst"), "the other job was pruned"
    assert orphans[JOB].exists("shared/user_totals/0/orphan.sst"), "the default job was not (grace 3600 s)"
    assert sorted(other.completed_checkpoint_ids()) == [1, 2]


def test_a_run_that_failed_on_its_configuration_gets_no_recovery_run(spark, tmp_path: Path):
    make_input(tmp_path, batches=1)
    instance = dg.DagsterInstance.ephemeral()
    broken = {"resources": {SOURCE: {"config": {"input_url": str(tmp_path / "no-such-input")}}}}
    failed = materialize(tmp_path, instance, raise_on_error=False, run_config=broken)
    assert not failed.success
    decision = recovery_sensor(failure_context(instance, failed))
    assert isinstance(decision, dg.SkipReason), decision
    assert "configuration" in (decision.skip_message or "")
    assert storage_of(tmp_path).completed_checkpoint_ids() == []


def test_recovery_heals_a_job_started_from_a_savepoint(spark, tmp_path: Path):
    """The first batch of a job started from a savepoint fails after its upload; recovery verifies
    the savepoint where it lives (not in the new job's directory) and heals the new job."""
    import pandas as pd

    from sparkpoint.checkpoint.savepoint import take_savepoint
    from sparkpoint.state.extract import operator_states
    from sparkpoint.state.sample import user_totals
    from tests.support import oracle

    input_dir = make_input(tmp_path, batches=3)
    instance = dg.DagsterInstance.ephemeral()
    materialize(tmp_path, instance)  # the old job: chk-1
    saved = take_savepoint(storage_of(tmp_path), target=f"file://{tmp_path}/savepoints/sp")
    started = {"resources": {
        STORAGE: {"config": {"checkpoints_url": f"file://{tmp_path}/ckpt", "job_id": "from-sp"}},
        REGISTRY: {"config": {"from_checkpoint": f"{saved.url}", "claim_mode": "NO_CLAIM"}},
    }}
    failed = materialize(tmp_path, instance, tags={INJECT_TAG: "after-upload"}, raise_on_error=False,
                         run_config=started)
    assert not failed.success
    request = recovery_sensor(failure_context(instance, failed))
    assert isinstance(request, dg.RunRequest), request
    healed = recover_job.execute_in_process(
        run_config=request.run_config, tags=request.tags, instance=instance, resources=resources(tmp_path)
    )
    assert healed.success
    new_job = CheckpointStorage(f"file://{tmp_path}/ckpt", "from-sp")
    assert new_job.completed_checkpoint_ids() == [1]
    materialize(tmp_path, instance, run_config=started)  # and it goes on
    latest = CompletedCheckpointStore(new_job).latest()
    assert latest is not None and len(latest.source_offsets["source"]["consumed"]) == 3
    events = pd.concat(oracle.read_batches(input_dir), ignore_index=True)
    with operator_states(new_job, latest, user_totals.name) as backends:
        oracle.assert_totals_equal(pd.concat([user_totals.export(b) for b in backends]), oracle.user_totals(events))
