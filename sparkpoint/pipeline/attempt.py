"""One batch in two halves that may run in separate processes: the seam orchestrators drive.

1. `run_spark_half`: trigger checkpoint N, run the Spark job (every subtask restores, applies its
   rows, stages its sink rows, snapshots and uploads) and return a `PendingAttempt`: the
   checkpoint id, the subtask state handles, staged sink files, the next source offsets.
2. `complete_attempt`: needs no Spark. A coordinator rebuilt from storage triggers exactly N,
   acknowledges every handle, writes `_metadata` (exclusive create: the fence against a second
   writer), applies retention and commits the sink.
3. `abort_attempt`: an attempt that will never complete: delete its uploads (those no retained
   checkpoint references) and its sink staging.

`PipelineCore._one_batch` (the CLI) calls 1 then 2 in one process with one coordinator.
An orchestrator running them as two steps persists the attempt in between with `save_attempt`:
versioned JSON at `<job>/_pending/chk-<N>-<attempt id>.json` in checkpoint storage (never pickle).
Storage rather than the orchestrator's IO layer, because recovery needs to find the attempts of
runs that died, from any process, with nothing but the checkpoint URL; the orphan sweep only
looks at `shared/` and `chk-*/`, so these files are managed here: deleted on completion or
abort, and by `recover`/`prune` once their checkpoint is completed or abandoned. The attempt id
(a Dagster run id, say) names which step wrote it, so two overlapping runs never read each
other's attempt.

Completing and aborting the same persisted attempt exclude each other on storage, never by a
check made before acting (DESIGN rule 9): whichever side first creates the attempt's claim file
`<job>/_pending/chk-<N>-<attempt id>.claim` (exclusive create, `sparkpoint.pipeline.claims`)
decides. A completer claims before it writes `_metadata`; an abort claims before it deletes
anything. A completer that finds the abort's claim gives up without writing; an abort that finds
the completer's claim deletes nothing (the completer may be alive and about to commit) until a
checkpoint at or above N exists that is not the attempt's, which it reads from chk-N *after* the
listing that showed it. An abort that wins the claim looks at chk-N once more: a completer that
committed and forgot its claim just before leaves nothing to undo. An abort's claim stays behind
as a tombstone until a checkpoint at or above N completes, so a completer that wakes up late
still finds it. A retry of a completing step whose first try died after its claim (the claim
names its holder) completes the attempt itself when that holder is known dead, and otherwise says
who holds it.

The committed `_metadata` records the attempt id beside the source offsets and the staged sink
files (`committed_offsets`; older files lack it). So a writer whose commit another writer's
checkpoint took can say whose: `finish_step_or_overtaken` returns `Overtaken` ("overtaken by chk-N
of attempt X; nothing committed") instead of raising, once a checkpoint at or above N that is not
the attempt's exists, and aborts the attempt itself.

`tests/support/interleavings.py` runs these actors against each other at every interleaving of their
storage steps that its bound allows.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.crash import crash_point
from sparkpoint.checkpoint.errors import (
    CheckpointAlreadyExists,
    CheckpointCorrupted,
    CheckpointDeclined,
    DeletionBlocked,
    PathEscapesJobDirectory,
    SparkpointError,
    UnknownSharedState,
)
from sparkpoint.checkpoint.metadata import (
    READ_KEY,
    CheckpointMetadata,
    FileHandle,
    SkippedFile,
    SubtaskStateHandle,
    load_skipped_files,
    metadata_path,
    read_facts,
    state_facts,
)
from sparkpoint.checkpoint.paths import validate_name
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.pipeline.badfiles import MANUAL, carried_skips, skipped_entries
from sparkpoint.pipeline.claims import (
    ABORT,
    COMPLETE,
    PENDING_DIR,
    Claim,
    claim,
    claim_holder,
    claim_path,
    current_holder,
    fenced,
    generation_path,
    release,
    take_over,
)
from sparkpoint.pipeline.runtime import BatchReport, PipelineError, _Start
from sparkpoint.spark.faults import InjectedFailure, check_point, fail_at
from sparkpoint.spark.routing import FileLayout, batch_bytes, choose_route
from sparkpoint.spark.sink import ExactlyOnceParquetSink
from sparkpoint.spark.source import SourceOffsets
from sparkpoint.spark.tasks import raised_in_task
from sparkpoint.state.eventtime import advance, lateness_micros

if TYPE_CHECKING:
    from sparkpoint.pipeline.runtime import PipelineCore

log = logging.getLogger(__name__)

ATTEMPT_FORMAT = "sparkpoint-pending-attempt"
ATTEMPT_VERSION = 1
ATTEMPT_KEY = "attempt"  # in a committed `_metadata`'s source offsets: the attempt that committed it
WATERMARK_KEY = "watermark"  # ... and the watermark after its batch (pipelines with an event time)
UNREADABLE_DIR = f"{PENDING_DIR}/unreadable"  # attempt records set aside by `recover`


class AttemptError(SparkpointError):
    """A pending attempt cannot be read, found or completed as asked."""


class AttemptAborted(CheckpointDeclined):
    """Recovery claimed the attempt first: it will never complete; its batch is processed again."""


class AttemptInProgress(AttemptError):
    """Another step holds the attempt's claim and may be committing it right now."""


class AttemptIdReused(PipelineError):
    """A step was started under an attempt id an abort has fenced at the next checkpoint."""


@dataclass(frozen=True)
class SubtaskRun:
    """How one subtask ran in the Spark half."""

    operator: str  # its uid
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
    watermark: int | None = None  # the watermark after this batch (µs since the epoch, UTC): event time only
    late_rows: int = 0  # rows of the batch below the watermark it started with
    # Every input file consumed unprocessed up to this checkpoint (`_metadata`'s `skipped_files`):
    # those of the checkpoint it started from, then the ones this batch skipped. Absent in older records.
    skipped_files: tuple[SkippedFile, ...] = ()
    # How the batch was read (`_metadata`'s `source_offsets.read`): its route ("read-all" or
    # "shuffle"), the bytes its tasks read and the batch's bytes on storage. Absent in older records.
    read: dict[str, Any] | None = None

    @property
    def path(self) -> str:
        return attempt_path(self.checkpoint_id, self.attempt_id)

    def state_handles(self) -> list[SubtaskStateHandle]:
        return [SubtaskStateHandle.loads(h) for h in self.handles]

    def new_files(self) -> list[FileHandle]:
        """Files this attempt uploaded (what an abort deletes unless a checkpoint took them)."""
        return [f for h in self.state_handles() for f in h.new_files()]

    def operator_summary(self, operator: str) -> dict[str, Any]:
        """Per operator (by uid): subtasks, SST files new/reused, bytes uploaded, restore path per subtask."""
        handles = [h for h in self.state_handles() if h.operator == operator]
        return {
            **snapshot_summary(handles, self.checkpoint_id),
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
            "rows": self.rows, "started_at": self.started_at, "watermark": self.watermark,
            "late_rows": self.late_rows,
            **({"skipped_files": [f.to_json() for f in self.skipped_files]} if self.skipped_files else {}),
            **({"read": self.read} if self.read is not None else {}),
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
                watermark=None if raw.get("watermark") is None else _int(raw["watermark"]),
                late_rows=_int(raw.get("late_rows", 0)),
                skipped_files=load_skipped_files(raw.get("skipped_files", []), f"{where}: skipped_files"),
                read=read_facts(raw.get("read")),
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


def snapshot_summary(handles: Iterable[SubtaskStateHandle], checkpoint_id: int) -> dict[str, Any]:
    """One operator's snapshot in checkpoint N: subtasks, SST files new/reused, bytes uploaded."""
    handles = list(handles)
    new = [f for h in handles for f in h.shared + h.staged if f.created_by == checkpoint_id]
    reused = [f for h in handles for f in h.shared + h.staged if f.created_by != checkpoint_id]
    return {
        "checkpoint_id": checkpoint_id,
        "subtasks": len(handles),
        "sst_files_new": len(new),
        "sst_files_reused": len(reused),
        "bytes_uploaded": sum(f.size for h in handles for f in h.new_files()),
        **state_facts(handles),
    }


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{value!r} is not an integer")
    return value


def attempt_path(checkpoint_id: int, attempt_id: str) -> str:
    return f"{PENDING_DIR}/chk-{checkpoint_id}-{attempt_id}.json"


def committed_offsets(attempt: PendingAttempt) -> dict[str, Any]:
    """What `_metadata` records of the attempt that commits it: the source offsets after its
    batch, its staged sink files, and its id (under Dagster the id of the run whose SSTable step
    made it), so that a writer it overtook can say whose checkpoint took its place. `_metadata`
    written before the id was recorded has no `attempt`: readers take it as unknown."""
    offsets: dict[str, Any] = {"source": attempt.source_offsets, "sink": list(attempt.staged),
                               ATTEMPT_KEY: attempt.attempt_id}
    if attempt.watermark is not None:
        offsets[WATERMARK_KEY] = attempt.watermark
    if attempt.read is not None:
        offsets[READ_KEY] = attempt.read
    return offsets




def watermark_of(meta: CheckpointMetadata | None) -> int | None:
    """The watermark a checkpoint recorded (µs since the epoch, UTC; None before any event time)."""
    raw = meta.source_offsets if meta is not None else None
    found = raw.get(WATERMARK_KEY) if isinstance(raw, dict) else None
    return found if isinstance(found, int) and not isinstance(found, bool) else None


def written_by(meta: CheckpointMetadata) -> str | None:
    """The attempt id that committed `meta` (None when its `_metadata` does not record one)."""
    raw = meta.source_offsets
    found = raw.get(ATTEMPT_KEY) if isinstance(raw, dict) else None
    return found if isinstance(found, str) and found else None


def consumed_files(meta: CheckpointMetadata) -> tuple[str, ...]:
    """The input files a checkpoint's source offsets list as consumed (all batches up to it)."""
    raw = meta.source_offsets
    try:
        return SourceOffsets.from_json(raw.get("source") if isinstance(raw, dict) else raw).consumed
    except SparkpointError:
        return ()


# --- the two halves ---------------------------------------------------------------------------


def run_spark_half(
    pipeline: PipelineCore,
    coordinator: CheckpointCoordinator,
    start: _Start,
    files: list[str],
    *,
    attempt_id: str | None = None,
    inject_failure: str | None = None,
    skip: list[tuple[str, str]] | None = None,
) -> PendingAttempt:
    """Trigger checkpoint N and run the Spark job over `files`; every subtask has uploaded when
    this returns. A failure aborts N (an `InjectedFailure` leaves everything, as a crash would).

    Every check of the files comes first (`PipelineCore.check_batch`): under `on_bad_file="fail"`
    a bad file raises `BadInputFile` before anything is triggered; under "skip" the job runs over
    the good files and the bad ones are consumed and recorded as skipped. `skip`: (file, reason)
    pairs to consume unprocessed as well (`sparkpoint skip`)."""
    inject = check_point(inject_failure)
    batch = pipeline.check_batch(files)
    started_at = time.time()
    expected = {op.uid: pipeline.parallelism for op in pipeline.operators}
    watermarks = _watermarks(pipeline, start, batch.max_event_time)
    cid = coordinator.trigger(expected=expected, checkpoint_id=start.next_id,
                              names=pipeline.operator_names()).checkpoint_id
    skipped = [*skipped_entries(batch.bad, cid), *(SkippedFile(n, MANUAL, r, cid) for n, r in skip or [])]
    for entry in skipped:
        log.warning("checkpoint %s skips input file %s", cid, entry.line())
    spec = replace(pipeline._spec(cid, start), watermark_start_us=watermarks[0], watermark_us=watermarks[1])
    if inject:
        spec = replace(spec, inject_failure=inject)
    layouts = [FileLayout(pipeline.source.url_of(v.name), v.size, v.row_group_bytes, v.splittable)
               for v in pipeline.file_verdicts(list(batch.good))]
    route = choose_route(pipeline.config.routing, pipeline.parallelism, layouts)
    try:
        results = pipeline._run_spark(spec, [f.url for f in layouts], layouts, route)
    except KeyboardInterrupt:
        raise  # stop at once: the uploads are the orphan sweep's (or recovery's), as after a kill
    except BaseException as e:
        injected = raised_in_task(e, InjectedFailure)
        if injected is not None:
            raise injected from e
        coordinator.abort(cid, reason=f"batch {files} failed: {type(e).__name__}")
        corrupted = raised_in_task(e, CheckpointCorrupted)
        if corrupted is not None:
            raise corrupted from e
        raise
    uids = [op.uid for op in pipeline.operators]
    results = sorted(results, key=lambda r: (int(r["op"]), int(r["subtask"])))
    consumed = [*files, *(n for n, _ in skip or [])]
    return PendingAttempt(
        job_id=pipeline.config.job_id, checkpoint_id=cid, attempt_id=attempt_id or uuid.uuid4().hex,
        expected=expected, handles=tuple(r["handle"] for r in results),
        staged=tuple(sorted(r["staged"] for r in results if r["staged"])),
        source_offsets=start.offsets.after(consumed).to_json(), files=tuple(batch.good),
        subtasks=tuple(
            SubtaskRun(uids[int(r["op"])], int(r["subtask"]), str(r["restore"]), int(r["rows"]), float(r["seconds"]))
            for r in results
        ),
        rows=sum(int(r["rows"]) for r in results) // len(uids), started_at=started_at,
        watermark=watermarks[1], late_rows=sum(int(r["late"]) for r in results if int(r["op"]) == 0),
        skipped_files=(*carried_skips(start.metadata), *skipped),
        read={"routing": route, "bytes_read": sum(int(r.get("read_bytes") or 0) for r in results),
              "batch_bytes": batch_bytes(layouts)},
    )


def _watermarks(pipeline: PipelineCore, start: _Start, highest: int | None) -> tuple[int | None, int | None]:
    """(the watermark the batch starts with, the one it advances to), for a pipeline with an
    event time: `highest`, the highest event time of its files (their Parquet statistics, read
    by the batch's checks), less the allowed lateness, never below where it was."""
    if pipeline.config.event_time is None:
        return None, None
    before = watermark_of(start.metadata)
    return before, advance(before, highest, lateness_micros(pipeline.config.allowed_lateness))


def complete_attempt(
    pipeline: PipelineCore,
    attempt: PendingAttempt,
    *,
    coordinator: CheckpointCoordinator | None = None,
    inject_failure: str | None = None,
    persisted: bool = False,
) -> tuple[BatchReport, CheckpointMetadata]:
    """Complete checkpoint N of `attempt` and commit its sink rows; needs no Spark.

    Without `coordinator` (another process ran the Spark half) one is rebuilt from storage and
    triggers exactly N. If another writer committed N, or a newer checkpoint completed, the
    commit is refused and this attempt's uploads are deleted. A `persisted` attempt (one that
    recovery can find and abort) is claimed first: when recovery claimed it already, nothing is
    written and `AttemptAborted` is raised.
    """
    inject = check_point(inject_failure)
    cid = attempt.checkpoint_id
    if attempt.job_id != pipeline.config.job_id:
        raise AttemptError(f"attempt {attempt.path} belongs to job {attempt.job_id!r}, not {pipeline.config.job_id!r}")
    storage = pipeline.storage
    held: tuple[int, Claim] | None = None  # (generation, our claim) of a persisted attempt
    if persisted:
        mine = claim(storage, cid, attempt.attempt_id, COMPLETE)
        if mine is not None:
            held = (0, mine)
        else:
            taken = _take_over(pipeline, attempt)
            if not isinstance(taken[0], int):
                return taken  # committed by the try that died
            held = taken
    if coordinator is None:
        _, coordinator = pipeline._begin()
        coordinator.trigger(expected=attempt.expected, checkpoint_id=cid, names=pipeline.operator_names())
    try:
        _check_uploads_present(storage, attempt)
        for handle in attempt.state_handles():
            coordinator.acknowledge(cid, handle)
        fail_at("before-commit", inject, f"checkpoint {cid} acknowledged, _metadata not written")
        completed = coordinator.complete(cid, source_offsets=committed_offsets(attempt),
                                         recheck=lambda: fenced(storage, attempt.attempt_id),
                                         skipped_files=attempt.skipped_files)
    except (InjectedFailure, KeyboardInterrupt):
        raise  # as a crash would leave it: recovery, the next start and the sweep settle it
    except CheckpointAlreadyExists:
        if persisted and _committed_by(storage, attempt):  # another completer of this attempt won: done
            return _finish_committed(pipeline, attempt)
        _after_failure(storage, attempt, held)
        raise
    except BaseException as e:
        coordinator.abort(cid, reason=f"batch {list(attempt.files)} failed to complete: {type(e).__name__}")
        _after_failure(storage, attempt, held)
        raise
    crash_point("after-metadata-before-sink-commit")
    if pipeline.sink:
        pipeline.sink.commit(cid, list(attempt.staged))
    if persisted:
        _forget(storage, attempt)
    return _report(attempt, completed.metadata, completed.files_deleted), completed.metadata


def _report(attempt: PendingAttempt, meta: CheckpointMetadata, files_deleted: int) -> BatchReport:
    return BatchReport(
        checkpoint_id=meta.checkpoint_id, files=attempt.files, rows=attempt.rows,
        state_size=meta.stats.state_size, checkpointed_size=meta.stats.checkpointed_size,
        files_new=meta.stats.files_new, files_reused=meta.stats.files_reused, files_deleted=files_deleted,
        seconds=time.time() - attempt.started_at, restored=tuple(s.restore for s in attempt.subtasks),
        watermark=attempt.watermark, late_rows=attempt.late_rows, skipped=meta.newly_skipped(), read=attempt.read,
    )


def _finish_committed(pipeline: PipelineCore, attempt: PendingAttempt) -> tuple[BatchReport, CheckpointMetadata]:
    """Checkpoint N is committed with this attempt's files (by a completer that died before its
    sink commit, or by another completer of the same attempt): make its output visible (safe to
    repeat) and forget the attempt."""
    meta = CompletedCheckpointStore(pipeline.storage).load(attempt.checkpoint_id)
    if pipeline.sink:
        pipeline.sink.commit(attempt.checkpoint_id, list(attempt.staged))
    _forget(pipeline.storage, attempt)
    log.warning("checkpoint %s of attempt %s was committed by an earlier try; its output is committed now",
                attempt.checkpoint_id, attempt.attempt_id)
    return _report(attempt, meta, 0), meta


def _take_over(
    pipeline: PipelineCore, attempt: PendingAttempt
) -> tuple[int, Claim] | tuple[BatchReport, CheckpointMetadata]:
    """This completer lost the attempt's claim: raise what happened, or take the claim over when
    its holder is a completer known to be dead (a retry after a kill -9 or an OOM between its
    claim and its commit): (the generation we hold, our claim). Returns the checkpoint instead
    when that completer had committed it already."""
    storage, cid = pipeline.storage, attempt.checkpoint_id
    _, held = current_holder(storage, cid, attempt.attempt_id)
    batch = list(attempt.files)
    if held is not None and held.side == ABORT:
        raise AttemptAborted(
            f"checkpoint {cid} of attempt {attempt.attempt_id} was aborted by {held.reason or 'recovery'} "
            f"({held.describe()}): nothing was "
            f"committed, and this attempt never will be; recovery processes batch {batch} again"
        )
    if _committed_by(storage, attempt):
        return _finish_committed(pipeline, attempt)
    if held is None:
        raise AttemptInProgress(
            f"checkpoint {cid} of attempt {attempt.attempt_id}: its claim {claim_path(cid, attempt.attempt_id)} "
            "cannot be read, so this step cannot tell who holds it and commits nothing. Run the recover job: "
            f"once a newer checkpoint took its place it settles the attempt and processes batch {batch} again"
        )
    taken = take_over(storage, cid, attempt.attempt_id) if held.holder_is_gone() else None
    if taken is None:
        raise AttemptInProgress(
            f"checkpoint {cid} of attempt {attempt.attempt_id} is being completed by {held.describe()}; this step "
            "leaves it to that process and commits nothing. If that process is gone (it cannot be checked from "
            f"another host, boot or PID namespace), run the recover job: it processes batch {batch} again as a "
            "newer checkpoint and settles this attempt"
        )
    log.warning("checkpoint %s of attempt %s: its completer (%s) is gone; this step completes it",
                cid, attempt.attempt_id, held.describe())
    return taken


@dataclass(frozen=True)
class AbortOutcome:
    """What `abort_attempt` did with one persisted attempt."""

    checkpoint_id: int
    attempt_id: str
    uploads_deleted: int
    completed: bool  # its checkpoint is committed: only the record was forgotten
    left_to_completer: bool  # a completer holds the claim: nothing was touched
    files: tuple[str, ...] = ()  # the attempt's batch


def abort_attempt(
    storage: CheckpointStorage, attempt: PendingAttempt, sink: ExactlyOnceParquetSink | None
) -> AbortOutcome:
    """Settle a persisted attempt that its own step will not finish: forget it when its checkpoint
    committed, otherwise claim it for the abort and delete its uploads (those no retained
    checkpoint references), its sink staging and its record. Safe to repeat, and safe against a
    completer of the same attempt running at the same time in another process (see the module
    docstring).

    An abort that lost the claim to a completer touches nothing of the attempt (its `_metadata`
    may land at any moment, and its sink commit needs the staged files) until a checkpoint at or
    above N exists that is *not* this attempt's: then the completer can never commit N. That is
    decided after the listing that found such a checkpoint, from chk-N itself: a listing that
    shows chk-N may show the completer's own commit (rule 9)."""
    cid = attempt.checkpoint_id
    completed = AbortOutcome(cid, attempt.attempt_id, 0, completed=True, left_to_completer=False,
                             files=attempt.files)
    if _committed_by(storage, attempt):
        _forget(storage, attempt)  # the sink commit is `_begin`'s if its completer died before it
        return completed
    if not claim(storage, cid, attempt.attempt_id, ABORT, reason="recovery"):
        if not _overtaken(storage, attempt):
            if _committed_by(storage, attempt):  # its completer committed since we looked
                _forget(storage, attempt)
                return completed
            log.warning("checkpoint %s (attempt %s) is claimed by its completer: recovery leaves its uploads to it "
                        "(or to the orphan sweep)", cid, attempt.attempt_id)
            return AbortOutcome(cid, attempt.attempt_id, 0, completed=False, left_to_completer=True,
                                files=attempt.files)
        # chk-N is another writer's, or a newer checkpoint completed: its completer can never
        # commit (the exclusive create fails, or the commit is withdrawn before any sink commit).
    elif _committed_by(storage, attempt):
        # Our claim came after its completer committed and forgot its own claim: nothing to undo.
        _forget(storage, attempt)
        return completed
    deleted = _delete_unreferenced(storage, attempt)
    if sink is not None:
        sink.discard_staged(cid, list(attempt.staged))
    storage.delete([attempt.path])  # the claim stays: the tombstone a late completer finds
    log.warning("aborted the pending attempt of checkpoint %s (%s): %d uploads deleted", cid, attempt.attempt_id,
                deleted)
    return AbortOutcome(cid, attempt.attempt_id, deleted, completed=False, left_to_completer=False,
                        files=attempt.files)


def _overtaken(storage: CheckpointStorage, attempt: PendingAttempt) -> bool:
    """A checkpoint at or above N exists and chk-N is not this attempt's: its completer can never
    commit N any more. chk-N is read *after* the listing, so a completer's `_metadata` that lands
    while we list is seen as its own, never taken for another writer's."""
    if max(storage.completed_checkpoint_ids(), default=0) < attempt.checkpoint_id:
        return False
    return not _committed_by(storage, attempt)


def _committed_by(storage: CheckpointStorage, attempt: PendingAttempt) -> bool:
    """Whether chk-N/_metadata exists and holds this attempt's uploads (not another writer's N).

    A read that fails for another reason than "not found" (a timeout, a 503) raises: taken for
    "not ours", it would let an abort discard the staged output of a checkpoint that committed."""
    try:
        data = storage.read_bytes(metadata_path(attempt.checkpoint_id))
    except FileNotFoundError:
        return False
    try:
        meta = CheckpointMetadata.loads(data)
    except Exception as e:  # cannot tell whose it is: acting on a guess could discard committed output
        raise AttemptError(
            f"chk-{attempt.checkpoint_id}/_metadata cannot be read ({e}): cannot tell whether attempt "
            f"{attempt.attempt_id} committed it; repair or remove it by hand (`sparkpoint verify`), then settle "
            "the attempt again"
        ) from e
    raw = meta.source_offsets
    if not isinstance(raw, dict) or (raw.get("source"), raw.get("sink")) != (attempt.source_offsets,
                                                                            list(attempt.staged)):
        return False
    if ATTEMPT_KEY in raw and raw[ATTEMPT_KEY] != attempt.attempt_id:  # absent in an older `_metadata`
        return False
    return {f.path for f in attempt.new_files()} <= meta.paths()


# --- persistence between the halves -------------------------------------------------------------


def save_attempt(storage: CheckpointStorage, attempt: PendingAttempt) -> str:
    """Persist the attempt whole or not at all (exclusive create: a reader never sees half)."""
    storage.commit_exclusive(attempt.path, attempt.dumps())
    return attempt.path


@dataclass(frozen=True)
class AttemptListing:
    """The job's persisted attempts, oldest checkpoint first, and the records that cannot be read."""

    attempts: tuple[PendingAttempt, ...]
    unreadable: dict[str, str]  # path under the job directory -> why


def list_attempts(storage: CheckpointStorage) -> AttemptListing:
    """Every persisted attempt; an unreadable record is reported, never an error for the others."""
    found, unreadable = [], {}
    for f in storage.walk(PENDING_DIR):
        if not f.path.endswith(".json") or f.path.startswith(UNREADABLE_DIR + "/"):
            continue
        try:
            found.append(PendingAttempt.loads(storage.read_bytes(f.path), where=f"{storage.job_url}/{f.path}"))
        except FileNotFoundError:  # settled by another process meanwhile
            continue
        except (AttemptError, PathEscapesJobDirectory) as e:  # its content, or a link: never readable
            unreadable[f.path] = str(e)
    if unreadable:
        log.error("unreadable pending attempt records (run the recover job to set them aside): %s",
                  "; ".join(f"{p}: {why}" for p, why in sorted(unreadable.items())))
    return AttemptListing(tuple(sorted(found, key=lambda a: (a.checkpoint_id, a.attempt_id))), unreadable)


def pending_attempts(storage: CheckpointStorage) -> list[PendingAttempt]:
    """Every readable persisted attempt of the job, oldest checkpoint first."""
    return list(list_attempts(storage).attempts)


def load_attempt(storage: CheckpointStorage, attempt_id: str) -> PendingAttempt | None:
    """The attempt `attempt_id` persisted (None when it persisted none: no batch was pending)."""
    listing = list_attempts(storage)
    mine = [p for p in listing.unreadable if p.endswith(f"-{attempt_id}.json")]
    if mine:
        raise AttemptError(f"{storage.job_url}/{mine[0]} cannot be read ({listing.unreadable[mine[0]]}); the recover "
                           "job sets it aside and processes its batch again")
    found = [a for a in listing.attempts if a.attempt_id == attempt_id]
    if len(found) > 1:
        raise AttemptError(f"attempt {attempt_id} persisted {len(found)} pending checkpoints; run the recover job")
    return found[0] if found else None


def pending_paths(storage: CheckpointStorage) -> set[str]:
    """Files the persisted attempts reference: the orphan sweep must keep them."""
    return {f.path for a in pending_attempts(storage) for f in a.new_files()}


def set_aside_unreadable(storage: CheckpointStorage, listing: AttemptListing) -> list[str]:
    """Move unreadable attempt records to `_pending/unreadable/` (kept for a look, never read
    again); their uploads are the orphan sweep's after its grace period. Returns the new paths."""
    moved = []
    for path, why in sorted(listing.unreadable.items()):
        target = f"{UNREADABLE_DIR}/{path.rpartition('/')[2]}"
        try:
            data = storage.read_bytes(path)
        except FileNotFoundError:
            continue
        try:
            storage.commit_exclusive(target, data)
        except FileExistsError:
            pass  # set aside before (a crash before the delete below)
        storage.delete([path])
        log.warning("set aside the unreadable pending attempt %s/%s as %s (%s)", storage.job_url, path, target, why)
        moved.append(target)
    return moved


def forget_tombstones(storage: CheckpointStorage) -> int:
    """Delete the claims of settled attempts (no record left) at or below the latest completed
    checkpoint: a completer of such an attempt can never commit any more (chk-N is another
    writer's, so its exclusive create fails, or a newer checkpoint exists, so its commit is
    declined or withdrawn)."""
    latest = max(storage.completed_checkpoint_ids(), default=0)
    doomed = []
    for f in storage.walk(PENDING_DIR):
        name = f.path.rpartition("/")[2]
        base, dot, generation = f.path.rpartition(".")
        if dot and generation.isdigit():  # a takeover's generation: `chk-N-<id>.claim.<g>`
            base, name = base, base.rpartition("/")[2]
        else:
            base = f.path
        if not f.path.startswith(f"{PENDING_DIR}/chk-") or not base.endswith(".claim"):
            continue
        cid = name[len("chk-"):].partition("-")[0]
        if cid.isdigit() and int(cid) <= latest and not storage.exists(base[: -len(".claim")] + ".json"):
            doomed.append(f.path)
    storage.delete(doomed)
    storage.remove_empty_dirs(PENDING_DIR)
    return len(doomed)


def _forget(storage: CheckpointStorage, attempt: PendingAttempt) -> None:
    """A committed attempt: its record and its claim (every generation a takeover may have made;
    any left over is a tombstone `forget_tombstones` deletes)."""
    claims = [generation_path(attempt.checkpoint_id, attempt.attempt_id, g) for g in range(4)]
    storage.delete([attempt.path, *claims])
    storage.remove_empty_dirs(PENDING_DIR)


def _after_failure(storage: CheckpointStorage, attempt: PendingAttempt, held: tuple[int, Claim] | None) -> None:
    """A completion that failed before committing: delete the uploads no checkpoint references
    and give our claim up (`held`: the generation and claim we hold, for a persisted attempt)."""
    try:  # handles not acknowledged before the failure: the coordinator never saw their uploads
        _delete_unreferenced(storage, attempt)
    except Exception as cleanup:  # best effort: the orphan sweep gets what is left
        log.warning("checkpoint %s: could not delete every upload of the attempt: %s", attempt.checkpoint_id,
                    cleanup)
    if held is not None:
        _release_claim(storage, attempt, *held)


def _release_claim(storage: CheckpointStorage, attempt: PendingAttempt, generation: int, mine: Claim) -> None:
    """A completer that failed without committing gives its own claim up, so that recovery can
    abort the attempt. Kept when `_metadata` may be there (its outcome is then the commit's)."""
    if storage.exists(metadata_path(attempt.checkpoint_id)):
        return
    try:
        release(storage, attempt.checkpoint_id, attempt.attempt_id, generation, mine)
    except Exception as e:  # the claim stays: recovery leaves the attempt to the sweep
        log.warning("checkpoint %s: could not release the attempt's claim: %s", attempt.checkpoint_id, e)


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



def pending_files(pipeline: PipelineCore, start: _Start) -> list[str]:
    """The next batch after `start` (`PipelineCore.next_batch`: it ends before a file still being written)."""
    return pipeline.next_batch(start.offsets)


def spark_half_with_fallback(
    pipeline: PipelineCore,
    *,
    attempt_id: str | None = None,
    inject_failure: str | None = None,
    start: tuple[_Start, CheckpointCoordinator] | None = None,
    tick: bool = False,
) -> tuple[PendingAttempt | None, CheckpointCoordinator]:
    """The Spark half of the next unconsumed batch (None: nothing to do), resuming from the
    latest completed checkpoint and falling back to older ones that restore, loudly. With
    `tick`, no unconsumed batch makes a checkpoint of no input (time passes: timers, TTL)."""
    begun, coordinator = start or pipeline._begin()
    while True:
        files = pending_files(pipeline, begun)
        if not files and not tick:
            return None, coordinator
        try:
            return run_spark_half(
                pipeline, coordinator, begun, files, attempt_id=attempt_id, inject_failure=inject_failure
            ), coordinator
        except CheckpointCorrupted as e:
            begun = pipeline._fall_back(begun, e)


# --- the two halves as two steps (what an orchestrator calls) -----------------------------------


def start_step(
    pipeline: PipelineCore, attempt_id: str, *, inject_failure: str | None = None, tick: bool = False
) -> PendingAttempt | None:
    """Step 1: run the Spark half of the next unconsumed batch and persist the attempt.

    None when no batch is unconsumed (nothing uploaded, nothing persisted). An attempt this id
    persisted before (a retried step) is aborted first. An abort's claim fences its attempt id at
    that checkpoint for good (a late completer of the aborted attempt must never commit), so when
    the next checkpoint is one this id was aborted at, `AttemptIdReused` is raised before any
    Spark work: a retry needs an id of its own. `after-upload` fails after persisting.
    """
    inject = check_point(inject_failure)
    storage = pipeline.storage
    for old in pending_attempts(storage):
        if old.attempt_id == attempt_id:
            abort_attempt(storage, old, pipeline.sink)
    following = max(storage.completed_checkpoint_ids(), default=0) + 1
    if claim_holder(storage, following, attempt_id) == ABORT:
        raise AttemptIdReused(
            f"attempt {attempt_id} was aborted at checkpoint {following} and can never complete it: "
            "run this step again under a new attempt id (e.g. one per try)"
        )
    attempt, _ = spark_half_with_fallback(pipeline, attempt_id=attempt_id, inject_failure=inject, tick=tick)
    if attempt is None:
        return None
    save_attempt(pipeline.storage, attempt)
    fail_at("after-upload", inject, f"checkpoint {attempt.checkpoint_id} uploaded, not completed")
    return attempt


def start_steps(
    pipeline: PipelineCore, attempt_id: str, *, max_batches: int | None, inject_failure: str | None = None,
    tick: bool = False, on_commit: Callable[[BatchReport, CheckpointMetadata], None] | None = None,
) -> PendingAttempt | None:
    """Step 1 over a backlog: every unconsumed batch, up to `max_batches` (None: all), each its
    own checkpoint, as `sparkpoint run` takes them. Every batch but the last is completed right
    here, both halves in this process (`on_commit` is told of each); the last one's attempt is
    persisted and returned for step 2, as `start_step` does. So one batch pending makes exactly
    what `start_step` makes, and a failure in batch k leaves batches before k committed, batch k
    to recovery. `inject_failure` hits the last batch (the one step 2 completes).

    The attempt id of the k-th batch is `attempt_id` for the first, `<attempt_id>-b<k>` after:
    each checkpoint's `_metadata` then says which batch of which step wrote it."""
    for k in itertools.count(1):
        last = (max_batches is not None and k >= max_batches) or remaining_batches(pipeline) <= 1
        attempt = start_step(pipeline, attempt_id if k == 1 else f"{attempt_id}-b{k}",
                             inject_failure=inject_failure if last else None, tick=tick and k == 1)
        if attempt is None or last:
            return attempt
        done = finish_step(pipeline, [attempt.attempt_id])
        if done is not None and on_commit is not None:
            on_commit(*done)
    raise AssertionError("unreachable")


def remaining_batches(pipeline: PipelineCore) -> int:
    """How many batches the unconsumed files make (`files_per_checkpoint` files each)."""
    return -(-len(pipeline.pending_files()) // int(pipeline.config.files_per_checkpoint))


def finish_step(
    pipeline: PipelineCore, attempt_ids: Iterable[str], *, inject_failure: str | None = None
) -> tuple[BatchReport, CheckpointMetadata] | None:
    """Step 2: complete the attempt persisted under the first of `attempt_ids` that has one
    (a re-executed run finds its parent's); None when step 1 found nothing to do."""
    for attempt_id in attempt_ids:
        attempt = load_attempt(pipeline.storage, attempt_id)
        if attempt is not None:
            return complete_attempt(pipeline, attempt, inject_failure=inject_failure, persisted=True)
    return None


# What a writer that lost the race for its checkpoint id raises: another writer committed chk-N
# (or a newer checkpoint completed) first, or an abort claimed the attempt once that was so.
LOST_RACE = (CheckpointAlreadyExists, CheckpointDeclined, UnknownSharedState)


@dataclass(frozen=True)
class Overtaken:
    """An attempt another writer's checkpoint took the place of: nothing of it was committed."""

    checkpoint_id: int  # the attempt's N
    attempt_id: str
    by_checkpoint: int  # the first completed checkpoint at or above N that is not the attempt's
    by_attempt: str | None  # the attempt that committed it, when its `_metadata` records one
    files: tuple[str, ...]  # the attempt's batch
    pending: tuple[str, ...]  # of those, the files no checkpoint has consumed yet
    by_savepoint: bool = False  # chk-<by_checkpoint> is a savepoint (of the checkpoint before it)

    def line(self, attempt_word: str = "attempt") -> str:
        """`overtaken by chk-7 of run 1f2e...; nothing committed` (`attempt_word`: what an attempt
        id is to the reader; a Dagster run id is the attempt id of its SSTable step)."""
        by = f"chk-{self.by_checkpoint}" + (f" of {attempt_word} {self.by_attempt}" if self.by_attempt
                                            else f" (its {attempt_word} is not recorded)")
        if self.by_savepoint:
            by = f"the savepoint chk-{self.by_checkpoint}"
        out = f"overtaken by {by}; nothing committed"
        if self.pending:
            out += f"; {', '.join(self.pending)} not consumed yet: the next run processes it"
        return out


def overtaken_by(storage: CheckpointStorage, attempt: PendingAttempt) -> Overtaken | None:
    """How another writer took the place of `attempt`, or None when no checkpoint at or above
    its N exists, or chk-N is its own. Decided after the listing, from chk-N itself (as
    `_overtaken`), so a `_metadata` of this attempt that lands meanwhile is never taken for
    another writer's."""
    ids = sorted(c for c in storage.completed_checkpoint_ids() if c >= attempt.checkpoint_id)
    if not ids or _committed_by(storage, attempt):
        return None
    store = CompletedCheckpointStore(storage)
    by_attempt: str | None = None
    by_savepoint = False
    pending: tuple[str, ...] = ()
    try:
        first = store.load(ids[0])
        by_savepoint = first.is_savepoint
        by_attempt = None if by_savepoint else written_by(first)
        consumed = set(consumed_files(store.load(ids[-1])))
        pending = tuple(f for f in attempt.files if f not in consumed)
    except (SparkpointError, OSError) as e:  # a report only: the outcome stands without it
        log.warning("checkpoint %s: could not read who overtook attempt %s (%s)", attempt.checkpoint_id,
                    attempt.attempt_id, e)
    return Overtaken(attempt.checkpoint_id, attempt.attempt_id, ids[0], by_attempt, attempt.files, pending,
                     by_savepoint)


def finish_step_or_overtaken(
    pipeline: PipelineCore, attempt_ids: Iterable[str], *, inject_failure: str | None = None
) -> tuple[BatchReport, CheckpointMetadata] | Overtaken | None:
    """`finish_step`, except that an attempt another writer overtook (its commit refused, its
    claim taken by an abort, and a checkpoint at or above its N that is not its own exists) is
    aborted here, its uploads and staged sink files deleted, and returned as `Overtaken` instead
    of raising. Any other failure raises as in `finish_step`."""
    for attempt_id in attempt_ids:
        attempt = load_attempt(pipeline.storage, attempt_id)
        if attempt is None:
            continue
        try:
            return complete_attempt(pipeline, attempt, inject_failure=inject_failure, persisted=True)
        except LOST_RACE:
            lost = overtaken_by(pipeline.storage, attempt)
            if lost is None:
                raise
        try:  # its completer (this step) can never commit it: settle it now rather than at the next prune
            abort_attempt(pipeline.storage, attempt, pipeline.sink)
        except (SparkpointError, OSError) as e:
            log.warning("checkpoint %s: the overtaken attempt %s is left to the next prune or recovery (%s)",
                        attempt.checkpoint_id, attempt.attempt_id, e)
        return lost
    return None
