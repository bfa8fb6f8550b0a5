"""Erasing a key's rows from the Iceberg sink's files: one overwrite snapshot.

The job's data files in the current snapshot that hold the key are copied without its rows to new
names of the same checkpoint (`<data>/sparkpoint-<job>/chk-<N>/<operator>-<subtask>-<new hex>.parquet`),
so `committed`, `rollback` and `drop` find the copy under checkpoint N as they found the old file.
One overwrite snapshot deletes the old data files and adds the copies (copy-on-write, what
pyiceberg's `table.delete(filter)` does, here limited to this job's files and keeping their
checkpoint in their names); its summary names the job, the column and each old file's copy, never
the key. Staged files of a checkpoint the table records nothing of yet (a commit still to come) are
rewritten in place under their own names.

What stays: the old files themselves. Older snapshots (time travel) still list them, and so do
the tags the sink keeps (`sparkpoint-<job>-chk-<N>`, `sparkpoint-<job>-latest`): deleting them
would break every reader of those snapshots. Their bytes go when those snapshots expire (remove
the tags, then expire snapshots older than the erase: the table's own maintenance), and with them
the old manifests, whose column bounds may name the key.

A kill at any step leaves the current snapshot before the erase (copies no snapshot lists, which
the table's orphan-file cleanup collects) or after it.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pyiceberg.io.pyarrow import parquet_file_to_data_file
from pyiceberg.table.snapshots import Operation
from pyiceberg.table.update.snapshot import _OverwriteFiles

from sparkpoint.checkpoint.interleave import storage_step
from sparkpoint.tables.erasing import EraseTally, filtered_copy, rewrite_file, scan_file
from sparkpoint.tables.files import files_below, remove_tree
from sparkpoint.tables.sink import RowsErased, SinkError

if TYPE_CHECKING:
    from sparkpoint.tables.iceberg import IcebergSink

ERASED = "sparkpoint.erase-rewrites"  # snapshot summary: JSON {old file: copy or null}
ERASED_COLUMN = "sparkpoint.erase-column"
_HEX = re.compile(r"-[0-9a-f]{12}\.parquet$")
_NAME = re.compile(r"^chk-(\d+)/[A-Za-z0-9_.-]+-\d{5}-[0-9a-f]{12}\.parquet$")  # relative to the job's prefix


def erase_iceberg_rows(sink: IcebergSink, column: str, values: Sequence[object], *, dry_run: bool) -> RowsErased:
    """`IcebergSink.erase_rows` (see the module)."""
    from sparkpoint.tables.iceberg import JOB, _without_own_retry

    table = sink._load()
    if table is None:
        return RowsErased(sink.url, column, dry_run=dry_run)
    names = [f.name for f in table.schema().fields]
    if column not in names:
        raise SinkError(f"the Iceberg table {sink.identifier} has no column {column!r} to erase by; it has "
                        f"{', '.join(names)}")
    fs, root = sink._fs()
    if not dry_run:
        storage_step("delete", f"{sink.prefix}/_erase")
        remove_tree(fs, f"{root}/_erase")
    tally = EraseTally()
    changes: dict[str, str | None] = {}  # old file (full path) -> its copy's (None: no rows left)
    for cid, files in sorted(sink._live(table).items()):
        for data_file in files:
            rel = data_file.file_path[len(sink.prefix) + 1:]
            scan = scan_file(fs, f"{root}/{rel}", column, values)
            if tally.count(cid, scan) and not dry_run:
                new = _HEX.sub(f"-{uuid.uuid4().hex[:12]}.parquet", rel)
                tally.read += scan.size
                written, kept = filtered_copy(fs, f"{root}/{rel}", column, values, f"{root}/{new}", keep_empty=False)
                tally.written += written
                changes[data_file.file_path] = f"{sink.prefix}/{new}" if kept else None
    _erase_pending(sink, fs, root, max(sink._held(table), default=0), column, values, tally, dry_run=dry_run)
    if dry_run or not changes:
        return tally.result(sink.url, column, dry_run)

    def attempt() -> int:
        current = sink._load()
        assert current is not None
        live = {f.file_path: f for files in sink._live(current).values() for f in files}
        storage_step("create", f"{sink.url}#erase")
        tx = _without_own_retry(current).transaction()
        overwrite = _OverwriteFiles(operation=Operation.OVERWRITE, transaction=tx, io=current.io, snapshot_properties={
            JOB: sink.job_id, ERASED_COLUMN: column, ERASED: json.dumps(changes, sort_keys=True)})
        for old, new in changes.items():
            if old in live:
                overwrite.delete_data_file(live[old])
            if new:
                overwrite.append_data_file(parquet_file_to_data_file(current.io, current.metadata, new))
        overwrite.commit()
        tx.commit_transaction()
        return overwrite.snapshot_id

    snapshot = sink._retrying("erase of rows", attempt)
    return tally.result(sink.url, column, dry_run, version=snapshot, rewrites=list(changes.items()))


def _erase_pending(sink: IcebergSink, fs: object, root: str, newest: int, column: str, values: Sequence[object],
                   tally: EraseTally, *, dry_run: bool) -> None:
    """Rewrite in place the staged files of checkpoints above the newest the table records (a
    commit still to come takes them by their names)."""
    storage_step("walk", root)
    for rel, path in files_below(fs, root):
        m = _NAME.fullmatch(rel)
        if m is None or int(m.group(1)) <= newest:
            continue
        scan = scan_file(fs, path, column, values)
        if tally.count(int(m.group(1)), scan) and not dry_run:
            tally.read += scan.size
            tally.written += rewrite_file(fs, path, column, values, f"{root}/_erase")
