"""What an exactly-once sink keeps with the checkpoint protocol (DESIGN: the sink).

Tasks stage a subtask's changed rows for checkpoint N, invisible to readers; the staged names
travel in N's `_metadata`. Once `_metadata` exists the driver commits them: the Parquet directory
moves them to their visible names, a table commits them in one transaction that records N. Every
method on the driver is safe to repeat and safe beside a second process doing the same (a retried
step, a recovery, a zombie completer).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol, Self

from sparkpoint.checkpoint.errors import SparkpointError
from sparkpoint.lazy import lazy_module

if TYPE_CHECKING:
    import pandas as pd
else:
    pd = lazy_module("pandas")

DAY = 24 * 3600.0
DEFAULT_REPLAY_WINDOW = 7 * DAY  # the `output_replay_window` setting's default


class SinkError(SparkpointError):
    """The output location cannot be written as asked."""


class SinkSchemaMismatch(SinkError):
    """The output table's schema does not take the columns an operator emits (names, types)."""


class SinkFenced(SinkError):
    """The table records a newer checkpoint of this job and operator than the one being committed:
    the writer is a zombie (or a retried step of an old attempt) and commits nothing."""


@dataclass(frozen=True)
class RowsErased:
    """What `Sink.erase_rows` removed from an output (or, with `dry_run`, would remove).

    `bytes_read` counts what was read to find and rewrite the rows (footers, the key column's
    chunks, the whole of each file rewritten); `bytes_written` the files written in their place.
    `rewrites` maps each file rewritten to the file that replaced it (a Parquet part keeps its
    name; a table's delete writes new files); `purged` names the files whose bytes are gone from
    storage (a table's delete leaves the old files for time travel until its purge).
    `by_checkpoint` is the rows removed from the output of each checkpoint (0: uncommitted staged
    rows). `version` is the table version (Delta) or snapshot id (Iceberg) the delete committed.
    """

    output: str
    column: str
    rows_removed: int = 0
    files_rewritten: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    files_scanned: int = 0
    files_skipped: int = 0
    dry_run: bool = False
    version: int | None = None
    by_checkpoint: tuple[tuple[int, int], ...] = ()
    rewrites: tuple[tuple[str, str], ...] = ()
    purged: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """A plain dict for `--json` and `--report` (lists, not tuples)."""
        out = asdict(self)
        out["by_checkpoint"] = {str(cid): rows for cid, rows in self.by_checkpoint}
        out["rewrites"] = [list(pair) for pair in self.rewrites]
        out["purged"] = list(self.purged)
        return out

    @property
    def message(self) -> str:
        """One line for a person: what left (or would leave) which output."""
        verb = "would remove" if self.dry_run else "removed"
        line = (f"{self.output}: {verb} {self.rows_removed} row(s) with a matching {self.column!r}, "
                f"{self.files_rewritten} file(s) rewritten of {self.files_scanned} scanned "
                f"({self.files_skipped} skipped by statistics), {self.bytes_read} bytes read, "
                f"{self.bytes_written} written")
        if self.version is not None:
            line += f", table version {self.version}"
        if self.purged:
            line += f", {len(self.purged)} old file(s) purged"
        return line


class Sink(Protocol):
    @property
    def url(self) -> str:
        """The output, as its URL form names it (`delta+file:///...`, a directory's URL)."""
        ...

    @property
    def job_id(self) -> str:
        """The job whose output this is (several jobs may write one output)."""
        ...

    # --- before Spark starts ------------------------------------------------------------------------
    def check_start(self, outputs: Mapping[str, Sequence[tuple[str, str]]]) -> None:
        """Refuse a table that cannot take what the job writes, before Spark starts: `outputs` maps
        each emitting operator's name to the (column, Arrow type) pairs it declares (none: not
        declared), the sink's own `checkpoint_id` column not among them."""
        ...

    def for_tasks(self) -> Self:
        """The sink the tasks of the next checkpoint stage with (a table's: with its schema now)."""
        ...

    # --- in the tasks ----------------------------------------------------------------------------
    def stage(self, checkpoint_id: int, operator: str, subtask: int, rows: pd.DataFrame) -> list[str]:
        """Write one subtask's changed rows for checkpoint N, invisible; the staged names (none
        for no rows; a partitioned table stages a file per partition)."""
        ...

    # --- on the driver ---------------------------------------------------------------------------
    def commit(self, checkpoint_id: int, staged: list[str], *, resuming: bool = False) -> int:
        """Make checkpoint N's staged rows visible, exactly once; returns files made visible now."""
        ...

    def discard_staged(self, checkpoint_id: int, staged: list[str]) -> None:
        """Delete these staged files of checkpoint N only (another attempt at N may be live)."""
        ...

    def committed(self, after: int = 0) -> dict[int, list[str]]:
        """This job's visible output by checkpoint id, of the checkpoints above `after` (what a
        start or a rollback needs: the output of every checkpoint ever is the job's history)."""
        ...

    def rollback(self, after: int) -> list[int]:
        """Hide the output of checkpoints newer than `after`; returns their ids."""
        ...

    def drop(self, checkpoint_ids: list[int]) -> list[int]:
        """Hide the visible output of these checkpoints; returns the ids that had any."""
        ...

    def discard_staging(self, up_to: int) -> None:
        """Delete staged files of checkpoints up to `up_to` that never became visible."""
        ...

    def facts(self, checkpoint_id: int, staged: list[str]) -> dict[str, Any]:
        """What checkpoint N made visible (files, rows, columns), for reports: never raises on a
        file it cannot read (`unreadable` names it)."""
        ...

    def erase_rows(self, column: str, values: Sequence[object], *, dry_run: bool = False) -> RowsErased:
        """Remove this job's output rows whose `column` holds one of `values` (a key being
        forgotten), committed or staged, keeping what `committed`, `rollback` and `drop` see of
        every checkpoint. With `dry_run`, count what would go and change nothing.

        Raises SinkError for a value that cannot be compared with the column (`"abc"` against an
        integer column), naming the column's type."""
        ...
