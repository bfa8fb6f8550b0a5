"""An append-only directory of Parquet files (any fsspec URL), one micro-batch per file.

The offsets stored in a checkpoint name every consumed file, so a file that lands late with a
name that sorts early is still read exactly once.
"""

from __future__ import annotations

import logging
import posixpath
import time
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol

import fsspec

from sparkpoint.checkpoint import ledger
from sparkpoint.checkpoint.storage import storage_url
from sparkpoint.lazy import lazy_module
from sparkpoint.spark.listing import DirectoryLister, Entry, is_s3, protocols
from sparkpoint.spark.offsets import SourceError, SourceOffsets
from sparkpoint.state.record import arrow_type_name

if TYPE_CHECKING:
    import pandas as pd
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq
else:
    pd = lazy_module("pandas")
    pa = lazy_module("pyarrow")
    pc = lazy_module("pyarrow.compute")
    pq = lazy_module("pyarrow.parquet")

log = logging.getLogger(__name__)

SAMPLE_COLUMNS = ["event_id", "user_id", "item_id", "amount", "ts"]


ACCEPTED = "*.parquet, names starting with _ or . skipped"
FULL_LISTING_SECONDS = 60.0  # a watch lists the whole directory at least this often
RECENT_SECONDS = 1.0  # a directory changed this recently is listed again (its mtime has a coarse clock)


class SourceSchemaError(SourceError):
    """A batch's files lack columns an operator reads."""


class BadInputFile(SourceError):
    """An input file failed a check made before any Spark work (not Parquet, a column missing or
    of the wrong type, null keys or event times). Under `on_bad_file="fail"` nothing was uploaded;
    the message names the file, the check and the ways on."""

    def __init__(self, message: str, *, file: str = "", check: str = "", reason: str = ""):
        super().__init__(message)
        self.file, self.check, self.reason = file, check, reason


@dataclass(frozen=True)
class InputNeeds:
    """What every input file must give the operators: the columns each reads (by operator name,
    key first), each one's key column and declared key type (`KeyedOperator.key_type`, None:
    any), and the pipeline's event-time column."""

    columns: dict[str, tuple[str, ...]]
    keys: dict[str, tuple[str, str | None]]
    event_time: str | None = None


@dataclass(frozen=True)
class FileVerdict:
    """One input file's checks: `check` and `reason` name the first that failed (None: none did);
    `max_event_time` is its highest event time in µs (None: no event time, or no rows)."""

    name: str
    check: str | None = None
    reason: str | None = None
    max_event_time: int | None = None
    size: int = 0  # the file's bytes
    modified: float | None = None  # a failing file's modification time once it settled (pipeline.badfiles)
    row_group_bytes: tuple[int, ...] = ()  # each row group's compressed bytes, from the footer
    # Its row groups read apart give the operators' columns the pandas types the whole file gives
    # (`row_groups_read_alike`): the shuffle route may cut it between row groups.
    splittable: bool = False

    @property
    def ok(self) -> bool:
        return self.check is None


@dataclass(frozen=True)
class BatchStat:
    """What a listing tells of a batch file: its size, and when it was last modified (seconds
    since the epoch; None where the filesystem does not say)."""

    size: int
    modified: float | None


class BatchSource(Protocol):
    """What the pipeline needs of its input: list the batches, check and read one. A batch is a
    list of files (names); `advance` says what the checkpoint's offsets become once they are
    consumed. `ParquetDirectorySource` records every name; a table's source
    (`sparkpoint.spark.tablesource.TableSource`) the table version reached."""

    url: str
    accepted: str  # the names it takes as batches, said in messages (e.g. "*.parquet, ...")
    whole: bool  # a batch file is complete once listed (a table's commit): no waiting for it to settle

    def listing(self) -> tuple[list[str], list[str]]: ...  # (batches, other names skipped), name order
    def pending(self, offsets: SourceOffsets) -> list[str]: ...
    def advance(self, offsets: SourceOffsets, names: list[str]) -> SourceOffsets: ...  # once `names` are consumed
    def file_columns(self, names: list[str]) -> dict[str, FileColumns]: ...  # by URL: values a file lacks
    def nothing_to_read(self) -> str | None: ...
    def check_files(self, names: list[str], needs: InputNeeds) -> list[FileVerdict]: ...
    def read(self, name: str, columns: list[str] | None = None) -> pd.DataFrame: ...
    def url_of(self, name: str) -> str: ...  # the batch's full URL, for messages and the tasks
    def stat(self, name: str) -> BatchStat: ...  # size and modification time (is it still being written?)
    def watch(self, full_listing_seconds: float = ...) -> BatchWatch: ...  # batches as they land, cheaply


FileColumns = tuple[tuple[str, Any], ...]  # (column, pyarrow scalar): values every row of a file has


class BatchWatch(Protocol):
    """What a long-running reader polls (`sparkpoint.pipeline.follow`): `poll` gives the batch
    names that appeared since the last poll; `unconsumed` those pending after `offsets` (and
    where the polls go on from); `by_name`: new names may sort anywhere among the pending ones."""

    by_name: bool

    def poll(self, now: float | None = None) -> list[str]: ...
    def unconsumed(self, offsets: SourceOffsets) -> list[str]: ...


class ParquetDirectorySource:
    """One Parquet file per batch in a directory of any fsspec filesystem (and its date
    partitions `date=YYYY-MM-DD/`). A run lists only names above its offsets' floor
    (`sparkpoint.spark.listing`); with `rescan`, the whole directory, and it names the batch
    files the floor closed that look late (modified after the floor's own file) in a warning."""

    accepted = ACCEPTED
    whole = False  # a file may show while it is still being copied

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, *, rescan: bool = False):
        url = storage_url(url)
        try:
            self.fs, self.root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        except (ValueError, ImportError) as e:
            raise SourceError(f"cannot open input {url!r}: {e}") from e
        self.url = url
        self.storage_options = dict(storage_options or {})
        self._seam_counts = not ledger.watch(self.fs)  # input reads, apart from checkpoint traffic
        ledger.mark_input(self.root)
        self._count("HEAD")
        self.rescan = rescan
        self.lister = DirectoryLister(self.fs, self.root)
        # What this source's listings saw, above `_seen_from` (a floor; None: everything): the
        # batch names `advance` must not let the floor pass while they are unconsumed.
        self._seen: dict[str, Entry] = {}
        self._seen_from: str | None = None
        self._listed = False
        self._floor: str | None = None  # the floor of the offsets last asked about (where listings start)
        if not self.fs.isdir(self.root):
            raise SourceError(f"input directory {url} does not exist (or is not a directory)")

    def _count(self, op: str, down: int = 0) -> None:
        if self._seam_counts:
            ledger.count(op, down=down, channel=ledger.INPUT)

    def files(self) -> list[str]:
        """Names of the Parquet files present above the last offsets' floor (all of them with
        `rescan`, or before any offsets), in name order (hidden and `_` files skipped)."""
        return self.listing()[0]

    def listing(self, after: str | None = None) -> tuple[list[str], list[str]]:
        """(batch files, other names skipped), each in name order: above `after` when given
        (the names that landed after it), else above the last offsets' floor (everything with
        `rescan`, or before any offsets were asked about)."""
        start = after if after is not None else None if self.rescan else self._floor
        try:
            listed = self.lister.requests
            entries = self.lister.names(start)
            for _ in range(self.lister.requests - listed):
                self._count("LIST")
        except OSError as e:
            raise SourceError(f"cannot list input directory {self.url}: {e}") from e
        batches = {e.name: e for e in entries if not e.directory and is_batch_name(e.name)}
        if after is None:  # all there is above `start`: what `advance` may trust
            self._seen, self._seen_from, self._listed = batches, start, True
        else:
            self._seen.update(batches)
        return list(batches), [e.name for e in entries if e.name not in batches]

    def watch(self, full_listing_seconds: float = FULL_LISTING_SECONDS) -> DirectoryWatch:
        """What a long-running reader polls for batch files as they land (`DirectoryWatch`)."""
        return DirectoryWatch(self, full_listing_seconds)

    def nothing_to_read(self) -> str | None:
        """Why the directory holds no batch at all although it holds files (None otherwise)."""
        accepted, skipped = self.listing()
        if accepted or not skipped or self._floor is not None:
            return None
        shown = ", ".join(skipped[:5]) + (f" and {len(skipped) - 5} more" if len(skipped) > 5 else "")
        return f"input directory {self.url} holds no batch file ({ACCEPTED}); skipped: {shown}"

    def check_files(self, names: list[str], needs: InputNeeds) -> list[FileVerdict]:
        """Every check of batch files `names` before any Spark work, from one read of each
        footer (`check_parquet`): a verdict per file, in order. A file that cannot be reached
        (a timeout, a 503, a permission) raises SourceError: that is no verdict on the file."""
        verdicts = []
        for name in names:
            url = self.url_of(name)
            try:
                with self.fs.open(posixpath.join(self.root, name), "rb") as f:
                    verdicts.append(check_parquet(f, name, url, needs))
                    self._count("GET", down=f.tell())
            except OSError as e:
                raise SourceError(f"cannot read input file {url}: {e}; nothing was skipped, run again once it "
                                  "can be read") from e
        return verdicts

    def pending(self, offsets: SourceOffsets) -> list[str]:
        """The batch files `offsets` has not consumed, in name order: listed from its floor on."""
        own = self._own(offsets)
        self._floor = own.floor
        names = self.files()
        if self.rescan and own.floor is not None:
            self._warn_late(own, names)
        return [n for n in names if not own.includes(n)]

    def advance(self, offsets: SourceOffsets, names: list[str]) -> SourceOffsets:
        """`offsets` with `names` consumed, the floor raised as far as what this source listed
        allows (`SourceOffsets.compacted`): never to an unconsumed file it saw."""
        own = self._own(offsets).after(names)
        if not self._listed or (self._seen_from is not None and (own.floor is None or self._seen_from > own.floor)):
            return own  # it did not list everything above the floor: the floor stays
        return own.compacted(self._seen)

    def _warn_late(self, offsets: SourceOffsets, names: list[str]) -> None:
        """With `rescan`: name the batch files at or below the floor modified after the floor's
        own file (they landed after it, most likely late: refused by the floor, never read)."""
        floor = offsets.floor
        since = self._modified_at(floor) if floor is not None and floor in self._seen else None
        if floor is None or since is None:
            return
        late = [n for n in names if n <= floor and (self._modified_at(n) or 0.0) > since]
        if late:
            shown = ", ".join(late[:10]) + (f" and {len(late) - 10} more" if len(late) > 10 else "")
            log.warning("input %s: %d batch file(s) below the floor %r were modified after it and look late: %s. "
                        "The floor closed their names: no run reads them. To have one read, land it again under a "
                        "name above %r (docs: A pipeline's life)", self.url, len(late), offsets.floor, shown,
                        offsets.mark)

    def _modified_at(self, name: str) -> float | None:
        """Batch file `name`'s modification time: from the listing where it says (S3), else a stat."""
        entry = self._seen.get(name)
        known = _modified(entry.info) if entry is not None else None
        return known if known is not None else self.stat(name).modified

    def file_columns(self, names: list[str]) -> dict[str, FileColumns]:
        return {}  # a batch file holds every column its rows have

    def _own(self, offsets: SourceOffsets) -> SourceOffsets:
        if offsets.table is not None:
            raise SourceError(f"the checkpoint's source offsets are those of input table {offsets.table.table} "
                              f"({offsets.table.describe()}), and this job's input is directory {self.url}: a job "
                              "keeps the input it started with. Name that table as the input again, or start a "
                              "new job (another --job-id) on this directory")
        return offsets

    def url_of(self, name: str) -> str:
        return str(self.fs.unstrip_protocol(posixpath.join(self.root, name)))

    def stat(self, name: str) -> BatchStat:
        """Size and modification time of batch file `name`, read without opening it."""
        self._count("HEAD")
        try:
            info = self.fs.info(posixpath.join(self.root, name))
        except (OSError, ValueError) as e:
            raise SourceError(f"cannot look at input file {self.url_of(name)}: {e}") from e
        return BatchStat(int(info.get("size") or 0), _modified(info))

    def read(self, name: str, columns: list[str] | None = None) -> pd.DataFrame:
        return read_parquet(self.url_of(name), self.storage_options, columns)


def is_batch_name(name: str) -> bool:
    """A batch file's name: `*.parquet`, its file name not starting with `_` or `.`."""
    return name.endswith(".parquet") and not posixpath.basename(name).startswith(("_", "."))


class DirectoryWatch:
    """The batch files that land in a `ParquetDirectorySource`, poll after poll, without listing
    the whole of a growing directory at every poll (what `sparkpoint run --follow` asks of it).

    * On S3 (s3fs) a poll lists only the names after the newest one seen (`StartAfter`): its cost
      follows what landed since, not what the directory holds.
    * On a local disk a poll is one `stat` of the directory (and of its newest date partition):
      it is listed again only when a modification time moved, or moved less than
      `RECENT_SECONDS` ago (that clock is coarse: a file created in the same tick as the last
      listing leaves it unchanged).
    * Elsewhere (memory, GCS, Azure, HDFS...) a poll lists the directory.

    At least every `full_listing_seconds` the directory is listed from the offsets' floor on
    (the whole of it with `rescan`): a file that lands late under a name sorting before the
    newest one seen (which `StartAfter` cannot see) but above the floor is found then. `poll`
    returns names never returned before, in name order; what was consumed is the caller's to
    remember."""

    by_name = True  # a late file may sort before the newest one seen

    def __init__(self, source: ParquetDirectorySource, full_listing_seconds: float = FULL_LISTING_SECONDS):
        self.source = source
        self.full_listing_seconds = full_listing_seconds
        self.seen: set[str] = set()
        self.newest: str | None = None
        self.listings = {"full": 0, "after": 0, "stat": 0}  # what the polls cost, by kind
        self._last_full: float | None = None
        self._dir_mtime: tuple[float | None, ...] | None = None
        self._s3 = is_s3(source.fs)

    def poll(self, now: float | None = None) -> list[str]:
        """Batch names that appeared since the last poll (all of them at the first), in name order."""
        now = time.time() if now is None else now
        full_due = self._last_full is None or now - self._last_full >= self.full_listing_seconds
        if full_due:
            names = self._full(now)
        elif self._s3 and self.newest is not None:
            self.listings["after"] += 1
            names = self.source.listing(after=self.newest)[0]
        elif self._local() and not self._directory_changed(now):
            return []
        else:
            names = self._full(now)
        new = sorted(n for n in names if n not in self.seen and is_batch_name(n))
        self.seen.update(new)
        if new and (self.newest is None or new[-1] > self.newest):
            self.newest = new[-1]
        return new

    def unconsumed(self, offsets: SourceOffsets) -> list[str]:
        """The names seen so far that `offsets` has not consumed, in name order; the polls list
        from its floor on."""
        own = self.source._own(offsets)
        self.source._floor = own.floor
        self.seen = {n for n in self.seen if own.floor is None or n > own.floor}  # what the floor closed goes
        return sorted(n for n in self.seen if not own.includes(n))

    def _full(self, now: float) -> list[str]:
        self.listings["full"] += 1
        self._last_full = now
        if self._local():
            self._dir_mtime = self._directory_mtimes()  # before the listing: a change during it is seen next time
        return self.source.listing()[0]

    def _local(self) -> bool:
        return "file" in protocols(self.source.fs)

    def _directory_mtimes(self) -> tuple[float | None, ...]:
        """The modification times of the directory and of its newest date partition seen so far
        (where files land): a partition new to a listing makes the next poll list once more."""
        source = self.source
        newest = max((n.split("/", 1)[0] for n in self.seen if "/" in n), default=None)
        paths = [source.root, *([posixpath.join(source.root, newest)] if newest else [])]
        try:
            return tuple(_modified(source.fs.info(p)) for p in paths)
        except (OSError, ValueError) as e:
            raise SourceError(f"cannot look at input directory {source.url}: {e}") from e

    def _directory_changed(self, now: float) -> bool:
        self.listings["stat"] += 1
        mtimes = self._directory_mtimes()
        return (None in mtimes or mtimes != self._dir_mtime
                or any(t is not None and now - t < RECENT_SECONDS for t in mtimes))


def _modified(info: dict[str, Any]) -> float | None:
    """The modification time in an fsspec `info` (seconds since the epoch): each filesystem names
    it its own way (local `mtime`, S3 `LastModified`, GCS `updated`, memory `created`)."""
    for key in ("mtime", "LastModified", "last_modified", "updated", "modified", "created"):
        value = info.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                value = datetime.fromisoformat(value.replace("Z", "+00:00"))
            except ValueError:
                continue
        if isinstance(value, datetime):
            return value.timestamp()
    return None


WHOLE_FILE_BYTES = 4 << 20  # input files up to this size are read in one request


def read_parquet(url: str, storage_options: dict[str, Any], columns: list[str] | None = None,
                 constants: FileColumns = ()) -> pd.DataFrame:
    """Input file `url` (the `columns` given, all when None) as pandas."""
    return read_parquet_counted(url, storage_options, columns, constants=constants)[0]


def read_parquet_counted(url: str, storage_options: dict[str, Any], columns: list[str] | None = None,
                         row_groups: tuple[int, ...] | None = None, constants: FileColumns = ()
                         ) -> tuple[pd.DataFrame, int]:
    """Input file `url` (its `row_groups` only, when given) as pandas, and the bytes read from
    storage to get it: what a checkpoint's read amplification is measured by. Both routes of a
    batch read through here, so a row reaches its subtask with the same types either way.
    `constants`: columns the file lacks and every row of it has (a Delta partition's values)."""
    wanted = [(n, v) for n, v in constants if columns is None or n in columns]
    if constants and columns is not None:
        columns = [c for c in columns if c not in {name for name, _ in constants}]
    try:
        # No read-ahead cache: what the tasks fetch from storage is what pyarrow reads (an object
        # store's default block cache fetches megabytes around each read, uncounted).
        fs, path = fsspec.core.url_to_fs(url, **storage_options)
        ledger.mark_input(posixpath.dirname(path))  # its directory: one root for a batch's files
        seam = not ledger.watch(fs)
        with fs.open(path, "rb", cache_type="none") as raw:
            f = _CountingFile(raw)
            size = getattr(raw, "size", None)
            # A small file is read whole, in one request: pyarrow would read its last 64 KB for
            # the footer and then the columns, most of such a file twice.
            whole = row_groups is None and size is not None and size <= WHOLE_FILE_BYTES
            parquet = pq.ParquetFile(pa.BufferReader(f.read()) if whole else f)
            table = (parquet.read(columns=columns, use_pandas_metadata=True) if row_groups is None
                     else parquet.read_row_groups(list(row_groups), columns=columns, use_pandas_metadata=True))
            for name, value in wanted:
                table = table.append_column(pa.field(name, value.type), pa.repeat(value, table.num_rows))
            if seam:
                ledger.count("GET", down=f.bytes_read, channel=ledger.INPUT)
            return table.to_pandas(), f.bytes_read
    except (OSError, ValueError) as e:
        raise SourceError(f"cannot read input file {url}: {e}") from e


class _CountingFile:
    """A binary file that counts the bytes read through it. Only these methods: pyarrow must not
    reach the file behind it (a `read_buffer` or a path of its own would read uncounted)."""

    def __init__(self, f: Any):
        self._f, self.bytes_read = f, 0

    def read(self, size: int = -1) -> bytes:
        data: bytes = self._f.read(size)
        self.bytes_read += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        n: int = self._f.readinto(buffer) or 0
        self.bytes_read += n
        return n

    def seek(self, offset: int, whence: int = 0) -> int:
        return int(self._f.seek(offset, whence))

    def tell(self) -> int:
        return int(self._f.tell())

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    @property
    def closed(self) -> bool:
        return bool(self._f.closed)

    def close(self) -> None:
        self._f.close()

    @property
    def size(self) -> int | None:
        return getattr(self._f, "size", None)


class _Bad(Exception):
    """A check failed: (check, reason)."""

    def __init__(self, check: str, reason: str):
        super().__init__(reason)
        self.check, self.reason = check, reason


def check_parquet(f: Any, name: str, url: str, needs: InputNeeds) -> FileVerdict:
    """The checks of one input file, open as `f`: a Parquet file (its footer parses), with every
    column an operator reads, each key column of its declared type and without nulls, and the
    event-time column a timestamp without nulls. Nulls and the highest event time come from the
    footer's row-group statistics where every row group has them, else from reading those columns
    only. An I/O error (OSError) is raised, never taken as a verdict."""
    try:
        parquet = pq.ParquetFile(f)
        schema = parquet.schema_arrow
        highest = _check_schema_and_values(parquet, schema, url, needs)
    except _Bad as bad:
        return FileVerdict(name, bad.check, bad.reason)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:  # not Parquet, or damaged
        return FileVerdict(name, "parquet", f"input file {url} is not a readable Parquet file: {_first_line(e)}")
    meta = parquet.metadata
    groups = tuple(sum(meta.row_group(g).column(c).total_compressed_size for c in range(meta.num_columns))
                   for g in range(meta.num_row_groups))
    read = [*{c for columns in needs.columns.values() for c in columns},
            *([needs.event_time] if needs.event_time else [])]
    return FileVerdict(name, max_event_time=highest, size=int(getattr(f, "size", 0) or 0), row_group_bytes=groups,
                       splittable=row_groups_read_alike(parquet, read))


def row_groups_read_alike(parquet: pq.ParquetFile, columns: list[str]) -> bool:
    """Whether `columns` read from some row groups of `parquet` come out of pyarrow with the
    pandas types the whole file gives them. pyarrow chooses a type by the rows it converts: an
    integer column with a null becomes float64, a boolean one object, and a categorical's
    categories are those it saw. So: no dictionary or categorical column, and integer and
    boolean columns only where the footer says no row group has a null."""
    schema = parquet.schema_arrow
    meta = parquet.metadata
    leaves = [meta.schema.column(i).path for i in range(meta.num_columns)]
    pandas_types = {c.get("name"): c.get("pandas_type") for c in (schema.pandas_metadata or {}).get("columns", [])}
    for column in dict.fromkeys(columns):
        kind = schema.field(column).type
        if pa.types.is_dictionary(kind) or pandas_types.get(column) == "categorical" or pa.types.is_nested(kind):
            return False
        if pa.types.is_integer(kind) or pa.types.is_boolean(kind):
            index = leaves.index(column) if column in leaves else None
            for g in range(meta.num_row_groups):
                stats = meta.row_group(g).column(index).statistics if index is not None else None
                if stats is None or not stats.has_null_count or stats.null_count:
                    return False
    return True


def _check_schema_and_values(parquet: pq.ParquetFile, schema: pa.Schema, url: str, needs: InputNeeds) -> int | None:
    have = set(schema.names)
    shown = ", ".join(sorted(have))
    for operator, columns in needs.columns.items():
        missing = [c for c in columns if c not in have]
        if missing:
            raise _Bad("columns", f"input file {url} lacks column{'s' if len(missing) > 1 else ''} "
                                  f"{', '.join(missing)}, which operator {operator!r} reads; it has: {shown}")
    column = needs.event_time
    if column is not None and column not in have:
        raise _Bad("columns", f"input file {url} has no event-time column {column!r}; it has: {shown}")
    for operator, (key, declared) in needs.keys.items():
        found = arrow_type_name(schema.field(key).type)
        if declared is not None and _comparable(found) != _comparable(declared):
            raise _Bad("types", f"input file {url}: key column {key!r} is {found}, operator {operator!r} keys by "
                                f"{declared} (its key_type)")
    if column is not None and not pa.types.is_timestamp(schema.field(column).type):
        raise _Bad("types", f"input file {url}: event-time column {column!r} is "
                            f"{arrow_type_name(schema.field(column).type)}, not a timestamp")
    keys = list(dict.fromkeys(key for key, _ in needs.keys.values()))
    nulls, highest = _footer_facts(parquet, schema, [*keys, *([column] if column else [])], column)
    unknown = [c for c in nulls if nulls[c] is None] + ([column] if column and highest is _UNKNOWN else [])
    if unknown:  # some row group lacks statistics: read those columns (only those)
        table = parquet.read(columns=list(dict.fromkeys(unknown)))
        for c in table.column_names:
            nulls[c] = table.column(c).null_count
        if column in table.column_names:
            top = pc.max(table.column(column))
            highest = _micros(top) if top.is_valid else None
    for key in keys:
        if nulls[key]:
            users = ", ".join(repr(op) for op, (k, _) in needs.keys.items() if k == key)
            raise _Bad("null_keys", f"input file {url}: key column {key!r} has {nulls[key]} null value(s); "
                                    f"operator {users} cannot key them")
    if column is not None and nulls[column]:
        raise _Bad("null_event_times", f"input file {url}: event-time column {column!r} has {nulls[column]} "
                                       "null value(s); every row needs an event time")
    return None if highest is _UNKNOWN else highest


_UNKNOWN: Any = object()  # a highest event time the statistics do not tell


def _footer_facts(parquet: pq.ParquetFile, schema: pa.Schema, columns: list[str], event_time: str | None
                  ) -> tuple[dict[str, int | None], Any]:
    """Per column its null count from the row-group statistics (None: some row group does not
    say), and the highest value of `event_time` (_UNKNOWN: some row group does not say)."""
    meta = parquet.metadata
    leaves = [meta.schema.column(i).path for i in range(meta.num_columns)]
    nulls: dict[str, int | None] = {}
    highest: Any = None if event_time is not None else _UNKNOWN
    for column in dict.fromkeys(columns):
        index = leaves.index(column) if column in leaves else None  # a nested column: no flat statistics
        count: int | None = 0
        for g in range(meta.num_row_groups):
            stats = meta.row_group(g).column(index).statistics if index is not None else None
            if stats is None or not stats.has_null_count:
                count = None
                break
            count += stats.null_count
            if column == event_time and highest is not _UNKNOWN:
                if not stats.has_min_max:
                    if meta.row_group(g).num_rows > stats.null_count:
                        highest = _UNKNOWN
                    continue
                kind = schema.field(column).type
                value = _micros(stats.max if isinstance(stats.max, pa.Scalar) else pa.scalar(stats.max, type=kind))
                highest = value if highest is None else max(highest, value)
        nulls[column] = count
        if column == event_time and count is None:
            highest = _UNKNOWN
    return nulls, highest


def _comparable(type_name: str) -> str:
    """Arrow type names that hold the same keys: large_string is a string, large_binary a binary."""
    name = type_name.removesuffix(" not null")
    return {"large_string": "string", "large_utf8": "string", "large_binary": "binary"}.get(name, name)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def _micros(value: pa.Scalar) -> int:
    """A timestamp scalar (any unit, any zone: Arrow stores UTC) as int microseconds, nanoseconds
    floored, as `event_micros` floors them (before 1970 too)."""
    raw = int(value.value)
    return {"s": raw * 1_000_000, "ms": raw * 1_000, "us": raw, "ns": raw // 1_000}[value.type.unit]
