"""A Delta table's commits as input: its log (`_delta_log/<version>.json`), one commit per version.

The commit files are read through fsspec (the pipeline's input options), as the data files are by
the tasks; delta-rs (`deltalake`) opens the table once for what its log states at the latest
version: the schema (a partition value is typed by it) and the table's configuration. A commit's
kind comes from its actions: only `add`s that change data is an append; `add`/`remove` with
`dataChange=false` only (OPTIMIZE, a checkpoint of metadata) is a rewrite; a `remove` that changes
data, a `cdc` file or a deletion vector is a change, whose feed is its `cdc` files (what
`DeltaTable.load_cdf` reads for it).
"""

from __future__ import annotations

import json
import logging
import posixpath
import re
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import fsspec

from sparkpoint.lazy import lazy_module
from sparkpoint.tables.source import (
    APPEND,
    CHANGE,
    CHANGE_TYPE,
    REWRITE,
    DataFile,
    TableCommit,
    TableSourceError,
    TableVersionsGone,
    resume_command,
)
from sparkpoint.tables.spec import DeltaTable

if TYPE_CHECKING:
    import pyarrow as pa
else:
    pa = lazy_module("pyarrow")

log = logging.getLogger(__name__)

_COMMIT = re.compile(r"^(\d{20})\.json$")


def delta_storage_options(table: DeltaTable, fsspec_options: Mapping[str, Any]) -> dict[str, str]:
    """delta-rs' storage options of `table`: its own, else those of an S3 endpoint and keys the
    pipeline's fsspec options give (`client_kwargs.endpoint_url`, `key`, `secret`)."""
    if table.storage_options is not None:
        return {str(k): str(v) for k, v in table.storage_options.items()}
    out: dict[str, str] = {}
    endpoint = (fsspec_options.get("client_kwargs") or {}).get("endpoint_url") or fsspec_options.get("endpoint_url")
    if endpoint:
        out.update(AWS_ENDPOINT_URL=str(endpoint), AWS_ALLOW_HTTP="true" if str(endpoint).startswith("http:")
                   else "false", AWS_S3_ALLOW_UNSAFE_RENAME="true")
    keys = (("key", "AWS_ACCESS_KEY_ID"), ("secret", "AWS_SECRET_ACCESS_KEY"), ("token", "AWS_SESSION_TOKEN"))
    for ours, theirs in keys:
        if fsspec_options.get(ours):
            out[theirs] = str(fsspec_options[ours])
    region = (fsspec_options.get("client_kwargs") or {}).get("region_name")
    if region:
        out["AWS_REGION"] = str(region)
    return out


class DeltaLog:
    """The commits of Delta table `table` (a `TableLog`), read through fsspec with `options`."""

    format = "delta"

    def __init__(self, table: DeltaTable, options: Mapping[str, Any], *, feed: bool = False):
        self.table, self.uri = table, table.uri
        self.options = dict(options)
        self.feed = feed  # the change data feed is read: appends say `_change_type` = insert
        location = self.uri.removeprefix("delta+")
        try:
            self.fs, self.root = fsspec.core.url_to_fs(location, **self.options)
        except (ValueError, ImportError) as e:
            raise TableSourceError(f"cannot open input table {self.uri}: {e}") from e
        self._url = location.rstrip("/")
        self._commits: dict[int, TableCommit] = {}  # a commit never changes once written
        self._schema, self._configuration = self._open()

    def _open(self) -> tuple[pa.Schema, dict[str, str]]:
        """The latest schema and configuration, from delta-rs; refuses what we cannot read right."""
        import deltalake

        try:
            dt = deltalake.DeltaTable(self._url, storage_options=delta_storage_options(self.table, self.options))
        except Exception as e:  # deltalake raises its own TableNotFoundError, OSError, ...
            raise TableSourceError(f"input table {self.uri} cannot be opened as a Delta table: {e}") from e
        configuration = dict(dt.metadata().configuration or {})
        mapping = configuration.get("delta.columnMapping.mode", "none")
        if mapping != "none":
            raise TableSourceError(f"input table {self.uri} uses column mapping ({mapping}): its data files name "
                                   "columns by physical names, which sparkpoint's reader does not map; read a copy "
                                   "without column mapping")
        return pa.schema(dt.schema().to_arrow()), configuration

    # --- the log -----------------------------------------------------------------------------------

    def versions(self) -> list[int]:
        """The versions whose commit file the log still has, oldest first."""
        log_dir = posixpath.join(self.root, "_delta_log")
        try:
            self.fs.invalidate_cache(log_dir)
            names = [posixpath.basename(p.rstrip("/")) for p in self.fs.ls(log_dir, detail=False)]
        except FileNotFoundError:
            raise TableSourceError(f"input table {self.uri} has no _delta_log: not a Delta table") from None
        return sorted(int(m.group(1)) for m in map(_COMMIT.match, names) if m)

    def commits_after(self, version: int | None) -> Iterator[TableCommit]:
        """Every commit after `version` (None: from version 0), in order."""
        have = self.versions()
        first = 0 if version is None else version + 1
        later = [v for v in have if v >= first]
        if later and later[0] != first:
            gone = (f"version {first}, the one after version {version} it consumed" if version is not None
                    else "version 0, where a new job starts")
            raise TableVersionsGone(f"input table {self.uri} no longer has {gone} (vacuumed, or its log cleaned "
                                    f"up past it); nothing was read. " + resume_command(have, "version"))
        for v in later:
            yield self.commit(v)

    def resume_point(self, version: int | None, resume_from: int) -> int | None:
        """The version to read from when `table_resume_from` is set: `resume_from` while the job
        has not consumed up to it (None: the setting does nothing any more)."""
        if version is not None and version + 1 >= resume_from:
            return None
        if resume_from not in self.versions():
            raise TableVersionsGone(f"input table {self.uri} has no version {resume_from} to resume from; "
                                    + resume_command(self.versions(), "version"))
        return resume_from

    def commit(self, version: int) -> TableCommit:
        """Version `version`'s commit, read once."""
        found = self._commits.get(version)
        if found is None:
            found = self._commits[version] = self._read(version)
        return found

    def _read(self, version: int) -> TableCommit:
        path = posixpath.join(self.root, "_delta_log", f"{version:020d}.json")
        try:
            with self.fs.open(path, "rb") as f:
                text = f.read().decode("utf-8")
        except FileNotFoundError:
            raise TableVersionsGone(f"input table {self.uri} no longer has version {version}; "
                                    + resume_command(self.versions(), "version")) from None
        actions = [json.loads(line) for line in text.splitlines() if line.strip()]
        return self._commit_of(version, actions)

    def _commit_of(self, version: int, actions: list[dict[str, Any]]) -> TableCommit:
        def of(kind: str) -> list[dict[str, Any]]:
            return [a[kind] for a in actions if kind in a]

        info = of("commitInfo")
        operation = str(info[0].get("operation", "")) if info else ""
        adds, removes, cdc = of("add"), of("remove"), of("cdc")
        changed = [a for a in adds if a.get("dataChange", True)]
        dropped = [r for r in removes if r.get("dataChange", True)]
        if dropped or cdc or any(a.get("deletionVector") for a in adds):
            return TableCommit(version, operation, CHANGE, feed=tuple(self._file(c) for c in cdc) if cdc else None)
        if not changed:
            return TableCommit(version, operation, REWRITE)
        return TableCommit(version, operation, APPEND,
                           files=tuple(self._file(a, "insert" if self.feed else None) for a in changed))

    def _file(self, action: dict[str, Any], change_type: str | None = None) -> DataFile:
        """The data file of an `add` (or a `cdc` action), with its partition values and, for an
        add read as a change feed, its `_change_type` (a `cdc` file has that column itself)."""
        path = unquote(str(action["path"]))
        url = path if "://" in path else f"{self._url}/{path}"
        columns = [(name, self._typed(name, value)) for name, value in (action.get("partitionValues") or {}).items()]
        if change_type is not None:
            columns.append((CHANGE_TYPE, pa.scalar(change_type, pa.string())))
        modified = action.get("modificationTime")
        return DataFile(path, url, int(action.get("size") or 0),
                        modified / 1000 if isinstance(modified, (int, float)) else None, tuple(columns))

    def _typed(self, column: str, value: str | None) -> pa.Scalar:
        """A partition value (Delta writes them as text) as a scalar of its column's type."""
        kind = self._schema.field(column).type if column in self._schema.names else pa.string()
        if value is None:
            return pa.scalar(None, kind)
        try:
            if pa.types.is_timestamp(kind):
                naive = pa.scalar(value.rstrip("Z").replace("T", " "), pa.string()).cast(pa.timestamp(kind.unit))
                return naive.cast(kind)
            return pa.scalar(value, pa.string()).cast(kind)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            raise TableSourceError(f"input table {self.uri}: partition value {value!r} of column {column!r} is "
                                   f"not a {kind}: {e}") from e
