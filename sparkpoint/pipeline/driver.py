"""The driver loop: one checkpoint per micro-batch, state and source offsets restored together.

For each batch: trigger checkpoint N, run one Spark job in which every (operator, subtask)
restores its state, applies its rows, stages its changed rows and snapshots; acknowledge the
handles; complete N with the new source offsets and the staged sink files in `_metadata`; then
make the sink's rows visible. Any failure aborts N; a rerun resumes from the latest completed
checkpoint, so every input file is applied to the state and to the output exactly once. This is
what `sparkpoint run` drives; an orchestrator drives the same two halves as two steps
(`sparkpoint.pipeline.attempt`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.errors import CheckpointAlreadyExists, CheckpointCorrupted, UnknownSharedState
from sparkpoint.checkpoint.files import stored_size_problems
from sparkpoint.checkpoint.metadata import CheckpointMetadata
from sparkpoint.pipeline.attempt import AttemptAborted, PendingAttempt, complete_attempt, run_spark_half, save_attempt
from sparkpoint.pipeline.claims import fenced
from sparkpoint.pipeline.runtime import BatchReport, PipelineCore, PipelineError, _Start

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Committed:
    """A checkpoint the loop committed: its report, its `_metadata`, the attempt that made it,
    and the batch's files as the loop took them (bad files skipped with them included)."""

    report: BatchReport
    metadata: CheckpointMetadata
    attempt: PendingAttempt
    files: tuple[str, ...]


class StatefulPipeline(PipelineCore):
    def run(self, on_checkpoint: Callable[[BatchReport], None] | None = None, *, tick: bool = False
            ) -> list[BatchReport]:
        """Process every unconsumed batch (up to `max_batches`), one checkpoint each. With `tick`,
        when there is none, one checkpoint of no input: processing time advances, due timers fire,
        TTL state expires (what a schedule runs so that time passes without data)."""
        return list(self.batches(on_checkpoint, tick=tick))

    def batches(self, on_checkpoint: Callable[[BatchReport], None] | None = None, *, tick: bool = False
                ) -> Iterator[BatchReport]:
        def next_files(start: _Start, done: int) -> list[str] | None:
            files = self.next_batch(start.offsets)
            return files if files or (tick and done == 0) else None

        for committed in self.checkpoints(next_files):
            if on_checkpoint:
                on_checkpoint(committed.report)
            yield committed.report
            if not committed.files:
                break  # the tick

    def checkpoints(self, next_files: Callable[[_Start, int], list[str] | None], *,
                    attempt_id: str | None = None) -> Iterator[Committed]:
        """One checkpoint per batch that `next_files(start, done)` names (None: stop; []: a
        checkpoint of no input), up to `max_batches`, resuming from the latest completed
        checkpoint. `start` is where the next batch starts: after a fallback or a lost race it
        is an older checkpoint than the last one yielded, and `next_files` must name files by
        its offsets. With `attempt_id`, each batch's attempt is persisted under that id before
        its commit (`sparkpoint.pipeline.attempt`): a recovery can then abort it, and fence the
        id so that a zombie of this loop never commits again."""
        start, coordinator = self._begin()
        done, lost_races = 0, 0
        while self.config.max_batches is None or done < self.config.max_batches:
            files = next_files(start, done)
            if files is None:
                break
            try:
                report, metadata, attempt = self._one_batch(coordinator, start, files, attempt_id=attempt_id)
            except CheckpointCorrupted as e:
                start = self._fall_back(start, e)
                continue
            except (CheckpointAlreadyExists, UnknownSharedState) as e:
                # Another driver (a zombie, a retried run) committed this id first, or subsumed the
                # checkpoint our state was based on: resume from the latest completed checkpoint.
                lost_races += 1
                if lost_races > 3:
                    raise PipelineError(f"another writer keeps committing to job {self.config.job_id}: {e}") from e
                log.warning("%s; resuming from the latest completed checkpoint", e)
                start, coordinator = self._begin()
                continue
            lost_races = 0
            start = _Start(metadata, start.offsets.after(files), next_id=metadata.checkpoint_id + 1)
            checked = self._check_committed(start)
            if checked is not start:  # it did not verify and could not be repaired: fell back
                start = checked
                continue
            done += 1
            yield Committed(report, metadata, attempt, tuple(files))

    def _one_batch(
        self, coordinator: CheckpointCoordinator, start: _Start, files: list[str], *, attempt_id: str | None = None
    ) -> tuple[BatchReport, CheckpointMetadata, PendingAttempt]:
        """Both halves of the seam in this process, with one coordinator (see `attempt`); with
        `attempt_id` the attempt is persisted between them, as an orchestrator's two steps do."""
        if attempt_id is not None:
            why = fenced(self.storage, attempt_id)
            if why:
                raise AttemptAborted(f"attempt {attempt_id} was {why}: it commits nothing more; the run "
                                     "launched after that recovery goes on from its checkpoint")
        attempt = run_spark_half(self, coordinator, start, files, attempt_id=attempt_id)
        if attempt_id is not None:
            save_attempt(self.storage, attempt)
        report, metadata = complete_attempt(self, attempt, coordinator=coordinator, persisted=attempt_id is not None)
        return report, metadata, attempt

    def _check_committed(self, start: _Start) -> _Start:
        """What the Dagster blocking check does for a materialization, for every checkpoint this
        loop commits: every file a restore of it reads must be on stable storage with its size (one listing
        per directory; the CRC32s of its uploads were taken as they were written). A bad file is
        rewritten from a task-local copy; otherwise the checkpoint is discarded and its batch
        replayed from the newest older one (`_fall_back`), before anything builds on it."""
        meta = start.metadata
        assert meta is not None
        problems = stored_size_problems(self.storage, list(meta.restored_files()))
        if not problems:
            return start
        error = CheckpointCorrupted(
            f"checkpoint {meta.checkpoint_id} fails verification right after its commit: "
            + "; ".join(str(p) for p in problems[:3]), checkpoint_id=meta.checkpoint_id,
        )
        log.error("%s", error)
        return self._fall_back(start, error)  # repairs in place when a task-local copy can

