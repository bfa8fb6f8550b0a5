"""What runs inside the Spark tasks of `sparkpoint bootstrap`: the initial state of a pipeline.

The job is a checkpoint's (`sparkpoint.spark.tasks`): `range(parallelism)`, one subtask index per
task, each task running that subtask of every operator. For the operator being bootstrapped the
task reads every file of the initial table, keeps the rows whose keys fall in its key groups and
hands them to `bootstrap(table, state)` over an empty backend; every other operator's subtask
stays empty. Each subtask then takes a *full* snapshot into the savepoint's directory (no
changelog, no base: nothing in it refers to any other checkpoint) and returns its handle.

Working databases live in a fresh temporary directory per task, deleted afterwards: a bootstrap
never touches the working state of a job running on the same machine.
"""

from __future__ import annotations

import os
import posixpath
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from sparkpoint.checkpoint.metadata import SubtaskStateHandle
from sparkpoint.checkpoint.storage import CheckpointStorage, storage_url
from sparkpoint.spark.offsets import SourceError
from sparkpoint.spark.source import ACCEPTED, SourceSchemaError, read_parquet
from sparkpoint.spark.tasks import LOCAL_DIR_ENV
from sparkpoint.state.backend import RocksDBStateBackend
from sparkpoint.state.engine.changelog import ChangelogOptions
from sparkpoint.state.engine.rocksdb import RocksDBOptions
from sparkpoint.state.keygroups import arrow_keys, subtasks_of
from sparkpoint.state.operators import KeyedOperator, run_bootstrap

BOOTSTRAP_SCHEMA = "op int, subtask int, handle string, rows long"


@dataclass(frozen=True)
class BootstrapSpec:
    """Plain picklable data: everything a bootstrap task needs, nothing from the driver."""

    checkpoint_id: int
    savepoint_url: str  # the directory above the savepoint's job directory
    job_id: str  # the savepoint's job directory name
    storage_options: dict[str, Any]
    operators: tuple[KeyedOperator, ...]  # every operator of the pipeline, in its order
    bootstrapped: int  # the index of the one whose `bootstrap` runs
    table_urls: tuple[str, ...]  # the initial table's Parquet files
    table_options: dict[str, Any]
    parallelism: int
    max_parallelism: int
    local_dir: str
    rocksdb: RocksDBOptions
    time_us: int  # the processing time the bootstrap runs at (TTL stamps, processing-time timers)
    event_time: bool  # the pipeline has an event time: timers default to event time


@dataclass(frozen=True)
class InitialTable:
    """The initial table's Parquet files, as their footers describe them (nothing else was read)."""

    url: str
    files: tuple[str, ...]  # full URLs, in name order
    rows: int
    columns: tuple[str, ...]


def check_initial_table(url: str, options: dict[str, Any], key: str, operator: str) -> InitialTable:
    """A Parquet file, or a directory of them (`*.parquet`, names starting with _ or . skipped, as
    the input directory), with rows, with column `key` in every file and no null in it where the
    footers' statistics tell (the tasks check the rest). Raises SourceError / SourceSchemaError
    naming the file and what to give instead."""
    url = storage_url(url)
    try:
        fs, root = fsspec.core.url_to_fs(url, **options)
    except (ValueError, ImportError) as e:
        raise SourceError(f"cannot open the initial table {url!r}: {e}") from e
    if not fs.exists(root):
        raise SourceError(f"initial table {url} does not exist: give a Parquet file or a directory of them")
    if fs.isdir(root):
        names = sorted(posixpath.basename(p.rstrip("/")) for p in fs.ls(root, detail=False))
        accepted = [n for n in names if n.endswith(".parquet") and not n.startswith(("_", "."))]
        if not accepted:
            skipped = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            raise SourceError(f"initial table directory {url} holds no Parquet file ({ACCEPTED})"
                              + (f"; skipped: {skipped}" if names else ": it is empty"))
        paths = [posixpath.join(root, n) for n in accepted]
    else:
        paths = [root]
    rows, columns = 0, {}
    for path in paths:
        shown = str(fs.unstrip_protocol(path))
        try:
            with fs.open(path, "rb") as f:
                meta = pq.ParquetFile(f).metadata
        except (OSError, ValueError, pa.ArrowException) as e:
            raise SourceError(f"initial table file {shown} is not a readable Parquet file: {e}") from e
        names = [meta.schema.column(i).name for i in range(meta.num_columns)]
        if key not in names:
            raise SourceSchemaError(f"initial table file {shown} lacks the key column {key!r} of operator "
                                    f"{operator!r}; it has: {', '.join(names)}")
        if _null_keys(meta, names.index(key)):
            raise SourceError(f"initial table file {shown}: column {key!r} has null keys; {operator} cannot key "
                              "them. Drop or fill those rows")
        rows += meta.num_rows
        columns.update(dict.fromkeys(names))
    if not rows:
        raise SourceError(f"initial table {url} holds no rows: nothing to bootstrap {operator} from")
    return InitialTable(url, tuple(str(fs.unstrip_protocol(p)) for p in paths), rows, tuple(columns))


def _null_keys(meta: pq.FileMetaData, column: int) -> bool:
    """Whether some row group's statistics count a null in `column` (False when none say)."""
    for g in range(meta.num_row_groups):
        stats = meta.row_group(g).column(column).statistics
        if stats is not None and stats.has_null_count and stats.null_count > 0:
            return True
    return False


def bootstrap_slots(spec: BootstrapSpec, ids: Iterator[pd.DataFrame]) -> Iterator[pd.DataFrame]:
    """mapInPandas over `range(parallelism)`: each subtask of every operator, one row per handle."""
    for frame in ids:
        for subtask in frame["id"].tolist():
            if not 0 <= subtask < spec.parallelism:
                raise ValueError(f"subtask {subtask} is outside 0..{spec.parallelism - 1}")
            table = initial_rows(spec, subtask)
            for op_index in range(len(spec.operators)):
                rows = table if op_index == spec.bootstrapped else None
                handle = bootstrap_subtask(spec, op_index, subtask, rows)
                yield pd.DataFrame([{"op": op_index, "subtask": subtask, "handle": handle.dumps(),
                                     "rows": 0 if rows is None else len(rows)}])


def initial_rows(spec: BootstrapSpec, subtask: int) -> pd.DataFrame:
    """The initial table's rows whose keys fall in `subtask`'s key groups, every column."""
    op = spec.operators[spec.bootstrapped]
    parts = []
    for url in spec.table_urls:
        data = read_parquet(url, spec.table_options)
        if op.key not in data.columns:
            raise SourceSchemaError(f"initial table file {url} lacks the key column {op.key!r} of {op.name}")
        keys = data[op.key]
        if keys.isna().any():
            raise SourceError(f"initial table file {url}: column {op.key!r} has null keys; {op.name} cannot key them")
        parts.append(data.loc[subtasks_of(arrow_keys(keys), spec.max_parallelism, spec.parallelism) == subtask])
    return pd.concat(parts, ignore_index=True)


def bootstrap_subtask(
    spec: BootstrapSpec, op_index: int, subtask: int, rows: pd.DataFrame | None
) -> SubtaskStateHandle:
    """One subtask's initial state (empty when `rows` is None), snapshotted in full."""
    op = spec.operators[op_index]
    storage = CheckpointStorage(spec.savepoint_url, spec.job_id, spec.storage_options)
    root = Path(tempfile.mkdtemp(prefix="sparkpoint-bootstrap-", dir=_local_root(spec)))
    try:
        backend = RocksDBStateBackend(
            storage, op.uid, subtask, parallelism=spec.parallelism, max_parallelism=spec.max_parallelism,
            local_dir=root, options=spec.rocksdb, incremental=False, local_recovery=False,
            changelog=ChangelogOptions(enabled=False), states=op.states, key_type=op.key_type,
        )
        backend.restore(None)
        try:
            if rows is not None:
                run_bootstrap(op, backend, rows, processing_us=spec.time_us, event_time=spec.event_time)
            return backend.snapshot(spec.checkpoint_id, full=True)
        finally:
            backend.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _local_root(spec: BootstrapSpec) -> str:
    root = os.environ.get(LOCAL_DIR_ENV) or spec.local_dir
    os.makedirs(root, exist_ok=True)
    return root
