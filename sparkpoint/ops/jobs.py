"""One pipeline's jobs: checkpoint (its assets), follow, recover, prune, verify, rebuild_registry,
savepoint, skip_file, each named `<pipeline>_<job>`, and an optional schedule.

The follow job is one step that runs `sparkpoint.pipeline.follow` (what `sparkpoint run --follow`
runs) for as long as the run lasts, and reports every checkpoint it commits as the checkpoint job
would: a materialization of each SSTable asset, of the checkpoint asset (and of the output), with
the same metadata. Its attempts are persisted under the run's id, so the recovery of a failed
follow run fences a zombie of it before its sweep.

Each op is a few lines around `sparkpoint.ops.steps` and `sparkpoint.pipeline.maintenance`. Every
op sits in the pipeline's concurrency pool with its assets, so a recovery never overlaps a
materialization of the same pipeline where the instance limits the pool. The schedule asks the
instance itself: a tick while one of the pipeline's runs is queued or in progress is skipped,
saying which run it waits for.

Every job runs its steps in the run's own process (`in_process_executor`). Its steps follow one
another (the Spark half, then the commit, then the checks), so the multiprocess executor's only
effect was a new Python process per step, each importing Dagster, Spark's client and the user's
code again: seconds of every checkpoint's latency from a file landing to its commit. The two
halves still cross through the persisted pending attempt, never through memory, so a re-execution
of the checkpoint step alone, in another run, completes it the same way.
"""

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import dagster as dg

from sparkpoint.assets.build import step_driver
from sparkpoint.assets.steps import input_cleanup_of
from sparkpoint.ops import results, steps
from sparkpoint.pipeline import maintenance
from sparkpoint.pipeline.follow import POLL_SECONDS
from sparkpoint.resources.scope import FOLLOW_JOB, PIPELINE_TAG, TICK_TAG, PipelineScope


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


def build_jobs(scope: PipelineScope) -> PipelineJobs:
    """The pipeline's jobs, and the checkpoint job's schedule when the options give a cron."""
    checkpoint = checkpoint_job(scope)
    return PipelineJobs(
        checkpoint=checkpoint,
        recover=job_of(scope, recover_op(scope), "recover", **{"sparkpoint/job": "recover"}),
        prune=job_of(scope, prune_op(scope), "prune"),
        verify=job_of(scope, verify_op(scope), "verify"),
        rebuild_registry=job_of(scope, rebuild_registry_op(scope), "rebuild_registry"),
        savepoint=job_of(scope, savepoint_op(scope), "savepoint"),
        skip_file=job_of(scope, skip_file_op(scope), "skip_file"),
        follow=job_of(scope, follow_op(scope), FOLLOW_JOB),
        schedule=checkpoint_schedule(scope, checkpoint),
    )


def job_of(scope: PipelineScope, op: dg.OpDefinition, role: str, **extra_tags: str) -> dg.JobDefinition:
    """Job `<name>_<role>`: the one op, in the run's own process."""
    @dg.job(name=scope.name(role), tags={PIPELINE_TAG: scope.pipeline.name, **extra_tags},
            description=op.description, executor_def=dg.in_process_executor)
    def job() -> None:
        op()

    return job


def checkpoint_job(scope: PipelineScope) -> Any:
    return dg.define_asset_job(
        scope.name("checkpoint"), tags={PIPELINE_TAG: scope.pipeline.name},
        # The upgrade pre-flight (a blocking check on the input) runs first and gates the SSTable step.
        selection=dg.AssetSelection.assets(*scope.sstable_keys.values(), scope.checkpoint_key).downstream()
        | dg.AssetSelection.checks_for_assets(scope.input_key),
        description=f"Materialize `{scope.pipeline.name}`'s SSTable and checkpoint assets: one batch, one checkpoint",
        executor_def=dg.in_process_executor,
    )


def checkpoint_schedule(scope: PipelineScope, checkpoint: Any) -> dg.ScheduleDefinition | None:
    """With the options' `schedule` (a cron): the checkpoint job on it, unless one of the pipeline's
    runs is in flight; with `tick`, a run that finds no unconsumed batch makes a checkpoint of no
    input (processing-time timers fire, TTL expires)."""
    cron, tick = scope.options.schedule, scope.options.tick
    if not cron:
        return None

    @dg.schedule(name=scope.name("checkpoint_schedule"), target=checkpoint, cron_schedule=cron,
                 default_status=scope.options.schedule_status,
                 description=f"Materializes `{scope.pipeline.name}` on `{cron}` unless one of its runs is in flight")
    def schedule(context: dg.ScheduleEvaluationContext) -> dg.RunRequest | dg.SkipReason:
        busy = scope.runs_in_flight(context.instance)
        if busy:
            return dg.SkipReason(scope.waiting_for(busy))
        return dg.RunRequest(tags={TICK_TAG: "true"} if tick else {})

    return schedule


_ALL_ROLES = ("storage", "registry", "spark", "state_backend", "source")


def recover_op(scope: PipelineScope) -> dg.OpDefinition:
    @dg.op(name=scope.name("recover_op"), pool=scope.pool, out=dg.Out(dg.Nothing),
           required_resource_keys=scope.resource_keys(*_ALL_ROLES))
    def recover(context: dg.OpExecutionContext, config: RecoverConfig) -> Iterator[Any]:
        """Abort the failed attempt, rebuild the registry, verify (fall back loudly), re-process;
        then report the checkpoint it made on the pipeline's assets and run the checkpoint's checks."""
        driver = step_driver(scope, context, spark=True)
        report = steps.recover(driver, context.instance, config.failed_run_id, context.run_id,
                               scope.registry(context).orphan_grace_seconds)
        metadata = results.recovery_said(report, config.failed_run_id, context.log)
        for event in steps.recovery_events(scope, driver, report, config.failed_run_id, context.log):
            context.log_event(event)  # type: ignore[arg-type]  # an op may report a check
        yield dg.Output(None, metadata=metadata)

    return recover


def prune_op(scope: PipelineScope) -> dg.OpDefinition:
    @dg.op(name=scope.name("prune_op"), pool=scope.pool, required_resource_keys=scope.resource_keys(
        "storage", "registry", "source"))
    def prune(context: dg.OpExecutionContext) -> dg.Output[None]:
        """Subsume beyond num_retained, forget stale attempts, sweep orphans past the grace period;
        then the consumed input as the input resource's `input_cleanup` says."""
        # The top-level storage resource: the run config of the job being pruned sets it (a
        # resource nested in the registry keeps its defaults whatever the launch config says).
        registry = scope.registry(context)
        report = maintenance.prune(scope.storage(context).open(), num_retained=registry.num_retained,
                                   orphan_grace_seconds=registry.orphan_grace_seconds,
                                   input_cleanup=input_cleanup_of(scope, context))
        return dg.Output(None, metadata=results.pruned(report))

    return prune


def verify_op(scope: PipelineScope) -> dg.OpDefinition:
    @dg.op(name=scope.name("verify_op"), pool=scope.pool, required_resource_keys=scope.resource_keys("storage"))
    def verify(context: dg.OpExecutionContext) -> dg.Output[None]:
        """Every retained checkpoint's files: present, size, CRC32. Fails when one does not verify."""
        return dg.Output(None, metadata=results.verified(maintenance.verify_all(scope.storage(context).open())))

    return verify


def rebuild_registry_op(scope: PipelineScope) -> dg.OpDefinition:
    @dg.op(name=scope.name("rebuild_registry_op"), pool=scope.pool,
           required_resource_keys=scope.resource_keys("storage"))
    def rebuild_registry(context: dg.OpExecutionContext) -> dg.Output[None]:
        """Rebuild the shared-state registry from the retained `_metadata` and compare with a recount."""
        storage = scope.storage(context).open()
        return dg.Output(None, metadata=results.rebuilt(maintenance.registry_counts(storage),
                                                        maintenance.recount(storage)))

    return rebuild_registry


def savepoint_op(scope: PipelineScope) -> dg.OpDefinition:
    @dg.op(name=scope.name("savepoint_op"), pool=scope.pool, required_resource_keys=scope.resource_keys("storage"))
    def savepoint(context: dg.OpExecutionContext, config: SavepointConfig) -> dg.Output[None]:
        """A self-contained, verified copy of the latest checkpoint that retention never deletes;
        with `diff_against`, what changed per operator since that savepoint or checkpoint."""
        return dg.Output(None, metadata=steps.savepoint(scope, scope.storage(context).open(), config.diff_against))

    return savepoint


def skip_file_op(scope: PipelineScope) -> dg.OpDefinition:
    @dg.op(name=scope.name("skip_file_op"), pool=scope.pool, out=dg.Out(dg.Nothing),
           required_resource_keys=scope.resource_keys("storage", "registry", "state_backend", "source"))
    def skip_file(context: dg.OpExecutionContext, config: SkipFileConfig) -> Iterator[Any]:
        """Consume one unconsumed input file without processing it, recorded as skipped with the
        reason (`sparkpoint skip`): a checkpoint of no input, its subtasks run in this step (no Spark)."""
        checkpoint_id, events = steps.skip(scope, step_driver(scope, context), config.file, config.reason,
                                           context.log)
        for event in events:
            context.log_event(event)  # type: ignore[arg-type]  # an op may report a check
        yield dg.Output(None, metadata={"checkpoint_id": checkpoint_id, "file": config.file, "reason": config.reason})

    return skip_file


def follow_op(scope: PipelineScope) -> dg.OpDefinition:
    @dg.op(name=scope.name("follow_op"), pool=scope.pool, out=dg.Out(dg.Nothing),
           required_resource_keys=scope.resource_keys(*_ALL_ROLES))
    def follow(context: dg.OpExecutionContext, config: FollowConfig) -> Iterator[Any]:
        """Keep one Spark session and checkpoint each batch as it lands (`sparkpoint run --follow`),
        until the run is terminated or a stop condition of its config; every checkpoint is reported
        on the pipeline's assets as the checkpoint job reports it."""
        options = steps.follow_options(config.checkpoint_interval, config.poll_seconds, config.idle_seconds)
        driver = step_driver(scope, context, spark=True)
        made = 0
        for events in steps.follow_events(scope, driver, options, context.run.run_id, config.max_batches,
                                          context.log):
            for event in events:
                context.log_event(event)
            made += 1
        yield dg.Output(None, metadata={"checkpoints": made})

    return follow
