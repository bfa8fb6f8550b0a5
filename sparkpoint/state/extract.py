"""Reading a checkpoint's state outside a job: an operator's state opened read-only (for `state`
and `read_state`), and one subtask's state as a plain RocksDB directory on local disk, for
debugging with rocksdict.

`restore_subtask` downloads and verifies the files against `_metadata` exactly as a job's restore
does, replays the changelog chain on them, and opens the result once more, read-only, to count
the entries of each state: what lands in the target directory is known to open.
"""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sparkpoint.checkpoint.catalog import existing_store
from sparkpoint.checkpoint.errors import (
    CheckpointAlreadyExists,
    CheckpointCorrupted,
    MetadataError,
    OperatorStateMismatch,
)
from sparkpoint.checkpoint.metadata import CheckpointMetadata, OperatorState, SubtaskStateHandle
from sparkpoint.checkpoint.progress import ProgressCounter, ProgressFn, reporting
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.lazy import lazy_module
from sparkpoint.state.backend import RocksDBStateBackend
from sparkpoint.state.engine.rocksdb import RocksDBOptions, count_keys, list_states, open_db
from sparkpoint.state.operators import KeyedOperator
from sparkpoint.state.schema import codec_of_spec
from sparkpoint.state.timers import TIMERS
from sparkpoint.state.ttl import StateTtl

if TYPE_CHECKING:
    import pandas as pd
else:
    pd = lazy_module("pandas")


def operator_state_of(meta: CheckpointMetadata, operator: str) -> OperatorState:
    """The state of `operator` in `meta`; an operator it does not hold is named with those it does."""
    if operator not in meta.operators:
        known = ", ".join(sorted(meta.operators)) or "none"
        raise OperatorStateMismatch(f"checkpoint {meta.checkpoint_id} has no operator {operator!r}; it has: {known}")
    return meta.operators[operator]


@contextmanager
def operator_states(
    storage: CheckpointStorage, meta: CheckpointMetadata, operator: str, work_dir: str | None = None,
    progress: ProgressFn | None = None, code: KeyedOperator | None = None,
) -> Iterator[list[RocksDBStateBackend]]:
    """Every subtask of `operator` at checkpoint `meta`, restored (verified) into a scratch dir;
    `progress` hears of the bytes downloaded. With the operator's `code`, its declared states are
    opened as a job's restore opens them (old RecordCodec entries read in its fields)."""
    op = operator_state_of(meta, operator)
    source = reporting(storage, ProgressCounter(sum(f.size for h in op.subtasks for f in h.files()), progress))
    scratch = Path(tempfile.mkdtemp(prefix="sparkpoint-export-", dir=work_dir))
    backends = []
    try:
        for handle in op.subtasks:
            b = RocksDBStateBackend(
                source, operator, handle.subtask, parallelism=op.parallelism, max_parallelism=op.max_parallelism,
                local_dir=scratch, local_recovery=False, states=code.states if code else None,
                key_type=code.key_type if code else None,
            )
            backends.append(b)
            b.restore(meta)
        yield backends
    finally:
        for b in backends:
            b.close()
        shutil.rmtree(scratch, ignore_errors=True)

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


def state_table(
    storage: CheckpointStorage, operator: str | KeyedOperator, checkpoint: int | None = None, *,
    progress: ProgressFn | None = None, raw: bool = False,
) -> tuple[CheckpointMetadata, pd.DataFrame]:
    """(the checkpoint read, the operator's state as one table sorted by key). `raw`: every
    state through the codec `_metadata` recorded, no operator code needed (`raw_table`)."""
    from sparkpoint.state.engine.verify import restore_hint

    if raw:
        name = operator.uid if isinstance(operator, KeyedOperator) else operator
        meta = _load(storage, checkpoint)
        try:
            with operator_states(storage, meta, name, progress=progress) as backends:
                return meta, raw_table(meta, name, backends)
        except CheckpointCorrupted as e:
            raise CheckpointCorrupted(f"{e}. {restore_hint(storage, meta.checkpoint_id)}") from e
    if not isinstance(operator, KeyedOperator):
        raise OperatorStateMismatch(
            f"reading {operator!r} through its code needs its KeyedOperator (or --pipeline MODULE:ATTR); "
            "its raw state needs none (raw=True, --raw)"
        )
    op = operator
    meta = _load(storage, checkpoint)
    try:
        with operator_states(storage, meta, op.uid, progress=progress, code=op) as backends:
            table = export_table(op, backends)
    except CheckpointCorrupted as e:
        raise CheckpointCorrupted(f"{e}. {restore_hint(storage, meta.checkpoint_id)}") from e
    return meta, table


def export_table(op: KeyedOperator, backends: list[RocksDBStateBackend]) -> pd.DataFrame:
    """`op.export` of every subtask as one table, sorted by the key column (when it has one)."""
    table = pd.concat([op.export(b) for b in backends], ignore_index=True)
    if op.key in table.columns:
        table = table.sort_values(op.key, kind="stable").reset_index(drop=True)
    return table


def _load(storage: CheckpointStorage, checkpoint: int | None) -> CheckpointMetadata:
    store = existing_store(storage)
    ids = store.checkpoint_ids()
    if checkpoint is None and not ids:
        raise MetadataError(f"{storage.job_url} holds no completed checkpoint")
    return store.load(checkpoint if checkpoint is not None else ids[0])


RAW_COLUMNS = ("state", "kind", "key", "user_key", "index", "value")


def raw_table(meta: CheckpointMetadata, operator: str, backends: list[RocksDBStateBackend]) -> pd.DataFrame:
    """Every state of `operator` without its code, one row per live entry (columns `RAW_COLUMNS`):
    a declared state's values through the codec `_metadata` recorded (a RecordCodec's as a dict
    of its fields, a JsonCodec's as the JSON value), bytes for any other codec and for states
    the operator did not declare; `user_key` for map entries, `index`
    for list elements. Entries a TTL expired by the checkpoint's time are left out."""
    recorded = dict(operator_state_of(meta, operator).states or {})
    rows: list[tuple[Any, ...]] = []
    for backend in backends:
        names = [n for n in backend.state_names() if n != TIMERS and n != "default"]
        for name in sorted(names, key=lambda n: (n not in recorded, n)):
            declared = recorded.get(name) or backend.last_declaration(name) or {}
            kind = declared.get("kind", "unknown")
            spec = declared.get("codec") or {}
            codec = codec_of_spec(spec) if spec.get("type") in ("record", "json") else None
            ttl = StateTtl(**declared["ttl"]) if declared.get("ttl") else None
            entries = backend.raw_state(name, ttl)
            try:
                for k, v in entries._all():
                    key, user_key, index = _split_key(kind, k)
                    rows.append((name, kind, key, user_key, index, v if codec is None else codec.decode(v)))
            finally:
                entries.release()
    table = pd.DataFrame(rows, columns=list(RAW_COLUMNS))
    return table.sort_values(["state", "key"], kind="stable", key=lambda c: c.map(str)).reset_index(drop=True)


def _split_key(kind: str, k: bytes) -> tuple[Any, Any, int | None]:
    """(key, user key, list index) of a stored key of a state of `kind`."""
    if kind in ("map", "list"):
        (n,) = struct.unpack_from(">I", k, 2)
        key, rest = k[6 : 6 + n], k[6 + n :]
        if kind == "list":
            return _text(key), None, int.from_bytes(rest, "big")
        return _text(key), _text(rest), None
    return _text(k[2:]), None, None


def _text(raw: bytes) -> str | bytes:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw
