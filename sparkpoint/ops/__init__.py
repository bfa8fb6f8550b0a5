"""Maintenance jobs (recover, prune, verify, rebuild_registry, savepoint) and the schedule.

Each op is a few lines around `sparkpoint.pipeline.maintenance`. Every op sits in the `sparkpoint`
concurrency pool with the assets, so a recovery never overlaps a materialization.
"""


import os
from collections.abc import Iterator
from typing import Any

import dagster as dg

from sparkpoint.assets import CHECKPOINT_GROUP, CHECKPOINT_KEY, POOL, SSTABLE_GROUP, plain_metadata
from sparkpoint.checkpoint.savepoint import take_savepoint
from sparkpoint.pipeline import maintenance
from sparkpoint.resources import (
    CheckpointRegistryResource,
    CheckpointStorageResource,
    InputResource,
    SparkResource,
    StateBackendResource,
    pipeline_of,
)

FAILED_RUN_TAG = "sparkpoint/recovers"


class RecoverConfig(dg.Config):
    failed_run_id: str = ""  # the run being healed (for the record; recovery reads storage)


@dg.op(pool=POOL, out=dg.Out(dg.Nothing))
def recover_op(
    context: dg.OpExecutionContext, config: RecoverConfig, storage: CheckpointStorageResource,
    registry: CheckpointRegistryResource, spark: SparkResource, state_backend: StateBackendResource,
    source: InputResource,
) -> Iterator[Any]:
    """Abort the failed attempt, rebuild the registry, verify (fall back loudly), re-process."""
    pipeline = pipeline_of(storage, registry, state_backend, source, spark.session)
    failed = context.instance.get_run_record_by_id(config.failed_run_id) if config.failed_run_id else None
    report = maintenance.recover(
        pipeline, failed_before=failed.end_time if failed and failed.end_time else None,
        orphan_grace_seconds=registry.orphan_grace_seconds,
    )
    context.log.info(f"recovery of run {config.failed_run_id or '?'}: {report.summary()}")
    if report.fell_back_from:
        context.log.error(f"FELL BACK: checkpoints {list(report.fell_back_from)} failed verification")
    if report.batch is not None:
        facts = maintenance.checkpoint_facts(pipeline.storage, *report.batch)
        yield dg.AssetMaterialization(
            asset_key=CHECKPOINT_KEY, metadata=plain_metadata(facts),
            tags={"dagster/data_version": str(facts["checkpoint_id"])},
            description=f"re-processed by recovery of run {config.failed_run_id}",
        )


@dg.op(pool=POOL)
def prune_op(
    context: dg.OpExecutionContext, storage: CheckpointStorageResource, registry: CheckpointRegistryResource,
) -> dg.Output[None]:
    """Subsume beyond num_retained, forget stale attempts, sweep orphans past the grace period."""
    # The top-level `storage` resource: the run config of the job being pruned sets it (a
    # resource nested in `registry` keeps its defaults whatever the launch config says). Stale
    # attempts' sink staging is the next start's (`_settle_sink` drops staging at or below the
    # latest checkpoint).
    r = maintenance.prune(storage.open(), num_retained=registry.num_retained,
                          orphan_grace_seconds=registry.orphan_grace_seconds)
    return dg.Output(None, metadata={"subsumed": dg.MetadataValue.json(list(r.subsumed)),
                                     "files_deleted": r.files_deleted, "orphans_deleted": r.orphans,
                                     "orphan_bytes": r.orphan_bytes, "stale_attempts": r.stale_attempts})


@dg.op(pool=POOL)
def verify_op(context: dg.OpExecutionContext, storage: CheckpointStorageResource) -> dg.Output[None]:
    """Every retained checkpoint's files: present, size, CRC32. Fails when one does not verify."""
    problems = maintenance.verify_all(storage.open())
    bad = {cid: [str(p) for p in ps] for cid, ps in problems.items() if ps}
    if bad:
        first = min(bad)
        raise dg.Failure(f"checkpoints {sorted(bad)} do not verify; chk-{first}: {bad[first][0]}",
                         metadata={"problems": dg.MetadataValue.json(bad)})
    return dg.Output(None, metadata={"verified": dg.MetadataValue.json(sorted(problems))})


@dg.op(pool=POOL)
def rebuild_registry_op(context: dg.OpExecutionContext, storage: CheckpointStorageResource) -> dg.Output[None]:
    """Rebuild the shared-state registry from the retained `_metadata` and compare with a recount."""
    st = storage.open()
    built, counted = maintenance.registry_counts(st), maintenance.recount(st)
    if (built.files, built.references) != (counted.files, counted.references):
        raise dg.Failure(f"registry {built} differs from a recount of _metadata {counted}")
    return dg.Output(None, metadata={"retained": dg.MetadataValue.json(list(built.checkpoints)),
                                     "registry_files": built.files, "references": built.references,
                                     "deletion_blocked": dg.MetadataValue.json(list(built.blocked))})


@dg.op(pool=POOL)
def savepoint_op(context: dg.OpExecutionContext, storage: CheckpointStorageResource) -> dg.Output[None]:
    """A self-contained, verified copy of the latest checkpoint that retention never deletes."""
    result = take_savepoint(storage.open())
    return dg.Output(None, metadata={"savepoint_id": result.metadata.checkpoint_id,
                                     "state_size": result.metadata.stats.state_size,
                                     "from_checkpoint": result.source_checkpoint, "files": result.files,
                                     "path": f"{result.url}/_metadata"})


@dg.job(name="recover", tags={"sparkpoint/job": "recover"})
def recover_job() -> None:
    recover_op()


@dg.job(name="prune")
def prune_job() -> None:
    prune_op()


@dg.job(name="verify")
def verify_job() -> None:
    verify_op()


@dg.job(name="rebuild_registry")
def rebuild_registry_job() -> None:
    rebuild_registry_op()


@dg.job(name="savepoint")
def savepoint_job() -> None:
    savepoint_op()


checkpoint_job = dg.define_asset_job(
    "checkpoint_job", selection=dg.AssetSelection.groups(SSTABLE_GROUP, CHECKPOINT_GROUP),
    description="Materialize the SSTable assets and the checkpoint asset: one batch, one checkpoint",
)

checkpoint_schedule = dg.ScheduleDefinition(
    name="checkpoint_schedule", target=checkpoint_job,
    cron_schedule=os.environ.get("SPARKPOINT_CHECKPOINT_CRON", "*/10 * * * *"),
    default_status=dg.DefaultScheduleStatus.STOPPED,
)

JOBS = [recover_job, prune_job, verify_job, rebuild_registry_job, savepoint_job, checkpoint_job]
