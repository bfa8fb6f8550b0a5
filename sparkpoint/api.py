"""The notebook API: checkpoints, state and the registry as pandas DataFrames.

    import sparkpoint
    sparkpoint.list_checkpoints("s3://bucket/checkpoints", "clicks", storage_options={...})
    sparkpoint.read_state("file:///data/checkpoints", "clicks", "user_totals", checkpoint=7)
    sparkpoint.registry("file:///data/checkpoints", "clicks")

The same data as `sparkpoint list --json`, `sparkpoint state` and `sparkpoint registry --json`:
each comes from one function of `sparkpoint.checkpoint.catalog` (or `sparkpoint.state.extract.state_table`) that the
command line prints.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from sparkpoint.checkpoint.catalog import LIST_COLUMNS, REGISTRY_COLUMNS, checkpoint_rows, registry_rows
from sparkpoint.checkpoint.errors import MetadataError
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.state.extract import state_table
from sparkpoint.state.operators import KeyedOperator

__all__ = ["list_checkpoints", "read_state", "registry", "state_table"]


def list_checkpoints(url: str, job_id: str, *, storage_options: dict[str, Any] | None = None) -> pd.DataFrame:
    """One row per retained checkpoint, newest first (columns: `LIST_COLUMNS`). A `_metadata` that
    cannot be read raises MetadataError naming it (`sparkpoint list` prints it as UNREADABLE)."""
    rows, unreadable = checkpoint_rows(CheckpointStorage(url, job_id, storage_options))
    if unreadable:
        raise MetadataError("; ".join(f"chk-{cid}/_metadata cannot be read: {why}" for cid, why in unreadable.items()))
    return pd.DataFrame(rows, columns=list(LIST_COLUMNS))


def read_state(
    url: str, job_id: str, operator: str | KeyedOperator, checkpoint: int | None = None, *,
    storage_options: dict[str, Any] | None = None, raw: bool = False,
) -> pd.DataFrame:
    """The state of `operator` at `checkpoint` (default: the latest), every subtask in one table.

        read_state("s3://bucket/checkpoints", "clicks", "totals_op", raw=True)

    Args:
        url: the checkpoints directory (any fsspec URL).
        job_id: the job whose checkpoints to read.
        operator: a `KeyedOperator` (its `export` makes the table), the name of a sample one,
            or, with `raw`, the operator's id in `_metadata` (its code is not needed).
        checkpoint: the checkpoint id; default the latest.
        storage_options: fsspec options of `url`.
        raw: every state of the operator through the codec `_metadata` recorded for it, one row
            per entry: columns state, kind, key, user_key (map), index (list), value (a
            RecordCodec's a dict of fields, a JsonCodec's its JSON value, bytes otherwise).

    Returns:
        A pandas DataFrame.

    Raises:
        OperatorStateMismatch: the checkpoint holds no such operator.
    """
    return state_table(CheckpointStorage(url, job_id, storage_options), operator, checkpoint, raw=raw)[1]


def registry(url: str, job_id: str, *, storage_options: dict[str, Any] | None = None) -> pd.DataFrame:
    """The shared-state registry rebuilt from the retained `_metadata`: one row per file it counts
    (columns: `REGISTRY_COLUMNS`); the totals are in `df.attrs["totals"]`."""
    rows, totals = registry_rows(CheckpointStorage(url, job_id, storage_options))
    frame = pd.DataFrame(rows, columns=list(REGISTRY_COLUMNS))
    frame.attrs["totals"] = totals
    return frame
