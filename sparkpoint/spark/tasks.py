"""What runs inside Spark tasks: task i runs subtask i of every operator, one after the other,
as a Flink slot runs one subtask of each operator of a pipeline (slot sharing): restore, process
its rows, stage its output, snapshot.

How the rows get there is the batch's route (`sparkpoint.spark.routing`):

* read-all (`run_slots`): one stage over `range(parallelism)`; task i reads every input file of
  the batch (the columns the operators need) and keeps, per operator, the rows whose keys fall
  in subtask i's key groups. Each file is read once per subtask index.
* shuffle (`route_units`, then `run_routed`): reading tasks read the batch once, a piece each,
  and tag each operator's rows with their subtask; Spark's shuffle brings them to task i, which
  puts them back in batch order and runs subtask i of every operator.

Everything receives a `TaskSpec` (plain picklable data) and imports nothing from the driver.
"""

from __future__ import annotations

import fcntl
import gc
import json
import logging
import os
import pickle
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from sparkpoint.checkpoint import ledger
from sparkpoint.checkpoint.interleave import stepping, storage_step
from sparkpoint.checkpoint.metadata import CheckpointMetadata, SubtaskStateHandle
from sparkpoint.checkpoint.phases import phase, recording
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.lazy import lazy_module
from sparkpoint.spark import routing
from sparkpoint.spark.faults import fail_at
from sparkpoint.spark.offsets import SourceError
from sparkpoint.spark.routing import ReadUnit
from sparkpoint.spark.source import FileColumns, read_parquet_counted
from sparkpoint.state.backend import RestoreResult, RocksDBStateBackend
from sparkpoint.state.engine.changelog import ChangelogOptions
from sparkpoint.state.engine.localfiles import open_no_follow
from sparkpoint.state.engine.rocksdb import RocksDBOptions, is_corruption
from sparkpoint.state.eventtime import LateSplit, event_micros, split_late
from sparkpoint.state.keygroups import arrow_keys, subtasks_of
from sparkpoint.state.operators import KeyedOperator, run_batch
from sparkpoint.tables.sink import Sink

if TYPE_CHECKING:
    import numpy as np
    import pandas as pd
else:
    np = lazy_module("numpy")
    pd = lazy_module("pandas")

log = logging.getLogger(__name__)

RESULT_SCHEMA = (
    "op int, subtask int, handle string, staged array<string>, rows long, late long, restore string, seconds double, "
    "read_bytes long, requests string, restore_phases string, phases string"
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
    sink: Sink | None  # as `Sink.for_tasks` made it for this checkpoint
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
    run_dir: str | None = None  # on the warm local Spark: the run's working directory (see __reduce__)
    # By input file URL: columns the file lacks and its rows have (a Delta partition's values).
    file_columns: dict[str, FileColumns] = field(default_factory=dict)

    def __reduce__(self) -> tuple[Any, ...]:
        """On the warm local Spark, a task starts in the run's working directory, as the Python
        workers of a Spark of the run's own do (DESIGN rule 16): the spec travels as the run's
        directory and a nested pickle of its fields, and unpickling it enters the directory
        before it loads the fields, so a user's module imported with the operators reads
        relative paths where the run would. Other specs pickle as any dataclass."""
        fields = {f: getattr(self, f) for f in self.__dataclass_fields__}
        if self.run_dir is None:
            return (_spec_of, (fields,))
        from pyspark import cloudpickle  # pyspark: only where Spark runs

        return (_spec_in_run_dir, (self.run_dir, cloudpickle.dumps(fields)))  # type: ignore[no-untyped-call]


def _spec_of(fields: dict[str, Any]) -> TaskSpec:
    return TaskSpec(**fields)


def _spec_in_run_dir(run_dir: str, fields: bytes) -> TaskSpec:
    if os.path.isdir(run_dir):
        os.chdir(run_dir)
    return TaskSpec(**pickle.loads(fields))  # noqa: S301  the driver's own spec


def run_slots(spec: TaskSpec, urls: list[str], ids: Iterator[pd.DataFrame]) -> Iterator[pd.DataFrame]:
    """The read-all route, mapInPandas over `range(parallelism)`: for each subtask index this
    task was given (one, by design), read the whole batch and run that subtask of every operator.
    Every subtask runs, with rows or without, so every subtask acknowledges."""
    _freeze_imports_once()
    for frame in ids:
        for subtask in frame["id"].tolist():
            _check_subtask(spec, subtask)
            files = [(url, *read_unit(spec, ReadUnit(url))) for url in urls]
            for op_index, op in enumerate(spec.operators):
                parts = [rows_of_subtask(spec, op, subtask, url, data) for url, data, _ in files]
                yield run_subtask(spec, op_index, subtask, concat_rows(op, [p.kept for p in parts]),
                                  late=sum(p.late for p in parts),
                                  read_bytes=sum(n for _, _, n in files) if op_index == 0 else 0)


def route_units(spec: TaskSpec, units: list[ReadUnit], routes: list[int],
                ids: Iterator[pd.DataFrame]) -> Iterator[pd.DataFrame]:
    """The shuffle route's reading stage, mapInPandas over the indexes of `units` (each task a
    run of consecutive ones): read each unit this task was given once and yield, per operator
    and subtask, that subtask's rows (pickled: a frame comes out as it went in) with its late
    count, under the route that sends it to the subtask's partition (`routes`). Consecutive
    units are sent together up to `UNIT_BYTES` read (a batch of many small files makes few
    parts), keyed by the first unit's index, which keeps batch order. Then one marker row per
    subtask, so that every subtask's partition exists and runs with rows or without; subtask
    0's carries the bytes this task read."""
    _freeze_imports_once()
    read = 0
    held: dict[tuple[int, int], list[LateSplit]] = defaultdict(list)
    first, held_bytes = -1, 0
    for frame in ids:
        for index in frame["id"].tolist():
            unit = units[index]
            data, n = read_unit(spec, unit)
            read += n
            first = index if first < 0 else first
            held_bytes += n
            for op_index, op in enumerate(spec.operators):
                for subtask, part in split_by_subtask(spec, op, unit.url, data).items():
                    held[(op_index, subtask)].append(part)
            if held_bytes >= routing.UNIT_BYTES:
                yield _routed_parts(held, first, routes)
                held, first, held_bytes = defaultdict(list), -1, 0
    if held:
        yield _routed_parts(held, first, routes)
    counted = json.dumps(ledger.drain().to_json()).encode()  # what reading cost, with subtask 0's marker
    yield pd.DataFrame([(routes[s], s, -1, -1, 0, read if s == 0 else 0, counted if s == 0 else None)
                        for s in range(spec.parallelism)], columns=_ROUTED_COLUMNS)


def _routed_parts(held: dict[tuple[int, int], list[LateSplit]], first: int, routes: list[int]) -> pd.DataFrame:
    out = []
    for (op_index, subtask), parts in held.items():
        rows = [p.kept for p in parts if len(p.kept)]
        kept = pd.concat(rows, ignore_index=True) if len(rows) > 1 else rows[0].reset_index(drop=True) if rows \
            else parts[0].kept.iloc[0:0]
        out.append((routes[subtask], subtask, op_index, first, sum(p.late for p in parts), 0,
                    pickle.dumps(kept, protocol=5)))
    return pd.DataFrame(out, columns=_ROUTED_COLUMNS)


_ROUTED_COLUMNS = ["route", "subtask", "op", "unit", "late", "read_bytes", "rows"]


def run_routed(spec: TaskSpec, frames: Iterator[pd.DataFrame]) -> Iterator[pd.DataFrame]:
    """The shuffle route's processing stage, mapInPandas over the repartitioned rows: each subtask
    whose marker is in this partition (one, by design) runs every operator over its rows, put
    back in batch order."""
    _freeze_imports_once()
    parts: dict[tuple[int, int], list[tuple[int, int, bytes]]] = defaultdict(list)
    read: dict[int, int] = defaultdict(int)
    reading: dict[int, ledger.RequestLedger] = defaultdict(ledger.RequestLedger)
    for frame in frames:
        for _, subtask, op_index, unit, late, nbytes, blob in frame.itertuples(index=False, name=None):
            if op_index < 0:
                read[int(subtask)] += int(nbytes)
                if blob is not None:  # the requests of a reading task, made in another process
                    reading[int(subtask)] += ledger.RequestLedger.from_json(json.loads(blob), "a reading task")
            else:
                parts[(int(subtask), int(op_index))].append((int(unit), int(late), blob))
    for subtask in sorted(read):
        _check_subtask(spec, subtask)
        for op_index, op in enumerate(spec.operators):
            got = sorted(parts.pop((subtask, op_index), []), key=lambda part: part[0])
            late = sum(late for _, late, _ in got)
            frames_ = [pickle.loads(blob) for _, _, blob in got]  # noqa: S301  our own tasks' frames
            del got  # the pickles go before the subtask runs: its rows are held once
            rows = concat_rows(op, frames_)
            del frames_
            yield run_subtask(spec, op_index, subtask, rows, late=late,
                              read_bytes=read[subtask] if op_index == 0 else 0,
                              reading=reading.pop(subtask, None) if op_index == 0 else None)
    if parts:  # rows whose subtask's marker did not come: a route that lost its way
        raise ValueError(f"rows for subtasks {sorted({s for s, _ in parts})} reached a partition without them")


def _check_subtask(spec: TaskSpec, subtask: int) -> None:
    if not 0 <= subtask < spec.parallelism:
        raise ValueError(f"subtask {subtask} is outside 0..{spec.parallelism - 1}")


def read_unit(spec: TaskSpec, unit: ReadUnit) -> tuple[pd.DataFrame, int]:
    """A piece of the batch, with the columns some operator reads, and the bytes read for it."""
    columns = list(dict.fromkeys([*(c for op in spec.operators for c in op.input_columns()),
                                  *([spec.event_time] if spec.event_time else [])]))
    return read_parquet_counted(unit.url, spec.input_options, columns, unit.row_groups,
                                constants=spec.file_columns.get(unit.url, ()))


def rows_of_subtask(spec: TaskSpec, op: KeyedOperator, subtask: int, url: str, data: pd.DataFrame) -> LateSplit:
    """The rows of one input file that `op` keys into `subtask`'s key groups, with `op`'s columns,
    less the late ones when the pipeline has an event time (and how many were late)."""
    mine = data.loc[_subtasks(spec, op, url, data) == subtask]
    if spec.event_time is None:
        return LateSplit(mine[op.input_columns()], 0)
    split = split_late(mine, event_micros(mine, spec.event_time, url), spec.watermark_start_us, spec.late)
    return LateSplit(split.kept[op.input_columns()], split.late)


def split_by_subtask(spec: TaskSpec, op: KeyedOperator, url: str, data: pd.DataFrame) -> dict[int, LateSplit]:
    """`rows_of_subtask` for every subtask at once, in one pass: the subtasks with rows (kept or
    late), each with its rows in the order they came."""
    subtasks = _subtasks(spec, op, url, data)
    columns = data[op.input_columns()]
    late = (event_micros(data, spec.event_time, url) < spec.watermark_start_us
            if spec.event_time is not None and spec.watermark_start_us is not None and len(data)
            else np.zeros(len(data), dtype=bool))
    order = np.argsort(subtasks, kind="stable")
    bounds = np.flatnonzero(np.diff(subtasks[order])) + 1
    out = {}
    for rows in np.split(order, bounds) if len(order) else []:
        is_late = late[rows]
        kept = rows[~is_late] if spec.late == "drop" else rows
        out[int(subtasks[rows[0]])] = LateSplit(columns.iloc[kept], int(is_late.sum()))
    return out


def _subtasks(spec: TaskSpec, op: KeyedOperator, url: str, data: pd.DataFrame) -> np.ndarray:
    keys = data[op.key]
    if keys.isna().any():
        raise SourceError(f"{url}: column {op.key!r} has null keys; {op.name} cannot key them")
    return np.asarray(subtasks_of(arrow_keys(keys), spec.max_parallelism, spec.parallelism))


def concat_rows(op: KeyedOperator, parts: list[pd.DataFrame]) -> pd.DataFrame:
    """A subtask's rows of `op` from its parts in batch order (empty parts left out, so that
    which parts a route hands over does not change a column's type)."""
    parts = [p for p in parts if len(p)]
    return pd.concat(parts, ignore_index=True) if parts else no_rows(op)


def no_rows(op: KeyedOperator) -> pd.DataFrame:
    """An empty batch with `op`'s input columns."""
    return pd.DataFrame({c: pd.Series(dtype=object) for c in op.input_columns()})


def run_subtask(spec: TaskSpec, op_index: int, subtask: int, batch: pd.DataFrame, *, late: int = 0,
                read_bytes: int = 0, reading: ledger.RequestLedger | None = None) -> pd.DataFrame:
    """One operator's subtask for checkpoint N: restore, process its rows, stage, snapshot.

    Its row carries the requests this process made since it last reported (`ledger.drain`: the
    batch's reads before it, its restore and uploads) and `reading`'s, made by reading tasks.

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
    with _exclusive(backend.dir), recording() as phases:
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
            "restore_phases": json.dumps(restore_phases(restored)),
            "read_bytes": read_bytes, "requests": json.dumps((ledger.drain() + (reading or ledger.RequestLedger())
                                                              ).to_json()),
            "phases": json.dumps(phases.to_json()),
        }]
    )


def restore_phases(restored: RestoreResult) -> dict[str, float | int]:
    """How long a subtask's restore took by phase, and the bytes it took from each copy."""
    return {"local_seconds": round(restored.local_seconds, 6), "download_seconds": round(restored.download_seconds, 6),
            "open_seconds": round(restored.open_seconds, 6), "local_bytes": restored.local_bytes,
            "remote_bytes": restored.downloaded_bytes}


def _attempt(
    spec: TaskSpec, op_index: int, subtask: int, batch: pd.DataFrame, backend: RocksDBStateBackend,
    meta: CheckpointMetadata | None, source: CheckpointStorage | None,
) -> tuple[RestoreResult, list[str], SubtaskStateHandle]:
    op = spec.operators[op_index]
    with phase("restore"):
        restored = backend.restore(meta, claim_mode=spec.claim_mode, source=source,
                                   allow_missing=spec.allow_new_operators)
    try:
        changed = run_batch(op, backend, batch, processing_us=spec.batch_time_us, watermark_us=spec.watermark_us,
                            event_time=spec.event_time is not None)
        staged: list[str] = []
        if op.emits and spec.sink is not None and changed is not None:
            # Output files are named by the display name: a name per checkpoint, never state.
            with phase("stage"):
                staged = spec.sink.stage(spec.checkpoint_id, op.name, subtask, changed)
        if op_index == 0 and subtask == 0:
            fail_at("before-upload", spec.inject_failure, f"{op.name}/{subtask} before its snapshot upload")
        with phase("snapshot"):
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
    """One attempt at a time per subtask directory (a retried or speculative task waits, and so
    does another run's task of the same subtask on this host: they share the local directory)."""
    os.makedirs(directory, exist_ok=True)
    with os.fdopen(open_no_follow(os.path.join(directory, ".lock"), os.O_RDWR | os.O_CREAT), "r+") as f:
        storage_step("lock", os.fspath(directory))
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | (fcntl.LOCK_NB if stepping() else 0))
                break
            except BlockingIOError:  # under a scheduler only: the holder must be let go on
                storage_step("blocked", os.fspath(directory))
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
