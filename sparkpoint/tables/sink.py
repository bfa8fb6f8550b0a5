"""What an exactly-once sink keeps with the checkpoint protocol (DESIGN: the sink).

Tasks stage a subtask's changed rows for checkpoint N, invisible to readers; the staged names
travel in N's `_metadata`. Once `_metadata` exists the driver commits them: the Parquet directory
moves them to their visible names, a table commits them in one transaction that records N. Every
method on the driver is safe to repeat and safe beside a second process doing the same (a retried
step, a recovery, a zombie completer).
"""

from __future__ import annotations

from typing import Protocol

import pandas as pd

from sparkpoint.checkpoint.errors import SparkpointError


class SinkError(SparkpointError):
    """The output location cannot be written as asked."""


class Sink(Protocol):
    url: str
    job_id: str

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

    def committed(self) -> dict[int, list[str]]:
        """This job's visible output by checkpoint id."""
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
