"""One pipeline's assets: its input (an observable source asset), an SSTable asset per keyed
operator, the checkpoint asset and the sink's output.

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

from sparkpoint.assets import steps
from sparkpoint.assets.committed import has_output, sstable_materializations
from sparkpoint.assets.metadata import input_observation, observed_input, state_schema
from sparkpoint.pipeline.attempt import Overtaken
from sparkpoint.pipeline.driver import StatefulPipeline
from sparkpoint.resources.scope import OVERTAKEN_TAG, PipelineScope
from sparkpoint.spark.source import ParquetDirectorySource
from sparkpoint.spark.tablesource import TableSource
from sparkpoint.tables.spec import DeltaTable, IcebergTable, TableSpec, table_of

_STEP_ROLES = ("storage", "registry", "state_backend", "source")  # what every step of the pipeline reads


def build_assets(scope: PipelineScope) -> list[dg.AssetsDefinition | dg.SourceAsset]:
    """The input, SSTable, checkpoint and output assets of `scope`'s pipeline."""
    return [input_asset(scope), sstables_asset(scope), complete_asset(scope)]


def _common(scope: PipelineScope) -> dict[str, Any]:
    return {"owners": scope.owners, "tags": scope.tags}


def step_driver(scope: PipelineScope, context: Any, *, spark: bool = False) -> StatefulPipeline:
    """The pipeline driver of a step or sensor, configured by its resources (`spark`: with the
    run's Spark session)."""
    driver = scope.resources(context).driver(scope.pipeline)
    if spark:
        driver.spark = scope.spark(context).session_for(driver)
    return driver


def table_kind(table: TableSpec | None) -> str:
    """The Dagster kind of an output or input: `delta`, `iceberg` or `parquet`."""
    return {DeltaTable: "delta", IcebergTable: "iceberg"}.get(type(table), "parquet")


def input_source(scope: PipelineScope) -> type[ParquetDirectorySource | TableSource]:
    """What kind of source the pipeline's input is (a table, or a directory of batch files)."""
    given = scope.pipeline.input or scope.pipeline.input_url or ""
    return TableSource if isinstance(table_of(given), (DeltaTable, IcebergTable)) else ParquetDirectorySource


def input_asset(scope: PipelineScope) -> dg.SourceAsset:
    def input_files(context: dg.AssetExecutionContext) -> dg.ObserveResult:
        version, metadata = observed_input(step_driver(scope, context))
        return dg.ObserveResult(data_version=version, metadata=metadata)

    with warnings.catch_warnings():  # observable source assets are "beta" in Dagster 1.13, and what we need
        warnings.simplefilter("ignore", dg.BetaWarning)
        return dg.observable_source_asset(
            key=scope.input_key, group_name=scope.group_name, required_resource_keys=scope.resource_keys(*_STEP_ROLES),
            description=f"Batches landing for `{scope.pipeline.name}`: {input_source(scope).accepted}",
            **_common(scope),
        )(input_files)


def sstables_asset(scope: PipelineScope) -> dg.AssetsDefinition:
    pipeline = scope.pipeline

    @dg.multi_asset(
        name=scope.name("sstables"),
        specs=[
            dg.AssetSpec(key, group_name=scope.group_name, skippable=True, kinds={"spark", "rocksdb"},
                         deps=[scope.input_key], code_version=pipeline.code_version(),
                         description=f"The SST files of operator `{name}`: every subtask's incremental snapshot",
                         metadata=state_schema(pipeline.operator(name)), **_common(scope))
            for name, key in scope.sstable_keys.items()
        ],
        pool=scope.pool, can_subset=True,  # every operator runs in the step; a selection chooses what is reported
        required_resource_keys=scope.resource_keys("spark", *_STEP_ROLES),
    )
    def sstables(context: dg.AssetExecutionContext) -> Iterator[dg.MaterializeResult[Any]]:
        driver = step_driver(scope, context, spark=True)
        attempt = steps.spark_half(scope, driver, context.run.run_id, context.run.tags, context.log)
        # The run that reads the input observes it too (the input sensor may be stopped), as the
        # sensor does: outside the run's own events, which say what the run made.
        context.instance.report_runless_asset_event(input_observation(
            scope.input_key, driver, f"seen by run {context.run.run_id}"))
        if attempt is not None:
            made = sstable_materializations(scope, attempt.checkpoint_id, attempt)
            yield from (m.result() for m in made if m.key in context.selected_asset_keys)

    return sstables


def complete_asset(scope: PipelineScope) -> dg.AssetsDefinition:
    code_version = scope.pipeline.code_version()
    output_specs = [dg.AssetSpec(
        scope.output_key, group_name=scope.group_name, skippable=True, deps=[scope.checkpoint_key],
        kinds={table_kind(scope.pipeline.output_table())}, code_version=code_version, **_common(scope),
        description=f"What `{scope.pipeline.name}`'s emitting operators changed, committed exactly once per checkpoint",
    )] if has_output(scope) else []

    @dg.multi_asset(
        name=scope.name("complete"),
        specs=[dg.AssetSpec(
            scope.checkpoint_key, deps=list(scope.sstable_keys.values()), group_name=scope.group_name,
            skippable=True, kinds={"rocksdb"}, code_version=code_version, **_common(scope),
            description="One materialization = one completed checkpoint (`_metadata`, registry, retention, "
                        "sink commit)",
        ), *output_specs],
        pool=scope.pool, can_subset=True,  # the checkpoint commits with its output; a selection chooses the reports
        required_resource_keys=scope.resource_keys(*_STEP_ROLES),
    )
    def complete(context: dg.AssetExecutionContext) -> Iterator[dg.MaterializeResult[Any]]:
        driver = step_driver(scope, context)
        done = steps.complete(scope, driver, context.run, context.log)
        if isinstance(done, Overtaken):
            report_overtaken(scope, context, done)
            return
        if done is None:
            return
        yield from (m.result() for m in done.materialized if m.key in context.selected_asset_keys)
        steps.after_commit(scope, driver, done, context)

    return complete


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
