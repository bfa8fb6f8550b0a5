"""An Iceberg table's snapshots as input, through pyiceberg: the ancestry of the current snapshot,
oldest first, each snapshot read as the data files its manifests mark ADDED by it.

A snapshot's operation gives its kind: `append` an append; `replace` (a compaction, a rewrite of
manifests) a rewrite; `overwrite` and `delete` a change. pyiceberg has no change data feed, so
`table_changes="feed"` is refused for Iceberg (`sparkpoint.spark.tables`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from sparkpoint.tables.source import (
    APPEND,
    CHANGE,
    REWRITE,
    DataFile,
    TableCommit,
    TableSourceError,
    TableVersionsGone,
    resume_command,
)
from sparkpoint.tables.spec import IcebergTable

log = logging.getLogger(__name__)

_KINDS = {"append": APPEND, "replace": REWRITE, "overwrite": CHANGE, "delete": CHANGE}


def load_iceberg_table(table: IcebergTable) -> Any:
    """The pyiceberg table `table` names, from its catalog's properties."""
    from pyiceberg.catalog import load_catalog

    from sparkpoint.tables.iceberg import EMBEDDED_DIR, catalog_properties

    properties = catalog_properties(table, EMBEDDED_DIR)
    try:
        return load_catalog(table.catalog_name, **properties).load_table(table.identifier)
    except Exception as e:  # pyiceberg's NoSuchTableError, a catalog it cannot reach, ...
        raise TableSourceError(f"input table {table.uri} cannot be loaded from its catalog "
                               f"({', '.join(sorted(properties)) or 'pyiceberg configuration'}): {e}") from e


class IcebergLog:
    """The snapshots of Iceberg table `table` (a `TableLog`)."""

    format = "iceberg"

    def __init__(self, table: IcebergTable):
        self.spec, self.uri = table, table.uri
        self.table = load_iceberg_table(table)
        self._commits: dict[int, TableCommit] = {}

    def _ancestry(self) -> list[Any]:
        """The current snapshot and its ancestors still in the table, oldest first."""
        self.table = self.table.refresh()
        chain, snapshot = [], self.table.current_snapshot()
        while snapshot is not None:
            chain.append(snapshot)
            parent = snapshot.parent_snapshot_id
            snapshot = self.table.snapshot_by_id(parent) if parent is not None else None
        return chain[::-1]

    def versions(self) -> list[int]:
        return [s.snapshot_id for s in self._ancestry()]

    def commits_after(self, version: int | None) -> Iterator[TableCommit]:
        chain = self._ancestry()
        ids = [s.snapshot_id for s in chain]
        if version is None:
            if chain and chain[0].parent_snapshot_id is not None:
                raise TableVersionsGone(
                    f"input table {self.uri} no longer has its first snapshots (expired); a new job would miss "
                    f"their rows, so nothing was read. " + resume_command(ids, "snapshot id"))
            later = chain
        elif version in ids:
            later = chain[ids.index(version) + 1:]
        elif self.table.snapshot_by_id(version) is not None:
            raise TableSourceError(
                f"input table {self.uri}: snapshot {version}, the one the checkpoint consumed, is no longer an "
                "ancestor of the current snapshot (the table was rolled back or its branch replaced); nothing was "
                "read. " + resume_command(ids, "snapshot id"))
        else:
            raise TableVersionsGone(f"input table {self.uri} no longer has snapshot {version}, the one the "
                                    "checkpoint consumed (expired); nothing was read. "
                                    + resume_command(ids, "snapshot id"))
        for snapshot in later:
            yield self._commit_of(snapshot)

    def resume_point(self, version: int | None, resume_from: int) -> int | None:
        """`resume_from` while the consumed snapshot is gone, or older than it in the ancestry
        (None: the setting does nothing any more)."""
        ids = self.versions()
        if resume_from not in ids:
            raise TableVersionsGone(f"input table {self.uri} has no snapshot {resume_from} in the current "
                                    "snapshot's ancestry to resume from; " + resume_command(ids, "snapshot id"))
        if version in ids and ids.index(version) >= ids.index(resume_from):
            return None
        return resume_from

    def commit(self, version: int) -> TableCommit:
        snapshot = self.table.snapshot_by_id(version)
        if snapshot is None:
            raise TableVersionsGone(f"input table {self.uri} no longer has snapshot {version}; "
                                    + resume_command(self.versions(), "snapshot id"))
        return self._commit_of(snapshot)

    def _commit_of(self, snapshot: Any) -> TableCommit:
        found = self._commits.get(snapshot.snapshot_id)
        if found is None:
            found = self._commits[snapshot.snapshot_id] = self._read(snapshot)
        return found

    def _read(self, snapshot: Any) -> TableCommit:
        summary = snapshot.summary
        operation = str(getattr(summary.operation, "value", summary.operation) if summary else "append")
        kind = _KINDS.get(operation, CHANGE)
        if kind != APPEND:
            return TableCommit(snapshot.snapshot_id, operation, kind)
        from pyiceberg.manifest import DataFileContent, ManifestEntryStatus

        files: dict[str, DataFile] = {}
        for manifest in snapshot.manifests(self.table.io):
            for entry in manifest.fetch_manifest_entry(self.table.io, discard_deleted=True):
                data = entry.data_file
                if entry.status != ManifestEntryStatus.ADDED or entry.snapshot_id != snapshot.snapshot_id:
                    continue
                if data.content != DataFileContent.DATA:  # delete files in an append: rows go
                    return TableCommit(snapshot.snapshot_id, operation, CHANGE)
                files[data.file_path] = DataFile(data.file_path, data.file_path, int(data.file_size_in_bytes),
                                                 snapshot.timestamp_ms / 1000)
        return TableCommit(snapshot.snapshot_id, operation, APPEND, files=tuple(files[p] for p in sorted(files)))
