"""The sample pipeline's Dagster definitions (`sparkpoint.definitions.sample`, built by the factory)
with resources pointed at a test's own directories."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dagster as dg

from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.definitions import sample
from sparkpoint.resources import (
    CheckpointRegistryResource,
    CheckpointStorageResource,
    InputResource,
    SparkResource,
    StateBackendResource,
)
from sparkpoint.spark.generate import generate

JOB = "job"
SCOPE = sample.scope
ASSETS, ASSET_CHECKS, JOBS = sample.assets, sample.checks, sample.jobs
CHECKPOINT_KEY, SSTABLE_KEYS, OUTPUT_KEY = SCOPE.checkpoint_key, SCOPE.sstable_keys, SCOPE.output_key
recover_job, prune_job = JOBS.recover, JOBS.prune
recovery_sensor, retention_sensor = sample.sensor("recovery_sensor"), sample.sensor("retention_sensor")


def make_input(tmp_path: Path, batches: int, seed: int = 7) -> str:
    generate(str(tmp_path / "in"), batches=batches, events_per_batch=1500, users=300, items=40, seed=seed)
    return str(tmp_path / "in")


def resources(tmp_path: Path, **registry: Any) -> dict[str, Any]:
    """By the sample's resource keys (`sparkpoint_storage`, ...)."""
    return SCOPE.keyed(by_role(tmp_path, **registry))


def by_role(tmp_path: Path, **registry: Any) -> dict[str, Any]:
    storage = CheckpointStorageResource(checkpoints_url=f"file://{tmp_path}/ckpt", job_id=JOB)
    return {
        "storage": storage,
        "registry": CheckpointRegistryResource(storage=storage, **registry),
        # The session fixture's JVM is shared by the whole test session: do not stop it.
        "spark": SparkResource(stop_on_teardown=False),
        "state_backend": StateBackendResource(local_dir=str(tmp_path / "local"), parallelism=2),
        "source": InputResource(input_url=str(tmp_path / "in"), output_url=f"file://{tmp_path}/out"),
    }


def storage_of(tmp_path: Path) -> CheckpointStorage:
    return CheckpointStorage(f"file://{tmp_path}/ckpt", JOB)


def materialize(tmp_path: Path, instance: dg.DagsterInstance, *, tags: dict[str, str] | None = None,
                raise_on_error: bool = True, selection: Any = None, run_config: dict[str, Any] | None = None,
                **registry: Any) -> dg.ExecuteInProcessResult:
    return dg.materialize(
        [*ASSETS, *ASSET_CHECKS], resources=resources(tmp_path, **registry), instance=instance, tags=tags,
        raise_on_error=raise_on_error, selection=selection, run_config=run_config,
    )


def init_resource(resource: dg.ConfigurableResource) -> None:  # type: ignore[type-arg]
    """Set `resource` up as a run would, which is where its settings are checked."""
    resource.setup_for_execution(dg.build_init_resource_context())
