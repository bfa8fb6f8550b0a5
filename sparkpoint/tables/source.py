"""A table as a pipeline's input: its commits after the last consumed one, each as the data files
it added, and the offset a checkpoint records of it.

A batch is the data files of the table versions (Iceberg snapshots) after the consumed one, in
commit order. What a checkpoint records is where it got to (`TableOffset`: the version reached,
and how many of its files when a version's files went into more than one checkpoint), never the
files: the offset does not grow with the table's history.

Each commit is one of three kinds (`TableCommit.kind`):

- `append`: new rows only; its added files are read.
- `rewrite`: no row changes (a compaction: Delta's `dataChange=false`, Iceberg's `replace`, or a
  commit of metadata only); always passed over by itself, with nothing read.
- `change`: rows removed or rewritten (a DELETE, an UPDATE, a MERGE, an overwrite); the
  `table_changes` setting says what happens: `fail` (refused, naming the version), `skip`
  (passed over), `feed` (Delta's change data feed: its change files, with `_change_type`).

`delta_source.DeltaLog` and `iceberg_source.IcebergLog` read the commits; `sparkpoint.spark.tables`
makes batches of them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from sparkpoint.checkpoint.errors import SparkpointError

TABLE_CHANGES = ("fail", "skip", "feed")
APPEND, REWRITE, CHANGE = "append", "rewrite", "change"
CHANGE_TYPE = "_change_type"  # the change data feed's column: insert, delete, update_preimage, update_postimage
RESUME_KEY = "source.table.resume-from"  # the `--conf` key of `table_resume_from`
FORMATS = {"delta": "version", "iceberg": "snapshot_id"}  # format -> what its offset's number is called


class TableSourceError(SparkpointError):
    """An input table cannot be read as asked."""


class TableChangeRefused(TableSourceError):
    """A commit removes or rewrites rows and `table_changes` is `fail` (or cannot do what it says)."""


class TableVersionsGone(TableSourceError):
    """The table no longer has the versions (or the files) after the consumed one: it was vacuumed,
    its log cleaned up, its snapshots expired. Nothing is read past the gap without being told."""


def check_table_changes(value: Any) -> list[str]:
    """What is wrong with a `table_changes` setting (none: nothing)."""
    if value not in TABLE_CHANGES:
        return [f"table_changes must be one of {', '.join(TABLE_CHANGES)}, got {value!r}"]
    return []


@dataclass(frozen=True)
class DataFile:
    """One data file a batch may read.

    `name` is the batch name: the file's path as the table records it (relative to a Delta
    table's root, a full URI in Iceberg). `columns` are values the file lacks but its rows have
    (a Delta partition's values; `_change_type` of a change feed), as pyarrow scalars."""

    name: str
    url: str
    size: int
    modified: float | None = None
    columns: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class TableCommit:
    """One table version (Iceberg snapshot): its number, what the table calls the operation, its
    kind (`append`, `rewrite`, `change`), the data files it added, and for a change the files
    of its change data feed (None: the table has none for it)."""

    version: int
    operation: str
    kind: str
    files: tuple[DataFile, ...] = ()
    feed: tuple[DataFile, ...] | None = None

    def describe(self) -> str:
        return f"{self.operation or 'a commit'} ({self.kind})"


@dataclass(frozen=True)
class TableOffset:
    """Where a checkpoint got to in its input table: every file of the commits up to `version`
    (a Delta version, an Iceberg snapshot id) is consumed; with `position`, only the first
    `position` files `version` has to read are (its other files are the next batch's)."""

    format: str  # "delta" or "iceberg"
    table: str  # the table's URI (`delta+...`, `iceberg://...`): said in messages
    version: int
    position: int | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": self.format, "table": self.table, FORMATS[self.format]: self.version}
        if self.position is not None:
            out["position"] = self.position
        return out

    @classmethod
    def from_json(cls, raw: Any) -> TableOffset:
        if not isinstance(raw, dict) or raw.get("format") not in FORMATS:
            raise ValueError(f"a table offset needs format {' or '.join(FORMATS)}, got {str(raw)[:200]!r}")
        version, position = raw.get(FORMATS[raw["format"]]), raw.get("position")
        if not isinstance(version, int) or isinstance(version, bool) \
                or not (position is None or (_is_int(position) and position >= 0)):
            raise ValueError(f"table offset {str(raw)[:200]!r} needs an integer {FORMATS[raw['format']]} "
                             "and a position >= 0 (or none)")
        return cls(raw["format"], str(raw.get("table", "")), version, position)

    def describe(self) -> str:
        what = f"{FORMATS[self.format].replace('_', ' ')} {self.version}"
        return what if self.position is None else f"{self.position} file(s) of {what}"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class TableLog(Protocol):
    """A table's commits, oldest first, as an input reads them."""

    format: str
    uri: str

    def commit(self, version: int) -> TableCommit: ...  # one commit (TableVersionsGone: no longer there)
    def commits_after(self, version: int | None) -> Iterator[TableCommit]: ...  # None: from the first
    def versions(self) -> list[int]: ...  # the versions (snapshot ids) it still has, oldest first
    def resume_point(self, version: int | None, resume_from: int) -> int | None: ...  # see below


def resume_command(versions: list[int], what: str) -> str:
    """How to go on from one of `versions`, said the same way by every message."""
    shown = (f"{versions[0]}..{versions[-1]}" if what == "version" and len(versions) > 3
             else ", ".join(str(v) for v in versions[:10]) + (f" and {len(versions) - 10} more"
                                                             if len(versions) > 10 else ""))
    value = what.replace(" ", "-")
    return (f"it has {what}s {shown or '(none)'}. To go on from one of them, reading nothing of the "
            f"{what}s in between: `sparkpoint run --pipeline MODULE:ATTR --conf {RESUME_KEY}=<{value}>` "
            f"(the setting table_resume_from; in Dagster and Airflow, the same setting)")
