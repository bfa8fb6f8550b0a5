"""One pipeline's assets: its input (an observable source asset), an SSTable asset per keyed
operator, the checkpoint asset, the sink's output, and the checkpoint's checks.

Materializing the SSTable assets runs the Spark half of the next unconsumed batch (every subtask
restores, applies its rows, snapshots and uploads its SSTs); the checkpoint asset completes that
checkpoint in its own step, without Spark, and with it the sink's output. What crosses between the
two steps is the pending attempt, persisted by `sparkpoint.pipeline.attempt` under the run's id.
Both steps sit in the pipeline's concurrency pool (see `sparkpoint.ops.instance`).

A run whose checkpoint another writer took first (another run of the pipeline, where the instance
gives its pool no limit) ends cleanly, whoever launched it: its checkpoint step aborts its own
attempt and says "overtaken by chk-N of run X; nothing committed" (a warning in the run's log, the
run tag `sparkpoint/overtaken`, an observation of the checkpoint asset); the SSTable
materializations it reported stay, the checkpoint asset gets none.
"""


import warnings
from collections.abc import Iterator
from typing import Any

import dagster as dg

from sparkpoint.assets.metadata import (
    checkpoint_metadata,
    input_data_version,
    input_metadata,
    input_observation,
    output_metadata,
    sstable_metadata,
    state_schema,
)
from sparkpoint.checkpoint.errors import SparkpointError
from sparkpoint.checkpoint.metadata import CheckpointMetadata
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.pipeline.attempt import Overtaken, finish_step_or_overtaken, start_step
from sparkpoint.pipeline.badfiles import bad_file_message
from sparkpoint.pipeline.maintenance import key_changes, prune_due, recount, registry_counts, verify_latest
from sparkpoint.pipeline.runtime import BatchReport, restore_plan
from sparkpoint.pipeline.upgrade import RestorePlan
from sparkpoint.resources.scope import INJECT_TAG, OVERTAKEN_TAG, TICK_TAG, PipelineScope
from sparkpoint.spark.sink import output_facts
from sparkpoint.spark.source import BadInputFile, ParquetDirectorySource

__all__ = ["INJECT_TAG", "SKIPPED_CHECK", "UPGRADE_CHECK", "build_assets", "build_checks",
           "committed_checkpoint_metadata", "committed_output_metadata", "has_output", "preflight",
           "registry_matches", "run_lineage", "skip_job_how", "skipped_files", "verifies"]
UPGRADE_CHECK = "upgrade_preflight"
SKIPPED_CHECK = "skipped_files"  # on the input: a WARN when the latest checkpoint skipped bad input files
CODE_VERSION_TAG = "dagster/code_version"  # what Dagster tags a materialization of an asset with a code version


def skip_job_how(scope: PipelineScope, file: str, input_url: str) -> str:
    """How to skip bad file `file` in Dagster: the pipeline's own skip job, reading the input the
    run that met it read."""
    return (f"launch the {scope.name('skip_file')} job with config file: {file!r} and a reason, its input resource "
            f"reading {input_url} as this run's did (or `sparkpoint skip --pipeline MODULE:ATTR --input {input_url} "
            f"...`, MODULE:ATTR naming pipeline {scope.pipeline.name!r})")


def run_lineage(run: dg.DagsterRun) -> list[str]:
    """This run and the runs it re-executes: the SSTable step may have run in one of them."""
    ids = [run.run_id, run.parent_run_id, run.root_run_id]
    return [i for i in dict.fromkeys(ids) if i]


def build_assets(scope: PipelineScope) -> list[dg.AssetsDefinition | dg.SourceAsset]:
    """The input, SSTable, checkpoint and output assets of `scope`'s pipeline."""
    pipeline = scope.pipeline
    common: dict[str, Any] = {"owners": list(scope.owners), "tags": dict(scope.tags)}
    code_version = pipeline.code_version()

    def input_files(context: dg.AssetExecutionContext) -> dg.ObserveResult:
        driver = scope.resources(context).driver(pipeline)
        pending = driver.pending_files()
        return dg.ObserveResult(data_version=input_data_version(pending, driver.consumed_files),
                                metadata=input_metadata(pending, driver.config.input_url))

    with warnings.catch_warnings():  # observable source assets are "beta" in Dagster 1.13, and what we need
        warnings.simplefilter("ignore", dg.BetaWarning)
        input_asset = dg.observable_source_asset(
            key=scope.input_key, group_name=scope.group_name,
            required_resource_keys=scope.resource_keys("source", "storage", "registry", "state_backend"),
            description=f"Batches landing for `{pipeline.name}`: {ParquetDirectorySource.accepted}", **common,
        )(input_files)

    @dg.multi_asset(
        name=scope.name("sstables"),
        specs=[
            dg.AssetSpec(key, group_name=scope.group_name, skippable=True, kinds={"spark", "rocksdb"},
                         deps=[scope.input_key], code_version=code_version,
                         description=f"The SST files of operator `{name}`: every subtask's incremental snapshot",
                         metadata=state_schema(pipeline.operator(name)), **common)
            for name, key in scope.sstable_keys.items()
        ],
        pool=scope.pool, can_subset=True,  # every operator runs in the step; a selection chooses what is reported
        required_resource_keys=scope.resource_keys("storage", "registry", "spark", "state_backend", "source"),
    )
    def sstables(context: dg.AssetExecutionContext) -> Iterator[dg.MaterializeResult[Any]]:
        source = scope.source(context)
        driver = scope.resources(context).driver(pipeline)
        driver.spark = scope.spark(context).session_for(driver)
        inject = context.run.tags.get(INJECT_TAG)
        try:
            attempt = start_step(driver, context.run.run_id, inject_failure=inject)
        except BadInputFile as e:  # say the way on in this UI: the pipeline's own skip job
            raise bad_file_message(e.file, e.check, e.reason,
                                   skip_how=skip_job_how(scope, e.file, driver.config.input_url)) from None
        if attempt is None and source.land_sample_batch(driver.consumed_files()):
            attempt = start_step(driver, context.run.run_id, inject_failure=inject)
        if attempt is None and context.run.tags.get(TICK_TAG, "").lower() == "true":
            context.log.info("no unconsumed batch: a tick (a checkpoint of no input: due timers fire, TTL expires)")
            attempt = start_step(driver, context.run.run_id, inject_failure=inject, tick=True)
        # The run that reads the input observes it too (the input sensor may be stopped), as the
        # sensor does: outside the run's own events, which say what the run made.
        context.instance.report_runless_asset_event(input_observation(
            scope.input_key, driver.pending_files(), driver.consumed_files, driver.config.input_url,
            f"seen by run {context.run.run_id}"))
        for line in driver.changed_skips:  # a skipped file that was still being written
            context.log.warning(line)
        if attempt is None and driver.waiting_for:
            context.log.warning(f"{driver.waiting_for}: no new checkpoint, nothing materialized")
            return
        if attempt is None:
            context.log.info(f"no unconsumed batch in {source.input_url}: no new checkpoint, nothing materialized")
            empty = driver.source.nothing_to_read()
            if empty:
                context.log.warning(empty)
            return
        if driver.rescaling:  # the parallelism set in the resource's config differs from the checkpoint's
            context.log.info(driver.rescaling)
        for name, key in scope.sstable_keys.items():  # asset keys by display name, state by uid
            if key not in context.selected_asset_keys:
                continue
            summary = attempt.operator_summary(pipeline.operator(name).uid)
            yield dg.MaterializeResult(asset_key=key, metadata=sstable_metadata(summary))

    output_specs = [dg.AssetSpec(
        scope.output_key, group_name=scope.group_name, skippable=True, deps=[scope.checkpoint_key],
        kinds={"parquet"}, code_version=code_version, **common,
        description=f"What `{pipeline.name}`'s emitting operators changed, committed exactly once per checkpoint",
    )] if has_output(scope) else []

    @dg.multi_asset(
        name=scope.name("complete"),
        specs=[dg.AssetSpec(
            scope.checkpoint_key, deps=list(scope.sstable_keys.values()), group_name=scope.group_name,
            skippable=True, kinds={"rocksdb"}, code_version=code_version, **common,
            description="One materialization = one completed checkpoint (`_metadata`, registry, retention, "
                        "sink commit)",
        ), *output_specs],
        pool=scope.pool, can_subset=True,  # the checkpoint commits with its output; a selection chooses the reports
        required_resource_keys=scope.resource_keys("storage", "registry", "state_backend", "source"),
    )
    def complete(context: dg.AssetExecutionContext) -> Iterator[dg.MaterializeResult[Any]]:
        driver = scope.resources(context).driver(pipeline)
        done = finish_step_or_overtaken(driver, run_lineage(context.run),
                                        inject_failure=context.run.tags.get(INJECT_TAG))
        if done is None:
            context.log.info("this run's SSTable step left no pending checkpoint: no new checkpoint")
            return
        if isinstance(done, Overtaken):
            report_overtaken(scope, context, done)
            return
        report, meta = done
        context.log.info(report.line())
        if scope.checkpoint_key in context.selected_asset_keys:
            yield dg.MaterializeResult(asset_key=scope.checkpoint_key,
                                       metadata=committed_checkpoint_metadata(context, driver, report, meta),
                                       data_version=dg.DataVersion(str(meta.checkpoint_id)))
        if output_specs and driver.sink is not None and scope.output_key in context.selected_asset_keys:
            yield dg.MaterializeResult(asset_key=scope.output_key, metadata=committed_output_metadata(driver, meta),
                                       data_version=dg.DataVersion(str(meta.checkpoint_id)))

    return [input_asset, sstables, complete]


def has_output(scope: PipelineScope) -> bool:
    """Whether the pipeline has the output asset (a sink, and an operator that emits)."""
    pipeline = scope.pipeline
    return bool(pipeline.output_url) and any(op.emits for op in pipeline.operators)


def committed_checkpoint_metadata(context: Any, driver: Any, report: BatchReport, meta: CheckpointMetadata
                                  ) -> dict[str, Any]:
    """The checkpoint asset's metadata for a checkpoint just committed, as every step that commits
    one reports it. The checkpoint is committed: this only reports, and never fails the step (a
    failed step would send a recovery after a checkpoint that completed)."""
    try:
        due = prune_due(driver.storage, num_retained=driver.config.num_retained)
    except (SparkpointError, OSError) as e:
        context.log.warning(f"could not tell whether a prune is due ({e}); the retention sensor will prune")
        due = [f"unknown: {e}"]
    previous, changes = changes_since_previous(context, driver, meta)
    return checkpoint_metadata(driver.storage, report, meta, prune_due=due, previous=previous, changes=changes)


def committed_output_metadata(driver: Any, meta: CheckpointMetadata) -> dict[str, Any]:
    """The output asset's metadata for the rows checkpoint `meta` committed."""
    facts = output_facts(driver.sink, meta.checkpoint_id, list(meta.source_offsets.get("sink") or []))
    return output_metadata(facts, meta.checkpoint_id)


def changes_since_previous(
    context: Any, driver: Any, meta: CheckpointMetadata
) -> tuple[CheckpointMetadata | None, dict[str, dict[str, int]] | None]:
    """The retained checkpoint before `meta` and, per operator, the keys that changed since it
    where a diff by changed files is cheap (reporting only: a failure here is a warning)."""
    try:
        store = CompletedCheckpointStore(driver.storage)
        older = [cid for cid in store.checkpoint_ids() if cid < meta.checkpoint_id]
        if not older:
            return None, None
        previous = store.load(max(older))
        if previous.is_savepoint:
            return previous, None
        return previous, key_changes(driver.storage, previous, meta, driver.operators,
                                     local_dir=driver.config.local_dir)
    except Exception as e:  # noqa: BLE001  reporting only: the checkpoint is committed, the step must not fail
        context.log.warning(f"could not tell what changed since the previous checkpoint: {type(e).__name__}: {e}")
        return None, None


def report_overtaken(scope: PipelineScope, context: dg.AssetExecutionContext, lost: Overtaken) -> None:
    """Say where the user looks that this run's checkpoint was another writer's to commit."""
    line = lost.line("run")
    context.log.warning(f"checkpoint {lost.checkpoint_id} of this run: {line}")
    context.instance.add_run_tags(context.run.run_id, {OVERTAKEN_TAG: line})
    metadata: dict[str, Any] = {"checkpoint_id": lost.checkpoint_id, "overtaken_by": lost.by_checkpoint,
                                   "committed": False, "batch": dg.MetadataValue.json(list(lost.files))}
    if lost.by_attempt:
        metadata["by_run"] = lost.by_attempt
    context.log_event(dg.AssetObservation(asset_key=scope.checkpoint_key, description=line, metadata=metadata))


def build_checks(scope: PipelineScope) -> list[dg.AssetChecksDefinition]:
    """The checkpoint's checks, run after each checkpoint (the first blocks what depends on it)
    and on their own from the UI; the recovery run reports them for the checkpoint it makes. And
    the upgrade pre-flight on the input, which the checkpoint job runs before its SSTable step
    (blocking: a restore that would be refused stops the run before Spark starts)."""
    keys = scope.resource_keys("storage")

    @dg.asset_check(asset=scope.input_key, name=UPGRADE_CHECK, blocking=True,
                    required_resource_keys=scope.resource_keys("storage", "registry", "state_backend", "source"),
                    description="Whether the latest checkpoint's state maps onto this code's operators (by uid): "
                                "what `sparkpoint check-upgrade` reports, from _metadata alone")
    def upgrade_preflight(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        config = scope.resources(context).config(scope.pipeline)
        return preflight(scope, restore_plan(config, scope.pipeline.operators),
                         last_code_version(context.instance, scope.checkpoint_key))

    @dg.asset_check(asset=scope.checkpoint_key, name="checkpoint_verifies", blocking=True,
                    required_resource_keys=keys, description="Every file of the latest checkpoint: size, CRC32")
    def checkpoint_verifies(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        return verifies(scope, scope.storage(context).open())

    @dg.asset_check(asset=scope.checkpoint_key, name="registry_matches_metadata", required_resource_keys=keys,
                    description="Registry counts equal a recount of the retained _metadata")
    def registry_matches_metadata(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        return registry_matches(scope, scope.storage(context).open())

    @dg.asset_check(asset=scope.input_key, name=SKIPPED_CHECK, additional_deps=[scope.checkpoint_key],
                    required_resource_keys=keys,
                    description="Whether the latest checkpoint consumed input files without processing them "
                                "(on_bad_file=\"skip\", or the skip_file job): a warning naming each file and why")
    def skipped_input_files(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        return skipped_files(scope, scope.storage(context).open())

    return [upgrade_preflight, checkpoint_verifies, registry_matches_metadata, skipped_input_files]


def skipped_files(scope: PipelineScope, storage: CheckpointStorage) -> dg.AssetCheckResult:
    """The input check after a checkpoint: passes unless the latest checkpoint skipped input
    files; then a WARN-severity failure naming them, the check each failed and why."""
    latest = CompletedCheckpointStore(storage).latest()
    skipped = latest.newly_skipped() if latest is not None else ()
    description = ("; ".join(f"skipped {s.line()}" for s in skipped) if skipped
                   else "no input file skipped" if latest is not None else "no completed checkpoint")
    return dg.AssetCheckResult(
        asset_key=scope.input_key, check_name=SKIPPED_CHECK, passed=not skipped,
        severity=dg.AssetCheckSeverity.WARN, description=description[:2000],
        metadata={"checkpoint_id": latest.checkpoint_id if latest else 0,
                  "skipped_files": dg.MetadataValue.json([s.to_json() for s in skipped]),
                  "skipped_before": len(latest.skipped_files) - len(skipped) if latest else 0},
    )


def last_code_version(instance: dg.DagsterInstance, key: dg.AssetKey) -> str | None:
    """The code version of `key`'s latest materialization (None: none, or none recorded)."""
    event = instance.get_latest_materialization_event(key)
    materialization = event.asset_materialization if event is not None else None
    return materialization.tags.get(CODE_VERSION_TAG) if materialization and materialization.tags else None


def preflight(scope: PipelineScope, plan: RestorePlan | None, before: str | None) -> dg.AssetCheckResult:
    """The upgrade pre-flight's result: passes when the next start's restore would go ahead.
    It runs before every checkpoint (it reads one `_metadata`); it matters on the first after the
    operators' code version changed, which its metadata says."""
    now = scope.pipeline.code_version()
    changed = before is not None and before != now
    if plan is None:
        description = "no checkpoint to restore: the job starts empty"
    else:
        description = plan.decision() + (f" (code version {before} -> {now})" if changed else "")
    return dg.AssetCheckResult(
        asset_key=scope.input_key, check_name=UPGRADE_CHECK, passed=plan is None or plan.ok,
        description=description[:2000],
        metadata={"code_version": now, "checkpointed_code_version": before or "", "code_changed": changed,
                  "plan": dg.MetadataValue.json(plan.to_json() if plan is not None else {})},
    )


def verifies(scope: PipelineScope, storage: CheckpointStorage) -> dg.AssetCheckResult:
    meta, problems = verify_latest(storage)
    return dg.AssetCheckResult(
        asset_key=scope.checkpoint_key, check_name="checkpoint_verifies",
        passed=meta is not None and not problems,
        metadata={
            "checkpoint_id": meta.checkpoint_id if meta else 0,
            "files": len(meta.paths()) if meta else 0,
            "problems": dg.MetadataValue.json([str(p) for p in problems]),
        },
        description=None if meta else "no completed checkpoint",
    )


def registry_matches(scope: PipelineScope, storage: CheckpointStorage) -> dg.AssetCheckResult:
    built, counted = registry_counts(storage), recount(storage)
    return dg.AssetCheckResult(
        asset_key=scope.checkpoint_key, check_name="registry_matches_metadata",
        passed=(built.checkpoints, built.files, built.references)
        == (counted.checkpoints, counted.files, counted.references),
        metadata={
            "registry_files": built.files, "recount_files": counted.files,
            "registry_references": built.references, "recount_references": counted.references,
            "retained": dg.MetadataValue.json(list(built.checkpoints)),
        },
    )
