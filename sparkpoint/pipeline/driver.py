"""The pipeline's driver: one checkpoint per micro-batch, state and source offsets restored together.

`StatefulPipeline` is the one driver every front end builds (the CLI, the notebook, Dagster's
resources, the Airflow operators). Its public seam: `begin` (where the next batch starts, and the
coordinator of its checkpoint), `task_spec` and `run_spark` (the checkpoint's Spark job),
`fall_back` (to an older checkpoint that restores, loudly), and the batch helpers
(`next_batch`, `check_batch`, ...). The two halves of a batch that an orchestrator runs as two
steps (`sparkpoint.pipeline.attempt`) take the driver through that seam.

Its own loop (`run`, `checkpoints`), which `sparkpoint run` drives: for each batch, trigger
checkpoint N, run one Spark job in which every (operator, subtask) restores its state, applies
its rows, stages its changed rows and snapshots; acknowledge the handles; complete N with the new
source offsets and the staged sink files in `_metadata`; then make the sink's rows visible. Any
failure aborts N; a rerun resumes from the latest completed checkpoint, so every input file is
applied to the state and to the output exactly once.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.errors import CheckpointAlreadyExists, CheckpointCorrupted, UnknownSharedState
from sparkpoint.checkpoint.files import stored_size_problems
from sparkpoint.checkpoint.metadata import CheckpointMetadata
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore, StoreListing
from sparkpoint.pipeline.attempt.protocol import AttemptAborted, complete_attempt, run_spark_half
from sparkpoint.pipeline.attempt.record import PendingAttempt
from sparkpoint.pipeline.attempt.store import save_attempt
from sparkpoint.pipeline.badfiles import BatchCheck, FileChecks, changed_skips, input_needs
from sparkpoint.pipeline.claims import fenced
from sparkpoint.pipeline.runtime import (
    BatchReport,
    BatchStart,
    PipelineConfig,
    PipelineError,
    check_operators,
    emitted_columns,
    offsets_of,
    open_output,
    operator_functions,
    resolve_parallelism,
    restore_plan,
    settle_sink,
    spark_job_group,
    starting_point,
    validate_config,
)
from sparkpoint.pipeline.upgrade import RestorePlan
from sparkpoint.spark.offsets import SourceOffsets
from sparkpoint.spark.routing import READ_ALL, SHUFFLE, FileLayout, read_units, shuffle_job
from sparkpoint.spark.source import BatchSource, FileVerdict
from sparkpoint.spark.tablesource import open_source
from sparkpoint.spark.tasks import (
    LOCAL_DIR_ENV,
    RESULT_SCHEMA,
    TaskSpec,
    no_rows,
    route_units,
    run_routed,
    run_slots,
    run_subtask,
)
from sparkpoint.state.engine.repair import repair_checkpoints
from sparkpoint.state.operators import KeyedOperator
from sparkpoint.tables.spec import table_of

log = logging.getLogger(__name__)

MAX_LOST_RACES = 3  # commits another writer takes in a row before the loop gives up


@dataclass(frozen=True)
class Committed:
    """A checkpoint the loop committed: its report, its `_metadata`, the attempt that made it,
    and the batch's files as the loop took them (bad files skipped with them included)."""

    report: BatchReport
    metadata: CheckpointMetadata
    attempt: PendingAttempt
    files: tuple[str, ...]


class StatefulPipeline:
    """A pipeline's driver: where a batch starts, how its Spark job is specified and run, how a
    checkpoint that cannot be restored is fallen back from, and the loop of batches.

    `operators` are the pipeline's own (a `Pipeline`'s `operators`); there is no default."""

    def __init__(self, spark: Any, config: PipelineConfig, operators: tuple[KeyedOperator, ...]):
        validate_config(config)
        for what, values in (("names", [op.name for op in operators]), ("uids", [op.uid for op in operators])):
            if len(set(values)) != len(values):
                raise PipelineError(f"operator {what} must be unique, got {values}")
        self.spark = spark
        self.config = config  # its parallelism is resolved by each start (`begin`) when the user set none
        self.requested_parallelism = config.parallelism
        self.rescaling: str | None = None  # `rescaling 3 -> 2 subtasks from chk-12`, when a start of it rescaled
        self.operators = tuple(operators)
        self.storage = CheckpointStorage(config.checkpoints_url, config.job_id, config.storage_options)
        self.store = CompletedCheckpointStore(self.storage)
        self.source: BatchSource = open_source(
            config.input_table or table_of(config.input_url), config.input_options,
            changes=config.table_changes, resume_from=config.table_resume_from, rescan=config.rescan)
        self._file_checks = FileChecks(input_needs(self.operators, config.event_time), config.on_bad_file,
                                       max_future_event_time=config.max_future_event_time,
                                       settle_seconds=config.settle_seconds)
        self.changed_skips: list[str] = []  # skipped files found changed by the last start (`changed_skips`)
        self.sink = open_output(config, self.operators)
        self._sink_checked = False  # the output was checked against what the operators emit (`check_output`)
        self._shipped = False  # the operators' modules went to the executors

    @property
    def parallelism(self) -> int:
        """The subtasks per operator of this start: as set, or as resolved by `begin`."""
        if self.config.parallelism is None:
            raise PipelineError("the parallelism is chosen when a batch starts (StatefulPipeline.begin)")
        return int(self.config.parallelism)

    def operator_names(self) -> dict[str, str]:
        """Each operator's display name by its uid (what `_metadata` records beside the state)."""
        return {op.uid: op.name for op in self.operators}

    # --- the input ---------------------------------------------------------------------------------

    def consumed_offsets(self) -> SourceOffsets:
        """The source offsets of the latest checkpoint (nothing consumed before the first)."""
        latest = self.store.latest()
        return offsets_of(latest) if latest is not None else SourceOffsets(())

    def consumed_files(self) -> tuple[str, ...]:
        """The input files the latest checkpoint records as consumed: every one until its offsets
        settle names below a floor, then the newest ones, above it (`SourceOffsets`; none before
        the first checkpoint; none for a table input, whose offsets are the version reached)."""
        return self.consumed_offsets().consumed

    def pending_files(self) -> list[str]:
        """The input files no checkpoint has consumed yet, in the order they will be read."""
        return self.source.pending(self.consumed_offsets())

    def check_batch(self, files: list[str]) -> BatchCheck:
        """Every check of the batch's files, before any Spark work (each footer read once):
        under `on_bad_file="fail"` a bad file raises `BadInputFile`; under "skip" the bad ones
        are returned apart from the good ones."""
        return self._file_checks.batch(self.source, files)

    def file_verdicts(self, files: list[str]) -> list[FileVerdict]:
        """Each file's checks, whatever `on_bad_file` says (a footer is read once per process)."""
        return self._file_checks.verdicts(self.source, files)

    def forget_verdicts(self, files: list[str]) -> None:
        """Check `files` again when next asked (they failed while they may still be landing)."""
        self._file_checks.forget(files)

    def ready_files(self, files: list[str], settle_seconds: float | None = None) -> list[str]:
        """`files` in order, up to the first that fails its checks while it may still be being
        written (DESIGN rule 18): a batch takes those; that file stays unconsumed, and
        `waiting_for` says why. `settle_seconds`: how long a failing file must be unchanged."""
        return self._file_checks.take(self.source, self._within_bytes(files), settle_seconds)

    def _within_bytes(self, files: list[str]) -> list[str]:
        """`files` up to `max_input_mb_per_checkpoint` of them (the first one always)."""
        bound = self.config.max_input_mb_per_checkpoint
        if bound is None:
            return files
        total = 0
        for i, name in enumerate(files):
            total += self.source.stat(name).size
            if i and total > bound << 20:
                return files[:i]
        return files

    def next_batch(self, offsets: SourceOffsets | None = None) -> list[str]:
        """The files of the next batch after `offsets` (default: the latest checkpoint's): up to
        `files_per_checkpoint` unconsumed files, ending before one still being written."""
        if offsets is None:
            offsets = self.consumed_offsets()
        return self.ready_files(self.source.pending(offsets)[: self.config.files_per_checkpoint])

    @property
    def waiting_for(self) -> str | None:
        """Why the last batch picked (`next_batch`, `ready_files`) ended before a file (None: it did not)."""
        return self._file_checks.waiting

    # --- where a batch starts ----------------------------------------------------------------------

    def begin(self) -> tuple[BatchStart, CheckpointCoordinator]:
        """Where the next batch starts, and the coordinator of its checkpoint: the latest
        checkpoint (or `from_checkpoint`, or none), checked against the job's operators, at the
        parallelism this start resolves; the sink's commit of that checkpoint is finished first.

        Raises:
            OperatorStateMismatch: the operators do not map onto the checkpoint's.
            StateSchemaIncompatible: a declared state cannot read what the checkpoint recorded.
            PipelineError: a `_metadata` newer than the latest readable one cannot be read.
        """
        start, lineage, unowned = starting_point(self.storage, self.config)
        self.changed_skips = changed_skips(self.source, start.metadata)
        for line in self.changed_skips:
            log.warning("%s", line)
        self.config = self.config.with_(parallelism=resolve_parallelism(self.requested_parallelism, start.metadata))
        if start.metadata is not None:
            plan = check_operators(start.metadata, self.config, self.operators)
            self.rescaling = plan.rescaling() or self.rescaling
        coordinator = CheckpointCoordinator(
            self.storage, num_retained=self.config.num_retained, retention=self.config.retention,
            lineage=lineage, unowned=unowned,
        )
        if self.sink:
            self.check_output()
            settle_sink(self.sink, self.storage, start)
        return start, coordinator

    def restore_plan(self) -> RestorePlan | None:
        """What the next start would restore (None: it starts empty), from `_metadata` alone."""
        return restore_plan(self.config, self.operators)

    def check_start(self) -> CheckpointMetadata | None:
        """The checkpoint the next batch restores (None: none), checked against the job's
        operators and their declared states, without Spark: the CLI calls it before starting
        a session, so that an incompatible change is refused first."""
        start, _, _ = starting_point(self.storage, self.config)
        if start.metadata is not None:
            check_operators(start.metadata, self.config, self.operators)
        self.check_output()
        return start.metadata

    def check_output(self) -> None:
        """Refuse an output that cannot take what the operators emit (a table's schema, its
        partition columns, how long it remembers our commits), once per driver, without Spark."""
        if self.sink is not None and not self._sink_checked:
            self.sink.check_start(emitted_columns(self.operators))
            self._sink_checked = True

    def fall_back(self, start: BatchStart, error: CheckpointCorrupted) -> BatchStart:
        """Restore the next older retained checkpoint instead of `start`'s, loudly.

        The candidates are read from the store each time (a long run has retained many since it
        began). Every checkpoint newer than the one we fall back to is retired *before* the
        sink's output after it is rolled back: a checkpoint whose output is gone must never be
        restored again (its offsets say its batch is consumed). A crash in between leaves output
        above the latest checkpoint, which the next start rolls back (`settle_sink`).

        Raises:
            PipelineError: no older retained checkpoint is left (or `start` is another job's).
        """
        failed = start.metadata.checkpoint_id if start.metadata else None
        listing = self.store.load_all()
        if start.metadata is not None and start.restore_job is None and self._repaired(start.metadata, listing):
            return start  # its bad files were rewritten from task-local copies: restore it again
        older = [m for m in listing.checkpoints if failed is not None and m.checkpoint_id < failed]
        if start.restore_job is not None or not older:
            raise PipelineError(
                f"checkpoint {failed} cannot be restored and no older retained checkpoint is left: {error}"
            ) from error
        target = older[0]
        check_operators(target, self.config, self.operators)
        log.error(
            "FALLING BACK: checkpoint %s cannot be restored (%s); restoring checkpoint %s instead, "
            "its batches after it are replayed", failed, error, target.checkpoint_id,
        )
        coordinator = CheckpointCoordinator(self.storage, num_retained=self.config.num_retained)
        retired, _ = coordinator.retire_above(
            target.checkpoint_id,
            reason=f"falling back to checkpoint {target.checkpoint_id}; their output is rolled back and their "
                   "batches replayed")
        if self.sink:
            self.sink.drop(retired)
        # next_id None: the highest id seen + 1, never an id a retired checkpoint had.
        return replace(start, metadata=target, offsets=offsets_of(target), next_id=None)

    def _repaired(self, failed: CheckpointMetadata, listing: StoreListing) -> bool:
        """Rewrite the failed checkpoint's bad files from task-local copies (True: all of them).

        A bad file every retained checkpoint needs, with no good copy, stops the run here, before
        a fallback discards checkpoints that it could not help anyway."""
        report = repair_checkpoints(self.storage, self.config.local_dir, [failed], retained=listing.checkpoints)
        if report.lost:
            raise PipelineError(report.lost[0])
        return bool(report.repaired) and not report.unrepairable

    # --- the checkpoint's Spark job ----------------------------------------------------------------

    def task_spec(self, checkpoint_id: int, start: BatchStart) -> TaskSpec:
        """What every Spark task of checkpoint `checkpoint_id` needs to restore `start`'s
        checkpoint, apply its rows and snapshot: the operators, locations and settings."""
        c = self.config
        run_dir = self._run_dir()
        # A Spark of the run's own hands the run's SPARKPOINT_LOCAL_DIR to its executors; the warm
        # server's workers have none of their own, so the spec carries it.
        local_dir = (os.environ.get(LOCAL_DIR_ENV) or c.local_dir) if run_dir is not None else c.local_dir
        return TaskSpec(
            checkpoint_id=checkpoint_id, checkpoints_url=self.storage.url, job_id=c.job_id,
            storage_options=c.storage_options, operators=self.operators, parallelism=self.parallelism,
            max_parallelism=c.max_parallelism, local_dir=local_dir, input_options=c.input_options,
            restore_metadata=start.metadata.dumps() if start.metadata else None, restore_job=start.restore_job,
            claim_mode=start.claim_mode, sink=self.sink.for_tasks() if self.sink else None, incremental=c.incremental,
            local_recovery=c.local_recovery, rocksdb=c.rocksdb, allow_new_operators=c.allow_new_operators,
            changelog=c.changelog_options(), batch_time_us=int(time.time() * 1_000_000),
            event_time=c.event_time, late=c.late, run_dir=run_dir,
        )

    def _run_dir(self) -> str | None:
        """The run's working directory when its tasks run on the warm local Spark, whose Python
        workers start elsewhere (a Spark of the run's own starts them here)."""
        from sparkpoint.spark.warm import attached_here

        if self.spark is None or not attached_here():
            return None
        try:
            return os.getcwd()
        except OSError:  # removed under the process: the tasks start where the workers do
            return None

    def run_spark(self, spec: TaskSpec, urls: list[str], layouts: list[FileLayout] | None = None,
                  route: str = READ_ALL) -> list[dict[str, Any]]:
        """The checkpoint's Spark job over the batch `urls` by `route` (`sparkpoint.spark.routing`;
        the shuffle cuts the batch by `layouts`): a result row per (operator, subtask).

        Raises:
            PipelineError: Spark returned another number of subtask results than it ran.
        """
        groups = len(self.operators) * spec.parallelism
        if self.spark is None and not urls:  # nothing to read (`sparkpoint skip`): no JVM for that
            return [run_subtask(spec, i, subtask, no_rows(op)).to_dict("records")[0]
                    for subtask in range(spec.parallelism) for i, op in enumerate(self.operators)]
        rows = self._spark_job(spec, urls, layouts, route)
        ran = {(int(r["op"]), int(r["subtask"])) for r in rows}
        if len(rows) != groups or len(ran) != groups:
            raise PipelineError(f"expected {groups} subtask results, Spark returned {len(rows)} "
                                f"for {len(ran)} (operator, subtask) pairs")
        return rows

    def _spark_job(self, spec: TaskSpec, urls: list[str], layouts: list[FileLayout] | None,
                   route: str) -> list[dict[str, Any]]:
        from sparkpoint.spark.session import job_group, one_task_per_index, ship_modules  # pyspark: only here

        if not self._shipped:  # the user's operator modules, to every executor
            ship_modules(self.spark, operator_functions(self.operators))
            self._shipped = True
        description = f"sparkpoint {spec.job_id}: checkpoint {spec.checkpoint_id} ({route})"
        with job_group(self.spark, spark_job_group(spec.job_id, spec.checkpoint_id), description):
            if route == SHUFFLE:  # read once, routed by key group through Spark's shuffle
                units = read_units(layouts if layouts is not None else [FileLayout(u) for u in urls])
                return list(shuffle_job(self.spark, spec, units, RESULT_SCHEMA, route_units, run_routed))

            def run(ids):  # type: ignore[no-untyped-def]  # Spark infers UDF kinds from hints: keep none
                return run_slots(spec, urls, ids)

            # one stage, task i reads the batch and runs subtask i of every operator
            return list(one_task_per_index(self.spark, spec.parallelism, run, RESULT_SCHEMA))

    # --- the loop ----------------------------------------------------------------------------------

    def run(self, on_checkpoint: Callable[[BatchReport], None] | None = None, *, tick: bool = False
            ) -> list[BatchReport]:
        """Process every unconsumed batch (up to `max_batches`), one checkpoint each. With `tick`,
        when there is none, one checkpoint of no input: processing time advances, due timers fire,
        TTL state expires (what a schedule runs so that time passes without data)."""
        return list(self.batches(on_checkpoint, tick=tick))

    def batches(self, on_checkpoint: Callable[[BatchReport], None] | None = None, *, tick: bool = False
                ) -> Iterator[BatchReport]:
        """`run`, one report at a time as each checkpoint commits."""
        def next_files(start: BatchStart, done: int) -> list[str] | None:
            files = self.next_batch(start.offsets)
            return files if files or (tick and done == 0) else None

        for committed in self.checkpoints(next_files):
            if on_checkpoint:
                on_checkpoint(committed.report)
            yield committed.report
            if not committed.files:
                break  # the tick

    def checkpoints(self, next_files: Callable[[BatchStart, int], list[str] | None], *,
                    attempt_id: str | None = None) -> Iterator[Committed]:
        """One checkpoint per batch that `next_files(start, done)` names (None: stop; []: a
        checkpoint of no input), up to `max_batches`, resuming from the latest completed
        checkpoint. `start` is where the next batch starts: after a fallback or a lost race it
        is an older checkpoint than the last one yielded, and `next_files` must name files by
        its offsets. With `attempt_id`, each batch's attempt is persisted under that id before
        its commit (`sparkpoint.pipeline.attempt`): a recovery can then abort it, and fence the
        id so that a zombie of this loop never commits again."""
        start, coordinator = self.begin()
        done, lost_races = 0, 0
        while self.config.max_batches is None or done < self.config.max_batches:
            files = next_files(start, done)
            if files is None:
                break
            try:
                report, metadata, attempt = self._one_batch(coordinator, start, files, attempt_id=attempt_id)
            except CheckpointCorrupted as e:
                start = self.fall_back(start, e)
                continue
            except (CheckpointAlreadyExists, UnknownSharedState) as e:
                # Another driver (a zombie, a retried run) committed this id first, or subsumed the
                # checkpoint our state was based on: resume from the latest completed checkpoint.
                lost_races += 1
                if lost_races > MAX_LOST_RACES:
                    raise PipelineError(f"another writer keeps committing to job {self.config.job_id}: {e}") from e
                log.warning("%s; resuming from the latest completed checkpoint", e)
                start, coordinator = self.begin()
                continue
            lost_races = 0
            start = BatchStart.after(metadata)
            checked = self._check_committed(start)
            if checked is not start:  # it did not verify and could not be repaired: fell back
                start = checked
                continue
            done += 1
            yield Committed(report, metadata, attempt, tuple(files))

    def _one_batch(
        self, coordinator: CheckpointCoordinator, start: BatchStart, files: list[str], *,
        attempt_id: str | None = None,
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

    def _check_committed(self, start: BatchStart) -> BatchStart:
        """What the Dagster blocking check does for a materialization, for every checkpoint this
        loop commits: every file a restore of it reads must be on stable storage with its size (one listing
        per directory; the CRC32s of its uploads were taken as they were written). A bad file is
        rewritten from a task-local copy; otherwise the checkpoint is discarded and its batch
        replayed from the newest older one (`fall_back`), before anything builds on it."""
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
        return self.fall_back(start, error)  # repairs in place when a task-local copy can
