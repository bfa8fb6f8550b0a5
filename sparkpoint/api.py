"""The notebook API: checkpoints, state and the registry as pandas DataFrames.

    import sparkpoint
    sparkpoint.list_checkpoints("s3://bucket/checkpoints", "clicks", storage_options={...})
    sparkpoint.read_state("file:///data/checkpoints", "clicks", "user_totals", checkpoint=7)
    sparkpoint.registry("file:///data/checkpoints", "clicks")

The same data as `sparkpoint list --json`, `sparkpoint state` and `sparkpoint registry --json`:
each comes from one function of `sparkpoint.checkpoint.catalog` (or `state_table` below) that the
command line prints.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from sparkpoint.checkpoint.catalog import LIST_COLUMNS, REGISTRY_COLUMNS, checkpoint_rows, existing_store, registry_rows
from sparkpoint.checkpoint.errors import CheckpointCorrupted, MetadataError, OperatorStateMismatch
from sparkpoint.checkpoint.metadata import CheckpointMetadata
from sparkpoint.checkpoint.progress import ProgressFn
from sparkpoint.checkpoint.storage import CheckpointStorage


def list_checkpoints(url: str, job_id: str, *, storage_options: dict[str, Any] | None = None) -> pd.DataFrame:
    """One row per retained checkpoint, newest first (columns: `LIST_COLUMNS`). A `_metadata` that
    cannot be read raises MetadataError naming it (`sparkpoint list` prints it as UNREADABLE)."""
    rows, unreadable = checkpoint_rows(CheckpointStorage(url, job_id, storage_options))
    if unreadable:
        raise MetadataError("; ".join(f"chk-{cid}/_metadata cannot be read: {why}" for cid, why in unreadable.items()))
    return pd.DataFrame(rows, columns=list(LIST_COLUMNS))


def read_state(
    url: str, job_id: str, operator: str, checkpoint: int | None = None, *,
    storage_options: dict[str, Any] | None = None,
) -> pd.DataFrame:
    """The state of `operator` at `checkpoint` (default: the latest), every subtask in one table."""
    return state_table(CheckpointStorage(url, job_id, storage_options), operator, checkpoint)[1]


def registry(url: str, job_id: str, *, storage_options: dict[str, Any] | None = None) -> pd.DataFrame:
    """The shared-state registry rebuilt from the retained `_metadata`: one row per file it counts
    (columns: `REGISTRY_COLUMNS`); the totals are in `df.attrs["totals"]`."""
    rows, totals = registry_rows(CheckpointStorage(url, job_id, storage_options))
    frame = pd.DataFrame(rows, columns=list(REGISTRY_COLUMNS))
    frame.attrs["totals"] = totals
    return frame


def state_table(
    storage: CheckpointStorage, operator: str, checkpoint: int | None = None, *, progress: ProgressFn | None = None
) -> tuple[CheckpointMetadata, pd.DataFrame]:
    """(the checkpoint read, the operator's state as one table sorted by key)."""
    from sparkpoint.state.extract import operator_states
    from sparkpoint.state.sample import operator_by_name
    from sparkpoint.state.verify import restore_hint

    try:
        op = operator_by_name(operator)
    except KeyError as e:
        raise OperatorStateMismatch(str(e.args[0])) from e
    store = existing_store(storage)
    ids = store.checkpoint_ids()
    if checkpoint is None and not ids:
        raise MetadataError(f"{storage.job_url} holds no completed checkpoint")
    meta = store.load(checkpoint if checkpoint is not None else ids[0])
    try:
        with operator_states(storage, meta, op.name, progress=progress) as backends:
            frames = [op.export(b) for b in backends]
    except CheckpointCorrupted as e:
        raise CheckpointCorrupted(f"{e}. {restore_hint(storage, meta.checkpoint_id)}") from e
    table = pd.concat(frames, ignore_index=True).sort_values(op.key, kind="stable").reset_index(drop=True)
    return meta, table
