"""What runs inside Spark tasks: read input files, route rows, run one subtask per group.

Both functions receive a `TaskSpec` (plain picklable data) and import nothing from the driver.
Rows travel between the two stages as Arrow IPC blobs, one per (input file, operator, subtask):
Spark shuffles a handful of binary rows instead of every event, and pandas dtypes (timestamps
with their zone) arrive unchanged.
"""

from __future__ import annotations

import fcntl
import io
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import pandas as pd
import pyarrow as pa

from sparkpoint.core.backend import RocksDBStateBackend
from sparkpoint.core.changelog import ChangelogOptions
from sparkpoint.core.keygroups import subtask_for_key
from sparkpoint.core.metadata import CheckpointMetadata
from sparkpoint.core.rocksdb import RocksDBOptions
from sparkpoint.core.storage import CheckpointStorage
from sparkpoint.spark.faults import fail_at
from sparkpoint.spark.operators import KeyedOperator
from sparkpoint.spark.sink import ExactlyOnceParquetSink
from sparkpoint.spark.source import SourceError, read_parquet

ROUTED_SCHEMA = "op int, subtask int, rows long, data binary"
RESULT_SCHEMA = "op int, subtask int, handle string, staged string, rows long, restore string, seconds double"


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


def route_files(spec: TaskSpec, batches: Iterator[pd.DataFrame]) -> Iterator[pd.DataFrame]:
    """mapInPandas: read each input file, split its rows by (operator, subtask).

    Every (operator, subtask) gets a blob, empty or not, so every subtask runs and acknowledges.
    """
    for frame in batches:
        for url in frame["url"]:
            data = read_parquet(url, spec.input_options)
            out = []
            for op_index, op in enumerate(spec.operators):
                part = data[op.input_columns()]
                if part[op.key].isna().any():
                    raise SourceError(f"{url}: column {op.key!r} has null keys; {op.name} cannot key them")
                subtasks = _subtasks_of(part[op.key], spec.max_parallelism, spec.parallelism)
                for subtask in range(spec.parallelism):
                    rows = part[subtasks == subtask]
                    out.append((op_index, subtask, len(rows), _to_ipc(rows)))
            yield pd.DataFrame(out, columns=["op", "subtask", "rows", "data"])


def run_subtask(spec: TaskSpec, group: pd.DataFrame) -> pd.DataFrame:
    """applyInPandas: one operator's subtask for checkpoint N: restore, process, stage, snapshot."""
    started = time.monotonic()
    op_index, subtask = int(group["op"].iloc[0]), int(group["subtask"].iloc[0])
    op = spec.operators[op_index]
    batch = pd.concat([_from_ipc(b) for b in group["data"]], ignore_index=True)
    storage = CheckpointStorage(spec.checkpoints_url, spec.job_id, spec.storage_options)
    source = CheckpointStorage(*spec.restore_job) if spec.restore_job else None
    backend = RocksDBStateBackend(
        storage, op.name, subtask, parallelism=spec.parallelism, max_parallelism=spec.max_parallelism,
        local_dir=task_local_dir(spec), options=spec.rocksdb, incremental=spec.incremental,
        local_recovery=spec.local_recovery, changelog=spec.changelog,
    )
    with _exclusive(backend.dir):
        meta = CheckpointMetadata.loads(spec.restore_metadata) if spec.restore_metadata else None
        restored = backend.restore(
            meta, claim_mode=spec.claim_mode, source=source, allow_missing=spec.allow_new_operators
        )
        try:
            changed = op.process(batch, backend) if len(batch) else None
            staged = None
            if op.emits and spec.sink is not None and changed is not None:
                staged = spec.sink.stage(spec.checkpoint_id, op.name, subtask, changed)
            if op_index == 0 and subtask == 0:
                fail_at("before-upload", spec.inject_failure, f"{op.name}/{subtask} before its snapshot upload")
            handle = backend.snapshot(spec.checkpoint_id)
        finally:
            backend.close()
    return pd.DataFrame(
        [{
            "op": op_index, "subtask": subtask, "handle": handle.dumps(), "staged": staged, "rows": len(batch),
            "restore": restored.source, "seconds": time.monotonic() - started,
        }]
    )


LOCAL_DIR_ENV = "SPARKPOINT_LOCAL_DIR"


def task_local_dir(spec: TaskSpec) -> str:
    """Where this machine keeps working databases and task-local copies: on a cluster each worker
    names its own disk in its environment (`SPARKPOINT_LOCAL_DIR`, inherited by its executors and
    their Python workers); otherwise the job's `local_dir`."""
    return os.environ.get(LOCAL_DIR_ENV) or spec.local_dir


def _subtasks_of(keys: pd.Series, max_parallelism: int, parallelism: int) -> pd.Series:
    unique = pd.unique(keys.astype("string"))
    table = {k: subtask_for_key(k, max_parallelism, parallelism) for k in unique}
    return keys.astype("string").map(table)


def _to_ipc(frame: pd.DataFrame) -> bytes:
    table = pa.Table.from_pandas(frame, preserve_index=False)
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue()


def _from_ipc(data: bytes) -> pd.DataFrame:
    with pa.ipc.open_stream(io.BytesIO(data)) as reader:
        return reader.read_all().to_pandas()


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
    with open(os.path.join(directory, ".lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
