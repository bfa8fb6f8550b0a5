"""One pipeline's jobs: checkpoint (its assets), follow, recover, prune, verify, rebuild_registry,
savepoint, skip_file, each named `<pipeline>_<job>`, and an optional schedule.

The follow job is one step that runs `sparkpoint.pipeline.follow` (what `sparkpoint run --follow`
runs) for as long as the run lasts, and reports every checkpoint it commits as the checkpoint job
would: a materialization of each SSTable asset, of the checkpoint asset (and of the output), with
the same metadata. Its attempts are persisted under the run's id, so the recovery of a failed
follow run fences a zombie of it before its sweep.

Each op is a few lines around `sparkpoint.pipeline.maintenance`. Every op sits in the pipeline's
concurrency pool with its assets, so a recovery never overlaps a materialization of the same
pipeline where the instance limits the pool. The schedule asks the instance itself: a tick while
one of the pipeline's runs is queued or in progress is skipped, saying which run it waits for.

Every job runs its steps in the run's own process (`in_process_executor`). Its steps follow one
another (the Spark half, then the commit, then the checks), so the multiprocess executor's only
effect was a new Python process per step, each importing Dagster, Spark's client and the user's
code again: seconds of every checkpoint's latency from a file landing to its commit. The two
halves still cross through the persisted pending attempt, never through memory, so a re-execution
of the checkpoint step alone, in another run, completes it the same way.
"""


from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import dagster as dg

from sparkpoint.assets import (
    committed_checkpoint_metadata,
    committed_output_metadata,
    has_output,
    registry_matches,
    run_lineage,
    skipped_files,
    verifies,
)
from sparkpoint.assets.metadata import (
    DATA_VERSION_TAG,
    checkpoint_metadata,
    location,
    plain,
    size_entries,
    sstable_metadata,
)
from sparkpoint.checkpoint.catalog import readable_size
from sparkpoint.checkpoint.savepoint import take_savepoint
from sparkpoint.pipeline import maintenance
from sparkpoint.pipeline.attempt import snapshot_summary
from sparkpoint.pipeline.driver import Committed
from sparkpoint.pipeline.follow import POLL_SECONDS, FollowOptions, check_follow_options, follow
from sparkpoint.pipeline.runtime import PipelineError
from sparkpoint.pipeline.skipping import skip_file
from sparkpoint.resources.scope import (
    FAILED_RUN_TAG,
    FOLLOW_JOB,
    PIPELINE_TAG,
    RECOVERED_BY_TAG,
    TICK_TAG,
    PipelineScope,
)

__all__ = ["FAILED_RUN_TAG", "RECOVERY_RUN", "FollowConfig", "PipelineJobs", "RecoverConfig", "SkipFileConfig",
           "build_jobs", "link_to_recovery"]
RECOVERY_RUN = "recovery_run"  # the metadata entry of the failed run's event that links its recovery


class FollowConfig(dg.Config):
    """How the `<name>_follow` job follows the input (`sparkpoint run --follow`'s flags)."""

    checkpoint_interval: float = 0.0  # seconds between checkpoint starts at most; 0: a checkpoint per landed file
    poll_seconds: float = POLL_SECONDS  # how often an idle loop looks for new files
    max_batches: int | None = None  # stop after this many checkpoints; None: never
    idle_seconds: float | None = None  # stop once no file has been pending this long; None: never


class RecoverConfig(dg.Config):
    failed_run_id: str = ""  # the run being healed (for the record; recovery reads storage)


class SkipFileConfig(dg.Config):
    file: str  # the input file's name, as the failed run's error names it (e.g. batch-0007.parquet)
    reason: str  # why it is skipped: one line, kept in the checkpoint's `_metadata`


class SavepointConfig(dg.Config):
    # A savepoint or checkpoint URL (<checkpoints-dir>/<job-id>/chk-<N>) to diff the new savepoint
    # against, per operator: keys added, removed, changed (`sparkpoint diff`).
    diff_against: str = ""


@dataclass(frozen=True)
class PipelineJobs:
    checkpoint: Any  # an asset job (resolved when the definitions load)
    recover: dg.JobDefinition
    prune: dg.JobDefinition
    verify: dg.JobDefinition
    rebuild_registry: dg.JobDefinition
    savepoint: dg.JobDefinition
    skip_file: dg.JobDefinition
    follow: dg.JobDefinition
    schedule: dg.ScheduleDefinition | None

    def all(self) -> list[Any]:
        return [self.checkpoint, self.follow, self.recover, self.prune, self.verify, self.rebuild_registry,
                self.savepoint, self.skip_file]


def link_to_recovery(instance: dg.DagsterInstance, failed: dg.DagsterRun, recovery_run_id: str) -> None:
    """The failed run's way to its recovery: the tag `sparkpoint/recovered-by` (runs are filtered
    by it) and, since the UI renders no tag as a link, an event in the failed run's own log whose
    `recovery_run` opens the recovery run in one click."""
    from dagster._core.events import EngineEventData  # Dagster exports no public way to write this event

    instance.add_run_tags(failed.run_id, {RECOVERED_BY_TAG: recovery_run_id})
    instance.report_engine_event(
        f"sparkpoint: run {recovery_run_id} recovers this run", dagster_run=failed,
        engine_event_data=EngineEventData(metadata={RECOVERY_RUN: dg.MetadataValue.dagster_run(recovery_run_id)}),
    )


def build_jobs(scope: PipelineScope, *, schedule: str | None = None,
               schedule_status: dg.DefaultScheduleStatus = dg.DefaultScheduleStatus.RUNNING,
               tick: bool = False) -> PipelineJobs:
    """`schedule`: a cron string the checkpoint job runs on; with `tick`, a scheduled run that finds
    no unconsumed batch makes a checkpoint of no input (processing-time timers fire, TTL expires)."""
    pipeline, pool = scope.pipeline, scope.pool
    tags = {PIPELINE_TAG: pipeline.name}

    @dg.op(name=scope.name("recover_op"), pool=pool, out=dg.Out(dg.Nothing),
           required_resource_keys=scope.resource_keys("storage", "registry", "spark", "state_backend", "source"))
    def recover_op(context: dg.OpExecutionContext, config: RecoverConfig) -> Iterator[Any]:
        """Abort the failed attempt, rebuild the registry, verify (fall back loudly), re-process;
        then report the checkpoint it made on the pipeline's assets and run the checkpoint's checks."""
        resources = scope.resources(context)
        driver = resources.driver(pipeline)
        driver.spark = scope.spark(context).session_for(driver)
        failed_id = config.failed_run_id
        failed = context.instance.get_run_record_by_id(failed_id) if failed_id else None
        if failed is not None:  # the link back: the failed run names the run that heals it
            link_to_recovery(context.instance, failed.dagster_run, context.run_id)
        # The failed run's attempts (its own id and those of the runs it re-executed) are fenced
        # before the sweep that takes what it uploaded: a zombie of it can never commit then.
        report = maintenance.recover(
            driver, failed_before=failed.end_time if failed and failed.end_time else None,
            failed_attempts=tuple(run_lineage(failed.dagster_run)) if failed else (),
            orphan_grace_seconds=resources.registry.orphan_grace_seconds, attempt_id=context.run_id,
        )
        summary = report.summary("run")
        context.log.info(f"recovery of run {failed_id or '?'}: {summary}")
        if report.overtaken is not None:
            context.log.warning(f"the re-processed checkpoint was {report.overtaken.line('run')}")
        if report.fell_back_from:
            context.log.error(f"FELL BACK: checkpoints {list(report.fell_back_from)} failed verification")
        if report.batch is not None:
            batch, meta = report.batch
            why = f"re-processed by the recovery of run {failed_id}" if failed_id else "re-processed by recovery"
            for name, key in scope.sstable_keys.items():  # asset keys by display name, state by uid
                handles = meta.operators[pipeline.operator(name).uid].subtasks
                context.log_event(dg.AssetMaterialization(
                    asset_key=key, description=why,
                    metadata=sstable_metadata(snapshot_summary(handles, meta.checkpoint_id))))
            context.log_event(dg.AssetMaterialization(
                asset_key=scope.checkpoint_key, description=why,
                metadata=checkpoint_metadata(driver.storage, batch, meta, recovered_run=failed_id or None),
                tags={DATA_VERSION_TAG: str(meta.checkpoint_id)},
            ))
            if has_output(scope) and driver.sink is not None:  # the rows recovery committed: the output heals too
                context.log_event(dg.AssetMaterialization(
                    asset_key=scope.output_key, description=why,
                    metadata=committed_output_metadata(driver, meta), tags={DATA_VERSION_TAG: str(meta.checkpoint_id)},
                ))
        storage = driver.storage
        for result in (verifies(scope, storage), registry_matches(scope, storage)):
            context.log_event(dg.AssetCheckEvaluation(  # type: ignore[arg-type]  # an op may report a check
                asset_key=scope.checkpoint_key, check_name=result.check_name or "", passed=result.passed,
                metadata=result.metadata, description=result.description,
            ))
        facts: dict[str, Any] = {"summary": summary}
        if report.failed_batch_committed is not None:  # another writer committed the failed batch first
            facts["failed_batch_committed_by"] = report.failed_batch_committed.checkpoint_id
        if report.overtaken is not None:
            facts["overtaken_by"] = report.overtaken.by_checkpoint
        yield dg.Output(None, metadata=facts)

    @dg.op(name=scope.name("prune_op"), pool=pool, required_resource_keys=scope.resource_keys("storage", "registry"))
    def prune_op(context: dg.OpExecutionContext) -> dg.Output[None]:
        """Subsume beyond num_retained, forget stale attempts, sweep orphans past the grace period."""
        # The top-level storage resource: the run config of the job being pruned sets it (a
        # resource nested in the registry keeps its defaults whatever the launch config says).
        registry = scope.registry(context)
        r = maintenance.prune(scope.storage(context).open(), num_retained=registry.num_retained,
                              orphan_grace_seconds=registry.orphan_grace_seconds)
        return dg.Output(None, metadata={"subsumed": dg.MetadataValue.json(list(r.subsumed)),
                                         "files_deleted": r.files_deleted, "orphans_deleted": r.orphans,
                                         "orphan_bytes": r.orphan_bytes, "orphan_size": readable_size(r.orphan_bytes),
                                         "stale_attempts": r.stale_attempts})

    @dg.op(name=scope.name("verify_op"), pool=pool, required_resource_keys=scope.resource_keys("storage"))
    def verify_op(context: dg.OpExecutionContext) -> dg.Output[None]:
        """Every retained checkpoint's files: present, size, CRC32. Fails when one does not verify."""
        problems = maintenance.verify_all(scope.storage(context).open())
        bad = {cid: [str(p) for p in ps] for cid, ps in problems.items() if ps}
        if bad:
            first = min(bad)
            raise dg.Failure(f"checkpoints {sorted(bad)} do not verify; chk-{first}: {bad[first][0]}",
                             metadata={"problems": dg.MetadataValue.json({str(k): v for k, v in bad.items()})})
        return dg.Output(None, metadata={"verified": dg.MetadataValue.json(sorted(problems))})

    @dg.op(name=scope.name("rebuild_registry_op"), pool=pool, required_resource_keys=scope.resource_keys("storage"))
    def rebuild_registry_op(context: dg.OpExecutionContext) -> dg.Output[None]:
        """Rebuild the shared-state registry from the retained `_metadata` and compare with a recount."""
        st = scope.storage(context).open()
        built, counted = maintenance.registry_counts(st), maintenance.recount(st)
        if (built.files, built.references) != (counted.files, counted.references):
            raise dg.Failure(f"registry {built} differs from a recount of _metadata {counted}")
        return dg.Output(None, metadata={"retained": dg.MetadataValue.json(list(built.checkpoints)),
                                         "registry_files": built.files, "references": built.references,
                                         "deletion_blocked": dg.MetadataValue.json(list(built.blocked))})

    @dg.op(name=scope.name("savepoint_op"), pool=pool, required_resource_keys=scope.resource_keys("storage"))
    def savepoint_op(context: dg.OpExecutionContext, config: SavepointConfig) -> dg.Output[None]:
        """A self-contained, verified copy of the latest checkpoint that retention never deletes;
        with `diff_against`, what changed per operator since that savepoint or checkpoint."""
        storage = scope.storage(context).open()
        result = take_savepoint(storage)
        facts: dict[str, Any] = {
            "savepoint_id": result.metadata.checkpoint_id,
            **size_entries("state_size", result.metadata.stats.state_size),
            "from_checkpoint": result.source_checkpoint, "files": result.files,
            "path": location(f"{result.url}/_metadata"),
        }
        if config.diff_against:
            from sparkpoint.state.diff import diff_snapshots, locate

            before = locate(config.diff_against, storage, storage.storage_options)
            after = locate(result.url, None, storage.storage_options)
            changes = {op.name: diff_snapshots(before, after, op).counts() for op in pipeline.operators
                       if op.uid in before.meta.operators}
            facts["diff_against"] = location(config.diff_against)
            for kind, column in (("keys_added", "added"), ("keys_removed", "removed"), ("keys_changed", "changed")):
                facts[kind] = {op: c[column] for op, c in changes.items()}
        return dg.Output(None, metadata=plain(facts))

    @dg.op(name=scope.name("skip_file_op"), pool=pool, out=dg.Out(dg.Nothing),
           required_resource_keys=scope.resource_keys("storage", "registry", "state_backend", "source"))
    def skip_file_op(context: dg.OpExecutionContext, config: SkipFileConfig) -> Iterator[Any]:
        """Consume one unconsumed input file without processing it, recorded as skipped with the
        reason (`sparkpoint skip`): a checkpoint of no input, its subtasks run in this step (no Spark)."""
        driver = scope.resources(context).driver(pipeline)
        driver.check_start()
        report, meta = skip_file(driver, config.file, config.reason)
        context.log.warning(f"{config.file} consumed as skipped by checkpoint {meta.checkpoint_id}: {config.reason}")
        context.log_event(dg.AssetMaterialization(
            asset_key=scope.checkpoint_key, description=f"skipped input file {config.file}",
            metadata=checkpoint_metadata(driver.storage, report, meta),
            tags={"dagster/data_version": str(meta.checkpoint_id)},
        ))
        result = skipped_files(scope, driver.storage)
        context.log_event(dg.AssetCheckEvaluation(  # type: ignore[arg-type]  # an op may report a check
            asset_key=scope.input_key, check_name=result.check_name or "", passed=result.passed,
            severity=result.severity, metadata=result.metadata, description=result.description,
        ))
        yield dg.Output(None, metadata={"checkpoint_id": meta.checkpoint_id, "file": config.file,
                                        "reason": config.reason})

    @dg.op(name=scope.name("follow_op"), pool=pool, out=dg.Out(dg.Nothing),
           required_resource_keys=scope.resource_keys("storage", "registry", "spark", "state_backend", "source"))
    def follow_op(context: dg.OpExecutionContext, config: FollowConfig) -> Iterator[Any]:
        """Keep one Spark session and checkpoint each batch as it lands (`sparkpoint run --follow`),
        until the run is terminated or a stop condition of its config; every checkpoint is reported
        on the pipeline's assets as the checkpoint job reports it."""
        options = FollowOptions(checkpoint_interval=config.checkpoint_interval, poll_seconds=config.poll_seconds,
                                idle_seconds=config.idle_seconds)
        problems = check_follow_options(options)
        if problems:
            raise PipelineError("; ".join(problems))
        driver = scope.resources(context).driver(pipeline)
        if config.max_batches is not None:
            driver.config = replace(driver.config, max_batches=config.max_batches)
        driver.spark = scope.spark(context).session_for(driver)
        made = 0
        for committed in follow(driver, options, attempt_id=context.run.run_id):
            report_committed(context, driver, committed)
            made += 1
        yield dg.Output(None, metadata={"checkpoints": made})

    def report_committed(context: dg.OpExecutionContext, driver: Any, committed: Committed) -> None:
        """One committed checkpoint on the pipeline's assets: what the checkpoint job's two steps
        materialize for it, with the same metadata."""
        report, meta = committed.report, committed.metadata
        context.log.info(report.line())
        version = {"dagster/data_version": str(meta.checkpoint_id)}
        for name, key in scope.sstable_keys.items():  # asset keys by display name, state by uid
            summary = committed.attempt.operator_summary(pipeline.operator(name).uid)
            context.log_event(dg.AssetMaterialization(asset_key=key, metadata=sstable_metadata(summary)))
        context.log_event(dg.AssetMaterialization(
            asset_key=scope.checkpoint_key, metadata=committed_checkpoint_metadata(context, driver, report, meta),
            tags=version))
        if has_output(scope) and driver.sink is not None:
            context.log_event(dg.AssetMaterialization(asset_key=scope.output_key,
                                                      metadata=committed_output_metadata(driver, meta), tags=version))

    def job_of(op: dg.OpDefinition, role: str, **extra_tags: str) -> dg.JobDefinition:
        @dg.job(name=scope.name(role), tags={**tags, **extra_tags}, description=op.description,
                executor_def=dg.in_process_executor)
        def job() -> None:
            op()

        return job

    checkpoint = dg.define_asset_job(
        scope.name("checkpoint"), tags=tags,
        # The upgrade pre-flight (a blocking check on the input) runs first and gates the SSTable step.
        selection=dg.AssetSelection.assets(*scope.sstable_keys.values(), scope.checkpoint_key).downstream()
        | dg.AssetSelection.checks_for_assets(scope.input_key),
        description=f"Materialize `{pipeline.name}`'s SSTable and checkpoint assets: one batch, one checkpoint",
        executor_def=dg.in_process_executor,
    )
    checkpoint_schedule = None
    if schedule:
        @dg.schedule(name=scope.name("checkpoint_schedule"), target=checkpoint, cron_schedule=schedule,
                     default_status=schedule_status,
                     description=f"Materializes `{pipeline.name}` on `{schedule}` unless one of its runs is in flight")
        def checkpoint_schedule_fn(context: dg.ScheduleEvaluationContext) -> dg.RunRequest | dg.SkipReason:
            busy = scope.runs_in_flight(context.instance)
            if busy:
                return dg.SkipReason(scope.waiting_for(busy))
            return dg.RunRequest(tags={TICK_TAG: "true"} if tick else {})

        checkpoint_schedule = checkpoint_schedule_fn

    return PipelineJobs(
        checkpoint=checkpoint,
        recover=job_of(recover_op, "recover", **{"sparkpoint/job": "recover"}),
        prune=job_of(prune_op, "prune"),
        verify=job_of(verify_op, "verify"),
        rebuild_registry=job_of(rebuild_registry_op, "rebuild_registry"),
        savepoint=job_of(savepoint_op, "savepoint"),
        skip_file=job_of(skip_file_op, "skip_file"),
        follow=job_of(follow_op, FOLLOW_JOB),
        schedule=checkpoint_schedule,
    )
