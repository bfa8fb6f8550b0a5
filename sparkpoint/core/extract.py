"""One subtask's state as a plain RocksDB directory on local disk, for debugging with rocksdict.

The files are downloaded and verified against `_metadata` exactly as a job's restore does, the
changelog chain is replayed on them, and the result is opened once more, read-only, to count
the entries of each state: what lands in the target directory is known to open.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from sparkpoint.core.backend import RocksDBStateBackend
from sparkpoint.core.errors import CheckpointAlreadyExists, OperatorStateMismatch
from sparkpoint.core.inspect import operator_state_of
from sparkpoint.core.metadata import CheckpointMetadata, SubtaskStateHandle
from sparkpoint.core.progress import ProgressCounter, ProgressFn, reporting
from sparkpoint.core.rocksdb import RocksDBOptions, count_keys, list_states, open_db
from sparkpoint.core.storage import CheckpointStorage


def subtask_handle_of(meta: CheckpointMetadata, operator: str, subtask: int) -> SubtaskStateHandle:
    """The handle of (operator, subtask) in `meta`; an unknown one is named with what exists."""
    op = operator_state_of(meta, operator)
    if not 0 <= subtask < op.parallelism:
        raise OperatorStateMismatch(
            f"checkpoint {meta.checkpoint_id} has subtasks 0..{op.parallelism - 1} of {operator}, not {subtask}"
        )
    return op.subtasks[subtask]


def restore_subtask(
    storage: CheckpointStorage,
    meta: CheckpointMetadata,
    operator: str,
    subtask: int,
    target: str | os.PathLike[str],
    *,
    progress: ProgressFn | None = None,
) -> dict[str, Any]:
    """Write the state of (operator, subtask) at `meta` as a RocksDB directory `target` (which must
    not exist); returns what it holds: files, bytes downloaded, entries per state."""
    handle = subtask_handle_of(meta, operator, subtask)
    out = Path(target)
    if out.exists():
        raise CheckpointAlreadyExists(f"{out} exists already; give a new directory (nothing was written)")
    out.parent.mkdir(parents=True, exist_ok=True)
    counter = ProgressCounter(sum(f.size for f in handle.files()), progress)
    op = meta.operators[operator]
    scratch = Path(tempfile.mkdtemp(prefix=".sparkpoint-restore-", dir=out.parent))  # same disk: a rename
    try:
        backend = RocksDBStateBackend(
            reporting(storage, counter), operator, subtask, parallelism=op.parallelism,
            max_parallelism=op.max_parallelism, local_dir=scratch, local_recovery=False,
        )
        result = backend.restore(meta)
        backend.close()
        backend.db_path.rename(out)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {
        "checkpoint_id": meta.checkpoint_id, "operator": operator, "subtask": subtask, "directory": str(out),
        "key_group_range": handle.key_group_range.to_json(),
        "files": result.files, "downloaded_bytes": result.downloaded_bytes, "states": count_entries(out),
    }


def count_entries(directory: Path) -> dict[str, int]:
    """Entries per state (column family) of a RocksDB directory, opened read-only as rocksdict would."""
    counts: dict[str, int] = {}
    db = open_db(str(directory), [], RocksDBOptions(), create=False, read_only=True)
    try:
        for name in list_states(str(directory)):
            counts[name] = count_keys(db.get_column_family(name))
    finally:
        db.close()
    return counts
