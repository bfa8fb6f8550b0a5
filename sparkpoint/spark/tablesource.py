"""A Delta or Iceberg table as a pipeline's input (`TableSource`, a `BatchSource`), and
`open_source`, which opens the input a pipeline names.

The batches are the data files the table's commits added after the consumed one, in commit order
(`sparkpoint.tables.source`). Their names are the files' paths as the table records them and
their URLs the files', so the checks before Spark (bad files, event times for the watermark) and
both routes read a table's files as they read a directory's; values a file lacks (a Delta
partition's, a change feed's `_change_type` on an append) travel to the tasks by URL
(`TaskSpec.file_columns`). The offset a checkpoint records is the version reached
(`TableOffset`): the files of the next batch must be the next ones in the table's order.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import fsspec

from sparkpoint.lazy import lazy_module
from sparkpoint.spark.offsets import SourceError, SourceOffsets
from sparkpoint.spark.source import (
    BatchStat,
    FileColumns,
    FileVerdict,
    InputNeeds,
    ParquetDirectorySource,
    check_parquet,
    read_parquet,
)
from sparkpoint.tables.delta_source import DeltaLog
from sparkpoint.tables.iceberg_source import IcebergLog
from sparkpoint.tables.source import (
    APPEND,
    CHANGE,
    RESUME_KEY,
    DataFile,
    TableChangeRefused,
    TableCommit,
    TableLog,
    TableOffset,
    TableVersionsGone,
    resume_command,
)
from sparkpoint.tables.spec import DeltaTable, IcebergTable, TableSpec

if TYPE_CHECKING:
    import pandas as pd
else:
    pd = lazy_module("pandas")

log = logging.getLogger(__name__)

CHANGES_KEY = "source.table.changes"  # the `--conf` key of `table_changes`


def open_source(spec: TableSpec, options: Mapping[str, Any], *, changes: str = "fail",
                resume_from: int | None = None, rescan: bool = False) -> ParquetDirectorySource | TableSource:
    """The input `spec` names, read with fsspec `options`: a directory of Parquet files (`rescan`:
    listed whole), or a table (`changes`: the `table_changes` setting; `resume_from`:
    `table_resume_from`)."""
    if isinstance(spec, DeltaTable):
        return TableSource(DeltaLog(spec, options, feed=changes == "feed"), options, changes=changes,
                           resume_from=resume_from)
    if isinstance(spec, IcebergTable):
        if changes == "feed":
            raise TableChangeRefused(
                f"input table {spec.uri}: table_changes=feed reads a change data feed, which pyiceberg does not "
                f"give for Iceberg tables; set --conf {CHANGES_KEY}=fail (deletes and overwrites stop the job, "
                "naming the snapshot) or skip (they are passed over)")
        return TableSource(IcebergLog(spec), options, changes=changes, resume_from=resume_from)
    return ParquetDirectorySource(spec.url, dict(options), rescan=rescan)


@dataclass(frozen=True)
class _Planned:
    """A file the next batches may read: its commit's version, its place among the files that
    commit gives, and how many it gives."""

    file: DataFile
    version: int
    index: int
    count: int


class TableSource:
    """The data files a table's commits add, as batches (see the module docstring)."""

    accepted = "the data files each table version adds"
    whole = True  # a table commits a data file once it is written

    def __init__(self, log: TableLog, options: Mapping[str, Any], *, changes: str = "fail",
                 resume_from: int | None = None):
        self.log, self.url = log, log.uri
        self.storage_options = dict(options)
        self.changes, self.resume_from = changes, resume_from
        self._planned: dict[str, _Planned] = {}  # every file planned so far, by name
        self._last: list[str] = []  # the names the last plan gave
        self._said: set[int] = set()  # versions a skip was logged for

    # --- the plan of what is pending ---------------------------------------------------------------

    def _offset(self, offsets: SourceOffsets) -> TableOffset | None:
        if offsets.consumed or offsets.floor is not None:
            raise SourceError(
                f"the checkpoint's source offsets are a directory's (consumed file names up to {offsets.mark!r}), "
                f"and this job's input is table {self.url}: a job keeps the "
                "input it started with. Name that directory as the input again, or start a new job (another "
                "--job-id) on this table")
        table = offsets.table
        if table is not None and table.format != self.log.format:
            raise SourceError(f"the checkpoint's source offsets are those of {table.format} table {table.table}; "
                              f"this job's input is {self.log.format} table {self.url}: a job keeps its input")
        return table

    def _commits(self, offset: TableOffset | None) -> Iterator[tuple[TableCommit, int]]:
        """The commits after `offset`, each with how many of its files are consumed already."""
        consumed = offset.version if offset is not None else None
        if self.resume_from is not None:
            point = self.log.resume_point(consumed, self.resume_from)
            if point is not None:
                log.warning("input table %s: resuming at %s (%s), as table_resume_from says; what lies between "
                            "%s and it is not read", self.url, point, RESUME_KEY,
                            offset.describe() if offset else "the start")
                yield self.log.commit(point), 0
                yield from ((c, 0) for c in self.log.commits_after(point))
                return
        if offset is not None and offset.position is not None:
            yield self.log.commit(offset.version), offset.position
        yield from ((c, 0) for c in self.log.commits_after(consumed))

    def _plan(self, offsets: SourceOffsets) -> tuple[list[_Planned], TableOffset | None]:
        """The files pending after `offsets` in the table's order, and the offset at the end of
        every commit looked at (None: none). A change the setting refuses ends the plan; it
        raises when it is the first thing pending. A log that cannot be read right now (a
        timeout, a 503) raises SourceError, which a follow loop retries."""
        try:
            return self._planned_after(offsets)
        except OSError as e:
            raise SourceError(f"cannot read input table {self.url}: {e}; nothing was consumed") from e

    def _planned_after(self, offsets: SourceOffsets) -> tuple[list[_Planned], TableOffset | None]:
        planned: list[_Planned] = []
        end = self._offset(offsets)
        for commit, done in self._commits(end):
            files = self._readable(commit, refuse=not planned)
            if files is None:
                break
            planned += [_Planned(f, commit.version, i, len(files)) for i, f in enumerate(files) if i >= done]
            end = TableOffset(self.log.format, self.url, commit.version)
        for p in planned:
            self._planned[p.file.name] = p
        self._last = [p.file.name for p in planned]
        return planned, end

    def _readable(self, commit: TableCommit, *, refuse: bool) -> tuple[DataFile, ...] | None:
        """What a batch reads of `commit` (None: it is refused; raised when `refuse`)."""
        if commit.kind == APPEND:
            return commit.files
        if commit.kind != CHANGE:
            log.info("input table %s: version %s is %s, no new rows: passed over", self.url, commit.version,
                     commit.describe())
            return ()
        if self.changes == "skip":
            if commit.version in self._said:
                return ()
            self._said.add(commit.version)
            log.warning("input table %s: version %s is %s; table_changes=skip passes over it", self.url,
                        commit.version, commit.describe())
            return ()
        if self.changes == "feed" and commit.feed is not None:
            return commit.feed
        if not refuse:
            return None
        what = f"{'snapshot' if self.log.format == 'iceberg' else 'version'} {commit.version} ({commit.operation})"
        if self.changes == "feed":
            raise TableChangeRefused(
                f"input table {self.url}: {what} removes or rewrites rows and has no change data "
                "(it removed whole files without writing a change data feed), so table_changes=feed cannot read it; "
                f"set --conf {CHANGES_KEY}=skip for the run that passes it")
        raise TableChangeRefused(
            f"input table {self.url}: {what} removes or rewrites rows, which an append-only input cannot apply "
            "(the state keeps what it removed). Nothing was read. To pass "
            f"over such commits, --conf {CHANGES_KEY}=skip; to read them as changes with a _change_type column "
            f"(Delta tables with delta.enableChangeDataFeed), --conf {CHANGES_KEY}=feed")

    # --- BatchSource ---------------------------------------------------------------------------------

    def current_version(self) -> int | None:
        """The table's newest version (Delta) or snapshot id (Iceberg) now; None: it has none."""
        versions = self.log.versions()
        return versions[-1] if versions else None

    def pending(self, offsets: SourceOffsets) -> list[str]:
        return [p.file.name for p in self._plan(offsets)[0]]

    def listing(self) -> tuple[list[str], list[str]]:
        """(the files the last plan found pending, nothing skipped): a table is not listed whole."""
        return list(self._last), []

    def advance(self, offsets: SourceOffsets, names: list[str]) -> SourceOffsets:
        """The offsets once `names`, the next files in the table's order, are consumed."""
        if not names:
            self._offset(offsets)
            return offsets
        planned, _ = self._plan(offsets)
        got = [p.file.name for p in planned[: len(names)]]
        if got != list(names):
            first, wrong = (got[0] if got else None), names[len(_common(got, names))]
            raise SourceError(
                f"input table {self.url}: its files are consumed in commit order, and {wrong!r} "
                f"is not the next one (the next is {first!r}"
                + (f", of version {planned[0].version}" if planned else "") + "); nothing was consumed")
        last = planned[len(names) - 1]
        position = None if last.index + 1 == last.count else last.index + 1
        return SourceOffsets((), TableOffset(self.log.format, self.url, last.version, position))

    def file_columns(self, names: list[str]) -> dict[str, FileColumns]:
        return {f.url: f.columns for f in map(self._file, names) if f.columns}

    def nothing_to_read(self) -> str | None:
        return None

    def url_of(self, name: str) -> str:
        return self._file(name).url

    def stat(self, name: str) -> BatchStat:
        f = self._file(name)
        return BatchStat(f.size, f.modified)

    def read(self, name: str, columns: list[str] | None = None) -> pd.DataFrame:
        f = self._file(name)
        return read_parquet(f.url, self.storage_options, columns, constants=f.columns)

    def check_files(self, names: list[str], needs: InputNeeds) -> list[FileVerdict]:
        """`check_parquet` of each file, for the columns the file holds itself (a partition
        column's values are the table's). A file that is gone was vacuumed: TableVersionsGone."""
        verdicts = []
        for name in names:
            f = self._file(name)
            try:
                fs, path = fsspec.core.url_to_fs(f.url, **self.storage_options)
                with fs.open(path, "rb") as opened:
                    verdicts.append(check_parquet(opened, name, f.url, _without(needs, f.columns)))
            except FileNotFoundError:
                raise self._vacuumed(name) from None
            except OSError as e:
                raise SourceError(f"cannot read input file {f.url}: {e}; nothing was skipped, run again once it "
                                  "can be read") from e
        return verdicts

    def watch(self, full_listing_seconds: float = 0.0) -> TableWatch:
        return TableWatch(self)

    def _file(self, name: str) -> DataFile:
        found = self._planned.get(name)
        if found is None:
            raise SourceError(f"{name!r} is not a pending data file of input table {self.url}")
        return found.file

    def _vacuumed(self, name: str) -> TableVersionsGone:
        """The error of a pending data file that is gone: removed by a later commit and vacuumed."""
        version = self._planned[name].version
        return TableVersionsGone(
            f"input table {self.url}: data file {name} of version {version} is gone (removed by a later commit and "
            "vacuumed, or its snapshot expired) before this job read it; nothing was read. "
            + resume_command(self.log.versions(), "snapshot id" if self.log.format == "iceberg" else "version"))


def _common(a: list[str], b: list[str]) -> list[str]:
    out = []
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        out.append(x)
    return out


def _without(needs: InputNeeds, columns: FileColumns) -> InputNeeds:
    """`needs` less the columns a file's rows get from the table (`columns`)."""
    if not columns:
        return needs
    given = {name for name, _ in columns}
    return replace(needs, columns={op: tuple(c for c in cs if c not in given) for op, cs in needs.columns.items()},
                   keys={op: kt for op, kt in needs.keys.items() if kt[0] not in given},
                   event_time=None if needs.event_time in given else needs.event_time)


class TableWatch:
    """What `--follow` polls of a table: the files of the commits after the last one looked at."""

    by_name = False  # commit order

    def __init__(self, source: TableSource):
        self.source = source
        self._end: SourceOffsets | None = None

    def unconsumed(self, offsets: SourceOffsets) -> list[str]:
        planned, end = self.source._plan(offsets)
        self._end = SourceOffsets((), end) if end is not None else offsets
        return [p.file.name for p in planned]

    def poll(self, now: float | None = None) -> list[str]:
        if self._end is None:
            return self.unconsumed(SourceOffsets(()))
        return self.unconsumed(self._end)

