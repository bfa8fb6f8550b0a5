"""What a pipeline's driver starts from and reports, without the driver: its settings
(`PipelineConfig`), where a batch starts (`BatchStart`: the latest checkpoint, another job's or a
savepoint, or none; `starting_point`), whether the job's operators can restore it
(`check_operators`, `restore_plan`), the sink's settlement on a start, what a completed checkpoint
reports (`BatchReport`), and the driver's public seam (`BatchDriver`) that the two halves of a
batch use. The driver itself is `sparkpoint.pipeline.driver.StatefulPipeline`. Knows no orchestrator.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.errors import CheckpointCorrupted, OperatorStateMismatch, SparkpointError
from sparkpoint.checkpoint.ledger import RequestLedger
from sparkpoint.checkpoint.metadata import CheckpointMetadata, RestoreLineage, SkippedFile
from sparkpoint.checkpoint.retention import ClaimMode
from sparkpoint.checkpoint.retired import next_id_after
from sparkpoint.checkpoint.savepoint import SAVEPOINT_OF
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.pipeline.badfiles import BatchCheck
from sparkpoint.pipeline.eraselock import erase_in_progress
from sparkpoint.pipeline.settings import SETTINGS, PipelineSettings
from sparkpoint.pipeline.upgrade import RestorePlan, checkpoint_parallelism, plan_restore
from sparkpoint.spark.offsets import SourceOffsets
from sparkpoint.spark.routing import READ_ALL, FileLayout
from sparkpoint.spark.source import BatchSource, FileVerdict
from sparkpoint.spark.tasks import TaskSpec
from sparkpoint.state.engine.changelog import ChangelogOptions
from sparkpoint.state.engine.rocksdb import RocksDBOptions
from sparkpoint.state.eventtime import check_event_time, iso_micros
from sparkpoint.state.keygroups import MAX_KEY_GROUPS
from sparkpoint.state.operators import KeyedOperator
from sparkpoint.state.schema import (
    StateChange,
    StateSchemaIncompatible,
    compare_states,
    refusals,
    restored_declarations,
    schema_fix,
)
from sparkpoint.tables.sink import Sink
from sparkpoint.tables.sinks import open_sink
from sparkpoint.tables.spec import DeltaTable, IcebergTable, TableSpecError

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
    input_table: DeltaTable | IcebergTable | None = None  # a table as input (`input_url` is then its URI)
    output_url: str | None = None  # a Parquet directory's URL, `delta+<URL>` or `iceberg://<catalog>/<table>`
    output_partition_by: tuple[str, ...] | None = None  # of a table the sink creates
    output_options: dict[str, Any] | None = None  # a Delta table's delta-rs storage options (None: from fsspec's)
    output_catalog: dict[str, Any] = field(default_factory=dict)  # an Iceberg output's catalog properties
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


def open_output(config: PipelineConfig, operators: tuple[KeyedOperator, ...]) -> Sink | None:
    """The exactly-once sink of the config's output (None: no output), nothing written yet."""
    if not config.output_url:
        return None
    try:
        return open_sink(config.output_url, config.job_id, storage_options=config.storage_options,
                         catalog=config.output_catalog, partition_by=config.output_partition_by,
                         table_options=config.output_options, operators=[(op.name, op.uid) for op in operators],
                         evolve_schema=config.output_schema_evolution, replay_window=config.output_replay_window)
    except TableSpecError as e:
        raise PipelineError(f"output: {e}") from e


def emitted_columns(operators: tuple[KeyedOperator, ...]) -> dict[str, tuple[tuple[str, str], ...]]:
    """What each emitting operator declares it emits, for the sink's check before Spark: its
    `schema` (the rows it emits are taken to have its export's columns; none declared: unknown)."""
    return {op.name: tuple(op.schema.items() if isinstance(op.schema, Mapping) else op.schema)
            for op in operators if op.emits}


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
    if config.input_table is not None and config.input_cleanup != "keep":
        problems.append(f"input_cleanup={config.input_cleanup} cannot apply to input table {config.input_url}: its "
                        "files are the table's (Delta's VACUUM, Iceberg's expire_snapshots clean them); set "
                        "input_cleanup=keep")
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
    requests: RequestLedger | None = None  # the storage requests of this checkpoint (sparkpoint.checkpoint.ledger)
    estimated_cost_usd: float | None = None  # what they cost by the pipeline's `storage_prices`
    # The longest any subtask spent in each phase (restore, download, process, timers, snapshot, upload, ...)
    phase_seconds: dict[str, float] = field(default_factory=dict)

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
            + (f" {self.requests.line()} cost=${self.estimated_cost_usd:.6f}" if self.requests is not None else "")
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
            **(self.requests.to_json() if self.requests is not None else {}),
            "estimated_cost_usd": self.estimated_cost_usd,
            "phase_seconds": dict(self.phase_seconds),
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



@dataclass(frozen=True)
class BatchStart:
    """Where the next batch starts: the checkpoint it restores (maybe another job's or a
    savepoint; None: it starts empty), the source offsets after it, the claim mode of a restore
    from another job, and the id the next checkpoint takes."""

    metadata: CheckpointMetadata | None
    offsets: SourceOffsets
    claim_mode: str = ClaimMode.CLAIM.value
    restore_job: tuple[str, str, dict[str, Any]] | None = None  # (checkpoints URL, job id, options) of another job
    next_id: int | None = None  # after our own checkpoint K (and every retired id): the id a zombie races for

    @classmethod
    def after(cls, metadata: CheckpointMetadata) -> BatchStart:
        """Where the batch after the one committed as `metadata` starts: at its offsets."""
        return cls(metadata, offsets_of(metadata), next_id=metadata.checkpoint_id + 1)


class BatchDriver(Protocol):
    """What the two halves of a batch (`sparkpoint.pipeline.attempt`) use of a pipeline's driver:
    the public seam of `sparkpoint.pipeline.driver.StatefulPipeline`, whose loop runs those halves
    (so they name this interface, not the class)."""

    config: PipelineConfig
    operators: tuple[KeyedOperator, ...]
    storage: CheckpointStorage
    source: BatchSource
    sink: Sink | None

    @property
    def parallelism(self) -> int: ...

    def operator_names(self) -> dict[str, str]: ...

    def pending_files(self) -> list[str]: ...

    def next_batch(self, offsets: SourceOffsets | None = None) -> list[str]: ...

    def check_batch(self, files: list[str]) -> BatchCheck: ...

    def file_verdicts(self, files: list[str]) -> list[FileVerdict]: ...

    def begin(self) -> tuple[BatchStart, CheckpointCoordinator]: ...

    def fall_back(self, start: BatchStart, error: CheckpointCorrupted) -> BatchStart: ...

    def task_spec(self, checkpoint_id: int, start: BatchStart) -> TaskSpec: ...

    def run_spark(self, spec: TaskSpec, urls: list[str], layouts: list[FileLayout] | None = None,
                  route: str = READ_ALL) -> list[dict[str, Any]]: ...


def starting_point(storage: CheckpointStorage, config: PipelineConfig
                   ) -> tuple[BatchStart, RestoreLineage | None, frozenset[str]]:
    """Where job `storage` starts: its latest checkpoint, else `config.from_checkpoint` (another
    job's checkpoint or a savepoint), else nothing. Reads `_metadata` files only. Refused while
    `sparkpoint erase` holds the job: its copies are written below the latest batch's until it ends."""
    _refuse_during_erase(storage)
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
        start = BatchStart(own[0], offsets_of(own[0]), next_id=next_id_after(storage, own[0].checkpoint_id))
        return start, None, frozenset()
    if not config.from_checkpoint:
        return BatchStart(None, SourceOffsets(()), next_id=next_id_after(storage, 0)), None, frozenset()
    meta, source = load_external_checkpoint(config.from_checkpoint, config.storage_options)
    claim = ClaimMode(config.restore_mode).value
    lineage = RestoreLineage(restored_from=f"{source.job_url}/{meta.metadata_path}", claim_mode=claim)
    same_job = source.job_url == storage.job_url
    unowned = frozenset(meta.paths() | {meta.metadata_path}) if same_job and claim == "NO_CLAIM" else frozenset()
    restore_job = None if same_job else (source.url, source.job_id, source.storage_options)
    return BatchStart(meta, offsets_of(meta), claim, restore_job), lineage, unowned


def _refuse_during_erase(storage: CheckpointStorage) -> None:
    why = erase_in_progress(storage)
    if why is not None:
        raise PipelineError(f"cannot start: {why}. Let it finish; if it died, run the same `sparkpoint erase` "
                            "again (it resumes), then start")


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


def offsets_of(meta: CheckpointMetadata) -> SourceOffsets:
    """The source offsets a checkpoint recorded (the input files consumed up to it)."""
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


def check_operators(meta: CheckpointMetadata, config: PipelineConfig,
                    operators: tuple[KeyedOperator, ...]) -> RestorePlan:
    """The checkpoint must hold exactly the job's operators (by uid), at its max parallelism,
    unless the user allows the difference (Flink's --allowNonRestoredState, and new operators),
    and their declared states must read what it recorded. Returns the plan (it says a rescale).

    Raises:
        StateSchemaIncompatible: a state's recorded schema cannot be read by its declaration.
        OperatorStateMismatch: the operators do not map onto the checkpoint's.
    """
    check_states(meta, operators)  # an incompatible schema is said as such
    plan = plan_for(meta, config, operators)
    if not plan.ok:
        raise OperatorStateMismatch(plan.refusal(op.name for op in operators))
    return plan


def check_states(meta: CheckpointMetadata, operators: tuple[KeyedOperator, ...]) -> None:
    """Each operator's declared states must read what the checkpoint recorded of them (a
    RecordCodec may add, remove, widen, reorder fields and make them nullable)."""
    problems: list[str] = []
    changes: list[StateChange] = []
    for op in operators:
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


def settle_sink(sink: Sink, storage: CheckpointStorage, start: BatchStart) -> None:
    """Finish the sink commit of the checkpoint `start` resumes from, drop abandoned staging."""
    meta = start.metadata
    if meta is not None and start.restore_job is None and isinstance(meta.source_offsets, dict):
        copied = _copied_sink(meta)
        if copied is not None:  # a savepoint taken before its checkpoint's writer made its output visible
            sink.commit(*copied, resuming=True)
        sink.commit(meta.checkpoint_id, list(meta.source_offsets.get("sink") or []), resuming=True)
        # Output of a checkpoint above the latest one whose `_metadata` is gone: a fallback
        # discarded it and died before its rollback. Its batches are replayed, so the output
        # goes. Output is listed before `_metadata`: a live writer commits `_metadata` first,
        # so its fresh output is never taken for a discarded checkpoint's.
        above = list(sink.committed(after=meta.checkpoint_id))
        if above:
            live = set(storage.completed_checkpoint_ids())
            dropped = sink.drop([cid for cid in above if cid not in live])
            if dropped:
                log.warning("rolled back the output of discarded checkpoints %s", dropped)
    sink.discard_staging(up_to=meta.checkpoint_id if meta is not None and start.restore_job is None else 0)
