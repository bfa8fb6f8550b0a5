"""Savepoints: a self-contained, verified copy of one checkpoint, kind `savepoint`.

A savepoint holds a copy of every file the checkpoint lists, RocksDB files and changelog files
alike (the chain is copied as it is, not materialized: the copy is byte for byte what was
verified), under its own `chk-<N>/<operator>/<subtask>/` and nowhere else: it references
nothing in any `shared/`, so deleting the job it came from, or its retention, cannot break it.
Retention never subsumes a savepoint (`checkpoints_to_subsume` skips the kind).

Where it goes:

- by default into the job's own directory, as the next checkpoint id: the job resumes from it
  (only a savepoint of the latest checkpoint may go there; resuming from an older one would
  replay batches whose output is already committed);
- with `target`, into a new directory `target` (it must not exist), laid out as a job
  directory whose job id is the directory's name: `target/chk-<N>/_metadata`. Start a job from
  it with `sparkpoint run --from-checkpoint target/chk-<N>`.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass, replace
from typing import Any

from sparkpoint.checkpoint.errors import CheckpointAlreadyExists, CheckpointCorrupted, CheckpointNotFound, StorageError
from sparkpoint.checkpoint.files import mismatch
from sparkpoint.checkpoint.metadata import (
    CheckpointMetadata,
    CheckpointStats,
    FileHandle,
    OperatorState,
    SubtaskStateHandle,
    utc_now_iso,
)
from sparkpoint.checkpoint.paths import is_plain_name, private_dir
from sparkpoint.checkpoint.progress import ProgressCounter, ProgressFn
from sparkpoint.checkpoint.storage import CheckpointStorage, crc32
from sparkpoint.checkpoint.store import CompletedCheckpointStore

_CHUNK = 4 * 1024 * 1024


@dataclass(frozen=True)
class SavepointResult:
    metadata: CheckpointMetadata
    source_checkpoint: int
    url: str  # the savepoint's `chk-<N>` directory: what `run --from-checkpoint` takes
    files: int
    bytes: int

    def to_json(self) -> dict[str, Any]:
        return {"savepoint": self.url, "checkpoint_id": self.metadata.checkpoint_id, "kind": self.metadata.kind,
                "from_checkpoint": self.source_checkpoint, "files": self.files, "bytes": self.bytes}


def target_storage(source: CheckpointStorage, target: str | None) -> CheckpointStorage:
    """The job directory a savepoint of `source` goes to; a `target` that exists is refused."""
    if target is None:
        return source
    return new_savepoint_storage(target, source.storage_options)


def new_savepoint_storage(
    target: str, storage_options: dict[str, Any], *, allow_empty: bool = False
) -> CheckpointStorage:
    """The job directory `target` names (its last segment is the job id); refused if it exists
    (with `allow_empty`, unless it is an empty directory)."""
    trimmed = target.rstrip("/")
    base, _, name = trimmed.rpartition("/")
    if not is_plain_name(name) or not base:
        raise StorageError(
            f"savepoint target {target!r} must end in a new directory name of 1-128 letters, digits, '.', '_' "
            "or '-' (e.g. file:///data/savepoints/sp-2024-06-01)"
        )
    storage = CheckpointStorage(base, name, storage_options)
    if storage.job_dir_exists() and not (allow_empty and _is_empty_dir(storage)):
        raise CheckpointAlreadyExists(
            f"savepoint target {storage.job_url} exists already; give a new directory (nothing was written)"
        )
    return storage


def _is_empty_dir(storage: CheckpointStorage) -> bool:
    storage.fs.invalidate_cache(storage.root)
    return bool(storage.fs.isdir(storage.root)) and not storage.fs.ls(storage.root, detail=False)


def take_savepoint(
    source: CheckpointStorage,
    *,
    checkpoint_id: int | None = None,
    target: str | None = None,
    progress: ProgressFn | None = None,
) -> SavepointResult:
    """Copy checkpoint `checkpoint_id` (default: the latest) of `source` into a savepoint, every
    file verified against `_metadata` (size and CRC32) on the way; nothing is left behind on failure."""
    store = CompletedCheckpointStore(source)
    ids = store.checkpoint_ids()
    if not ids:
        raise CheckpointNotFound(f"{source.job_url} holds no completed checkpoint to take a savepoint of")
    meta = store.load(checkpoint_id if checkpoint_id is not None else ids[0])
    dest = target_storage(source, target)
    if target is None and meta.checkpoint_id != ids[0]:
        raise StorageError(
            f"a savepoint of checkpoint {meta.checkpoint_id} cannot go into the job directory, where the job would "
            f"resume from it and replay what checkpoints {meta.checkpoint_id + 1}..{ids[0]} committed; give --to URL"
        )
    new_id = _next_free_id(dest) if target is None else meta.checkpoint_id
    copies = [(f, private_dir(new_id, h.operator, h.subtask) + "/" + f.local_name)
              for h in meta.subtask_handles() for f in h.files()]
    counter = ProgressCounter(sum(f.size for f, _ in copies), progress)
    written: list[str] = []
    try:
        def copy(item: tuple[FileHandle, str]) -> None:
            written.append(item[1])
            _copy_verified(source, dest, item[0], item[1], meta, counter)

        dest.parallel(copy, copies)
        saved = _savepoint_metadata(meta, dest.job_id, new_id, copies)
        dest.commit_exclusive(saved.metadata_path, saved.dumps())
    except BaseException:
        _remove(dest, written, new_id, created=target is not None)
        raise
    return SavepointResult(saved, meta.checkpoint_id, f"{dest.job_url}/{saved.directory}", len(copies),
                           counter.total)


_PENDING = re.compile(r"chk-([1-9][0-9]*)-.*\.json")  # `_pending/chk-<N>-<attempt>.json` (sparkpoint.pipeline.attempt)


def _next_free_id(storage: CheckpointStorage) -> int:
    """An id above every `chk-N` directory and every pending attempt's: a savepoint never takes the id
    a running job is about to commit (if it did, the exclusive create of `_metadata` would fence one)."""
    pending = [m.group(1) for f in storage.walk("_pending") if (m := _PENDING.fullmatch(posixpath.basename(f.path)))]
    return max([*storage.checkpoint_dirs(), *map(int, pending)], default=0) + 1


def _copy_verified(
    source: CheckpointStorage, dest: CheckpointStorage, f: FileHandle, rel: str, meta: CheckpointMetadata,
    counter: ProgressCounter,
) -> None:
    """Stream one file across (any two fsspec filesystems), checking size and CRC32 of what was read."""
    target = dest.abspath(rel)
    dest.fs.makedirs(posixpath.dirname(target), exist_ok=True)
    size, crc = 0, 0
    try:
        with source.fs.open(source.abspath(f.path), "rb") as src, dest.fs.open(target, "wb") as out:
            while chunk := src.read(_CHUNK):
                crc = crc32(chunk, crc)
                out.write(chunk)
                size += len(chunk)
                counter.add(len(chunk))
    except FileNotFoundError:
        size = -1
    problem = mismatch(f, None if size < 0 else size, lambda: crc)
    if problem:
        raise CheckpointCorrupted(
            f"checkpoint {meta.checkpoint_id} cannot be saved: {f.path} {problem}; no savepoint was written. "
            "Run `sparkpoint verify` and save a checkpoint that verifies (--from-checkpoint N)",
            checkpoint_id=meta.checkpoint_id, path=f.path,
        )


def _savepoint_metadata(
    meta: CheckpointMetadata, job_id: str, new_id: int, copies: list[tuple[FileHandle, str]]
) -> CheckpointMetadata:
    moved = {f.path: rel for f, rel in copies}

    def own(h: SubtaskStateHandle) -> SubtaskStateHandle:
        files = tuple(replace(f, path=moved[f.path], created_by=new_id) for f in h.files())
        return replace(h, checkpoint_id=new_id, shared=(), private=files, staged=())  # no slices: nothing reads them

    operators = {uid: OperatorState(op.max_parallelism, tuple(own(h) for h in op.subtasks), op.states, name=op.name)
                 for uid, op in meta.operators.items()}
    offsets = meta.source_offsets
    if isinstance(offsets, dict) and "sink" in offsets:  # that output was committed with the checkpoint
        offsets = {**offsets, "sink": []}
    total = sum(f.size for f, _ in copies)
    return replace(
        meta, job_id=job_id, checkpoint_id=new_id, kind="savepoint", created_at=utc_now_iso(), source_offsets=offsets,
        stats=CheckpointStats(state_size=meta.stats.state_size, checkpointed_size=total, files_new=len(copies)),
        operators=operators, unowned=frozenset(),
    )


def _remove(dest: CheckpointStorage, written: list[str], new_id: int, *, created: bool) -> None:
    """Best effort: what a failed savepoint copied (and the target directory it created)."""
    try:
        dest.delete(written)  # file by file: no user path ever reaches a pattern (DESIGN rule 11)
        dest.remove_created_dirs(written, job_dir=created)
    except Exception:  # the orphan sweep takes what is left
        pass
