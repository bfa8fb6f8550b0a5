"""The attempt protocol: the Spark half of a batch, its completion and its abort, which may run in
separate processes (see `sparkpoint.pipeline.attempt` for how they exclude each other).

1. `run_spark_half`: trigger checkpoint N, run the Spark job (every subtask restores, applies its
   rows, stages its sink rows, snapshots and uploads) and return a `PendingAttempt`.
2. `complete_attempt`: needs no Spark. A coordinator rebuilt from storage triggers exactly N,
   acknowledges every handle, writes `_metadata` (exclusive create: the fence against a second
   writer), applies retention and commits the sink.
3. `abort_attempt`: an attempt that will never complete: delete its uploads (those no retained
   checkpoint references) and its sink staging.

Each takes the pipeline's driver through its public seam (`BatchDriver`).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

from sparkpoint.checkpoint import ledger
from sparkpoint.checkpoint.coordinator import CheckpointCoordinator, CompletedCheckpoint
from sparkpoint.checkpoint.crash import crash_point
from sparkpoint.checkpoint.errors import (
    CheckpointAlreadyExists,
    CheckpointCorrupted,
    CheckpointDeclined,
    DeletionBlocked,
    UnknownSharedState,
)
from sparkpoint.checkpoint.ledger import Prices, RequestLedger
from sparkpoint.checkpoint.metadata import CheckpointMetadata, CheckpointStats, SkippedFile, metadata_path
from sparkpoint.checkpoint.phases import Phase, phases_from_json
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.pipeline import monitoring
from sparkpoint.pipeline.attempt.record import (
    ATTEMPT_KEY,
    AttemptError,
    PendingAttempt,
    SubtaskRun,
    committed_offsets,
    restore_summary,
    watermark_of,
)
from sparkpoint.pipeline.attempt.store import forget_attempt
from sparkpoint.pipeline.badfiles import MANUAL, carried_skips, skipped_entries
from sparkpoint.pipeline.claims import (
    ABORT,
    COMPLETE,
    Claim,
    claim,
    claim_path,
    current_holder,
    fenced,
    release,
    take_over,
)
from sparkpoint.pipeline.history import phase_seconds
from sparkpoint.pipeline.observe import observe_checkpoint
from sparkpoint.pipeline.runtime import BatchDriver, BatchReport, BatchStart
from sparkpoint.spark.faults import InjectedFailure, check_point, fail_at
from sparkpoint.spark.routing import FileLayout, batch_bytes, choose_route
from sparkpoint.spark.tasks import raised_in_task
from sparkpoint.state.eventtime import advance, lateness_micros
from sparkpoint.tables.sink import Sink

log = logging.getLogger(__name__)

# What a writer that lost the race for its checkpoint id raises: another writer committed chk-N
# (or a newer checkpoint completed) first, or an abort claimed the attempt once that was so.
LOST_RACE = (CheckpointAlreadyExists, CheckpointDeclined, UnknownSharedState)


class AttemptAborted(CheckpointDeclined):
    """Recovery claimed the attempt first: it will never complete; its batch is processed again."""


class AttemptInProgress(AttemptError):
    """Another step holds the attempt's claim and may be committing it right now."""


def run_spark_half(
    pipeline: BatchDriver,
    coordinator: CheckpointCoordinator,
    start: BatchStart,
    files: list[str],
    *,
    attempt_id: str | None = None,
    inject_failure: str | None = None,
    skip: list[tuple[str, str]] | None = None,
) -> PendingAttempt:
    """Trigger checkpoint N and run the Spark job over `files`; every subtask has uploaded when
    this returns. A failure aborts N (an `InjectedFailure` leaves everything, as a crash would).

    Every check of the files comes first (`StatefulPipeline.check_batch`): under `on_bad_file="fail"`
    a bad file raises `BadInputFile` before anything is triggered; under "skip" the job runs over
    the good files and the bad ones are consumed and recorded as skipped. `skip`: (file, reason)
    pairs to consume unprocessed as well (`sparkpoint skip`)."""
    inject = check_point(inject_failure)
    offsets = pipeline.source.advance(start.offsets, [*files, *(n for n, _ in skip or [])])
    batch = pipeline.check_batch(files)
    started_at = time.time()
    expected = {op.uid: pipeline.parallelism for op in pipeline.operators}
    watermarks = _watermarks(pipeline, start, batch.max_event_time)
    cid = coordinator.trigger(expected=expected, checkpoint_id=start.next_id,
                              names=pipeline.operator_names()).checkpoint_id
    skipped = [*skipped_entries(batch.bad, cid), *(SkippedFile(n, MANUAL, r, cid) for n, r in skip or [])]
    for entry in skipped:
        log.warning("checkpoint %s skips input file %s", cid, entry.line())
    spec = replace(pipeline.task_spec(cid, start), watermark_start_us=watermarks[0], watermark_us=watermarks[1],
                   inject_failure=inject, file_columns=pipeline.source.file_columns(list(batch.good)))
    layouts = [FileLayout(pipeline.source.url_of(v.name), v.size, v.row_group_bytes, v.splittable)
               for v in pipeline.file_verdicts(list(batch.good))]
    route = choose_route(pipeline.config.routing, pipeline.parallelism, layouts)
    try:
        results = pipeline.run_spark(spec, [f.url for f in layouts], layouts, route)
    except KeyboardInterrupt:
        raise  # stop at once: the uploads are the orphan sweep's (or recovery's), as after a kill
    except BaseException as e:
        monitoring.checkpoint_failed(pipeline.config)
        _abort_failed_job(coordinator, cid, files, e)
        raise
    return PendingAttempt(
        job_id=pipeline.config.job_id, checkpoint_id=cid, attempt_id=attempt_id or uuid.uuid4().hex,
        expected=expected, source_offsets=offsets.to_json(),
        files=tuple(batch.good), started_at=started_at, watermark=watermarks[1],
        skipped_files=(*carried_skips(start.metadata), *skipped),
        base=start.metadata.checkpoint_id if start.metadata is not None and start.restore_job is None else None,
        **_results_of(pipeline, results, route, batch_bytes(layouts)),
    )


def _abort_failed_job(coordinator: CheckpointCoordinator, cid: int, files: list[str], error: BaseException) -> None:
    """The Spark job of checkpoint `cid` failed: abort the checkpoint, and raise what a task raised
    when it says more than Spark's wrapper (an injected failure leaves everything, as a crash)."""
    injected = raised_in_task(error, InjectedFailure)
    if injected is not None:
        raise injected from error
    coordinator.abort(cid, reason=f"batch {files} failed: {type(error).__name__}")
    corrupted = raised_in_task(error, CheckpointCorrupted)
    if corrupted is not None:
        raise corrupted from error


def _results_of(pipeline: BatchDriver, results: list[dict[str, Any]], route: str, read_bytes: int
                ) -> dict[str, Any]:
    """The `PendingAttempt` fields the subtasks' result rows make (one per (operator, subtask))."""
    uids = [op.uid for op in pipeline.operators]
    results = sorted(results, key=lambda r: (int(r["op"]), int(r["subtask"])))
    return {
        "handles": tuple(r["handle"] for r in results),
        "staged": tuple(sorted(name for r in results for name in r["staged"] or ())),
        "subtasks": tuple(SubtaskRun(uids[int(r["op"])], int(r["subtask"]), str(r["restore"]), int(r["rows"]),
                                     float(r["seconds"]), _phases(r.get("phases")),
                                     json.loads(r["restore_phases"]) if r.get("restore_phases") else None)
                          for r in results),
        "rows": sum(int(r["rows"]) for r in results) // len(uids),
        "late_rows": sum(int(r["late"]) for r in results if int(r["op"]) == 0),
        "read": {"routing": route, "bytes_read": sum(int(r.get("read_bytes") or 0) for r in results),
                 "batch_bytes": read_bytes},
        "requests": sum((RequestLedger.from_json(json.loads(r["requests"]), "a task's requests")
                         for r in results if r.get("requests")), ledger.drain()),
    }


def _phases(raw: Any) -> tuple[Phase, ...]:
    """A subtask's timed phases from its result row (JSON text; none from an older task)."""
    try:
        return phases_from_json(json.loads(raw)) if isinstance(raw, str) else ()
    except ValueError:
        return ()


def _watermarks(pipeline: BatchDriver, start: BatchStart, highest: int | None) -> tuple[int | None, int | None]:
    """(the watermark the batch starts with, the one it advances to), for a pipeline with an
    event time: `highest`, the highest event time of its files (their Parquet statistics, read
    by the batch's checks), less the allowed lateness, never below where it was."""
    if pipeline.config.event_time is None:
        return None, None
    before = watermark_of(start.metadata)
    return before, advance(before, highest, lateness_micros(pipeline.config.allowed_lateness))


def complete_attempt(
    pipeline: BatchDriver,
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
        taken = (0, mine) if mine is not None else _take_over(pipeline, attempt)
        if not isinstance(taken[0], int):
            return taken  # committed by the try that died
        held = taken
    if coordinator is None:
        _, coordinator = pipeline.begin()
        coordinator.trigger(expected=attempt.expected, checkpoint_id=cid, names=pipeline.operator_names())
    commit_started = time.time()
    try:
        completed = _acknowledge_and_commit(storage, coordinator, attempt, inject,
                                            Prices.parse(pipeline.config.storage_prices))
    except (InjectedFailure, KeyboardInterrupt):
        raise  # as a crash would leave it: recovery, the next start and the sweep settle it
    except CheckpointAlreadyExists:
        if persisted and committed_by_attempt(storage, attempt):  # another completer of this attempt won: done
            return _finish_committed(pipeline, attempt)
        monitoring.checkpoint_failed(pipeline.config)
        _after_failure(storage, attempt, held)
        raise
    except BaseException as e:
        monitoring.checkpoint_failed(pipeline.config)
        coordinator.abort(cid, reason=f"batch {list(attempt.files)} failed to complete: {type(e).__name__}")
        _after_failure(storage, attempt, held)
        raise
    crash_point("after-metadata-before-sink-commit")
    phases: list[Phase] = [("commit", -1, commit_started, time.time())]
    if pipeline.sink:
        pipeline.sink.commit(cid, list(attempt.staged))
        phases.append(("sink commit", -1, phases[0][3], time.time()))
    if persisted:
        forget_attempt(storage, attempt)
    report = _report(attempt, completed.metadata, completed.files_deleted, Prices.parse(pipeline.config.storage_prices))
    monitoring.checkpoint_completed(pipeline.config, completed.metadata)
    observe_checkpoint(pipeline.config, storage, pipeline.sink, attempt, completed.metadata, report,
                       driver_phases=phases)
    return report, completed.metadata


def _acknowledge_and_commit(storage: CheckpointStorage, coordinator: CheckpointCoordinator,
                            attempt: PendingAttempt, inject: str | None, prices: Prices) -> CompletedCheckpoint:
    """Every handle of the attempt acknowledged, then `_metadata` written (exclusive create),
    re-checking after the commit the attempt's fence (an abort that claimed it meanwhile wins)
    and the checkpoint its state was restored from (a rollback retired it meanwhile)."""
    cid = attempt.checkpoint_id
    _check_uploads_present(storage, attempt)
    for handle in attempt.state_handles():
        coordinator.acknowledge(cid, handle)
    fail_at("before-commit", inject, f"checkpoint {cid} acknowledged, _metadata not written")
    return coordinator.complete(cid, source_offsets=committed_offsets(attempt),
                                recheck=lambda: fenced(storage, attempt.attempt_id), base=attempt.base,
                                skipped_files=attempt.skipped_files,
                                observe=lambda stats: observed(stats, attempt, prices))


def observed(stats: CheckpointStats, attempt: PendingAttempt, prices: Prices) -> CheckpointStats:
    """`stats` with what the attempt observed, right before its commit: every storage request of
    both halves so far, the seconds since its trigger, its rows, late rows and restore phases."""
    return stats.observed((attempt.requests or RequestLedger()) + ledger.drain(), prices,
                          duration_seconds=round(time.time() - attempt.started_at, 3), records_in=attempt.rows,
                          late_rows=attempt.late_rows, restore=restore_summary(attempt.subtasks))


def _report(attempt: PendingAttempt, meta: CheckpointMetadata, files_deleted: int, prices: Prices) -> BatchReport:
    """What the run says of checkpoint N; its requests are those `_metadata` records and the ones
    made since (the commit itself, retention's deletes, the sink's commit)."""
    requests = (meta.stats.ledger or attempt.requests or RequestLedger()) + ledger.drain()
    return BatchReport(
        checkpoint_id=meta.checkpoint_id, files=attempt.files, rows=attempt.rows,
        state_size=meta.stats.state_size, checkpointed_size=meta.stats.checkpointed_size,
        files_new=meta.stats.files_new, files_reused=meta.stats.files_reused, files_deleted=files_deleted,
        seconds=time.time() - attempt.started_at, restored=tuple(s.restore for s in attempt.subtasks),
        watermark=attempt.watermark, late_rows=attempt.late_rows, skipped=meta.newly_skipped(), read=attempt.read,
        requests=requests, estimated_cost_usd=prices.cost(requests),
        phase_seconds=phase_seconds(s.phases for s in attempt.subtasks),
    )


def _finish_committed(pipeline: BatchDriver, attempt: PendingAttempt) -> tuple[BatchReport, CheckpointMetadata]:
    """Checkpoint N is committed with this attempt's files (by a completer that died before its
    sink commit, or by another completer of the same attempt): make its output visible (safe to
    repeat) and forget the attempt."""
    meta = CompletedCheckpointStore(pipeline.storage).load(attempt.checkpoint_id)
    if pipeline.sink:
        pipeline.sink.commit(attempt.checkpoint_id, list(attempt.staged))
    forget_attempt(pipeline.storage, attempt)
    log.warning("checkpoint %s of attempt %s was committed by an earlier try; its output is committed now",
                attempt.checkpoint_id, attempt.attempt_id)
    report = _report(attempt, meta, 0, Prices.parse(pipeline.config.storage_prices))
    observe_checkpoint(pipeline.config, pipeline.storage, pipeline.sink, attempt, meta, report)
    return report, meta


def _take_over(
    pipeline: BatchDriver, attempt: PendingAttempt
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
    if committed_by_attempt(storage, attempt):
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
    storage: CheckpointStorage, attempt: PendingAttempt, sink: Sink | None
) -> AbortOutcome:
    """Settle a persisted attempt that its own step will not finish: forget it when its checkpoint
    committed, otherwise claim it for the abort and delete its uploads (those no retained
    checkpoint references), its sink staging and its record. Safe to repeat, and safe against a
    completer of the same attempt running at the same time in another process (see
    `sparkpoint.pipeline.attempt`).

    An abort that lost the claim to a completer touches nothing of the attempt (its `_metadata`
    may land at any moment, and its sink commit needs the staged files) until a checkpoint at or
    above N exists that is *not* this attempt's: then the completer can never commit N. That is
    decided after the listing that found such a checkpoint, from chk-N itself: a listing that
    shows chk-N may show the completer's own commit (rule 9)."""
    cid = attempt.checkpoint_id
    completed = AbortOutcome(cid, attempt.attempt_id, 0, completed=True, left_to_completer=False,
                             files=attempt.files)
    if committed_by_attempt(storage, attempt):
        forget_attempt(storage, attempt)  # the sink commit is `begin`'s if its completer died before it
        return completed
    if not claim(storage, cid, attempt.attempt_id, ABORT, reason="recovery"):
        if not _overtaken(storage, attempt):
            if committed_by_attempt(storage, attempt):  # its completer committed since we looked
                forget_attempt(storage, attempt)
                return completed
            log.warning("checkpoint %s (attempt %s) is claimed by its completer: recovery leaves its uploads to it "
                        "(or to the orphan sweep)", cid, attempt.attempt_id)
            return AbortOutcome(cid, attempt.attempt_id, 0, completed=False, left_to_completer=True,
                                files=attempt.files)
        # chk-N is another writer's, or a newer checkpoint completed: its completer can never
        # commit (the exclusive create fails, or the commit is withdrawn before any sink commit).
    elif committed_by_attempt(storage, attempt):
        # Our claim came after its completer committed and forgot its own claim: nothing to undo.
        forget_attempt(storage, attempt)
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
    return not committed_by_attempt(storage, attempt)


def committed_by_attempt(storage: CheckpointStorage, attempt: PendingAttempt) -> bool:
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
