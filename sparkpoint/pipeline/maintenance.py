"""Keeping a job's checkpoints healthy: recover, prune, verify, rebuild the registry, savepoint.

What the orchestrator's jobs call (Dagster's `recover`, `prune`, ... ops are a line each).
Every function reads the truth from checkpoint storage; nothing is carried in memory between
calls.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sparkpoint.checkpoint.catalog import readable_size
from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.errors import CheckpointCorrupted
from sparkpoint.checkpoint.files import FileProblem
from sparkpoint.checkpoint.metadata import CheckpointMetadata
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.checkpoint.sweep import SweepReport, sweep_orphans
from sparkpoint.pipeline.attempt import (
    LOST_RACE,
    AbortOutcome,
    Overtaken,
    PendingAttempt,
    abort_attempt,
    complete_attempt,
    forget_tombstones,
    list_attempts,
    overtaken_by,
    pending_paths,
    recorded_offsets,
    set_aside_unreadable,
    spark_half_with_fallback,
    written_by,
)
from sparkpoint.pipeline.claims import fence, forget_fences
from sparkpoint.pipeline.cleanup import KEEP, CleanupReport, InputCleanup, clean_input
from sparkpoint.pipeline.runtime import BatchReport, BatchStart
from sparkpoint.state.engine.verify import verify_checkpoint
from sparkpoint.state.eventtime import iso_micros
from sparkpoint.state.operators import KeyedOperator
from sparkpoint.tables.sink import Sink
from sparkpoint.tables.sinks import output_facts, table_version

if TYPE_CHECKING:
    from sparkpoint.pipeline.driver import StatefulPipeline

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RegistryCounts:
    """The shared-state registry rebuilt from the retained `_metadata` (or recounted), in numbers."""

    checkpoints: tuple[int, ...]  # retained, newest first
    files: int  # distinct files referenced
    references: int  # sum of reference counts
    blocked: tuple[str, ...]  # why deletion is blocked (unreadable `_metadata`)

    @property
    def message(self) -> str:
        """One line: the files, references and retained checkpoints counted."""
        blocked = f"; deletion blocked: {'; '.join(self.blocked)}" if self.blocked else ""
        return (f"{self.files} files, {self.references} references, retained checkpoints "
                f"{list(self.checkpoints)}{blocked}")

    def to_json(self) -> dict[str, Any]:
        return {"retained": list(self.checkpoints), "registry_files": self.files, "references": self.references,
                "deletion_blocked": list(self.blocked)}


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


def checkpoint_event(storage: CheckpointStorage, meta: CheckpointMetadata, batch: Iterable[str]) -> dict[str, Any]:
    """What an orchestrator announces of a committed checkpoint (an Airflow asset event's
    `extra`), as JSON values: its id, its `_metadata`, its sizes in bytes, its batch's files."""
    return {
        "checkpoint_id": meta.checkpoint_id,
        "path": f"{storage.job_url}/{meta.metadata_path}",
        "state_size": meta.stats.state_size,
        "checkpointed_size": meta.stats.checkpointed_size,
        "batch": list(batch),
    }


def output_event(sink: Sink | None, meta: CheckpointMetadata) -> dict[str, Any] | None:
    """What an orchestrator announces of the rows checkpoint N committed to an output table (an
    Airflow asset event's `extra` on the table's URL), as JSON values: the checkpoint's id, the
    table's URL, the table version (Delta: `table_version`) or snapshot (Iceberg: `snapshot_id`)
    it made, the rows and files it added and the table's columns. None: no sink, or a directory."""
    if sink is None:
        return None
    facts = output_facts(sink, meta.checkpoint_id, list(meta.source_offsets.get("sink") or []))
    version = table_version(facts)
    if version is None:
        return None
    return {"checkpoint_id": meta.checkpoint_id, "url": facts["url"], version[0]: version[1],
            "rows": facts["rows"], "files": facts["files"], "columns": dict(facts["columns"])}


def checkpoint_facts(storage: CheckpointStorage, report: BatchReport, meta: CheckpointMetadata) -> dict[str, Any]:
    """What a completed checkpoint is worth showing, as plain numbers (the UI plots them)."""
    counts = registry_counts(storage)
    state = meta.stats.state_size
    event = checkpoint_event(storage, meta, report.files)
    return {
        **{k: event[k] for k in ("checkpoint_id", "path", "state_size", "checkpointed_size")},
        "incremental_ratio": round(meta.stats.checkpointed_size / state, 4) if state else 0.0,
        "files_new": report.files_new,
        "files_reused": report.files_reused,
        "files_deleted": report.files_deleted,
        "registry_files": counts.files,
        "retained": list(counts.checkpoints),
        "duration_s": round(report.seconds, 3),
        **({"watermark": iso_micros(report.watermark), "late_rows": report.late_rows}
           if report.watermark is not None else {}),  # pipelines with an event time
        **({"skipped_files": [s.to_json() for s in report.skipped]} if report.skipped else {}),  # consumed unprocessed
        **({"routing": report.read["routing"], "input_bytes_read": report.read["bytes_read"],
            "batch_bytes": report.read["batch_bytes"], "read_amplification": report.read_amplification or 0.0}
           if report.read else {}),  # how the batch reached its subtasks, and what that read
        # its storage requests by operation, bytes up and down, input reads apart, and their cost
        **({**report.requests.to_json(), "estimated_cost_usd": report.estimated_cost_usd}
           if report.requests is not None else {}),
    }


def prune_due(storage: CheckpointStorage, *, num_retained: int) -> list[str]:
    """What a prune would do now that the checkpoint step did not: checkpoints beyond
    `num_retained` (the setting was lowered, or retention was skipped) and persisted attempts
    that can never complete. Two listings, and `_metadata` read only when more than
    `num_retained` are listed: cheap enough after every checkpoint. Savepoints count toward
    nothing (retention never subsumes them), so one kept in the job's directory is not a prune
    due after every checkpoint. (Orphans are the sweep's, due once per grace period.)"""
    due = []
    completed = storage.completed_checkpoint_ids()
    if len(completed) > num_retained:
        listing = CompletedCheckpointStore(storage).load_all()
        # An unreadable `_metadata` counts (its kind is unknown; retention is blocked until someone looks).
        checkpoints = sum(1 for m in listing.checkpoints if not m.is_savepoint) + len(listing.unreadable)
        if checkpoints > num_retained:
            due.append(f"{checkpoints} checkpoints retained, num_retained is {num_retained}")
    latest = max(completed, default=0)
    stale = [a.attempt_id for a in list_attempts(storage).attempts if a.checkpoint_id <= latest]
    if stale:
        due.append(f"{len(stale)} attempt(s) at or below chk-{latest} can never complete")
    return due


def prune_reason(due: Sequence[str], last_pruned: float | None, now: float, orphan_grace_seconds: float
                 ) -> str | None:
    """Why a prune is due after a checkpoint (None: it is not): what the checkpoint said is due
    (`prune_due`), else the orphan sweep, once `orphan_grace_seconds` have passed since the job's
    last prune (`last_pruned`; None: never pruned). The one decision of the retention sensor and
    of the checkpoint run that prunes in its own step."""
    if due:
        return "; ".join(due)
    if last_pruned is None or now - last_pruned >= orphan_grace_seconds:
        return "orphan sweep due"
    return None


@dataclass(frozen=True)
class VerifyReport:
    """Every checkpoint verified, newest first, and its problems (none: it verifies)."""

    problems: dict[int, list[FileProblem]]  # newest first; an unreadable `_metadata` is a problem too
    files: dict[int, int] = field(default_factory=dict)  # the files each readable checkpoint lists
    unreadable: dict[int, str] = field(default_factory=dict)  # why a `_metadata` cannot be read

    @property
    def bad(self) -> dict[int, list[str]]:
        """The checkpoints that do not verify, and their problems as text."""
        return {cid: [str(p) for p in ps] for cid, ps in self.problems.items() if ps}

    @property
    def ok(self) -> bool:
        return not self.bad

    @property
    def message(self) -> str:
        """One line: which checkpoints verify, or which do not and the first problem."""
        bad = self.bad
        if not bad:
            return f"checkpoints {sorted(self.problems)} verify"
        first = min(bad)
        return f"checkpoints {sorted(bad)} do not verify; chk-{first}: {bad[first][0]}"

    def to_json(self) -> dict[str, Any]:
        return {"verified": sorted(self.problems)}

    def problems_json(self) -> dict[str, list[str]]:
        """The problems of the checkpoints that do not verify, by id as text (JSON keys)."""
        return {str(cid): problems for cid, problems in self.bad.items()}

    def checkpoints_json(self) -> list[dict[str, Any]]:
        """One verdict per checkpoint, newest first (`sparkpoint verify --json`)."""
        return [{"checkpoint_id": cid, "ok": False, "problems": [f"_metadata: {self.unreadable[cid]}"]}
                if cid in self.unreadable else
                {"checkpoint_id": cid, "ok": not ps, "files": self.files.get(cid), "problems": [str(p) for p in ps]}
                for cid, ps in self.problems.items()]

    def lines(self) -> list[str]:
        """`chk-7: ok (12 files)`, or `chk-6: BAD` and a line per problem, newest first."""
        out = []
        for verdict in self.checkpoints_json():
            out.append(f"chk-{verdict['checkpoint_id']}: " + (f"ok ({verdict['files']} files)" if verdict["ok"]
                                                              else "BAD"))
            out += [f"  {p}" for p in verdict["problems"]]
        return out



def verify_latest(
    storage: CheckpointStorage, *, deep: bool = True
) -> tuple[CheckpointMetadata | None, list[FileProblem]]:
    """The newest checkpoint and what is wrong with its files (empty: it verifies)."""
    meta = CompletedCheckpointStore(storage).latest()
    if meta is None:
        return None, []
    return meta, verify_checkpoint(storage, meta, deep=deep)


def verify_all(storage: CheckpointStorage, *, deep: bool = True) -> VerifyReport:
    """Every retained checkpoint and its problems; unreadable `_metadata` is a problem too."""
    listing = CompletedCheckpointStore(storage).load_all()
    return verify_checkpoints(storage, listing.checkpoints, listing.unreadable, deep=deep)


def verify_checkpoints(storage: CheckpointStorage, checkpoints: Iterable[CheckpointMetadata],
                       unreadable: dict[int, str] | None = None, *, deep: bool = True) -> VerifyReport:
    """`checkpoints`' files checked (present, size, and with `deep` CRC32), and the `unreadable`
    `_metadata` (id -> why) as problems."""
    checkpoints = list(checkpoints)
    out = {m.checkpoint_id: verify_checkpoint(storage, m, deep=deep) for m in checkpoints}
    for cid, why in (unreadable or {}).items():
        out[cid] = [FileProblem(f"chk-{cid}/_metadata", "_metadata", why)]
    return VerifyReport(dict(sorted(out.items(), reverse=True)), {m.checkpoint_id: len(m.paths()) for m in checkpoints},
                        dict(unreadable or {}))


def interruption_summary(storage: CheckpointStorage) -> str:
    """The one line said when a user interrupts a run (Ctrl-C)."""
    try:
        latest = max(storage.completed_checkpoint_ids(), default=None)
    except Exception as e:  # storage gone too: say so, still one line
        return f"interrupted; the last committed checkpoint could not be read ({e}); a rerun resumes from it"
    where = f"chk-{latest} in {storage.job_url}" if latest is not None else f"none yet in {storage.job_url}"
    return (f"interrupted; last committed checkpoint: {where}; a rerun resumes from it; the interrupted "
            "attempt's uploads are left for recovery or the orphan sweep (`sparkpoint gc`)")


# --- recovery ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class RecoveryReport:
    """What `recover` did: the attempts it settled, the orphans swept, where it restored from,
    the batch it processed again."""

    aborted: tuple[int, ...]  # checkpoint ids of the abandoned attempts
    uploads_deleted: int
    orphans_deleted: int
    registry: RegistryCounts
    restored_from: int | None  # the verified checkpoint the re-processing started from
    fell_back_from: tuple[int, ...]  # newer checkpoints that failed verification
    batch: tuple[BatchReport, CheckpointMetadata] | None  # the re-processed batch
    left_to_completer: tuple[int, ...] = ()  # attempts a live completer had claimed: left alone
    set_aside: tuple[str, ...] = ()  # unreadable attempt records moved to _pending/unreadable/
    failed_batch: tuple[str, ...] = ()  # the batch of the failed run's persisted attempts
    failed_batch_committed: CommittedBy | None = None  # ... when a checkpoint has consumed it since
    overtaken: Overtaken | None = None  # the re-processing lost its commit to another writer
    found_committed: tuple[AbortOutcome, ...] = ()  # attempts it settled whose checkpoint their completer committed

    @property
    def message(self) -> str:
        """`summary()` in the orchestrator-neutral words."""
        return self.summary()

    def to_json(self) -> dict[str, Any]:
        return {"aborted": list(self.aborted), "uploads_deleted": self.uploads_deleted,
                "orphans_deleted": self.orphans_deleted, "restored_from": self.restored_from,
                "fell_back_from": list(self.fell_back_from), "summary": self.summary(),
                **({"checkpoint_id": self.batch[1].checkpoint_id} if self.batch is not None else {})}

    def summary(self, attempt_word: str = "attempt") -> str:
        """One readable paragraph for a log: what was aborted, restored, re-processed.
        `attempt_word`: what an attempt id is to the reader (a run, under Dagster)."""
        parts = [f"aborted attempts of checkpoints {list(self.aborted)} ({self.uploads_deleted} uploads deleted)"
                 if self.aborted else "no attempt to abort"]
        if self.failed_batch_committed is not None:
            parts.append(f"the failed batch {', '.join(self.failed_batch)} was already committed by "
                         f"{self.failed_batch_committed.describe(attempt_word)}")
        if self.left_to_completer:
            parts.append(f"left checkpoints {list(self.left_to_completer)} to the completer that claimed them")
        if self.set_aside:
            parts.append(f"set aside unreadable attempt records {list(self.set_aside)}")
        if self.orphans_deleted:
            parts.append(f"{self.orphans_deleted} orphans swept")
        if self.fell_back_from:
            parts.append(f"FELL BACK from checkpoints {list(self.fell_back_from)}, which failed verification")
        parts.append(f"restored from checkpoint {self.restored_from}" if self.restored_from else "started empty")
        if self.batch is not None:
            report, _ = self.batch
            parts.append(f"re-processed {', '.join(report.files)} as checkpoint {report.checkpoint_id}")
        elif self.overtaken is not None:
            parts.append(f"re-processed {', '.join(self.overtaken.files)}: {self.overtaken.line(attempt_word)}")
        else:
            parts.append("no unconsumed batch to re-process")
        return "; ".join(parts)


@dataclass(frozen=True)
class CommittedBy:
    """Which checkpoint consumed a batch, and the attempt that wrote it when its `_metadata` says."""

    checkpoint_id: int
    attempt_id: str | None
    exact: bool  # False: the oldest retained checkpoint lists it, an older one may have committed it

    def describe(self, attempt_word: str = "attempt") -> str:
        where = f"chk-{self.checkpoint_id}" if self.exact else f"chk-{self.checkpoint_id} or an older checkpoint"
        return where + (f" of {attempt_word} {self.attempt_id}" if self.attempt_id and self.exact else "")


def committed_by(storage: CheckpointStorage, files: tuple[str, ...]) -> CommittedBy | None:
    """The first retained checkpoint whose source offsets list every one of `files` (None: not
    all of them are consumed, or nothing is retained)."""
    if not files:
        return None
    checkpoints = sorted(CompletedCheckpointStore(storage).load_all().checkpoints, key=lambda m: m.checkpoint_id)
    for i, meta in enumerate(checkpoints):
        if all(map(recorded_offsets(meta).includes, files)):
            return CommittedBy(meta.checkpoint_id, written_by(meta), exact=i > 0 or meta.checkpoint_id == 1)
    return None


@dataclass(frozen=True)
class AttemptSettlement:
    outcomes: tuple[AbortOutcome, ...]
    set_aside: tuple[str, ...]

    @property
    def aborted(self) -> tuple[int, ...]:
        return tuple(o.checkpoint_id for o in self.outcomes if not o.completed and not o.left_to_completer)

    @property
    def left_to_completer(self) -> tuple[int, ...]:
        return tuple(o.checkpoint_id for o in self.outcomes if o.left_to_completer)

    @property
    def committed(self) -> tuple[AbortOutcome, ...]:
        """Attempts whose checkpoint had committed (their completer died after `_metadata`)."""
        return tuple(o for o in self.outcomes if o.completed)

    @property
    def uploads_deleted(self) -> int:
        return sum(o.uploads_deleted for o in self.outcomes)


def settle_attempts(
    storage: CheckpointStorage, sink: Sink | None, *, only_superseded: bool = False
) -> AttemptSettlement:
    """Abort every persisted attempt whose step will not finish it (forget those whose checkpoint
    committed); with `only_superseded`, only attempts at or below the latest completed checkpoint
    (they can never complete). Unreadable records are set aside unless `only_superseded`; abort
    claims that no completer can need any more are deleted."""
    listing = list_attempts(storage)
    latest = max(storage.completed_checkpoint_ids(), default=0)
    chosen = [a for a in listing.attempts if not only_superseded or a.checkpoint_id <= latest]
    outcomes = tuple(abort_attempt(storage, a, sink) for a in chosen)
    moved = () if only_superseded else tuple(set_aside_unreadable(storage, listing))
    forget_tombstones(storage)
    return AttemptSettlement(outcomes, moved)


def clear_failed_attempts(
    storage: CheckpointStorage, sink: Sink | None, *, failed_before: float | None = None,
    failed_attempts: tuple[str, ...] = (), orphan_grace_seconds: float = 3600.0,
) -> tuple[AttemptSettlement, SweepReport]:
    """Recovery's first half, on storage alone: fence the failed run's attempts, settle every
    persisted attempt and sweep orphans (steps 1 and 2 of `recover`).

    The fence comes first and the listings after it: an attempt of the failed run that a zombie
    of it persists later can then never commit (its claim is taken), so the sweep may take its
    uploads; one whose completer claimed before the fence was persisted before that claim, so the
    listing finds it and its uploads stay (DESIGN rule 9: exclusion on storage, not a listing)."""
    if failed_attempts:
        fenced = fence(storage, failed_attempts, reason="recovery, which fenced the failed run before its orphan sweep")
        log.info("fenced the failed run's attempts before the sweep: %s", fenced)
    settled = settle_attempts(storage, sink)
    keep = pending_paths(storage)
    if failed_before is not None:
        sweep = sweep_orphans(storage, grace_seconds=0.0, now=failed_before, pending_paths=keep)
    else:
        sweep = sweep_orphans(storage, grace_seconds=orphan_grace_seconds, pending_paths=keep)
    return settled, sweep


def recover(
    pipeline: StatefulPipeline, *, failed_before: float | None = None, failed_attempts: tuple[str, ...] = (),
    orphan_grace_seconds: float = 3600.0, attempt_id: str | None = None,
) -> RecoveryReport:
    """Heal the job after a failed batch, then process that batch again.

    1. Abort every persisted attempt whose checkpoint did not complete (its uploads, its sink
       staging); forget those whose checkpoint did; leave alone one that a completer claimed
       (see `sparkpoint.pipeline.attempt`); set unreadable attempt records aside.
    2. Sweep orphans (uploads of attempts that never got persisted, such as a Spark job that
       died mid-upload): with `failed_before` (POSIX seconds, when the failed run ended) every
       unreferenced file written before then, and nothing written after it: those may be a
       live writer's pending uploads (a CLI run on the same job), which a sweep must never take.
       Without it, files older than `orphan_grace_seconds`. Uploads of pending attempts stay.
       `failed_attempts` (the failed run's attempt ids) are fenced before anything is listed,
       so a zombie of the failed run can never commit over what the sweep took.
    3. Rebuild the registry from the retained `_metadata`.
    4. Verify the latest checkpoint; if it fails, fall back to the next older that verifies,
       loudly (its later sink output is rolled back and its batches replayed).
    5. Local state rolls back by itself: each subtask's restore discards a working database that
       is not exactly the restored checkpoint.
    6. Re-process the next unconsumed batch (the failed one): a newer checkpoint completes,
       recorded as written by `attempt_id` (under Dagster, the recover run's id).

    When the failed run's batch was committed by another writer meanwhile, the report says by
    which checkpoint (`failed_batch_committed`), and step 6 takes the next batch, if any. When
    the re-processing loses its commit to another writer (`overtaken`), the report says so and
    nothing fails: its uploads are aborted, and the batch is the other writer's or still pending.
    """
    storage = pipeline.storage
    settled, sweep = clear_failed_attempts(
        storage, pipeline.sink, failed_before=failed_before, failed_attempts=failed_attempts,
        orphan_grace_seconds=orphan_grace_seconds,
    )
    counts = registry_counts(storage)
    start, coordinator = pipeline.begin()
    start, fell_back = _verified_start(pipeline, start)
    restored_from = start.metadata.checkpoint_id if start.metadata else None
    redo, coordinator = spark_half_with_fallback(pipeline, attempt_id=attempt_id, start=(start, coordinator))
    batch, overtaken = _complete_redo(pipeline, redo, coordinator) if redo is not None else (None, None)
    failed_batch = tuple(dict.fromkeys(f for o in settled.outcomes if o.attempt_id in failed_attempts
                                       for f in o.files))
    already = None  # the failed batch, when a checkpoint other than this recovery's consumed it
    if failed_batch and (batch is None or not set(failed_batch) & set(batch[0].files)):
        already = committed_by(storage, failed_batch)
    # An attempt left to a completer that claimed it is settled once the re-processed checkpoint
    # took its id: that completer can never commit now (and one that died never will).
    late = settle_attempts(storage, pipeline.sink, only_superseded=True)
    return RecoveryReport(
        aborted=settled.aborted + late.aborted, uploads_deleted=settled.uploads_deleted + late.uploads_deleted,
        orphans_deleted=len(sweep.orphans), registry=counts, restored_from=restored_from,
        fell_back_from=fell_back, batch=batch,
        left_to_completer=tuple(c for c in settled.left_to_completer if c not in late.aborted),
        set_aside=settled.set_aside, failed_batch=failed_batch,
        failed_batch_committed=already,
        overtaken=overtaken, found_committed=settled.committed,
    )


def _verified_start(pipeline: StatefulPipeline, start: BatchStart) -> tuple[BatchStart, tuple[int, ...]]:
    """`start`, or the newest older checkpoint that verifies, falling back loudly (step 4 of
    `recover`); and the checkpoints fallen back from."""
    fell_back: list[int] = []
    while start.metadata is not None:
        # A job started from a savepoint or another job's checkpoint (and with none of its own
        # yet) restores from that checkpoint's directory: verify it there, not in ours.
        home = CheckpointStorage(*start.restore_job) if start.restore_job is not None else pipeline.storage
        problems = verify_checkpoint(home, start.metadata)
        if not problems:
            break
        fell_back.append(start.metadata.checkpoint_id)
        error = CheckpointCorrupted(
            f"chk-{start.metadata.checkpoint_id} fails verification: " + "; ".join(str(p) for p in problems[:3]),
            checkpoint_id=start.metadata.checkpoint_id,
        )
        start = pipeline.fall_back(start, error)  # logs FALLING BACK, raises when none is left
    return start, tuple(fell_back)


def _complete_redo(pipeline: StatefulPipeline, redo: PendingAttempt, coordinator: CheckpointCoordinator
                   ) -> tuple[tuple[BatchReport, CheckpointMetadata] | None, Overtaken | None]:
    """Complete the re-processed batch (step 6 of `recover`): its checkpoint, or how another
    writer overtook it (its uploads are then deleted, and its staged output, best effort)."""
    try:
        return complete_attempt(pipeline, redo, coordinator=coordinator), None
    except LOST_RACE:  # the commit was refused and the attempt's uploads deleted
        overtaken = overtaken_by(pipeline.storage, redo)
        if overtaken is None:
            raise
    if pipeline.sink is not None:
        try:  # best effort: the next start discards staging at or below the latest checkpoint
            pipeline.sink.discard_staged(redo.checkpoint_id, list(redo.staged))
        except OSError as e:
            log.warning("recovery: the staged output of the overtaken checkpoint %s stays (%s)",
                        redo.checkpoint_id, e)
    log.warning("recovery: %s", overtaken.line())
    return None, overtaken


# --- retention, savepoints ----------------------------------------------------------------------


@dataclass(frozen=True)
class PruneReport:
    """What `prune` did: checkpoints subsumed, files deleted, orphans swept, stale attempts settled,
    and the consumed input cleaned up (`input_cleanup`; None: not asked)."""

    subsumed: tuple[int, ...]
    files_deleted: int
    orphans: int
    orphan_bytes: int
    stale_attempts: int
    input: CleanupReport | None = None

    @property
    def message(self) -> str:
        return (f"subsumed {list(self.subsumed)}, {self.files_deleted} files deleted, {self.orphans} orphans "
                f"({self.orphan_bytes} B), {self.stale_attempts} stale attempts"
                + (f"; {self.input.message}" if self.input is not None else ""))

    def to_json(self) -> dict[str, Any]:
        return {"subsumed": list(self.subsumed), "files_deleted": self.files_deleted, "orphans_deleted": self.orphans,
                "orphan_bytes": self.orphan_bytes, "stale_attempts": self.stale_attempts,
                **({"input_cleanup": self.input.to_json()} if self.input is not None else {})}


def prune(
    storage: CheckpointStorage,
    *,
    num_retained: int,
    orphan_grace_seconds: float = 3600.0,
    sink: Sink | None = None,
    input_cleanup: InputCleanup | None = None,
) -> PruneReport:
    """Subsume checkpoints beyond `num_retained` (after the setting was lowered), forget pending
    attempts of completed checkpoints, sweep orphans older than the grace period (files of
    attempts still pending are kept whatever their age); `sink`: the job's output, whose staging of
    the attempts settled goes. Then `input_cleanup` (`keep`, `delete`, `archive:<url>`) on the
    input files every retained checkpoint and savepoint has consumed, unless retention was
    blocked (`sparkpoint.pipeline.cleanup`); a table input with a policy other than keep is
    refused (InputCleanupRefused) before anything is done."""
    if input_cleanup is not None:
        input_cleanup.refuse_table()
    coordinator = CheckpointCoordinator(storage, num_retained=num_retained)
    subsumed, files_deleted, blocked = coordinator.subsume()
    if blocked:
        log.warning("prune: retention skipped: %s", blocked)
    stale = settle_attempts(storage, sink, only_superseded=True)  # they can never complete
    forget_fences(storage)
    sweep = collect_garbage(storage, grace_seconds=orphan_grace_seconds).sweep
    cleaned = None
    if input_cleanup is not None:
        cleaned = (CleanupReport(input_cleanup.policy, blocked=f"retention was blocked ({blocked})")
                   if blocked and input_cleanup.policy != KEEP else clean_input(storage, input_cleanup))
    return PruneReport(tuple(subsumed), files_deleted, len(sweep.orphans), sweep.orphan_bytes, len(stale.outcomes),
                       cleaned)



@dataclass(frozen=True)
class GcReport:
    """What the orphan sweep of `sparkpoint gc` deleted (`dry_run`: would delete), what it kept as
    younger than the grace period, and the symbolic links it left alone."""

    sweep: SweepReport
    dry_run: bool
    grace_seconds: float
    job_id: str

    @property
    def _verb(self) -> str:
        return "would delete" if self.dry_run else "deleted"

    @property
    def message(self) -> str:
        said = f"{self._verb} {len(self.sweep.orphans)} orphan files, {self.sweep.orphan_bytes} bytes"
        if self.sweep.young:
            said += (f"\nkept {len(self.sweep.young)} unreferenced files ({readable_size(self.sweep.young_bytes)}) "
                     f"younger than the grace period ({self.grace_seconds:g} s): a running job may still be writing "
                     f"them; with no job of {self.job_id} running, include them with --grace 0")
        return said

    def lines(self) -> list[str]:
        """A line per orphan file, then the message."""
        return [f"{self._verb} {f.path} ({f.size} bytes)" for f in self.sweep.orphans] + [self.message]

    def warnings(self) -> list[str]:
        return [f"warning: {link.path} is a symbolic link; it is neither followed nor deleted"
                for link in self.sweep.symlinks]

    def to_json(self) -> dict[str, Any]:
        sweep = self.sweep
        return {"dry_run": self.dry_run, "orphans": [f.path for f in sweep.orphans], "bytes": sweep.orphan_bytes,
                "referenced": sweep.referenced, "symlinks": [f.path for f in sweep.symlinks],
                "young": [f.path for f in sweep.young], "young_bytes": sweep.young_bytes}


def collect_garbage(storage: CheckpointStorage, *, grace_seconds: float, dry_run: bool = False) -> GcReport:
    """Sweep the files no retained checkpoint references, at least `grace_seconds` old. The uploads
    of attempts still pending (a step between its two halves) are kept whatever their age:
    deleting them would fail that attempt's checkpoint step."""
    sweep = sweep_orphans(storage, grace_seconds=grace_seconds, dry_run=dry_run, pending_paths=pending_paths(storage))
    return GcReport(sweep, dry_run, grace_seconds, storage.job_id)

# --- what changed, per operator, when it is cheap to know ------------------------------------------

CHEAP_DIFF_BYTES = 32 << 20  # the differing files a diff may read after a checkpoint (its changelog, new SSTs)


def key_changes(
    storage: CheckpointStorage, previous: CheckpointMetadata, meta: CheckpointMetadata,
    operators: Iterable[KeyedOperator], *, local_dir: str | None = None, max_bytes: int = CHEAP_DIFF_BYTES,
) -> dict[str, dict[str, int]]:
    """Per operator, the keys its export gained, lost and changed from `previous` to `meta`, where
    the diff can go by the files one lists and the other lacks (one lineage, the same key-group
    layout, no TTL) and those files hold at most `max_bytes`: the batch's changelog, a
    materialization's new SSTs. Operators it would cost more for are left out."""
    from sparkpoint.state.diff import CHANGED_FILES, Snapshot, cheap_path_refusal, diff_snapshots

    before, after = Snapshot(storage, previous), Snapshot(storage, meta)
    out: dict[str, dict[str, int]] = {}
    for op in operators:
        if op.uid not in previous.operators or op.uid not in meta.operators:
            continue
        if cheap_path_refusal(before, after, op.uid) is not None:
            continue
        old = {f.path for h in previous.operators[op.uid].subtasks for f in h.files()}
        new = {f.path: f.size for h in meta.operators[op.uid].subtasks for f in h.files()}
        if sum(size for path, size in new.items() if path not in old) > max_bytes:
            continue
        counts = diff_snapshots(before, after, op, local_dir=local_dir, method=CHANGED_FILES).counts()
        out[op.name] = {"keys_added": counts["added"], "keys_removed": counts["removed"],
                        "keys_changed": counts["changed"]}
    return out
