"""SSTable assets (one per stateful operator) feeding the checkpoint asset, and its checks.

Materializing the SSTable assets runs the Spark half of the next unconsumed batch (every subtask
restores, applies its rows, snapshots and uploads its SSTs); the checkpoint asset completes that
checkpoint in its own step, without Spark. What crosses between the two steps is the pending
attempt, persisted by `sparkpoint.pipeline.attempt` under the run's id. Both steps sit in the
`sparkpoint` concurrency pool (see `sparkpoint.ops.instance`).
"""


from collections.abc import Iterator
from typing import Any

import dagster as dg

from sparkpoint.pipeline.attempt import finish_step, start_step
from sparkpoint.pipeline.maintenance import checkpoint_facts, recount, registry_counts, verify_latest
from sparkpoint.resources import (
    CheckpointRegistryResource,
    CheckpointStorageResource,
    InputResource,
    SparkResource,
    StateBackendResource,
    pipeline_of,
)
from sparkpoint.state.sample import SAMPLE_OPERATORS

PREFIX = "sparkpoint"
POOL = "sparkpoint"
INJECT_TAG = "sparkpoint/inject-failure"
SSTABLE_GROUP = "sstables"
CHECKPOINT_GROUP = "checkpoints"
SSTABLE_KEYS = {op.name: dg.AssetKey([PREFIX, op.name]) for op in SAMPLE_OPERATORS}
CHECKPOINT_KEY = dg.AssetKey([PREFIX, "checkpoint"])


def run_lineage(run: dg.DagsterRun) -> list[str]:
    """This run and the runs it re-executes: the SSTable step may have run in one of them."""
    ids = [run.run_id, run.parent_run_id, run.root_run_id]
    return [i for i in dict.fromkeys(ids) if i]


def plain_metadata(values: dict[str, Any]) -> dict[str, Any]:
    """Numbers stay numbers (the UI plots them); lists and dicts become JSON."""
    return {k: dg.MetadataValue.json(v) if isinstance(v, (list, dict)) else v for k, v in values.items()}


@dg.multi_asset(
    name="sstables",
    specs=[
        dg.AssetSpec(key, group_name=SSTABLE_GROUP, skippable=True, kinds={"spark", "rocksdb"},
                     description=f"The SST files of operator `{name}`: every subtask's incremental snapshot")
        for name, key in SSTABLE_KEYS.items()
    ],
    pool=POOL,
)
def sstables(
    context: dg.AssetExecutionContext, storage: CheckpointStorageResource, registry: CheckpointRegistryResource,
    spark: SparkResource, state_backend: StateBackendResource, source: InputResource,
) -> Iterator[dg.MaterializeResult]:
    pipeline = pipeline_of(storage, registry, state_backend, source, spark.session)
    inject = context.run.tags.get(INJECT_TAG)
    attempt = start_step(pipeline, context.run.run_id, inject_failure=inject)
    if attempt is None and source.land_sample_batch(pipeline.consumed_files()):
        attempt = start_step(pipeline, context.run.run_id, inject_failure=inject)
    if attempt is None:
        context.log.info(f"no unconsumed batch in {source.input_url}: no new checkpoint, nothing materialized")
        empty = pipeline.source.nothing_to_read()
        if empty:
            context.log.warning(empty)
        return
    for name, key in SSTABLE_KEYS.items():
        yield dg.MaterializeResult(asset_key=key, metadata=plain_metadata(attempt.operator_summary(name)))


@dg.asset(
    key=CHECKPOINT_KEY, deps=list(SSTABLE_KEYS.values()), group_name=CHECKPOINT_GROUP, pool=POOL,
    output_required=False, kinds={"rocksdb"},
    description="One materialization = one completed checkpoint (`_metadata`, registry, retention, sink commit)",
)
def checkpoint(
    context: dg.AssetExecutionContext, storage: CheckpointStorageResource, registry: CheckpointRegistryResource,
    state_backend: StateBackendResource, source: InputResource,
) -> Iterator[dg.MaterializeResult]:
    pipeline = pipeline_of(storage, registry, state_backend, source)
    done = finish_step(pipeline, run_lineage(context.run), inject_failure=context.run.tags.get(INJECT_TAG))
    if done is None:
        context.log.info("this run's SSTable step left no pending checkpoint: no new checkpoint")
        return
    facts = checkpoint_facts(pipeline.storage, *done)
    context.log.info(done[0].line())
    yield dg.MaterializeResult(metadata=plain_metadata(facts), data_version=dg.DataVersion(str(facts["checkpoint_id"])))


@dg.asset_check(asset=CHECKPOINT_KEY, blocking=True, description="Every file of the latest checkpoint: size, CRC32")
def checkpoint_verifies(storage: CheckpointStorageResource) -> dg.AssetCheckResult:
    meta, problems = verify_latest(storage.open())
    return dg.AssetCheckResult(
        passed=meta is not None and not problems,
        metadata={
            "checkpoint_id": meta.checkpoint_id if meta else 0,
            "files": len(meta.paths()) if meta else 0,
            "problems": dg.MetadataValue.json([str(p) for p in problems]),
        },
        description=None if meta else "no completed checkpoint",
    )


@dg.asset_check(asset=CHECKPOINT_KEY, description="Registry counts equal a recount of the retained _metadata")
def registry_matches_metadata(storage: CheckpointStorageResource) -> dg.AssetCheckResult:
    st = storage.open()
    built, counted = registry_counts(st), recount(st)
    return dg.AssetCheckResult(
        passed=(built.checkpoints, built.files, built.references)
        == (counted.checkpoints, counted.files, counted.references),
        metadata={
            "registry_files": built.files, "recount_files": counted.files,
            "registry_references": built.references, "recount_references": counted.references,
            "retained": dg.MetadataValue.json(list(built.checkpoints)),
        },
    )


ASSETS = [sstables, checkpoint]
ASSET_CHECKS = [checkpoint_verifies, registry_matches_metadata]
