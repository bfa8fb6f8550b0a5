"""A committed checkpoint as materializations of the pipeline's assets, the same whichever step
committed it: the checkpoint job's two steps, the follow job, a recovery, a skipped file.

`committed_materializations` is the one place that says what a checkpoint materializes: the
SSTable assets (each operator's snapshot), the checkpoint asset, the sink's output; each with the
checkpoint's id as its data version (`checkpoint_version`). An asset step returns them as its
results (`Materialized.result`), an op logs them as events (`Materialized.event`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import dagster as dg

from sparkpoint.assets.metadata import (
    DATA_VERSION_TAG,
    change_entries,
    checkpoint_metadata,
    output_metadata,
    sstable_metadata,
)
from sparkpoint.checkpoint.errors import SparkpointError
from sparkpoint.checkpoint.metadata import CheckpointMetadata
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.pipeline.attempt import PendingAttempt, snapshot_summary
from sparkpoint.pipeline.driver import StatefulPipeline
from sparkpoint.pipeline.maintenance import key_changes, prune_due
from sparkpoint.pipeline.runtime import BatchReport
from sparkpoint.resources.scope import PipelineScope
from sparkpoint.tables.sinks import output_facts


class Log(Protocol):
    """What reporting writes to: a Dagster step's `context.log`, or any `logging.Logger`."""

    def info(self, msg: str) -> Any: ...
    def warning(self, msg: str) -> Any: ...
    def error(self, msg: str) -> Any: ...


def checkpoint_version(checkpoint_id: int) -> dg.DataVersion:
    """The data version of what checkpoint `checkpoint_id` materializes: its id."""
    return dg.DataVersion(str(checkpoint_id))


@dataclass(frozen=True)
class Materialized:
    """One asset's materialization for a committed checkpoint, before it becomes a step's result
    or an op's event."""

    key: dg.AssetKey
    metadata: Mapping[str, Any]
    version: dg.DataVersion | None = None  # None: an SSTable asset (its version is the input's)
    description: str | None = None

    def result(self) -> dg.MaterializeResult[Any]:
        return dg.MaterializeResult(asset_key=self.key, metadata=dict(self.metadata), data_version=self.version)

    def event(self) -> dg.AssetMaterialization:
        tags = {DATA_VERSION_TAG: self.version.value} if self.version is not None else None
        return dg.AssetMaterialization(asset_key=self.key, description=self.description,
                                       metadata=dict(self.metadata), tags=tags)


def has_output(scope: PipelineScope) -> bool:
    """Whether the pipeline has the output asset (a sink, and an operator that emits)."""
    pipeline = scope.pipeline
    return pipeline.output_table() is not None and any(op.emits for op in pipeline.operators)


def sstable_materializations(scope: PipelineScope, checkpoint_id: int, attempt: PendingAttempt | None = None,
                             meta: CheckpointMetadata | None = None, description: str | None = None
                             ) -> list[Materialized]:
    """Each operator's snapshot in the checkpoint: from the `attempt` that made it when the step
    has it (it knows the restores and rows), else from its `_metadata`."""
    out = []
    for name, key in scope.sstable_keys.items():  # asset keys by display name, state by uid
        uid = scope.pipeline.operator(name).uid
        if attempt is not None:
            summary = attempt.operator_summary(uid)
        else:
            assert meta is not None, "an attempt or its _metadata"
            summary = snapshot_summary(meta.operators[uid].subtasks, checkpoint_id)
        out.append(Materialized(key, sstable_metadata(summary), description=description))
    return out


def committed_materializations(
    scope: PipelineScope, driver: StatefulPipeline, report: BatchReport, meta: CheckpointMetadata, log: Log, *,
    attempt: PendingAttempt | None = None, sstables: bool = True, output: bool = True,
    description: str | None = None, recovered_run: str | None = None, changes: bool = True,
) -> list[Materialized]:
    """What checkpoint `meta` (just committed by `driver`) materializes: the SSTable assets (unless
    the step reported them itself: `sstables` False), the checkpoint asset, and the output when
    the pipeline has one (and `output`). Without `changes`, the checkpoint asset's metadata leaves
    out the keys changed since the previous checkpoint (a diff that reads state: the caller reports
    them after the materialization, `key_changes_observation`)."""
    out = sstable_materializations(scope, meta.checkpoint_id, attempt, meta, description) if sstables else []
    version = checkpoint_version(meta.checkpoint_id)
    metadata = committed_checkpoint_metadata(log, driver, report, meta, recovered_run=recovered_run, changes=changes)
    out.append(Materialized(scope.checkpoint_key, metadata, version, description))
    if output and has_output(scope) and driver.sink is not None:
        out.append(Materialized(scope.output_key, committed_output_metadata(driver, meta), version, description))
    return out


def committed_checkpoint_metadata(log: Log, driver: StatefulPipeline, report: BatchReport, meta: CheckpointMetadata,
                                  recovered_run: str | None = None, changes: bool = True) -> dict[str, Any]:
    """The checkpoint asset's metadata for a checkpoint just committed (`changes`: with the keys
    changed since the previous one). The checkpoint is committed: this only reports, and never
    fails the step (a failed step would send a recovery after a checkpoint that completed)."""
    try:
        due = prune_due(driver.storage, num_retained=driver.config.num_retained)
    except (SparkpointError, OSError) as e:
        log.warning(f"could not tell whether a prune is due ({e}); the retention sensor will prune")
        due = [f"unknown: {e}"]
    previous = previous_checkpoint(log, driver, meta)
    changed = key_changes_since(log, driver, previous, meta) if changes else None
    return checkpoint_metadata(driver.storage, report, meta, prune_due=due, previous=previous, changes=changed,
                               recovered_run=recovered_run)


def key_changes_observation(scope: PipelineScope, driver: StatefulPipeline, meta: CheckpointMetadata, log: Log
                            ) -> dg.AssetObservation | None:
    """The keys each operator's export gained, lost and changed from the previous checkpoint to
    `meta`, as an observation of the checkpoint asset (`keys_added`, `keys_removed`,
    `keys_changed`, the metadata a materialization carries when it waits for the diff). None:
    no previous checkpoint, or no operator whose diff is cheap."""
    previous = previous_checkpoint(log, driver, meta)
    changes = key_changes_since(log, driver, previous, meta)
    if previous is None or not changes:
        return None
    metadata: dict[str, Any] = {"checkpoint_id": meta.checkpoint_id, "previous_checkpoint_id": previous.checkpoint_id}
    metadata.update(change_entries(changes))
    return dg.AssetObservation(asset_key=scope.checkpoint_key, metadata=metadata,
                               description=f"chk-{meta.checkpoint_id}: keys changed since chk-{previous.checkpoint_id}",
                               tags={DATA_VERSION_TAG: checkpoint_version(meta.checkpoint_id).value})


def committed_output_metadata(driver: StatefulPipeline, meta: CheckpointMetadata) -> dict[str, Any]:
    """The output asset's metadata for the rows checkpoint `meta` committed (a pipeline with a sink)."""
    assert driver.sink is not None
    facts = output_facts(driver.sink, meta.checkpoint_id, list(meta.source_offsets.get("sink") or []))
    return output_metadata(facts, meta.checkpoint_id)


def previous_checkpoint(log: Log, driver: StatefulPipeline, meta: CheckpointMetadata) -> CheckpointMetadata | None:
    """The retained checkpoint before `meta` (reporting only: a failure here is a warning)."""
    try:
        store = CompletedCheckpointStore(driver.storage)
        older = [cid for cid in store.checkpoint_ids() if cid < meta.checkpoint_id]
        return store.load(max(older)) if older else None
    except Exception as e:  # noqa: BLE001  reporting only: the checkpoint is committed, the step must not fail
        log.warning(f"could not read the checkpoint before chk-{meta.checkpoint_id}: {type(e).__name__}: {e}")
        return None


def key_changes_since(log: Log, driver: StatefulPipeline, previous: CheckpointMetadata | None,
                      meta: CheckpointMetadata) -> dict[str, dict[str, int]] | None:
    """Per operator, the keys that changed from `previous` to `meta` where a diff by changed files
    is cheap (reporting only: a failure here is a warning)."""
    if previous is None or previous.is_savepoint:
        return None
    try:
        return key_changes(driver.storage, previous, meta, driver.operators, local_dir=driver.config.local_dir)
    except Exception as e:  # noqa: BLE001  reporting only: the checkpoint is committed, the step must not fail
        log.warning(f"could not tell what changed since the previous checkpoint: {type(e).__name__}: {e}")
        return None
