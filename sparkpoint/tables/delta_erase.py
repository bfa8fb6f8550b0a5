"""Erasing a key's rows from the Delta sink's files: one delete transaction, then a purge of
exactly the files it removed.

The job's live files that hold the key are copied without its rows to new names of the same
checkpoint (`sparkpoint-<job>/chk-<N>/<operator>-<subtask>-<new 12 hex>.parquet`), so `committed`,
`rollback` and `drop` find the new file under checkpoint N as they found the old one. One table
version removes the old files and adds the new ones; its commit info names the job and maps each
old file to its new one (`sparkpoint.erase`: never the key itself, which the log would keep). Then
the removed files are deleted from storage at once: Delta's own VACUUM keeps a removed file for
the table's retention period (`delta.deletedFileRetentionDuration`, 7 days by default) and would,
with a retention of 0, also delete every other file older versions of the table keep, other
writers' included. The price: time travel to a version before the erase fails for those files
(and only those).

Files of the job the table does not hold are erased too: staged files of a checkpoint the table
records nothing of yet (a commit still to come, rewritten under their own names), and files that
only older versions hold (a rollback's, an attempt that lost), deleted. Other writers' files are
not read. A kill at any step leaves either the table before the erase (new copies no version
names: the table's VACUUM or the next erase collects them) or after it, with old files perhaps not
yet deleted: the next erase deletes the files every earlier erase removed first.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from sparkpoint.checkpoint.interleave import storage_step
from sparkpoint.tables.erasing import EraseTally, filtered_copy, rewrite_file, scan_file
from sparkpoint.tables.files import files_below, remove_file, remove_tree
from sparkpoint.tables.sink import RowsErased

if TYPE_CHECKING:
    import deltalake

    from sparkpoint.tables.delta import DeltaSink

ERASE_INFO = "sparkpoint.erase"  # commit info of an erase: {"column": ..., "rewrites": {old: new or null}}
_HEX = re.compile(r"-[0-9a-f]{12}\.parquet$")


def erase_delta_rows(sink: DeltaSink, column: str, values: Sequence[object], *, dry_run: bool) -> RowsErased:
    """`DeltaSink.erase_rows` (see the module)."""
    fs, root = sink._fs()
    purged = [] if dry_run else finish_purges(sink, fs, root)
    table = sink._load()
    if table is None:
        return RowsErased(sink.url, column, dry_run=dry_run, purged=tuple(purged))
    if not dry_run:
        storage_step("delete", f"{root}/{sink._prefix}/_erase")
        remove_tree(fs, f"{root}/{sink._prefix}/_erase")
    live = sink._paths(table)
    pattern = sink._staged_re()
    tally = EraseTally()
    changes: dict[str, str | None] = {}
    for rel in live:
        cid = int(pattern.fullmatch(rel).group(1))  # type: ignore[union-attr]  # _paths: the job's names only
        scan = scan_file(fs, f"{root}/{rel}", column, values)
        if tally.count(cid, scan) and not dry_run:
            changes[rel] = _copy_without(fs, root, rel, column, values, tally)
    gone = _erase_unheld(sink, fs, root, set(live), column, values, tally, dry_run=dry_run)
    if dry_run or not changes:
        return tally.result(sink.url, column, dry_run, purged=[*purged, *gone])
    version = _commit(sink, table, column, changes)
    for old in changes:
        storage_step("delete", f"{root}/{old}")
        remove_file(fs, f"{root}/{old}")
    return tally.result(sink.url, column, dry_run, version=version, rewrites=list(changes.items()),
                        purged=[*purged, *gone, *changes])


def _copy_without(fs: Any, root: str, rel: str, column: str, values: Sequence[object], tally: EraseTally) -> str | None:
    """A copy of the live file `rel` without the key's rows, under a new name of its checkpoint
    (None: no rows left, the file goes without a successor)."""
    new = _HEX.sub(f"-{uuid.uuid4().hex[:12]}.parquet", rel)
    tally.read += int(fs.size(f"{root}/{rel}"))
    written, kept = filtered_copy(fs, f"{root}/{rel}", column, values, f"{root}/{new}", keep_empty=False)
    tally.written += written
    return new if kept else None


def _erase_unheld(sink: DeltaSink, fs: Any, root: str, live: set[str], column: str, values: Sequence[object],
                  tally: EraseTally, *, dry_run: bool) -> list[str]:
    """Erase the key from the job's files the table does not hold: a checkpoint's staged files
    still to be committed are rewritten in place, files of a checkpoint at or below the newest the
    table holds (older versions', or an attempt's that lost) are deleted. Returns those deleted."""
    base = f"{root}/{sink._prefix}"
    storage_step("walk", base)
    pattern = sink._staged_re()
    newest = max(sink.committed(), default=0)
    deleted = []
    for below, path in files_below(fs, base):
        rel = f"{sink._prefix}/{below}"
        m = pattern.fullmatch(rel)
        if m is None or rel in live:
            continue
        cid = int(m.group(1))
        if not tally.count(cid, scan_file(fs, path, column, values)) or dry_run:
            continue
        if cid > newest:
            tally.read += int(fs.size(path))
            tally.written += rewrite_file(fs, path, column, values, f"{base}/_erase")
        else:
            storage_step("delete", path)
            remove_file(fs, path)
            deleted.append(rel)
    return deleted


def _commit(sink: DeltaSink, table: deltalake.DeltaTable, column: str, changes: dict[str, str | None]) -> int:
    """One table version: the old files removed, their copies added; returns the version."""
    from deltalake.transaction import AddAction, CommitProperties, RemoveAction

    now = int(time.time() * 1000)
    held = {a["path"]: a for a in pa.table(table.get_add_actions(flatten=True)).to_pylist()}
    partitions = list(table.metadata().partition_columns)
    actions: list[AddAction | RemoveAction] = [
        RemoveAction(old, True, now, held[old]["size_bytes"],
                     {c: held[old].get(f"partition.{c}") for c in partitions} if partitions else None)
        for old in changes]
    pattern = sink._staged_re()
    for new in (n for n in changes.values() if n):
        staged = sink._read_staged(new, int(pattern.fullmatch(new).group(1)))  # type: ignore[union-attr]
        actions.append(AddAction(staged.rel, staged.size, staged.partition_values, now, True, staged.stats))
    info = {"sparkpoint.job": sink.job_id, ERASE_INFO: {"column": column, "rewrites": changes}}
    storage_step("create", sink._log)
    table.create_write_transaction(actions, "append", table.schema(), partition_by=partitions or None,
                                   commit_properties=CommitProperties(custom_metadata=info))
    storage_step("read", sink._log)
    table.update_incremental()
    return int(table.version())


def finish_purges(sink: DeltaSink, fs: Any, root: str, lookback: int = 200) -> list[str]:
    """Delete the files earlier erases of this job removed from the table that are still in
    storage (an erase killed between its commit and its purge); returns them."""
    storage_step("list", f"{root}/_delta_log/*.json")
    try:
        logs = sorted(p for p in fs.ls(f"{root}/_delta_log", detail=False) if p.endswith(".json"))[-lookback:]
    except FileNotFoundError:
        return []
    purged = []
    for path in logs:
        storage_step("read", path)
        for line in fs.cat_file(path).decode().splitlines():
            info = json.loads(line).get("commitInfo") if line.strip() else None
            if not info or info.get("sparkpoint.job") != sink.job_id or ERASE_INFO not in info:
                continue
            for old in info[ERASE_INFO].get("rewrites", {}):
                if fs.exists(f"{root}/{old}"):
                    storage_step("delete", f"{root}/{old}")
                    remove_file(fs, f"{root}/{old}")
                    purged.append(old)
    return purged
