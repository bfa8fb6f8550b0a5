"""Where a batch starts and how it runs on Spark: the pipeline's settings (`PipelineConfig`), what a
completed checkpoint reports, and `PipelineCore`: the starting point (the latest checkpoint,
another job's or a savepoint, or none), the Spark job of a checkpoint, the fallback to an older
checkpoint that restores, the sink's settlement. Knows no orchestrator.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field, replace
from typing import Any

from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.errors import (
    CheckpointCorrupted,
    OperatorStateMismatch,
    SparkpointError,
)
from sparkpoint.checkpoint.metadata import CheckpointMetadata, RestoreLineage, SkippedFile
from sparkpoint.checkpoint.retention import ClaimMode
from sparkpoint.checkpoint.savepoint import SAVEPOINT_OF
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore, StoreListing
from sparkpoint.pipeline.badfiles import BatchCheck, FileChecks, changed_skips, input_needs
from sparkpoint.pipeline.settings import SETTINGS, PipelineSettings
from sparkpoint.pipeline.upgrade import RestorePlan, checkpoint_parallelism, plan_restore
from sparkpoint.spark.routing import READ_ALL, SHUFFLE, FileLayout, read_units, shuffle_job
from sparkpoint.spark.sink import ExactlyOnceParquetSink
from sparkpoint.spark.source import BatchSource, FileVerdict, ParquetDirectorySource, SourceOffsets
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
from sparkpoint.state.engine.changelog import ChangelogOptions
from sparkpoint.state.engine.repair import repair_checkpoints
from sparkpoint.state.engine.rocksdb import RocksDBOptions
from sparkpoint.state.eventtime import check_event_time, iso_micros
from sparkpoint.state.keygroups import MAX_KEY_GROUPS
from sparkpoint.state.operators import KeyedOperator
from sparkpoint.state.sample import SAMPLE_OPERATORS
from sparkpoint.state.schema import (
    StateChange,
    StateSchemaIncompatible,
    compare_states,
    refusals,
    restored_declarations,
    schema_fix,
)

log = logging.getLogger(__name__)


DEFAULT_PARALLELISM = 2  # subtasks per operator of a first run that names no parallelism


def spark_job_group(job_id: str, checkpoint_id: int) -> str:
    """The Spark job group of checkpoint N's Spark job: find it in the Spark UI or `statusTracker()`."""
    return f"sparkpoint-{job_id}-chk-{checkpoint_id}"


class PipelineError(SparkpointError):
    """The pipeline cannot start or go on."""


@dataclass(frozen=True)
class PipelineConfig(PipelineSettings):  # type: ignore[misc]  # its settings' fields: made from the table
    """The driver's settings, resolved: where it reads and writes, and every setting of
    `sparkpoint.pipeline.settings.SETTINGS` that is a field of its own (keyword-only)."""

    input_url: str
    checkpoints_url: str
    job_id: str
    storage_options: dict[str, Any] = field(default_factory=dict)
    input_options: dict[str, Any] = field(default_factory=dict)
    output_url: str | None = None
    max_batches: int | None = None
    local_dir: str = ".sparkpoint/local"
    rocksdb: RocksDBOptions = field(default_factory=RocksDBOptions)  # the `rocksdb_*` settings

    def with_(self, **changes: Any) -> PipelineConfig:
        """A copy with `changes` (by field name, settings included)."""
        return replace(self, **changes)

    def changelog_options(self) -> ChangelogOptions:
        return ChangelogOptions(
            enabled=self.changelog, materialize_share=self.changelog_materialize_share,
            max_chain=self.changelog_max_chain, in_steps=self.changelog_materialize_in_steps,
        )


def validate_config(config: PipelineConfig) -> None:
    """Every route to a pipeline (flags, `--conf` and Flink keys, Dagster resources) meets these
    checks, with the same messages, before Spark starts."""
    problems = []
    if not 1 <= config.max_parallelism <= MAX_KEY_GROUPS:
        problems.append(f"max parallelism must be between 1 and {MAX_KEY_GROUPS}, got {config.max_parallelism}")
    elif config.parallelism is not None and not 1 <= config.parallelism <= config.max_parallelism:
        problems.append(f"parallelism must be between 1 and the max parallelism ({config.max_parallelism}), "
                        f"got {config.parallelism}")
    if config.num_retained < 1:
        problems.append(f"num_retained must be at least 1, got {config.num_retained}")
    if config.files_per_checkpoint < 1:
        problems.append("files per checkpoint must be at least 1")
    if config.max_batches is not None and config.max_batches < 1:
        problems.append(f"max batches must be at least 1, got {config.max_batches}")
    try:
        config.changelog_options()
    except ValueError as e:
        problems.append(str(e))
    problems += check_event_time(config.event_time, config.allowed_lateness, config.late)
    for setting in SETTINGS:  # each setting's own check (on_bad_file, max_future_event_time, routing, ...)
        if setting.check is not None and setting.field == setting.name:
            problems += setting.check(getattr(config, setting.name))
    if problems:
        raise PipelineError("; ".join(problems))


@dataclass(frozen=True)
class BatchReport:
    """One completed checkpoint, as `sparkpoint run` prints it."""

    checkpoint_id: int
    files: tuple[str, ...]
    rows: int
    state_size: int
    checkpointed_size: int
    files_new: int
    files_reused: int
    files_deleted: int
    seconds: float
    restored: tuple[str, ...]  # per (operator, subtask), how it got its state: working | local | primary | ...
    watermark: int | None = None  # after the batch, µs since the epoch, UTC (pipelines with an event time)
    late_rows: int = 0  # rows below the watermark the batch started with (dropped unless late="process")
    skipped: tuple[SkippedFile, ...] = ()  # input files this checkpoint consumed without processing them
    read: dict[str, Any] | None = None  # how the batch was read: routing, bytes_read, batch_bytes

    @property
    def read_amplification(self) -> float | None:
        """Bytes the batch's tasks read ÷ the batch's bytes (None: nothing read, or not recorded)."""
        if not self.read or not self.read["batch_bytes"]:
            return None
        return round(int(self.read["bytes_read"]) / int(self.read["batch_bytes"]), 3)

    def line(self) -> str:
        """One line, however many files: a batch of more than `LINE_NAMES` files is said as its
        count and its first and last names (`--json` lists every one)."""
        batch = shown_names(self.files) or ("(none)" if self.skipped else "(tick)")
        return (
            f"chk-{self.checkpoint_id} batch={batch} rows={self.rows} "
            f"state={self.state_size}B "
            f"uploaded={self.checkpointed_size}B files new={self.files_new} reused={self.files_reused} "
            f"deleted={self.files_deleted} {self.seconds:.2f}s"
            + (f" watermark={iso_micros(self.watermark)} late={self.late_rows}" if self.watermark is not None else "")
            + (" skipped=" + _skipped_line(self.skipped) if self.skipped else "")
            + (f" route={self.read['routing']} read={self.read_amplification}x"
               if self.read and self.read_amplification else "")
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "checkpoint_id": self.checkpoint_id, "batch": list(self.files), "rows": self.rows,
            "state_size": self.state_size, "checkpointed_size": self.checkpointed_size,
            "files_new": self.files_new, "files_reused": self.files_reused, "files_deleted": self.files_deleted,
            "seconds": round(self.seconds, 3), "restored": sorted(set(self.restored)),
            "restored_by_subtask": list(self.restored),  # in (operator, subtask) order
            "watermark": iso_micros(self.watermark) if self.watermark is not None else None,
            "late_rows": self.late_rows,
            "skipped": [{"file": s.file, "check": s.check, "reason": s.reason} for s in self.skipped],
            "routing": self.read["routing"] if self.read else None,
            "bytes_read": self.read["bytes_read"] if self.read else None,
            "batch_bytes": self.read["batch_bytes"] if self.read else None,
        }


LINE_NAMES = 3  # a run line names up to this many files of a batch; more are counted


def shown_names(names: tuple[str, ...] | list[str]) -> str:
    """`a,b,c`, or `1000 files r-0000.parquet … r-0999.parquet` beyond `LINE_NAMES` names."""
    if len(names) <= LINE_NAMES:
        return ",".join(names)
    return f"{len(names)} files {names[0]} … {names[-1]}"


def _skipped_line(skipped: tuple[SkippedFile, ...]) -> str:
    shown = "; ".join(s.line() for s in skipped[:LINE_NAMES])
    return shown + (f"; and {len(skipped) - LINE_NAMES} more (inspect lists them)" if len(skipped) > LINE_NAMES
                    else "")


@dataclass
class _Start:
    """Where the next batch starts: a checkpoint (maybe another job's), its offsets, claim mode."""

    metadata: CheckpointMetadata | None
    offsets: SourceOffsets
    claim_mode: str = ClaimMode.CLAIM.value
    restore_job: tuple[str, str, dict[str, Any]] | None = None
    next_id: int | None = None  # K + 1 after our own checkpoint K: the id a zombie would race for


class PipelineCore:
    """A pipeline's driver without its batch loop: where a batch starts (the latest checkpoint,
    another job's, none), how its Spark job is specified and run, how a checkpoint that cannot be
    restored is fallen back from, how the sink is settled. The two halves of a batch
    (`sparkpoint.pipeline.attempt`) and the loop that runs batch after batch
    (`sparkpoint.pipeline.driver.StatefulPipeline`) build on it."""

    def __init__(self, spark: Any, config: PipelineConfig, operators: tuple[KeyedOperator, ...] = SAMPLE_OPERATORS):
        validate_config(config)
        for what, values in (("names", [op.name for op in operators]), ("uids", [op.uid for op in operators])):
            if len(set(values)) != len(values):
                raise PipelineError(f"operator {what} must be unique, got {values}")
        self.spark = spark
        self.config = config  # its parallelism is resolved by each start (`_begin`) when the user set none
        self.requested_parallelism = config.parallelism
        self.rescaling: str | None = None  # `rescaling 3 -> 2 subtasks from chk-12`, when a start of it rescaled
        self.operators = tuple(operators)
        self.storage = CheckpointStorage(config.checkpoints_url, config.job_id, config.storage_options)
        self.store = CompletedCheckpointStore(self.storage)
        self.source: BatchSource = ParquetDirectorySource(config.input_url, config.input_options)
        self._file_checks = FileChecks(input_needs(self.operators, config.event_time), config.on_bad_file,
                                       max_future_event_time=config.max_future_event_time,
                                       settle_seconds=config.settle_seconds)
        self.changed_skips: list[str] = []  # skipped files found changed by the last start (`changed_skips`)
        self.sink = (
            ExactlyOnceParquetSink.at(config.output_url, config.job_id, config.storage_options)
            if config.output_url
            else None
        )

    @property
    def parallelism(self) -> int:
        """The subtasks per operator of this start: as set, or as resolved by `_begin`."""
        if self.config.parallelism is None:
            raise PipelineError("the parallelism is chosen when a batch starts (PipelineCore._begin)")
        return int(self.config.parallelism)

    def operator_names(self) -> dict[str, str]:
        """Each operator's display name by its uid (what `_metadata` records beside the state)."""
        return {op.uid: op.name for op in self.operators}

    def consumed_files(self) -> tuple[str, ...]:
        """The input files the latest checkpoint has consumed (none before the first)."""
        latest = self.store.latest()
        return _offsets_of(latest).consumed if latest is not None else ()

    def pending_files(self) -> list[str]:
        """The input files no checkpoint has consumed yet, in the order they will be read."""
        return self.source.pending(SourceOffsets(self.consumed_files()))

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
        return self._file_checks.take(self.source, files, settle_seconds)

    def next_batch(self, offsets: SourceOffsets | None = None) -> list[str]:
        """The files of the next batch after `offsets` (default: the latest checkpoint's): up to
        `files_per_checkpoint` unconsumed files, ending before one still being written."""
        if offsets is None:
            offsets = SourceOffsets(self.consumed_files())
        return self.ready_files(self.source.pending(offsets)[: self.config.files_per_checkpoint])

    @property
    def waiting_for(self) -> str | None:
        """Why the last batch picked (`next_batch`, `ready_files`) ended before a file (None: it did not)."""
        return self._file_checks.waiting

    def _begin(self) -> tuple[_Start, CheckpointCoordinator]:
        start, lineage, unowned = self._starting_point()
        self.changed_skips = changed_skips(self.source, start.metadata)
        for line in self.changed_skips:
            log.warning("%s", line)
        self.config = self.config.with_(parallelism=resolve_parallelism(self.requested_parallelism, start.metadata))
        if start.metadata is not None:
            self.rescaling = self._check_operators(start.metadata).rescaling() or self.rescaling
        coordinator = CheckpointCoordinator(
            self.storage, num_retained=self.config.num_retained, retention=self.config.retention,
            lineage=lineage, unowned=unowned,
        )
        self._settle_sink(start)
        return start, coordinator

    # --- one batch -------------------------------------------------------------------------------

    def _spec(self, cid: int, start: _Start) -> TaskSpec:
        c = self.config
        run_dir = self._run_dir()
        # A Spark of the run's own hands the run's SPARKPOINT_LOCAL_DIR to its executors; the warm
        # server's workers have none of their own, so the spec carries it.
        local_dir = (os.environ.get(LOCAL_DIR_ENV) or c.local_dir) if run_dir is not None else c.local_dir
        return TaskSpec(
            checkpoint_id=cid, checkpoints_url=self.storage.url, job_id=c.job_id, storage_options=c.storage_options,
            operators=self.operators, parallelism=self.parallelism, max_parallelism=c.max_parallelism,
            local_dir=local_dir, input_options=c.input_options,
            restore_metadata=start.metadata.dumps() if start.metadata else None, restore_job=start.restore_job,
            claim_mode=start.claim_mode, sink=self.sink, incremental=c.incremental,
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

    def _run_spark(self, spec: TaskSpec, urls: list[str], layouts: list[FileLayout] | None = None,
                   route: str = READ_ALL) -> list[dict[str, Any]]:
        """The checkpoint's Spark job over the batch `urls` by `route` (`sparkpoint.spark.routing`;
        the shuffle cuts the batch by `layouts`): a result row per (operator, subtask)."""
        groups = len(self.operators) * spec.parallelism
        if self.spark is None and not urls:  # nothing to read (`sparkpoint skip`): no JVM for that
            return [run_subtask(spec, i, subtask, no_rows(op)).to_dict("records")[0]
                    for subtask in range(spec.parallelism) for i, op in enumerate(self.operators)]
        if not getattr(self, "_shipped", False):  # the user's operator modules, to every executor
            from sparkpoint.spark.session import ship_modules  # pyspark: only where Spark runs

            ship_modules(self.spark, operator_functions(self.operators))
            self._shipped = True
        from sparkpoint.spark.session import job_group, one_task_per_index

        description = f"sparkpoint {spec.job_id}: checkpoint {spec.checkpoint_id} ({route})"
        with job_group(self.spark, spark_job_group(spec.job_id, spec.checkpoint_id), description):
            if route == SHUFFLE:  # read once, routed by key group through Spark's shuffle
                units = read_units(layouts if layouts is not None else [FileLayout(u) for u in urls])
                rows = shuffle_job(self.spark, spec, units, RESULT_SCHEMA, route_units, run_routed)
            else:  # one stage, task i reads the batch and runs subtask i of every operator

                def run(ids):  # type: ignore[no-untyped-def]  # Spark infers UDF kinds from hints: keep none
                    return run_slots(spec, urls, ids)

                rows = one_task_per_index(self.spark, spec.parallelism, run, RESULT_SCHEMA)
        ran = {(int(r["op"]), int(r["subtask"])) for r in rows}
        if len(rows) != groups or len(ran) != groups:
            raise PipelineError(f"expected {groups} subtask results, Spark returned {len(rows)} "
                                f"for {len(ran)} (operator, subtask) pairs")
        return rows

    # --- start, fallback, sink ---------------------------------------------------------------------

    def _starting_point(self) -> tuple[_Start, RestoreLineage | None, frozenset[str]]:
        return starting_point(self.storage, self.config)

    def _fall_back(self, start: _Start, error: CheckpointCorrupted) -> _Start:
        """Restore the next older retained checkpoint instead of `start`'s, loudly.

        The candidates are read from the store each time (a long run has retained many since it
        began). Every checkpoint newer than the one we fall back to is discarded *before* the
        sink's output after it is rolled back: a checkpoint whose output is gone must never be
        restored again (its offsets say its batch is consumed). A crash in between leaves output
        above the latest checkpoint, which the next start rolls back (`_settle_sink`).
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
        self._check_operators(target)
        log.error(
            "FALLING BACK: checkpoint %s cannot be restored (%s); restoring checkpoint %s instead, "
            "its batches after it are replayed", failed, error, target.checkpoint_id,
        )
        newer = [m.checkpoint_id for m in listing.checkpoints if m.checkpoint_id > target.checkpoint_id]
        coordinator = CheckpointCoordinator(self.storage, num_retained=self.config.num_retained)
        coordinator.discard(newer, reason=f"falling back to checkpoint {target.checkpoint_id}; their output is "
                                          "rolled back and their batches replayed")
        if self.sink:
            self.sink.rollback(after=target.checkpoint_id)
        # next_id None: the highest id seen + 1, never an id a discarded checkpoint had.
        return replace(start, metadata=target, offsets=_offsets_of(target), next_id=None)

    def _repaired(self, failed: CheckpointMetadata, listing: StoreListing) -> bool:
        """Rewrite the failed checkpoint's bad files from task-local copies (True: all of them).

        A bad file every retained checkpoint needs, with no good copy, stops the run here, before
        a fallback discards checkpoints that it could not help anyway."""
        report = repair_checkpoints(self.storage, self.config.local_dir, [failed], retained=listing.checkpoints)
        if report.lost:
            raise PipelineError(report.lost[0])
        return bool(report.repaired) and not report.unrepairable

    def restore_plan(self) -> RestorePlan | None:
        """What the next start would restore (None: it starts empty), from `_metadata` alone."""
        return restore_plan(self.config, self.operators)

    def _check_operators(self, meta: CheckpointMetadata) -> RestorePlan:
        """The checkpoint must hold exactly the job's operators (by uid), at its max parallelism,
        unless the user allows the difference (Flink's --allowNonRestoredState, and new operators).
        Returns the plan (it says a rescale)."""
        self._check_states(meta)  # an incompatible schema is said as such (StateSchemaIncompatible)
        plan = plan_for(meta, self.config, self.operators)
        if not plan.ok:
            raise OperatorStateMismatch(plan.refusal(op.name for op in self.operators))
        return plan

    def _check_states(self, meta: CheckpointMetadata) -> None:
        """Each operator's declared states must read what the checkpoint recorded of them (a
        RecordCodec may add, remove, widen, reorder fields and make them nullable)."""
        problems: list[str] = []
        changes: list[StateChange] = []
        for op in self.operators:
            recorded = restored_declarations(meta, op.uid, op.states, op.key_type)
            if recorded is not None and len(op.states):
                found = compare_states(recorded, op.declarations())
                problems += refusals(op.name, found)
                changes += found
        if problems:
            raise StateSchemaIncompatible(
                f"checkpoint {meta.checkpoint_id} cannot be restored by this job's code (refused before Spark "
                "starts): " + "; ".join(problems) + f". To go ahead: {schema_fix(changes)}"
            )

    def check_start(self) -> CheckpointMetadata | None:
        """The checkpoint the next batch restores (None: none), checked against the job's
        operators and their declared states, without Spark: the CLI calls it before starting
        a session, so that an incompatible change is refused first."""
        start, _, _ = self._starting_point()
        if start.metadata is not None:
            self._check_operators(start.metadata)
        return start.metadata

    def _settle_sink(self, start: _Start) -> None:
        """Finish the sink commit of the checkpoint we resume from, drop abandoned staging."""
        if not self.sink:
            return
        meta = start.metadata
        if meta is not None and start.restore_job is None and isinstance(meta.source_offsets, dict):
            copied = _copied_sink(meta)
            if copied is not None:  # a savepoint taken before its checkpoint's writer made its output visible
                self.sink.commit(*copied, resuming=True)
            self.sink.commit(meta.checkpoint_id, list(meta.source_offsets.get("sink") or []), resuming=True)
            # Output of a checkpoint above the latest one whose `_metadata` is gone: a fallback
            # discarded it and died before its rollback. Its batches are replayed, so the output
            # goes. Output is listed before `_metadata`: a live writer commits `_metadata` first,
            # so its fresh output is never taken for a discarded checkpoint's.
            above = [cid for cid in self.sink.committed() if cid > meta.checkpoint_id]
            if above:
                live = set(self.storage.completed_checkpoint_ids())
                dropped = self.sink.drop([cid for cid in above if cid not in live])
                if dropped:
                    log.warning("rolled back the output of discarded checkpoints %s", dropped)
        self.sink.discard_staging(up_to=meta.checkpoint_id if meta is not None and start.restore_job is None else 0)


def starting_point(storage: CheckpointStorage, config: PipelineConfig
                   ) -> tuple[_Start, RestoreLineage | None, frozenset[str]]:
    """Where job `storage` starts: its latest checkpoint, else `config.from_checkpoint` (another
    job's checkpoint or a savepoint), else nothing. Reads `_metadata` files only."""
    listing = CompletedCheckpointStore(storage).load_all()
    own = listing.checkpoints
    newest_readable = own[0].checkpoint_id if own else 0
    for cid, why in sorted(listing.unreadable.items()):
        if cid > newest_readable:  # resuming from an older one could repeat its output
            raise PipelineError(
                f"chk-{cid}/_metadata cannot be read ({why}) and it is newer than the latest readable "
                f"checkpoint ({newest_readable or 'none'}): resuming would replay what it committed. Repair "
                f"or remove {storage.job_url}/chk-{cid} by hand (`sparkpoint verify` lists it)."
            )
        log.error("chk-%s/_metadata cannot be read, it is skipped: %s", cid, why)
    if own:
        if config.from_checkpoint:
            log.warning(
                "job %s already has checkpoints; resuming from chk-%s, --from-checkpoint %s is ignored",
                config.job_id, own[0].checkpoint_id, config.from_checkpoint,
            )
        start = _Start(own[0], _offsets_of(own[0]), next_id=own[0].checkpoint_id + 1)
        return start, None, frozenset()
    if not config.from_checkpoint:
        return _Start(None, SourceOffsets(()), next_id=1), None, frozenset()
    meta, source = load_external_checkpoint(config.from_checkpoint, config.storage_options)
    claim = ClaimMode(config.restore_mode).value
    lineage = RestoreLineage(restored_from=f"{source.job_url}/{meta.metadata_path}", claim_mode=claim)
    same_job = source.job_url == storage.job_url
    unowned = frozenset(meta.paths() | {meta.metadata_path}) if same_job and claim == "NO_CLAIM" else frozenset()
    restore_job = None if same_job else (source.url, source.job_id, source.storage_options)
    return _Start(meta, _offsets_of(meta), claim, restore_job), lineage, unowned


def restore_plan(config: PipelineConfig, operators: tuple[KeyedOperator, ...]) -> RestorePlan | None:
    """What a start of `operators` with `config` would restore, per operator uid (None: it starts
    empty), from `_metadata` alone: what `sparkpoint run` says before Spark starts and
    `sparkpoint check-upgrade` reports."""
    storage = CheckpointStorage(config.checkpoints_url, config.job_id, config.storage_options)
    start = starting_point(storage, config)[0]
    return plan_for(start.metadata, config, operators) if start.metadata is not None else None


def resolve_parallelism(requested: int | None, meta: CheckpointMetadata | None) -> int:
    """The parallelism a start runs at: the one the user set (a flag, a setting, a resource's
    config, `Pipeline(parallelism=...)`), else the checkpoint's it restores, else
    DEFAULT_PARALLELISM. So a run that names none keeps its checkpoint's layout and reuses its
    files, instead of rescaling to a default with a full re-upload."""
    if requested is not None:
        return requested
    return (checkpoint_parallelism(meta) if meta is not None else None) or DEFAULT_PARALLELISM


def plan_for(meta: CheckpointMetadata, config: PipelineConfig, operators: tuple[KeyedOperator, ...]) -> RestorePlan:
    """Restoring `meta` into a job of `operators` with `config` (`plan_restore`); a config that
    names no parallelism keeps the checkpoint's."""
    parallelism = resolve_parallelism(config.parallelism, meta)
    return plan_restore(meta, operators, parallelism=parallelism, max_parallelism=config.max_parallelism,
                        allow_non_restored_state=config.allow_non_restored_state,
                        allow_new_operators=config.allow_new_operators)


def operator_functions(operators: tuple[KeyedOperator, ...]) -> list[Any]:
    """Every function of the operators that runs in Spark tasks: their modules are shipped."""
    return [f for op in operators for f in (op.process, op.export, op.on_timer, op.bootstrap) if f is not None]


def _copied_sink(meta: CheckpointMetadata) -> tuple[int, list[str]] | None:
    """A savepoint's record of the checkpoint it copies: (its id, its staged sink files)."""
    raw = meta.source_offsets.get(SAVEPOINT_OF) if meta.is_savepoint and isinstance(meta.source_offsets, dict) \
        else None
    if not isinstance(raw, dict):
        return None
    cid, sink = raw.get("checkpoint_id"), raw.get("sink")
    if isinstance(cid, bool) or not isinstance(cid, int) or not isinstance(sink, list) or not sink:
        return None
    return cid, [str(s) for s in sink]


def _offsets_of(meta: CheckpointMetadata) -> SourceOffsets:
    raw = meta.source_offsets
    return SourceOffsets.from_json(raw.get("source") if isinstance(raw, dict) else raw)



def load_external_checkpoint(
    path: str, storage_options: dict[str, Any]
) -> tuple[CheckpointMetadata, CheckpointStorage]:
    """`<checkpoints-dir>/<job-id>/chk-<N>[/_metadata]` -> its metadata and job storage."""
    trimmed = path.rstrip("/")
    if trimmed.endswith("/_metadata"):
        trimmed = trimmed[: -len("/_metadata")]
    parent, _, chk = trimmed.rpartition("/")
    base, _, job_id = parent.rpartition("/")
    if not chk.startswith("chk-") or not chk[4:].isdigit() or not base or not job_id:
        raise PipelineError(
            f"--from-checkpoint {path!r} must name <checkpoints-dir>/<job-id>/chk-<N> (or its _metadata)"
        )
    storage = CheckpointStorage(base, job_id, storage_options)
    return CompletedCheckpointStore(storage).load(int(chk[4:])), storage
