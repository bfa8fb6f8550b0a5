"""Keeping a job's checkpoints healthy: recover, prune, verify, rebuild the registry, savepoint.

What the orchestrator's jobs call (Dagster's `recover`, `prune`, ... ops are a line each).
Every function reads the truth from checkpoint storage; nothing is carried in memory between
calls.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sparkpoint.core.coordinator import CheckpointCoordinator
from sparkpoint.core.errors import CheckpointCorrupted
from sparkpoint.core.inspect import verify_checkpoint
from sparkpoint.core.metadata import CheckpointMetadata
from sparkpoint.core.restore import FileProblem
from sparkpoint.core.storage import CheckpointStorage
from sparkpoint.core.store import CompletedCheckpointStore
from sparkpoint.core.sweep import SweepReport, sweep_orphans
from sparkpoint.spark.attempt import (
    abort_attempt,
    complete_attempt,
    pending_attempts,
    pending_paths,
    spark_half_with_fallback,
)
from sparkpoint.spark.runtime import BatchReport

if TYPE_CHECKING:
    from sparkpoint.spark.runtime import StatefulPipeline

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RegistryCounts:
    checkpoints: tuple[int, ...]  # retained, newest first
    files: int  # distinct files referenced
    references: int  # sum of reference counts
    blocked: tuple[str, ...]  # why deletion is blocked (unreadable `_metadata`)


def registry_counts(storage: CheckpointStorage) -> RegistryCounts:
    """The registry rebuilt from every retained `_metadata` (what each process starts from)."""
    listing = CompletedCheckpointStore(storage).load_all()
    registry = CompletedCheckpointStore(storage).rebuild_registry(listing)
    return RegistryCounts(
        checkpoints=tuple(listing.ids), files=len(registry.paths()),
        references=sum(registry.count(p) for p in registry.paths()), blocked=tuple(registry.blocked_reasons),
    )


def recount(storage: CheckpointStorage) -> RegistryCounts:
    """The same counts computed the plain way (a set and a counter over `_metadata`), for a check."""
    listing = CompletedCheckpointStore(storage).load_all()
    refs: dict[str, int] = {}
    for meta in listing.checkpoints:
        for path in meta.paths() | {meta.metadata_path}:
            refs[path] = refs.get(path, 0) + 1
    return RegistryCounts(
        checkpoints=tuple(listing.ids), files=len(refs), references=sum(refs.values()),
        blocked=tuple(f"chk-{cid}/_metadata cannot be read ({why})" for cid, why in sorted(listing.unreadable.items())),
    )


def checkpoint_facts(storage: CheckpointStorage, report: BatchReport, meta: CheckpointMetadata) -> dict[str, Any]:
    """What a completed checkpoint is worth showing, as plain numbers (the UI plots them)."""
    counts = registry_counts(storage)
    state = meta.stats.state_size
    return {
        "checkpoint_id": meta.checkpoint_id,
        "path": f"{storage.job_url}/{meta.metadata_path}",
        "state_size": state,
        "checkpointed_size": meta.stats.checkpointed_size,
        "incremental_ratio": round(meta.stats.checkpointed_size / state, 4) if state else 0.0,
        "files_new": report.files_new,
        "files_reused": report.files_reused,
        "files_deleted": report.files_deleted,
        "registry_files": counts.files,
        "retained": list(counts.checkpoints),
        "duration_s": round(report.seconds, 3),
    }


def verify_latest(
    storage: CheckpointStorage, *, deep: bool = True
) -> tuple[CheckpointMetadata | None, list[FileProblem]]:
    """The newest checkpoint and what is wrong with its files (empty: it verifies)."""
    meta = CompletedCheckpointStore(storage).latest()
    if meta is None:
        return None, []
    return meta, verify_checkpoint(storage, meta, deep=deep)


def verify_all(storage: CheckpointStorage, *, deep: bool = True) -> dict[int, list[FileProblem]]:
    """Every retained checkpoint and its problems; unreadable `_metadata` is a problem too."""
    listing = CompletedCheckpointStore(storage).load_all()
    out = {m.checkpoint_id: verify_checkpoint(storage, m, deep=deep) for m in listing.checkpoints}
    for cid, why in listing.unreadable.items():
        out[cid] = [FileProblem(f"chk-{cid}/_metadata", "_metadata", why)]
    return dict(sorted(out.items(), reverse=True))


# --- recovery ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class RecoveryReport:
    aborted: tuple[int, ...]  # checkpoint ids of the abandoned attempts
    uploads_deleted: int
    orphans_deleted: int
    registry: RegistryCounts
    restored_from: int | None  # the verified checkpoint the re-processing started from
    fell_back_from: tuple[int, ...]  # newer checkpoints that failed verification
    batch: tuple[BatchReport, CheckpointMetadata] | None  # the re-processed batch


def recover(
    pipeline: StatefulPipeline, *, failed_before: float | None = None, orphan_grace_seconds: float = 3600.0
) -> RecoveryReport:
    """Heal the job after a failed batch, then process that batch again.

    1. Abort every persisted attempt whose checkpoint did not complete (its uploads, its sink
       staging); forget those whose checkpoint did.
    2. Sweep orphans (uploads of attempts that never got persisted, such as a Spark job that
       died mid-upload): with `failed_before` (POSIX seconds, when the failed run ended) every
       unreferenced file written before then, and nothing written after it: those may be a
       live writer's pending uploads (a CLI run on the same job), which a sweep must never take.
       Without it, files older than `orphan_grace_seconds`.
    3. Rebuild the registry from the retained `_metadata`.
    4. Verify the latest checkpoint; if it fails, fall back to the next older that verifies,
       loudly (its later sink output is rolled back and its batches replayed).
    5. Local state rolls back by itself: each subtask's restore discards a working database that
       is not exactly the restored checkpoint.
    6. Re-process the next unconsumed batch (the failed one): a newer checkpoint completes.
    """
    storage = pipeline.storage
    latest = max(storage.completed_checkpoint_ids(), default=0)
    aborted, deleted = [], 0
    for attempt in pending_attempts(storage):
        abandoned = attempt.checkpoint_id > latest
        # The staging of a completed checkpoint may still await its sink commit (`_begin` does it).
        deleted += abort_attempt(storage, attempt, pipeline.sink if abandoned else None)
        if abandoned:
            aborted.append(attempt.checkpoint_id)
    if failed_before is not None:
        sweep: SweepReport = sweep_orphans(storage, grace_seconds=0.0, now=failed_before)
    else:
        sweep = sweep_orphans(storage, grace_seconds=orphan_grace_seconds)
    counts = registry_counts(storage)
    start, coordinator = pipeline._begin()
    fell_back: list[int] = []
    while start.metadata is not None:
        problems = verify_checkpoint(storage, start.metadata)
        if not problems:
            break
        fell_back.append(start.metadata.checkpoint_id)
        error = CheckpointCorrupted(
            f"chk-{start.metadata.checkpoint_id} fails verification: " + "; ".join(str(p) for p in problems[:3]),
            checkpoint_id=start.metadata.checkpoint_id,
        )
        start = pipeline._fall_back(start, error)  # logs FALLING BACK, raises when none is left
    restored_from = start.metadata.checkpoint_id if start.metadata else None
    redo, coordinator = spark_half_with_fallback(pipeline, start=(start, coordinator))
    batch = complete_attempt(pipeline, redo, coordinator=coordinator) if redo is not None else None
    return RecoveryReport(
        aborted=tuple(aborted), uploads_deleted=deleted, orphans_deleted=len(sweep.orphans), registry=counts,
        restored_from=restored_from, fell_back_from=tuple(fell_back), batch=batch,
    )


# --- retention, savepoints ----------------------------------------------------------------------


@dataclass(frozen=True)
class PruneReport:
    subsumed: tuple[int, ...]
    files_deleted: int
    orphans: int
    orphan_bytes: int
    stale_attempts: int


def prune(
    storage: CheckpointStorage,
    *,
    num_retained: int,
    orphan_grace_seconds: float = 3600.0,
    sink_url: str | None = None,
) -> PruneReport:
    """Subsume checkpoints beyond `num_retained` (after the setting was lowered), forget pending
    attempts of completed checkpoints, sweep orphans older than the grace period (files of
    attempts still pending are kept whatever their age)."""
    coordinator = CheckpointCoordinator(storage, num_retained=num_retained)
    subsumed, files_deleted, blocked = coordinator.subsume()
    if blocked:
        log.warning("prune: retention skipped: %s", blocked)
    latest = max(storage.completed_checkpoint_ids(), default=0)
    stale = [a for a in pending_attempts(storage) if a.checkpoint_id <= latest]
    for attempt in stale:  # its checkpoint completed (referenced files stay) or was superseded
        abort_attempt(storage, attempt, None)
    sweep = sweep_orphans(storage, grace_seconds=orphan_grace_seconds, pending_paths=pending_paths(storage))
    return PruneReport(tuple(subsumed), files_deleted, len(sweep.orphans), sweep.orphan_bytes, len(stale))
