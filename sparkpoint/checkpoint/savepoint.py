"""Savepoints: a self-contained, verified copy of one checkpoint, kind `savepoint`.

A savepoint holds a copy of every file the checkpoint lists, RocksDB files and changelog files
alike (the chain is copied as it is, not materialized: the copy is byte for byte what was
verified), under its own `chk-<N>/<operator>/<subtask>/` and nowhere else: it references
nothing in any `shared/`, so deleting the job it came from, or its retention, cannot break it.
Retention never subsumes a savepoint (`checkpoints_to_subsume` skips the kind).

Where it goes:

- by default into the job's own directory, as exactly the id after the checkpoint it copies,
  chk-<L+1> for the latest L (above every retired id, `sparkpoint.checkpoint.retired`): the job
  resumes from it (only a savepoint of the latest checkpoint may go there; resuming from an
  older one would replay batches whose output is already committed). A savepoint is a writer of
  the job directory like a run (DESIGN rules 6, 9, 14): a run that resumed from L commits L+1
  too, and the exclusive create of `chk-<L+1>/_metadata` lets exactly one of them win. A run that
  loses gives its batch up as a losing writer does and resumes from the savepoint, which holds
  the same state; a savepoint that loses (the job
  committed L+1 while it copied L) removes its copies and is taken again of the new latest, a few
  times, then fails (`SavepointOvertaken`). It never takes an id above another writer's: a copy
  of L committed above a checkpoint L+1 would become the latest and roll the job back (its
  batch replayed, its output written twice). It copies only a checkpoint whose completion has
  settled (the step that committed it has finished: a recovery may still withdraw a checkpoint
  its fenced completer just committed), and it records which checkpoint it copies
  (`source_offsets["savepoint_of"]`, with that checkpoint's staged sink files), so a start from it
  finishes that checkpoint's sink commit when its writer died before making it;
- with `target`, into a new directory `target` (it must not exist), laid out as a job
  directory whose job id is the directory's name: `target/chk-<N>/_metadata`. Start a job from
  it with `sparkpoint run --from-checkpoint target/chk-<N>`.
"""

from __future__ import annotations

import itertools
import json
import logging
import posixpath
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

from sparkpoint.checkpoint.catalog import readable_size
from sparkpoint.checkpoint.errors import (
    CheckpointAlreadyExists,
    CheckpointCorrupted,
    CheckpointNotFound,
    SavepointOvertaken,
    StorageError,
)
from sparkpoint.checkpoint.files import mismatch, stored_size_problems
from sparkpoint.checkpoint.interleave import storage_step
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
from sparkpoint.checkpoint.retired import next_id_after
from sparkpoint.checkpoint.storage import CheckpointStorage, crc32
from sparkpoint.checkpoint.store import CompletedCheckpointStore

log = logging.getLogger(__name__)

_CHUNK = 4 * 1024 * 1024
TARGET_CLAIM = "_claim.json"  # in a savepoint's own directory (`--to`, bootstrap): who took it, from what
SAVEPOINT_OF = "savepoint_of"  # in a savepoint's source offsets: {"checkpoint_id": L, "sink": L's staged files}
ATTEMPTS = 3  # tries of a savepoint into the job directory that a run keeps overtaking
SETTLE_POLLS = 20  # looks at a checkpoint whose completion has not settled yet, before giving up
SETTLE_SECONDS = 0.25  # between two looks


@dataclass(frozen=True)
class SavepointResult:
    metadata: CheckpointMetadata
    source_checkpoint: int
    url: str  # the savepoint's `chk-<N>` directory: what `run --from-checkpoint` takes
    files: int
    bytes: int

    @property
    def message(self) -> str:
        """One line: where the savepoint is, what it copies, how big, verified."""
        return (f"savepoint {self.url} of chk-{self.source_checkpoint}: {self.files} files, "
                f"{readable_size(self.bytes)}, verified")

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
    attempts: int = ATTEMPTS,
) -> SavepointResult:
    """Copy checkpoint `checkpoint_id` (default: the latest) of `source` into a savepoint, every
    file verified against `_metadata` (size and CRC32) on the way; nothing is left behind on failure.

    Into the job directory (no `target`) it commits as chk-<L+1>, L the checkpoint it copies, by
    exclusive create: when a run commits L+1 first, the copies are removed and, without
    `checkpoint_id`, the savepoint is taken again of the new latest, `attempts` times in all.

    Raises:
        SavepointOvertaken: the job committed the savepoint's id first on every try, or the
            checkpoint to copy did not settle; nothing of the savepoint is left.
        CheckpointCorrupted: a file of the checkpoint differs from its `_metadata`.
    """
    store = CompletedCheckpointStore(source)
    dest = target_storage(source, target)
    for attempt in itertools.count(1):
        meta = _checkpoint_to_copy(store, checkpoint_id, into_job=target is None)
        try:
            return _save(source, dest, meta, into_job=target is None, progress=progress)
        except SavepointOvertaken as e:
            if target is not None or checkpoint_id is not None or attempt >= attempts:
                raise
            log.warning("%s; taking the savepoint again, of the latest checkpoint", e)
    raise AssertionError("unreachable")


def _checkpoint_to_copy(store: CompletedCheckpointStore, checkpoint_id: int | None, *, into_job: bool
                        ) -> CheckpointMetadata:
    ids = store.checkpoint_ids()
    if not ids:
        raise CheckpointNotFound(f"{store.storage.job_url} holds no completed checkpoint to take a savepoint of")
    try:
        meta = store.load(checkpoint_id if checkpoint_id is not None else ids[0])
    except CheckpointNotFound as e:
        if checkpoint_id is not None:
            raise
        raise SavepointOvertaken(f"checkpoint {ids[0]} was subsumed by a newer one as the savepoint began") from e
    if into_job and meta.checkpoint_id != ids[0]:
        raise StorageError(
            f"a savepoint of checkpoint {meta.checkpoint_id} cannot go into the job directory, where the job would "
            f"resume from it and replay what checkpoints {meta.checkpoint_id + 1}..{ids[0]} committed; give --to URL"
        )
    if into_job:
        _wait_settled(store.storage, meta)
    return meta


def _save(source: CheckpointStorage, dest: CheckpointStorage, meta: CheckpointMetadata, *, into_job: bool,
          progress: ProgressFn | None) -> SavepointResult:
    new_id = _savepoint_id(dest, meta, into_job=into_job)
    tag = uuid.uuid4().hex[:12]  # every copy a name of its own (rule 1): a loser removes only its own files
    copies = [(f, f"{private_dir(new_id, h.operator, h.subtask)}/{tag}/{f.local_name}")
              for h in meta.subtask_handles() for f in h.files()]
    counter = ProgressCounter(sum(f.size for f, _ in copies), progress)
    written: list[str] = []
    try:
        if not into_job:  # before anything is written: a bootstrap or another savepoint into it excluded
            claim_target(dest, {"format": "sparkpoint-savepoint", "version": 1, "created_at": utc_now_iso(),
                                "from": f"{source.job_url}/{meta.metadata_path}"})
            written.append(TARGET_CLAIM)

        def copy(item: tuple[FileHandle, str]) -> None:
            written.append(item[1])
            _copy_verified(source, dest, item[0], item[1], meta, counter)

        try:
            dest.parallel(copy, copies)
        except CheckpointCorrupted as e:
            if source.exists(meta.metadata_path):
                raise
            raise SavepointOvertaken(  # its files went with it: no damage to report
                f"checkpoint {meta.checkpoint_id} was subsumed by a newer one while the savepoint copied it"
            ) from e
        saved = _savepoint_metadata(meta, dest.job_id, new_id, copies)
        # Its copies are referenced by nothing until `_metadata` lands: an orphan sweep (a
        # recovery's, `gc`, `prune`) may have taken one while it copied. One listing per directory.
        gone = stored_size_problems(dest, list(saved.files()))
        if gone:
            raise StorageError(
                f"the savepoint's copies of checkpoint {meta.checkpoint_id} changed while it ran ("
                + "; ".join(str(p) for p in gone[:3]) + "): an orphan sweep (a recovery, gc or prune) took them; "
                "nothing was committed: take the savepoint again")
        _commit(dest, saved, meta, into_job=into_job)
    except BaseException:
        _remove(dest, written, new_id, created=not into_job)
        raise
    return SavepointResult(saved, meta.checkpoint_id, f"{dest.job_url}/{saved.directory}", len(copies),
                           counter.total)


def _savepoint_id(dest: CheckpointStorage, meta: CheckpointMetadata, *, into_job: bool) -> int:
    """Into the job directory exactly the id a run resuming from the checkpoint copied commits
    (the one after it, or after the highest retired id: the exclusive create decides between
    them), never "the next free id" after a listing, which a run commits below meanwhile;
    elsewhere the checkpoint's own id."""
    return next_id_after(dest, meta.checkpoint_id) if into_job else meta.checkpoint_id


def claim_target(target: CheckpointStorage, record: dict[str, Any]) -> None:
    """Take a new savepoint directory for one writer, by the exclusive create of its
    `TARGET_CLAIM` (what is written there, and from what), before anything else is written into
    it: two writers of one new directory (two savepoints, a savepoint and a bootstrap) that both
    found it absent cannot mix their files, nor can the loser's clean-up take the winner's."""
    try:
        target.commit_exclusive(TARGET_CLAIM, json.dumps(record, indent=1).encode())
    except CheckpointAlreadyExists:
        raise CheckpointAlreadyExists(
            f"savepoint target {target.job_url} was claimed by another writer meanwhile; give a new directory "
            "(nothing was written)") from None


def _commit(dest: CheckpointStorage, saved: CheckpointMetadata, meta: CheckpointMetadata, *, into_job: bool) -> None:
    """The exclusive create of the savepoint's `_metadata`; another writer's there: SavepointOvertaken."""
    data = saved.dumps()
    try:
        dest.commit_exclusive(saved.metadata_path, data)
        return
    except CheckpointAlreadyExists as e:
        try:
            if dest.read_bytes(saved.metadata_path) == data:
                return  # our own write, whose response was lost
        except FileNotFoundError:
            pass
        if not into_job:  # a target: its claim keeps every other writer out
            raise
        raise SavepointOvertaken(
            f"the job committed checkpoint {saved.checkpoint_id} while the savepoint copied checkpoint "
            f"{meta.checkpoint_id} into {dest.job_url}/chk-{saved.checkpoint_id}; nothing of the savepoint is left. "
            "Take it again (of the new latest checkpoint), or give --to URL to save into a directory of its own"
        ) from e


def _wait_settled(storage: CheckpointStorage, meta: CheckpointMetadata) -> None:
    """A checkpoint committed by a step whose attempt is still pending may yet be withdrawn (a
    recovery fenced its attempt; its completer re-checks the fence right after the commit) and
    its output is not committed yet: wait until that step is done with it.

    Its attempt record (`_pending/chk-<N>-<attempt>.json`, sparkpoint.pipeline.attempt) goes only
    after the completer's re-check passed and its sink commit: once gone it never comes back."""
    offsets = meta.source_offsets
    attempt = offsets.get("attempt") if isinstance(offsets, dict) else None
    if not isinstance(attempt, str) or not is_plain_name(attempt):
        return  # a run of one process (no record), or a `_metadata` that does not say
    record = f"_pending/chk-{meta.checkpoint_id}-{attempt}.json"
    for poll in range(SETTLE_POLLS):
        if not storage.exists(record):
            return
        if poll + 1 < SETTLE_POLLS:
            time.sleep(SETTLE_SECONDS)
    raise SavepointOvertaken(
        f"checkpoint {meta.checkpoint_id} is still being completed by attempt {attempt} ({storage.job_url}/{record} "
        "is pending): take the savepoint once that step is done; if its run died, run the recover job first"
    )


def _copy_verified(
    source: CheckpointStorage, dest: CheckpointStorage, f: FileHandle, rel: str, meta: CheckpointMetadata,
    counter: ProgressCounter,
) -> None:
    """Stream one file across (any two fsspec filesystems), checking size and CRC32 of what was read."""
    target = dest.abspath(rel)
    storage_step("read", source.abspath(f.path))
    storage_step("write", target)
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
    if isinstance(offsets, dict) and "sink" in offsets:  # that output is committed with the checkpoint copied:
        # a start from the savepoint finishes that commit if the checkpoint's writer died before it
        copied = offsets.get(SAVEPOINT_OF) if meta.is_savepoint else None  # a savepoint's: where its output is
        offsets = {**offsets, "sink": [], SAVEPOINT_OF: copied or {"checkpoint_id": meta.checkpoint_id,
                                                                    "sink": list(offsets.get("sink") or [])}}
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
