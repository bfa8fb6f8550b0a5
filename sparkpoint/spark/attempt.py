"""One batch in two halves that may run in separate processes: the seam orchestrators drive.

1. `run_spark_half`: trigger checkpoint N, run the Spark job (every subtask restores, applies its
   rows, stages its sink rows, snapshots and uploads) and return a `PendingAttempt`: the
   checkpoint id, the subtask state handles, staged sink files, the next source offsets.
2. `complete_attempt`: needs no Spark. A coordinator rebuilt from storage triggers exactly N,
   acknowledges every handle, writes `_metadata` (exclusive create: the fence against a second
   writer), applies retention and commits the sink.
3. `abort_attempt`: an attempt that will never complete: delete its uploads (those no retained
   checkpoint references) and its sink staging.

`StatefulPipeline._one_batch` (the CLI) calls 1 then 2 in one process with one coordinator.
An orchestrator running them as two steps persists the attempt in between with `save_attempt`:
versioned JSON at `<job>/_pending/chk-<N>-<attempt id>.json` in checkpoint storage (never pickle).
Storage rather than the orchestrator's IO layer, because recovery needs to find the attempts of
runs that died, from any process, with nothing but the checkpoint URL; the orphan sweep only
looks at `shared/` and `chk-*/`, so these files are managed here: deleted on completion or
abort, and by `recover`/`prune` once their checkpoint is completed or abandoned. The attempt id
(a Dagster run id, say) names which step wrote it, so two overlapping runs never read each
other's attempt.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from sparkpoint.core.coordinator import CheckpointCoordinator
from sparkpoint.core.crash import crash_point
from sparkpoint.core.errors import CheckpointCorrupted, CheckpointDeclined, DeletionBlocked, SparkpointError
from sparkpoint.core.metadata import CheckpointMetadata, FileHandle, SubtaskStateHandle
from sparkpoint.core.paths import validate_name
from sparkpoint.core.storage import CheckpointStorage
from sparkpoint.core.store import CompletedCheckpointStore
from sparkpoint.spark.faults import InjectedFailure, check_point, fail_at
from sparkpoint.spark.runtime import BatchReport, _Start
from sparkpoint.spark.sink import ExactlyOnceParquetSink
from sparkpoint.spark.source import SourceOffsets
from sparkpoint.spark.tasks import raised_in_task

if TYPE_CHECKING:
    from sparkpoint.spark.runtime import StatefulPipeline

log = logging.getLogger(__name__)

ATTEMPT_FORMAT = "sparkpoint-pending-attempt"
ATTEMPT_VERSION = 1
PENDING_DIR = "_pending"


class AttemptError(SparkpointError):
    """A pending attempt cannot be read, found or completed as asked."""


@dataclass(frozen=True)
class SubtaskRun:
    """How one subtask ran in the Spark half."""

    operator: str
    subtask: int
    restore: str  # working | local | primary | rescale | empty
    rows: int
    seconds: float


@dataclass(frozen=True)
class PendingAttempt:
    """The Spark half's result: everything the completing half needs, as plain JSON."""

    job_id: str
    checkpoint_id: int
    attempt_id: str
    expected: dict[str, int]  # operator -> parallelism
    handles: tuple[str, ...]  # SubtaskStateHandle.dumps(), sorted by (operator, subtask)
    staged: tuple[str, ...]  # sink files staged for this checkpoint
    source_offsets: dict[str, Any]  # SourceOffsets.to_json() after this batch
    files: tuple[str, ...]  # the input files of the batch
    subtasks: tuple[SubtaskRun, ...]
    rows: int
    started_at: float  # POSIX seconds when the checkpoint was triggered
    format_version: int = ATTEMPT_VERSION

    @property
    def path(self) -> str:
        return attempt_path(self.checkpoint_id, self.attempt_id)

    def state_handles(self) -> list[SubtaskStateHandle]:
        return [SubtaskStateHandle.loads(h) for h in self.handles]

    def new_files(self) -> list[FileHandle]:
        """Files this attempt uploaded (what an abort deletes unless a checkpoint took them)."""
        return [f for h in self.state_handles() for f in h.new_files()]

    def operator_summary(self, operator: str) -> dict[str, Any]:
        """Per operator: subtasks, SST files new/reused, bytes uploaded, restore path per subtask."""
        handles = [h for h in self.state_handles() if h.operator == operator]
        new = [f for h in handles for f in h.shared if f.created_by == self.checkpoint_id]
        reused = [f for h in handles for f in h.shared if f.created_by != self.checkpoint_id]
        uploaded = sum(f.size for h in handles for f in h.new_files())
        return {
            "checkpoint_id": self.checkpoint_id,
            "subtasks": len(handles),
            "sst_files_new": len(new),
            "sst_files_reused": len(reused),
            "bytes_uploaded": uploaded,
            "restore": {str(s.subtask): s.restore for s in self.subtasks if s.operator == operator},
            "rows": sum(s.rows for s in self.subtasks if s.operator == operator),
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "format": ATTEMPT_FORMAT, "version": self.format_version, "job_id": self.job_id,
            "checkpoint_id": self.checkpoint_id, "attempt_id": self.attempt_id, "expected": dict(self.expected),
            "handles": list(self.handles), "staged": list(self.staged), "source_offsets": self.source_offsets,
            "files": list(self.files),
            "subtasks": [
                {"operator": s.operator, "subtask": s.subtask, "restore": s.restore, "rows": s.rows,
                 "seconds": s.seconds}
                for s in self.subtasks
            ],
            "rows": self.rows, "started_at": self.started_at,
        }

    def dumps(self) -> bytes:
        return json.dumps(self.to_json(), indent=1, allow_nan=False).encode("utf-8")

    @classmethod
    def from_json(cls, raw: Any, *, where: str = "pending attempt") -> PendingAttempt:
        try:
            if not isinstance(raw, dict) or raw.get("format") != ATTEMPT_FORMAT:
                raise ValueError(f"not a {ATTEMPT_FORMAT} document")
            if raw.get("version") != ATTEMPT_VERSION:
                raise ValueError(f"version {raw.get('version')!r}, this sparkpoint reads version {ATTEMPT_VERSION}")
            attempt = cls(
                job_id=str(raw["job_id"]), checkpoint_id=_int(raw["checkpoint_id"]),
                attempt_id=validate_name(str(raw["attempt_id"]), "attempt id"),
                expected={str(k): _int(v) for k, v in dict(raw["expected"]).items()},
                handles=tuple(str(h) for h in raw["handles"]), staged=tuple(str(s) for s in raw["staged"]),
                source_offsets=dict(raw["source_offsets"]), files=tuple(str(f) for f in raw["files"]),
                subtasks=tuple(
                    SubtaskRun(str(s["operator"]), _int(s["subtask"]), str(s["restore"]), _int(s["rows"]),
                               float(s["seconds"]))
                    for s in raw["subtasks"]
                ),
                rows=_int(raw["rows"]), started_at=float(raw["started_at"]),
            )
            SourceOffsets.from_json(attempt.source_offsets)
            for h in attempt.state_handles():
                if h.checkpoint_id != attempt.checkpoint_id:
                    raise ValueError(f"a handle of checkpoint {h.checkpoint_id} in attempt {attempt.checkpoint_id}")
        except (KeyError, TypeError, ValueError, SparkpointError) as e:
            raise AttemptError(
                f"{where} cannot be read ({e}); abort it with the recover job (or `sparkpoint gc`)"
            ) from e
        return attempt

    @classmethod
    def loads(cls, data: bytes, *, where: str = "pending attempt") -> PendingAttempt:
        try:
            raw = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise AttemptError(f"{where} is not UTF-8 JSON ({e}); abort it with the recover job") from e
        return cls.from_json(raw, where=where)


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{value!r} is not an integer")
    return value


def attempt_path(checkpoint_id: int, attempt_id: str) -> str:
    return f"{PENDING_DIR}/chk-{checkpoint_id}-{attempt_id}.json"


# --- the two halves ---------------------------------------------------------------------------


def run_spark_half(
    pipeline: StatefulPipeline,
    coordinator: CheckpointCoordinator,
    start: _Start,
    files: list[str],
    *,
    attempt_id: str | None = None,
    inject_failure: str | None = None,
) -> PendingAttempt:
    """Trigger checkpoint N and run the Spark job over `files`; every subtask has uploaded when
    this returns. A failure aborts N (an `InjectedFailure` leaves everything, as a crash would)."""
    inject = check_point(inject_failure)
    started_at = time.time()
    expected = {op.name: pipeline.config.parallelism for op in pipeline.operators}
    cid = coordinator.trigger(expected=expected, checkpoint_id=start.next_id).checkpoint_id
    spec = pipeline._spec(cid, start)
    if inject:
        spec = replace(spec, inject_failure=inject)
    try:
        results = pipeline._run_spark(spec, [pipeline.source.url_of(f) for f in files])
    except BaseException as e:
        injected = raised_in_task(e, InjectedFailure)
        if injected is not None:
            raise injected from e
        coordinator.abort(cid, reason=f"batch {files} failed: {type(e).__name__}")
        corrupted = raised_in_task(e, CheckpointCorrupted)
        if corrupted is not None:
            raise corrupted from e
        raise
    names = [op.name for op in pipeline.operators]
    results = sorted(results, key=lambda r: (int(r["op"]), int(r["subtask"])))
    return PendingAttempt(
        job_id=pipeline.config.job_id, checkpoint_id=cid, attempt_id=attempt_id or uuid.uuid4().hex,
        expected=expected, handles=tuple(r["handle"] for r in results),
        staged=tuple(sorted(r["staged"] for r in results if r["staged"])),
        source_offsets=start.offsets.after(files).to_json(), files=tuple(files),
        subtasks=tuple(
            SubtaskRun(names[int(r["op"])], int(r["subtask"]), str(r["restore"]), int(r["rows"]), float(r["seconds"]))
            for r in results
        ),
        rows=sum(int(r["rows"]) for r in results) // len(names), started_at=started_at,
    )


def complete_attempt(
    pipeline: StatefulPipeline,
    attempt: PendingAttempt,
    *,
    coordinator: CheckpointCoordinator | None = None,
    inject_failure: str | None = None,
) -> tuple[BatchReport, CheckpointMetadata]:
    """Complete checkpoint N of `attempt` and commit its sink rows; needs no Spark.

    Without `coordinator` (another process ran the Spark half) one is rebuilt from storage and
    triggers exactly N. If another writer committed N, or a newer checkpoint completed, the
    commit is refused and this attempt's uploads are deleted.
    """
    inject = check_point(inject_failure)
    cid = attempt.checkpoint_id
    if attempt.job_id != pipeline.config.job_id:
        raise AttemptError(f"attempt {attempt.path} belongs to job {attempt.job_id!r}, not {pipeline.config.job_id!r}")
    if coordinator is None:
        _, coordinator = pipeline._begin()
        coordinator.trigger(expected=attempt.expected, checkpoint_id=cid)
    try:
        _check_uploads_present(pipeline.storage, attempt)
        for handle in attempt.state_handles():
            coordinator.acknowledge(cid, handle)
        fail_at("before-commit", inject, f"checkpoint {cid} acknowledged, _metadata not written")
        completed = coordinator.complete(cid, source_offsets={"source": attempt.source_offsets,
                                                              "sink": list(attempt.staged)})
    except InjectedFailure:
        raise
    except BaseException as e:
        coordinator.abort(cid, reason=f"batch {list(attempt.files)} failed to complete: {type(e).__name__}")
        try:  # handles not acknowledged before the failure: the coordinator never saw their uploads
            _delete_unreferenced(pipeline.storage, attempt)
        except Exception as cleanup:  # best effort: the orphan sweep gets what is left
            log.warning("checkpoint %s: could not delete every upload of the attempt: %s", cid, cleanup)
        raise
    crash_point("after-metadata-before-sink-commit")
    if pipeline.sink:
        pipeline.sink.commit(cid, list(attempt.staged))
    _forget(pipeline.storage, attempt)
    meta = completed.metadata
    report = BatchReport(
        checkpoint_id=cid, files=attempt.files, rows=attempt.rows,
        state_size=meta.stats.state_size, checkpointed_size=meta.stats.checkpointed_size,
        files_new=completed.files_new, files_reused=completed.files_reused, files_deleted=completed.files_deleted,
        seconds=time.time() - attempt.started_at, restored=tuple(s.restore for s in attempt.subtasks),
    )
    return report, meta


def abort_attempt(storage: CheckpointStorage, attempt: PendingAttempt, sink: ExactlyOnceParquetSink | None) -> int:
    """Delete what a failed attempt left: its uploads no retained checkpoint references, its
    sink staging, its persisted JSON. Returns how many uploads were deleted. Safe to repeat,
    and safe on an attempt whose checkpoint did complete (its files are referenced)."""
    deleted = _delete_unreferenced(storage, attempt)
    if sink is not None:
        sink.discard_staged(attempt.checkpoint_id, list(attempt.staged))
    _forget(storage, attempt)
    log.warning("aborted the pending attempt of checkpoint %s (%s): %d uploads deleted", attempt.checkpoint_id,
                attempt.attempt_id, deleted)
    return deleted


# --- persistence between the halves -------------------------------------------------------------


def save_attempt(storage: CheckpointStorage, attempt: PendingAttempt) -> str:
    storage.write_bytes(attempt.path, attempt.dumps())
    return attempt.path


def load_attempt(storage: CheckpointStorage, attempt_id: str) -> PendingAttempt | None:
    """The attempt `attempt_id` persisted (None when it persisted none: no batch was pending)."""
    found = [a for a in pending_attempts(storage) if a.attempt_id == attempt_id]
    if len(found) > 1:
        raise AttemptError(f"attempt {attempt_id} persisted {len(found)} pending checkpoints; run the recover job")
    return found[0] if found else None


def pending_attempts(storage: CheckpointStorage) -> list[PendingAttempt]:
    """Every persisted attempt of the job, oldest checkpoint first."""
    found = []
    for f in storage.walk(PENDING_DIR):
        if not f.path.endswith(".json"):
            continue
        found.append(PendingAttempt.loads(storage.read_bytes(f.path), where=f"{storage.job_url}/{f.path}"))
    return sorted(found, key=lambda a: (a.checkpoint_id, a.attempt_id))


def pending_paths(storage: CheckpointStorage) -> set[str]:
    """Files the persisted attempts reference: the orphan sweep must keep them."""
    return {f.path for a in pending_attempts(storage) for f in a.new_files()}


def _forget(storage: CheckpointStorage, attempt: PendingAttempt) -> None:
    storage.delete([attempt.path])
    storage.remove_empty_dirs(PENDING_DIR)


# --- internals --------------------------------------------------------------------------------


def _check_uploads_present(storage: CheckpointStorage, attempt: PendingAttempt) -> None:
    """A late completer must not commit a checkpoint whose uploads an abort already deleted."""
    for f in attempt.new_files():
        try:
            size = storage.info(f.path).size
        except FileNotFoundError:
            size = None
        if size != f.size:
            raise CheckpointDeclined(
                f"checkpoint {attempt.checkpoint_id}: upload {f.path} is "
                f"{'missing' if size is None else f'{size} bytes, expected {f.size}'} (aborted by recovery?); "
                "the batch will be processed again by the next materialization"
            )


def _delete_unreferenced(storage: CheckpointStorage, attempt: PendingAttempt) -> int:
    registry = CompletedCheckpointStore(storage).rebuild_registry()
    if registry.deletion_blocked:
        raise DeletionBlocked(
            f"not deleting the uploads of checkpoint {attempt.checkpoint_id}: "
            + "; ".join(registry.blocked_reasons)
        )
    doomed = [f.path for f in attempt.new_files() if not registry.is_known(f.path)]
    deleted = storage.delete(doomed)
    storage.remove_empty_dirs(f"chk-{attempt.checkpoint_id}")
    return deleted



def pending_files(pipeline: StatefulPipeline, start: _Start) -> list[str]:
    return pipeline.source.pending(start.offsets)[: pipeline.config.files_per_checkpoint]


def spark_half_with_fallback(
    pipeline: StatefulPipeline,
    *,
    attempt_id: str | None = None,
    inject_failure: str | None = None,
    start: tuple[_Start, CheckpointCoordinator] | None = None,
) -> tuple[PendingAttempt | None, CheckpointCoordinator]:
    """The Spark half of the next unconsumed batch (None: nothing to do), resuming from the
    latest completed checkpoint and falling back to older ones that restore, loudly."""
    begun, coordinator = start or pipeline._begin()
    while True:
        files = pending_files(pipeline, begun)
        if not files:
            return None, coordinator
        try:
            return run_spark_half(
                pipeline, coordinator, begun, files, attempt_id=attempt_id, inject_failure=inject_failure
            ), coordinator
        except CheckpointCorrupted as e:
            begun = pipeline._fall_back(begun, e)


# --- the two halves as two steps (what an orchestrator calls) -----------------------------------


def start_step(
    pipeline: StatefulPipeline, attempt_id: str, *, inject_failure: str | None = None
) -> PendingAttempt | None:
    """Step 1: run the Spark half of the next unconsumed batch and persist the attempt.

    None when no batch is unconsumed (nothing uploaded, nothing persisted). An attempt this id
    persisted before (a retried step) is aborted first. `after-upload` fails after persisting.
    """
    inject = check_point(inject_failure)
    for old in pending_attempts(pipeline.storage):
        if old.attempt_id == attempt_id:
            abort_attempt(pipeline.storage, old, pipeline.sink)
    attempt, _ = spark_half_with_fallback(pipeline, attempt_id=attempt_id, inject_failure=inject)
    if attempt is None:
        return None
    save_attempt(pipeline.storage, attempt)
    fail_at("after-upload", inject, f"checkpoint {attempt.checkpoint_id} uploaded, not completed")
    return attempt


def finish_step(
    pipeline: StatefulPipeline, attempt_ids: Iterable[str], *, inject_failure: str | None = None
) -> tuple[BatchReport, CheckpointMetadata] | None:
    """Step 2: complete the attempt persisted under the first of `attempt_ids` that has one
    (a re-executed run finds its parent's); None when step 1 found nothing to do."""
    for attempt_id in attempt_ids:
        attempt = load_attempt(pipeline.storage, attempt_id)
        if attempt is not None:
            return complete_attempt(pipeline, attempt, inject_failure=inject_failure)
    return None
