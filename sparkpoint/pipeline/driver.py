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

from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.errors import CheckpointAlreadyExists, CheckpointCorrupted, UnknownSharedState
from sparkpoint.checkpoint.files import stored_size_problems
from sparkpoint.checkpoint.metadata import CheckpointMetadata
from sparkpoint.pipeline.attempt import complete_attempt, run_spark_half
from sparkpoint.pipeline.runtime import BatchReport, PipelineCore, PipelineError, _Start

log = logging.getLogger(__name__)


class StatefulPipeline(PipelineCore):
    def run(self, on_checkpoint: Callable[[BatchReport], None] | None = None, *, tick: bool = False
            ) -> list[BatchReport]:
        """Process every unconsumed batch (up to `max_batches`), one checkpoint each. With `tick`,
        when there is none, one checkpoint of no input: processing time advances, due timers fire,
        TTL state expires (what a schedule runs so that time passes without data)."""
        return list(self.batches(on_checkpoint, tick=tick))

    def batches(self, on_checkpoint: Callable[[BatchReport], None] | None = None, *, tick: bool = False
                ) -> Iterator[BatchReport]:
        start, coordinator = self._begin()
        done, lost_races = 0, 0
        while self.config.max_batches is None or done < self.config.max_batches:
            files = self.source.pending(start.offsets)[: self.config.files_per_checkpoint]
            if not files and not (tick and done == 0):
                break
            try:
                report, metadata = self._one_batch(coordinator, start, files)
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
            if on_checkpoint:
                on_checkpoint(report)
            yield report
            if not files:
                break  # the tick

    def _one_batch(
        self, coordinator: CheckpointCoordinator, start: _Start, files: list[str]
    ) -> tuple[BatchReport, CheckpointMetadata]:
        """Both halves of the seam in this process, with one coordinator (see `attempt`)."""

        attempt = run_spark_half(self, coordinator, start, files)
        return complete_attempt(self, attempt, coordinator=coordinator)

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

