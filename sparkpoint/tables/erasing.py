"""Removing a key's rows from Parquet files in place, reading as little as it can.

A file is ruled out by its footer first (no such column, or every row group's min/max statistics
exclude every value), then by reading the key column alone; only a file that holds a matching row
is read whole, filtered and written again. The filtered copy goes to a scratch directory readers
skip (`_erase/...`) and then replaces the file in one move: a kill at any point leaves the old
file or the new one under the file's name, never neither and never both (a scratch copy left
behind is invisible, and deleted by the next erase). A file left with no rows stays, empty: its
name is how the sink knows the checkpoint it belongs to committed.
"""

from __future__ import annotations

import posixpath
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from sparkpoint.checkpoint.interleave import storage_step
from sparkpoint.checkpoint.storage import move_file
from sparkpoint.tables.files import write_parquet
from sparkpoint.tables.sink import RowsErased, SinkError


@dataclass(frozen=True)
class FileScan:
    """What one file's footer and key column say: `matches` rows hold a wanted value."""

    path: str
    size: int
    matches: int
    bytes_read: int
    skipped: bool  # ruled out by the footer alone (no such column, or statistics)


def wanted_array(values: Sequence[object], column: str, type_: pa.DataType, where: str) -> pa.Array:
    """`values` as an Arrow array of the column's type; SinkError naming the type when a value
    cannot be one (`"abc"` for an integer column)."""
    target = type_.value_type if pa.types.is_dictionary(type_) else type_
    try:
        return pa.array(list(values), type=target)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError):
        pass
    try:
        return pa.array([str(v) for v in values]).cast(target)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
        raise SinkError(f"cannot erase {list(values)[:5]!r} from column {column!r} of {where}: the column holds "
                        f"{target}, give keys of that type ({e})") from e


# Parquet is read on this thread: no pre-buffering (Arrow's I/O threads), no decoding threads, not
# `pq.read_table`'s dataset scan. Otherwise an Arrow worker thread lets go of the Python file's
# buffers after the read has returned; when that happens as the interpreter exits, the process
# aborts ("terminate called without an active exception", exit -6) after an erase that succeeded.
def scan_file(fs: Any, path: str, column: str, values: Sequence[object]) -> FileScan:
    """How many rows of the Parquet file `path` hold one of `values` in `column`, reading the footer
    and, unless its statistics rule the file out, that column's chunks only."""
    storage_step("read", path)
    with fs.open(path, "rb") as f:
        footer = pq.ParquetFile(f, pre_buffer=False)
        meta = footer.metadata
        size = int(fs.size(path))
        read = min(size, meta.serialized_size + 8)
        if column not in footer.schema_arrow.names:
            return FileScan(path, size, 0, read, True)
        wanted = wanted_array(values, column, footer.schema_arrow.field(column).type, path)
        leaf = _leaf_index(meta, column)
        groups = [i for i in range(meta.num_row_groups) if _may_hold(meta.row_group(i), leaf, wanted)]
        if not groups:
            return FileScan(path, size, 0, read, True)
        keys = footer.read_row_groups(groups, columns=[column], use_threads=False)[column]
        read += sum(meta.row_group(i).column(leaf).total_compressed_size for i in groups) if leaf is not None else size
    matches = int(pc.sum(pc.is_in(keys, value_set=wanted)).as_py() or 0)
    return FileScan(path, size, matches, min(read, size), False)


def filtered_copy(fs: Any, path: str, column: str, values: Sequence[object], target: str, *,
                  keep_empty: bool = True) -> tuple[int, int]:
    """Write the rows of the Parquet file `path` whose `column` holds none of `values` to `target`,
    with the file's schema and footer metadata; returns (bytes written, rows kept). Without
    `keep_empty`, no rows kept writes nothing."""
    storage_step("read", path)
    with fs.open(path, "rb") as f:
        table = pq.ParquetFile(f, pre_buffer=False).read(use_threads=False)
    wanted = wanted_array(values, column, table.schema.field(column).type, path)
    kept = table.filter(pc.invert(pc.fill_null(pc.is_in(table[column], value_set=wanted), False)))
    if not kept.num_rows and not keep_empty:
        return 0, 0
    fs.makedirs(posixpath.dirname(target), exist_ok=True)
    storage_step("write", target)
    write_parquet(fs, target, kept)
    return int(fs.size(target)), kept.num_rows


def rewrite_file(fs: Any, path: str, column: str, values: Sequence[object], scratch: str) -> int:
    """Replace the file `path` with its rows whose `column` holds none of `values`, through a copy
    in the directory `scratch`; returns the bytes written."""
    copy = f"{scratch}/{uuid.uuid4().hex}-{posixpath.basename(path)}"
    written, _ = filtered_copy(fs, path, column, values, copy)
    storage_step("move", f"{copy} -> {path}")
    move_file(fs, copy, path)
    return written


class EraseTally:
    """Rows, files and bytes an erase has counted so far, and the result it makes of them."""

    def __init__(self) -> None:
        self.rows = self.read = self.written = self.rewritten = self.scanned = self.skipped = 0
        self.by_checkpoint: dict[int, int] = {}

    def count(self, checkpoint_id: int, scan: FileScan) -> bool:
        """Count one scanned file of checkpoint N; whether it holds the key."""
        self.scanned += 1
        self.skipped += scan.skipped
        self.read += scan.bytes_read
        if not scan.matches:
            return False
        self.rows += scan.matches
        self.rewritten += 1
        self.by_checkpoint[checkpoint_id] = self.by_checkpoint.get(checkpoint_id, 0) + scan.matches
        return True

    def result(self, output: str, column: str, dry_run: bool, *, version: int | None = None,
               rewrites: Sequence[tuple[str, str | None]] = (), purged: Sequence[str] = ()) -> RowsErased:
        return RowsErased(output, column, rows_removed=self.rows, files_rewritten=self.rewritten,
                          bytes_read=self.read, bytes_written=self.written, files_scanned=self.scanned,
                          files_skipped=self.skipped, dry_run=dry_run, version=version,
                          by_checkpoint=tuple(sorted(self.by_checkpoint.items())),
                          rewrites=tuple((old, new or "") for old, new in rewrites), purged=tuple(purged))


def erase_in_files(fs: Any, output: str, column: str, values: Sequence[object],
                   files: Sequence[tuple[int, str]], scratch: str, *, dry_run: bool) -> RowsErased:
    """Erase the rows of `values` from each (checkpoint id, path) of `files`, in place."""
    tally = EraseTally()
    rewrites: list[tuple[str, str | None]] = []
    for checkpoint_id, path in files:
        scan = scan_file(fs, path, column, values)
        if tally.count(checkpoint_id, scan) and not dry_run:
            tally.read += scan.size
            tally.written += rewrite_file(fs, path, column, values, scratch)
            rewrites.append((path, path))
    return tally.result(output, column, dry_run, rewrites=rewrites)


def _leaf_index(meta: pq.FileMetaData, column: str) -> int | None:
    """The Parquet leaf column of a top-level Arrow column (None for a nested one)."""
    for i in range(meta.num_columns):
        if meta.schema.column(i).path == column:
            return i
    return None


def _may_hold(group: pq.RowGroupMetaData, leaf: int | None, wanted: pa.Array) -> bool:
    """Whether a row group's min/max statistics leave room for one of the wanted values."""
    if leaf is None:
        return True
    stats = group.column(leaf).statistics
    if stats is None or not stats.has_min_max:
        return True
    try:
        return any(v is not None and stats.min <= v <= stats.max for v in wanted.to_pylist())
    except TypeError:  # a type whose statistics Python cannot compare with the values
        return True
