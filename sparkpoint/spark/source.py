"""An append-only directory of Parquet files (any fsspec URL), one micro-batch per file.

The offsets stored in a checkpoint name every consumed file, so a file that lands late with a
name that sorts early is still read exactly once.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

import fsspec
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from sparkpoint.checkpoint.errors import SparkpointError
from sparkpoint.checkpoint.storage import storage_url

OFFSETS_VERSION = 1
SAMPLE_COLUMNS = ["event_id", "user_id", "item_id", "amount", "ts"]


ACCEPTED = "*.parquet, names starting with _ or . skipped"


class SourceError(SparkpointError):
    """The input directory cannot be read, or a checkpoint's offsets belong elsewhere."""


class SourceSchemaError(SourceError):
    """A batch's files lack columns an operator reads."""


@dataclass(frozen=True)
class SourceOffsets:
    consumed: tuple[str, ...]  # file names, in the order they were read

    def to_json(self) -> dict[str, Any]:
        return {"version": OFFSETS_VERSION, "consumed": list(self.consumed)}

    @classmethod
    def from_json(cls, raw: Any) -> SourceOffsets:
        if raw is None:
            return cls(())
        if (
            not isinstance(raw, dict)
            or raw.get("version") != OFFSETS_VERSION
            or not isinstance(raw.get("consumed"), list)
            or not all(isinstance(n, str) for n in raw["consumed"])
        ):
            raise SourceError(f"source offsets {str(raw)[:200]!r} are not sparkpoint directory offsets (version 1)")
        return cls(tuple(raw["consumed"]))

    def after(self, files: list[str]) -> SourceOffsets:
        return SourceOffsets(self.consumed + tuple(files))


@dataclass(frozen=True)
class BatchStat:
    """What a listing tells of a batch file: its size, and when it was last modified (seconds
    since the epoch; None where the filesystem does not say)."""

    size: int
    modified: float | None


class BatchSource(Protocol):
    """What the pipeline needs of its input: list the batches, check and read one. A batch is a
    file (name) the checkpoint's offsets record once consumed; the source never forgets one.
    `ParquetDirectorySource` is the one today; CSV or JSON lines directories, or a table format's
    snapshots, fit the same calls."""

    url: str
    accepted: str  # the names it takes as batches, said in messages (e.g. "*.parquet, ...")

    def listing(self) -> tuple[list[str], list[str]]: ...  # (batches, other names skipped), name order
    def max_event_time(self, names: list[str], column: str) -> int | None: ...
    def pending(self, offsets: SourceOffsets) -> list[str]: ...
    def nothing_to_read(self) -> str | None: ...
    def check_columns(self, names: list[str], required: dict[str, list[str]]) -> None: ...
    def read(self, name: str, columns: list[str] | None = None) -> pd.DataFrame: ...
    def url_of(self, name: str) -> str: ...  # the batch's full URL, for messages and the tasks
    def stat(self, name: str) -> BatchStat: ...  # size and modification time (is it still being written?)


class ParquetDirectorySource:
    """One Parquet file per batch in a directory of any fsspec filesystem."""

    accepted = ACCEPTED

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None):
        url = storage_url(url)
        try:
            self.fs, self.root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        except (ValueError, ImportError) as e:
            raise SourceError(f"cannot open input {url!r}: {e}") from e
        self.url = url
        self.storage_options = dict(storage_options or {})
        if not self.fs.isdir(self.root):
            raise SourceError(f"input directory {url} does not exist (or is not a directory)")

    def files(self) -> list[str]:
        """Names of the Parquet files present, in name order (hidden and `_` files skipped)."""
        return self.listing()[0]

    def listing(self) -> tuple[list[str], list[str]]:
        """(batch files, other names skipped), each in name order."""
        self.fs.invalidate_cache(self.root)
        names = sorted(posixpath.basename(p.rstrip("/")) for p in self.fs.ls(self.root, detail=False))
        accepted = [n for n in names if n.endswith(".parquet") and not n.startswith(("_", "."))]
        return accepted, [n for n in names if n not in set(accepted)]

    def nothing_to_read(self) -> str | None:
        """Why the directory holds no batch at all although it holds files (None otherwise)."""
        accepted, skipped = self.listing()
        if accepted or not skipped:
            return None
        shown = ", ".join(skipped[:5]) + (f" and {len(skipped) - 5} more" if len(skipped) > 5 else "")
        return f"input directory {self.url} holds no batch file ({ACCEPTED}); skipped: {shown}"

    def check_columns(self, names: list[str], required: dict[str, list[str]]) -> None:
        """Every file of a batch must have the columns each operator reads (`required`: operator
        -> columns), checked from the Parquet footers before any Spark work."""
        for name in names:
            try:
                with self.fs.open(posixpath.join(self.root, name), "rb") as f:
                    have = set(pq.read_schema(f).names)
            except (OSError, ValueError, pa.ArrowException) as e:
                raise SourceError(f"cannot read the schema of input file {self.url_of(name)}: {e}") from e
            for operator, columns in required.items():
                missing = [c for c in columns if c not in have]
                if missing:
                    raise SourceSchemaError(
                        f"input file {self.url_of(name)} lacks column{'s' if len(missing) > 1 else ''} "
                        f"{', '.join(missing)}, which operator {operator!r} reads; it has: {', '.join(sorted(have))}. "
                        "Give an input with those columns, or an operator written for these"
                    )

    def max_event_time(self, names: list[str], column: str) -> int | None:
        """The highest value of timestamp column `column` over batch files `names`, as int
        microseconds since the epoch, UTC (None for no rows), from the Parquet footers' statistics
        where every row group has them, else from the column. A column that is not a timestamp or
        holds a null is refused before any Spark work."""
        highest: int | None = None
        for name in names:
            try:
                with self.fs.open(posixpath.join(self.root, name), "rb") as f:
                    found = _max_timestamp(pq.ParquetFile(f), column, self.url_of(name))
            except (OSError, pa.ArrowException) as e:
                raise SourceError(f"cannot read the event times of input file {self.url_of(name)}: {e}") from e
            if found is not None:
                highest = found if highest is None else max(highest, found)
        return highest

    def pending(self, offsets: SourceOffsets) -> list[str]:
        done = set(offsets.consumed)
        return [n for n in self.files() if n not in done]

    def url_of(self, name: str) -> str:
        return str(self.fs.unstrip_protocol(posixpath.join(self.root, name)))

    def stat(self, name: str) -> BatchStat:
        """Size and modification time of batch file `name`, read without opening it."""
        try:
            info = self.fs.info(posixpath.join(self.root, name))
        except (OSError, ValueError) as e:
            raise SourceError(f"cannot look at input file {self.url_of(name)}: {e}") from e
        return BatchStat(int(info.get("size") or 0), _modified(info))

    def read(self, name: str, columns: list[str] | None = None) -> pd.DataFrame:
        return read_parquet(self.url_of(name), self.storage_options, columns)


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


def read_parquet(url: str, storage_options: dict[str, Any], columns: list[str] | None = None) -> pd.DataFrame:
    try:
        with fsspec.open(url, "rb", **storage_options) as f:
            return pd.read_parquet(f, columns=columns)
    except (OSError, ValueError) as e:
        raise SourceError(f"cannot read input file {url}: {e}") from e


def _max_timestamp(parquet: pq.ParquetFile, column: str, url: str) -> int | None:
    schema = parquet.schema_arrow
    if column not in schema.names:
        raise SourceSchemaError(f"input file {url} has no event-time column {column!r}; it has: "
                                + ", ".join(sorted(schema.names)))
    kind = schema.field(column).type
    if not pa.types.is_timestamp(kind):
        raise SourceSchemaError(f"input file {url}: event-time column {column!r} is {kind}, not a timestamp")
    meta = parquet.metadata
    index = schema.get_field_index(column)
    highest, nulls, complete = None, 0, True
    for g in range(meta.num_row_groups):
        stats = meta.row_group(g).column(index).statistics
        if stats is None or not stats.has_min_max or stats.null_count is None:
            complete = False
            break
        nulls += stats.null_count
        if meta.row_group(g).num_rows > stats.null_count:
            value = _micros(pa.scalar(stats.max, type=kind) if not isinstance(stats.max, pa.Scalar) else stats.max)
            highest = value if highest is None else max(highest, value)
    if not complete:
        values = parquet.read(columns=[column]).column(0)
        nulls = values.null_count
        top = pc.max(values)
        highest = _micros(top) if top.is_valid else None
    if nulls:
        raise SourceError(f"input file {url}: event-time column {column!r} has {nulls} null value(s); every row "
                          "needs an event time")
    return highest


def _micros(value: pa.Scalar) -> int:
    """A timestamp scalar (any unit, any zone: Arrow stores UTC) as int microseconds."""
    return int(pc.cast(value, pa.timestamp("us", tz=value.type.tz)).value)
