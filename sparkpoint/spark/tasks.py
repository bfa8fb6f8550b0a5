"""What runs inside Spark tasks: one task per subtask index, in a single stage.

A checkpoint's Spark job is `range(parallelism)` with one index per partition, mapped by
`run_slots`. Task i runs subtask i of every operator, one after the other, as a Flink slot runs
one subtask of each operator of a pipeline (slot sharing). It reads the batch's input files once
(the columns the operators need), keeps for each operator the rows whose keys fall in that
subtask's key groups, and runs the subtask: restore, process, stage, snapshot.

There is no routing stage and no shuffle. Measured on `local[2]`, a routing task that read each
file once and shuffled Arrow blobs to the subtasks cost more than every subtask reading the file:
the routing ran on one core for a whole input file, and its stage, its shuffle and one task per
(operator, subtask) added a fixed cost to every batch (benchmarks/README.md). The price is that
each input file is read once per subtask index, column-projected.

Everything receives a `TaskSpec` (plain picklable data) and imports nothing from the driver.
"""

from __future__ import annotations

import fcntl
import gc
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import pandas as pd

from sparkpoint.checkpoint.metadata import CheckpointMetadata, SubtaskStateHandle
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.spark.faults import fail_at
from sparkpoint.spark.sink import ExactlyOnceParquetSink
from sparkpoint.spark.source import SourceError, read_parquet
from sparkpoint.state.backend import RestoreResult, RocksDBStateBackend
from sparkpoint.state.changelog import ChangelogOptions
from sparkpoint.state.eventtime import LateSplit, event_micros, split_late
from sparkpoint.state.keygroups import arrow_keys, subtasks_of
from sparkpoint.state.localfiles import open_no_follow
from sparkpoint.state.operators import KeyedOperator, run_batch
from sparkpoint.state.rocksdb import RocksDBOptions, is_corruption

log = logging.getLogger(__name__)

RESULT_SCHEMA = (
    "op int, subtask int, handle string, staged string, rows long, late long, restore string, seconds double"
)


@dataclass(frozen=True)
class TaskSpec:
    checkpoint_id: int
    checkpoints_url: str
    job_id: str
    storage_options: dict[str, Any]
    operators: tuple[KeyedOperator, ...]
    parallelism: int
    max_parallelism: int
    local_dir: str
    input_options: dict[str, Any]
    restore_metadata: bytes | None  # the checkpoint every subtask starts from
    restore_job: tuple[str, str, dict[str, Any]] | None  # (url, job id, options) when another job's
    claim_mode: str
    sink: ExactlyOnceParquetSink | None
    incremental: bool = True
    local_recovery: bool = True
    rocksdb: RocksDBOptions = RocksDBOptions()
    allow_new_operators: bool = False
    changelog: ChangelogOptions = ChangelogOptions()
    inject_failure: str | None = None  # see sparkpoint.spark.faults
    batch_time_us: int | None = None  # the batch's processing time: what processing-time TTL expires against
    event_time: str | None = None  # the pipeline's event-time column (sparkpoint.state.eventtime)
    late: str = "drop"  # what happens to rows below `watermark_start_us`: "drop" or "process"
    watermark_start_us: int | None = None  # the watermark the batch starts with: rows below it are late
    watermark_us: int | None = None  # the watermark the batch advances to (timers, event-time TTL)


def run_slots(spec: TaskSpec, urls: list[str], ids: Iterator[pd.DataFrame]) -> Iterator[pd.DataFrame]:
    """mapInPandas over `range(parallelism)`: for each subtask index this task was given (one, by
    design), run that subtask of every operator. Every subtask runs, with rows or without, so
    every subtask acknowledges."""
    _freeze_imports_once()
    for frame in ids:
        for subtask in frame["id"].tolist():
            if not 0 <= subtask < spec.parallelism:
                raise ValueError(f"subtask {subtask} is outside 0..{spec.parallelism - 1}")
            files = read_batch(spec, urls)
            for op_index, op in enumerate(spec.operators):
                parts = [rows_of_subtask(spec, op, subtask, url, data) for url, data in files]
                rows = pd.concat([p.kept for p in parts], ignore_index=True) if parts else no_rows(op)
                yield run_subtask(spec, op_index, subtask, rows, late=sum(p.late for p in parts))


def read_batch(spec: TaskSpec, urls: list[str]) -> list[tuple[str, pd.DataFrame]]:
    """Each input file of the batch, with the columns some operator reads."""
    columns = list(dict.fromkeys([*(c for op in spec.operators for c in op.input_columns()),
                                  *([spec.event_time] if spec.event_time else [])]))
    return [(url, read_parquet(url, spec.input_options, columns)) for url in urls]


def rows_of_subtask(spec: TaskSpec, op: KeyedOperator, subtask: int, url: str, data: pd.DataFrame) -> LateSplit:
    """The rows of one input file that `op` keys into `subtask`'s key groups, with `op`'s columns,
    less the late ones when the pipeline has an event time (and how many were late)."""
    keys = data[op.key]
    if keys.isna().any():
        raise SourceError(f"{url}: column {op.key!r} has null keys; {op.name} cannot key them")
    mine = data.loc[subtasks_of(arrow_keys(keys), spec.max_parallelism, spec.parallelism) == subtask]
    if spec.event_time is None:
        return LateSplit(mine[op.input_columns()], 0)
    split = split_late(mine, event_micros(mine, spec.event_time, url), spec.watermark_start_us, spec.late)
    return LateSplit(split.kept[op.input_columns()], split.late)


def no_rows(op: KeyedOperator) -> pd.DataFrame:
    """An empty batch with `op`'s input columns."""
    return pd.DataFrame({c: pd.Series(dtype=object) for c in op.input_columns()})


def run_subtask(spec: TaskSpec, op_index: int, subtask: int, batch: pd.DataFrame, *, late: int = 0) -> pd.DataFrame:
    """One operator's subtask for checkpoint N: restore, process its rows, stage, snapshot.

    When RocksDB reports corrupt data on the way (its block checksums, checked on every read),
    the subtask's local state is discarded and the subtask runs once more from stable storage."""
    started = time.monotonic()
    op = spec.operators[op_index]
    storage = CheckpointStorage(spec.checkpoints_url, spec.job_id, spec.storage_options)
    source = CheckpointStorage(*spec.restore_job) if spec.restore_job else None
    backend = RocksDBStateBackend(
        storage, op.uid, subtask, parallelism=spec.parallelism, max_parallelism=spec.max_parallelism,
        local_dir=task_local_dir(spec), options=spec.rocksdb, incremental=spec.incremental,
        local_recovery=spec.local_recovery, changelog=spec.changelog, states=op.states, key_type=op.key_type,
    )
    meta = CheckpointMetadata.loads(spec.restore_metadata) if spec.restore_metadata else None
    with _exclusive(backend.dir):
        try:
            outcome = _attempt(spec, op_index, subtask, batch, backend, meta, source)
        except Exception as e:
            if not is_corruption(e):
                raise
            # RocksDB's block checksums caught what the restore's checks could not (a rewrite that
            # put the old mtime back, bits rotting on disk): the local files are not trusted again.
            log.warning("%s/%s: RocksDB reports corrupt local state (%s); discarding the working database and "
                        "task-local copies and running the subtask again from stable storage", op.name, subtask, e)
            outcome = None
        if outcome is None:  # out of the handler: its traceback no longer holds the old database
            backend.discard_local_state()
            outcome = _attempt(spec, op_index, subtask, batch, backend, meta, source)
        restored, staged, handle = outcome
    return pd.DataFrame(
        [{
            "op": op_index, "subtask": subtask, "handle": handle.dumps(), "staged": staged, "rows": len(batch),
            "late": late, "restore": restored.source, "seconds": time.monotonic() - started,
        }]
    )


def _attempt(
    spec: TaskSpec, op_index: int, subtask: int, batch: pd.DataFrame, backend: RocksDBStateBackend,
    meta: CheckpointMetadata | None, source: CheckpointStorage | None,
) -> tuple[RestoreResult, str | None, SubtaskStateHandle]:
    op = spec.operators[op_index]
    restored = backend.restore(meta, claim_mode=spec.claim_mode, source=source, allow_missing=spec.allow_new_operators)
    try:
        changed = run_batch(op, backend, batch, processing_us=spec.batch_time_us, watermark_us=spec.watermark_us,
                            event_time=spec.event_time is not None)
        staged = None
        if op.emits and spec.sink is not None and changed is not None:
            # Output files are named by the display name: a name per checkpoint, never state.
            staged = spec.sink.stage(spec.checkpoint_id, op.name, subtask, changed)
        if op_index == 0 and subtask == 0:
            fail_at("before-upload", spec.inject_failure, f"{op.name}/{subtask} before its snapshot upload")
        handle = backend.snapshot(spec.checkpoint_id)
    except BaseException:
        try:
            backend.close()
        except Exception as e:  # noqa: BLE001  the first error is the one to report
            log.warning("%s/%s: closing the database after a failure: %s", op.name, subtask, e)
        raise
    backend.close()
    return restored, staged, handle


LOCAL_DIR_ENV = "SPARKPOINT_LOCAL_DIR"


def task_local_dir(spec: TaskSpec) -> str:
    """Where this machine keeps working databases and task-local copies: on a cluster each worker
    names its own disk in its environment (`SPARKPOINT_LOCAL_DIR`, inherited by its executors and
    their Python workers); otherwise the job's `local_dir`."""
    return os.environ.get(LOCAL_DIR_ENV) or spec.local_dir


_FROZEN = False


def _freeze_imports_once() -> None:
    """PySpark's daemon runs a full `gc.collect()` after every task of a reused Python worker. With
    pandas, pyarrow and rocksdict loaded that took ~40 ms of CPU a task, most of a small batch's
    overhead. Once per worker, what the imports built is moved out of the collector's sight
    (`gc.freeze`), so each later collection scans only what tasks allocated since. Reference
    counting still frees everything as before; only cyclic garbage that exists at the freeze would
    stay, and a full collection runs right before it."""
    global _FROZEN
    if not _FROZEN:
        gc.collect()
        gc.freeze()
        _FROZEN = True


E = TypeVar("E", bound=BaseException)


def raised_in_task(error: BaseException, kind: type[E]) -> E | None:
    """`kind` raised in a Spark task reaches the driver only as text in a Py4J error: rebuild it
    from its `Kind: message` line (None when the error is not one)."""
    if isinstance(error, kind):
        return error
    marker = f"{kind.__name__}: "
    text = str(error)
    if marker not in text:
        return None
    return kind(text.split(marker, 1)[1].splitlines()[0])


@contextmanager
def _exclusive(directory: os.PathLike[str]) -> Iterator[None]:
    """One attempt at a time per subtask directory (a retried or speculative task waits)."""
    os.makedirs(directory, exist_ok=True)
    with os.fdopen(open_no_follow(os.path.join(directory, ".lock"), os.O_RDWR | os.O_CREAT), "r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
