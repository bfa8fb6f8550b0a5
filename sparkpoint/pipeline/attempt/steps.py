"""The two halves of a batch as two steps: what an orchestrator's step functions call (Dagster's
SSTable and checkpoint assets, Airflow's batch and checkpoint tasks). Step 1 runs the Spark half
of the next unconsumed batch and persists its attempt under the step's attempt id; step 2
completes the attempt persisted under an id, or says which writer overtook it.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.errors import CheckpointCorrupted, SparkpointError
from sparkpoint.checkpoint.metadata import CheckpointMetadata
from sparkpoint.checkpoint.retired import next_id_after
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.pipeline.attempt.protocol import (
    LOST_RACE,
    abort_attempt,
    committed_by_attempt,
    complete_attempt,
    run_spark_half,
)
from sparkpoint.pipeline.attempt.record import PendingAttempt, recorded_offsets, written_by
from sparkpoint.pipeline.attempt.store import load_attempt, pending_attempts, save_attempt
from sparkpoint.pipeline.claims import ABORT, claim_holder
from sparkpoint.pipeline.runtime import BatchDriver, BatchReport, BatchStart, PipelineError
from sparkpoint.spark.faults import check_point, fail_at

log = logging.getLogger(__name__)


class AttemptIdReused(PipelineError):
    """A step was started under an attempt id an abort has fenced at the next checkpoint."""


def spark_half_with_fallback(
    pipeline: BatchDriver,
    *,
    attempt_id: str | None = None,
    inject_failure: str | None = None,
    start: tuple[BatchStart, CheckpointCoordinator] | None = None,
    tick: bool = False,
) -> tuple[PendingAttempt | None, CheckpointCoordinator]:
    """The Spark half of the next unconsumed batch (None: nothing to do), resuming from the
    latest completed checkpoint and falling back to older ones that restore, loudly. With
    `tick`, no unconsumed batch makes a checkpoint of no input (time passes: timers, TTL)."""
    begun, coordinator = start or pipeline.begin()
    while True:
        files = pipeline.next_batch(begun.offsets)  # it ends before a file still being written
        if not files and not tick:
            return None, coordinator
        try:
            return run_spark_half(
                pipeline, coordinator, begun, files, attempt_id=attempt_id, inject_failure=inject_failure
            ), coordinator
        except CheckpointCorrupted as e:
            begun = pipeline.fall_back(begun, e)


def start_step(
    pipeline: BatchDriver, attempt_id: str, *, inject_failure: str | None = None, tick: bool = False
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
    following = next_id_after(storage, max(storage.completed_checkpoint_ids(), default=0))
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
    pipeline: BatchDriver, attempt_id: str, *, max_batches: int | None, inject_failure: str | None = None,
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


def remaining_batches(pipeline: BatchDriver) -> int:
    """How many batches the unconsumed files make (`files_per_checkpoint` files each)."""
    return -(-len(pipeline.pending_files()) // int(pipeline.config.files_per_checkpoint))


def finish_step(
    pipeline: BatchDriver, attempt_ids: Iterable[str], *, inject_failure: str | None = None
) -> tuple[BatchReport, CheckpointMetadata] | None:
    """Step 2: complete the attempt persisted under the first of `attempt_ids` that has one
    (a re-executed run finds its parent's); None when step 1 found nothing to do."""
    for attempt_id in attempt_ids:
        attempt = load_attempt(pipeline.storage, attempt_id)
        if attempt is not None:
            return complete_attempt(pipeline, attempt, inject_failure=inject_failure, persisted=True)
    return None




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
    if not ids or committed_by_attempt(storage, attempt):
        return None
    store = CompletedCheckpointStore(storage)
    by_attempt: str | None = None
    by_savepoint = False
    pending: tuple[str, ...] = ()
    try:
        first = store.load(ids[0])
        by_savepoint = first.is_savepoint
        by_attempt = None if by_savepoint else written_by(first)
        consumed = recorded_offsets(store.load(ids[-1]))
        pending = tuple(f for f in attempt.files if not consumed.includes(f))
    except (SparkpointError, OSError) as e:  # a report only: the outcome stands without it
        log.warning("checkpoint %s: could not read who overtook attempt %s (%s)", attempt.checkpoint_id,
                    attempt.attempt_id, e)
    return Overtaken(attempt.checkpoint_id, attempt.attempt_id, ids[0], by_attempt, attempt.files, pending,
                     by_savepoint)


def finish_step_or_overtaken(
    pipeline: BatchDriver, attempt_ids: Iterable[str], *, inject_failure: str | None = None
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
