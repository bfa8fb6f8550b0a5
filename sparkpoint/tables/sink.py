"""What an exactly-once sink keeps with the checkpoint protocol (DESIGN: the sink).

Tasks stage a subtask's changed rows for checkpoint N, invisible to readers; the staged names
travel in N's `_metadata`. Once `_metadata` exists the driver commits them: the Parquet directory
moves them to their visible names, a table commits them in one transaction that records N. Every
method on the driver is safe to repeat and safe beside a second process doing the same (a retried
step, a recovery, a zombie completer).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, Self

import pandas as pd

from sparkpoint.checkpoint.errors import SparkpointError

DAY = 24 * 3600.0
DEFAULT_REPLAY_WINDOW = 7 * DAY  # the `output_replay_window` setting's default


class SinkError(SparkpointError):
    """The output location cannot be written as asked."""


class SinkSchemaMismatch(SinkError):
    """The output table's schema does not take the columns an operator emits (names, types)."""


class SinkFenced(SinkError):
    """The table records a newer checkpoint of this job and operator than the one being committed:
    the writer is a zombie (or a retried step of an old attempt) and commits nothing."""


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
