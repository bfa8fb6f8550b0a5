"""The RocksDB keyed-state backend of one (operator, subtask): snapshot, confirm, restore.

Local layout, under `<local_dir>/<job_id>/<operator>/<subtask>/`:

    db/            the working database
    chk-<N>/       RocksDB native checkpoint N (hard links): pending until confirmed; the latest
                   confirmed one stays as the task-local copy for local recovery
    working.json   written right after snapshot N: "db/ holds exactly checkpoint N"; removed by
                   the first write after it. A later process that is told N completed reopens
                   db/ as it is, with no copy at all.

Invariants:

1. Only the last *confirmed* checkpoint's shared files are re-referenced (rule 2); pending
   checkpoints never see each other's uploads.
2. Every upload gets a fresh unique name under `shared/<operator>/<subtask>/` or
   `chk-<N>/<operator>/<subtask>/<attempt>/` (rule 1), so racing attempts never overwrite or
   delete each other's files.
3. Nothing is opened by RocksDB before every file was checked against `_metadata` (rule 7): its
   size, and its CRC32 unless it is a task-local SST whose inode is unchanged since its content
   was last checksummed (`restore`); RocksDB's own block checksums cover such a file on every read.
4. With the changelog on (see `changelog`), a checkpoint that only writes a changelog file
   builds on the confirmed base, and only when the changes logged since are exactly the
   changes since that base; anything else materializes. Such handles hold no private files:
   everything a later checkpoint re-references lives under `shared/`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from rocksdict import Checkpoint, Rdict

from sparkpoint.core import changelog
from sparkpoint.core.changelog import ChangeLog, ChangelogFormatError, ChangelogOptions
from sparkpoint.core.coordinator import CheckpointCoordinator, CompletedCheckpoint
from sparkpoint.core.crash import crash_point
from sparkpoint.core.errors import (
    CheckpointCorrupted,
    CheckpointDeclined,
    LocalStateError,
    OperatorStateMismatch,
    SparkpointError,
    StateBackendError,
    UnknownSharedState,
)
from sparkpoint.core.keygroups import key_group_range
from sparkpoint.core.localfiles import write_replacing
from sparkpoint.core.metadata import CheckpointMetadata, FileHandle, KeyGroupRange, SubtaskStateHandle
from sparkpoint.core.paths import checkpoint_id_of_dir, private_dir, shared_dir
from sparkpoint.core.restore import (
    SHARED_SUFFIXES,
    check_handle_shape,
    download_verified,
    local_copy_matches,
    materialize,
    read_fingerprints,
    record_fingerprints,
    stored_size_problems,
)
from sparkpoint.core.retention import ClaimMode
from sparkpoint.core.rocksdb import (
    RocksDBOptions,
    compact_all,
    ensure_column_families,
    flush_all,
    is_corruption,
    list_states,
    open_db,
)
from sparkpoint.core.serde import Codec
from sparkpoint.core.state import MapState, ValueState, _KeyedState, key_group_bounds
from sparkpoint.core.storage import CheckpointStorage, fsync_dir

log = logging.getLogger(__name__)
V = TypeVar("V")
_MARKER = "working.json"
_MERGE_BATCH = 10_000


@dataclass(frozen=True)
class RestoreResult:
    """How a subtask got its state."""

    checkpoint_id: int | None  # None: started empty
    source: str  # empty | working | local | primary | rescale
    files: int = 0
    downloaded_bytes: int = 0
    seconds: float = 0.0
    fell_back_from: tuple[int, ...] = ()
    problems: tuple[str, ...] = field(default=())


def handle_digest(handle: SubtaskStateHandle) -> str:
    """Identifies one acknowledged snapshot: same digest, same files."""
    parts = sorted(f"{f.path}:{f.size}:{f.crc32}" for f in handle.files())
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


class RocksDBStateBackend:
    def __init__(
        self,
        storage: CheckpointStorage,
        operator: str,
        subtask: int,
        *,
        parallelism: int,
        max_parallelism: int = 128,
        local_dir: str | os.PathLike[str],
        options: RocksDBOptions | None = None,
        incremental: bool = True,
        local_recovery: bool = True,
        changelog: ChangelogOptions | None = None,
    ):
        if not operator or "/" in operator or operator in (".", ".."):
            raise ValueError(f"invalid operator name {operator!r}")
        self.storage = storage
        self.operator = operator
        self.subtask = subtask
        self.parallelism = parallelism
        self.max_parallelism = max_parallelism
        self.key_group_range: KeyGroupRange = key_group_range(max_parallelism, parallelism, subtask)
        self.options = options or RocksDBOptions()
        self.incremental = incremental
        self.local_recovery = local_recovery
        self.dir = Path(local_dir) / storage.job_id / operator / str(subtask)
        self.db: Rdict | None = None
        self.changelog = changelog or ChangelogOptions()
        self._states: dict[str, _KeyedState[Any]] = {}
        self._base: dict[str, FileHandle] = {}  # confirmed: local name -> uploaded shared file
        self._base_id: int | None = None
        self._base_handle: SubtaskStateHandle | None = None
        self._pending: dict[int, SubtaskStateHandle] = {}
        self._log = ChangeLog() if self.changelog.enabled else None
        self._log_base: int | None = None  # the checkpoint the logged changes start from
        self._clean = False  # db/ equals the checkpoint named in working.json
        self._source = storage  # the job directory the last restore read from

    def __repr__(self) -> str:
        return f"RocksDBStateBackend({self.operator}/{self.subtask}, kg={self.key_group_range}, dir={self.dir})"

    def __enter__(self) -> RocksDBStateBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def db_path(self) -> Path:
        return self.dir / "db"

    @property
    def confirmed_checkpoint(self) -> int | None:
        return self._base_id

    # --- states --------------------------------------------------------------------------------

    def value_state(self, name: str, codec: Codec[V]) -> ValueState[V]:
        state = self._states.get(name) or self._add_state(ValueState, name, codec)
        if not isinstance(state, ValueState):
            raise StateBackendError(f"state {name!r} of {self.operator} is a {type(state).__name__}, not a ValueState")
        return state

    def map_state(self, name: str, codec: Codec[V]) -> MapState[V]:
        state = self._states.get(name) or self._add_state(MapState, name, codec)
        if not isinstance(state, MapState):
            raise StateBackendError(f"state {name!r} of {self.operator} is a {type(state).__name__}, not a MapState")
        return state

    def _add_state(self, kind: Any, name: str, codec: Codec[Any]) -> _KeyedState[Any]:
        if not name or name == "default":
            raise ValueError(f"invalid state name {name!r}")
        db = self._open_db()
        ensure_column_families(db, str(self.db_path), [name], self.options)
        state: _KeyedState[Any] = kind(
            db, name, codec, self.max_parallelism, self.key_group_range, on_write=self._before_write, log=self._log
        )
        self._states[name] = state
        return state

    def state_names(self) -> list[str]:
        return list_states(str(self.db_path)) if self.db_path.exists() else []

    def _before_write(self) -> None:
        # The first write after a snapshot makes db/ differ from that checkpoint. The unlink is
        # made durable before the write: RocksDB may persist an SST of this batch at any moment.
        if self._clean:
            self._clean = False
            (self.dir / _MARKER).unlink(missing_ok=True)
            fsync_dir(str(self.dir))

    # --- restore -------------------------------------------------------------------------------

    def restore(
        self,
        checkpoint: CheckpointMetadata | None,
        *,
        claim_mode: ClaimMode | str = "CLAIM",
        source: CheckpointStorage | None = None,
        allow_missing: bool = False,
    ) -> RestoreResult:
        """Open this subtask's state as of `checkpoint` (None: empty).

        A checkpoint without this operator is an OperatorStateMismatch unless `allow_missing`
        (a new operator added to the job starts empty only when the user says so).

        Tries, in order: the working database if it is exactly that checkpoint, the task-local
        copy if every file verifies, then stable storage. Several old subtasks overlapping this
        key-group range (a rescale) are merged. Raises CheckpointCorrupted naming the bad file.
        `source` is the job directory `checkpoint` lives in, when it is another job's: its files
        are read, never referenced, so the first checkpoint after it is full.
        """
        started = time.monotonic()
        self._source = source or self.storage
        foreign = self._source.job_url != self.storage.job_url
        self.close()
        self._states.clear()
        self._pending.clear()
        self._forget_log()
        self.dir.mkdir(parents=True, exist_ok=True)
        self._drop_leftovers()
        claim = ClaimMode(claim_mode)
        if checkpoint is not None and self.operator not in checkpoint.operators and not allow_missing:
            raise OperatorStateMismatch(
                f"checkpoint {checkpoint.checkpoint_id} holds no state of operator {self.operator!r} (it has "
                f"{', '.join(sorted(checkpoint.operators))}); restoring it would start {self.operator} empty. "
                "Allow new operators explicitly to do so."
            )
        if checkpoint is None or self.operator not in checkpoint.operators:
            self._reset_empty()
            return RestoreResult(None, "empty", seconds=time.monotonic() - started)
        op = checkpoint.operators[self.operator]
        if op.max_parallelism != self.max_parallelism:
            raise OperatorStateMismatch(
                f"checkpoint {checkpoint.checkpoint_id} stores {self.operator} with max parallelism "
                f"{op.max_parallelism}, this job uses {self.max_parallelism}: key groups would not match. "
                f"Run with --max-parallelism {op.max_parallelism}."
            )
        handles = [h for h in op.subtasks if h.key_group_range.intersects(self.key_group_range)]
        cid = checkpoint.checkpoint_id
        if len(handles) == 1 and handles[0].key_group_range == self.key_group_range:
            result = self._restore_one(handles[0], cid, started)
            if claim is ClaimMode.CLAIM and not foreign:
                self._confirm_base(cid, handles[0])
                self._log_base = cid
            else:  # NO_CLAIM: the first checkpoint is full, it owns nothing of the restored one
                self.forget_base()
        else:
            result = self._restore_rescaled(handles, cid, started)
            self.forget_base()  # a fresh incremental history
        self._drop_local_checkpoints(keep={cid} if self.local_recovery and result.source != "rescale" else set())
        return result

    def _restore_one(self, handle: SubtaskStateHandle, cid: int, started: float) -> RestoreResult:
        check_handle_shape(handle, cid)
        files = len(handle.shared) + len(handle.private)
        marker = self._read_marker()
        if marker == self._marker_for(cid, handle) and self.db_path.is_dir():
            try:
                self._open_db()
                self._clean = True
                return RestoreResult(cid, "working", files=files, seconds=time.monotonic() - started)
            except StateBackendError as e:  # a copy replaces it: no checkpoint is touched either way
                log.warning("working database of checkpoint %s does not open (%s); restoring a copy", cid, e)
        self._forget_working()
        local = self.dir / f"chk-{cid}"
        problems: tuple[str, ...] = ()
        if self.local_recovery and local.is_dir():
            problems = tuple(str(p) for p in local_copy_matches(local, handle))
            if not problems:
                try:
                    self._install(local, handle, cid)
                except CheckpointCorrupted as e:  # RocksDB's own checks refuse it
                    problems = (f"{local}: {e}",)
                    shutil.rmtree(local, ignore_errors=True)
                else:
                    record_fingerprints(local, [f.local_name for f in handle.files()], {})  # all checked now
                    self._write_marker(cid, handle)
                    self._repair_primary(handle, deep=False)  # a missing or truncated primary file: rewritten
                    return RestoreResult(cid, "local", files=files, seconds=time.monotonic() - started)
            log.warning("task-local copy of checkpoint %s fails verification, using stable storage: %s", cid,
                        "; ".join(problems))
            # kept until the download replaces it: its good files may repair a bad primary copy
        downloaded = self._download(handle, cid)
        self._write_marker(cid, handle)
        return RestoreResult(
            cid, "primary", files=files, downloaded_bytes=downloaded, seconds=time.monotonic() - started,
            problems=problems,
        )

    def _download(self, handle: SubtaskStateHandle, cid: int) -> int:
        target = self.dir / f"download-{uuid.uuid4().hex[:8]}"
        try:
            downloaded = download_verified(self._source, handle, cid, target)
        except CheckpointCorrupted:
            if not self._repair_primary(handle, deep=True):
                raise
            downloaded = download_verified(self._source, handle, cid, target)
        try:
            if self.local_recovery:  # keep the verified files as the task-local copy
                local = self.dir / f"chk-{cid}"
                shutil.rmtree(local, ignore_errors=True)
                names = [f.local_name for f in handle.files()]
                materialize(target, local, names)
                record_fingerprints(local, names, {})  # every file was just checksummed
            self._install(target, handle, cid)
        finally:
            shutil.rmtree(target, ignore_errors=True)
        return downloaded

    def _repair_primary(self, handle: SubtaskStateHandle, *, deep: bool) -> bool:
        """Rewrite the handle's bad files in stable storage from good task-local copies (see
        `repair`); True when every bad file was repaired. `deep` checks CRC32s, else sizes only.
        Never writes into another job's directory; a failure here is logged, not raised."""
        from sparkpoint.core.repair import problems_of_handle_files, repair_files

        if self._source.job_url != self.storage.job_url:
            return False
        files = {f.path: f for f in handle.files()}
        try:
            bad = problems_of_handle_files(self.storage, list(files.values()), deep=deep)
            report = repair_files(self.storage, self.dir.parent, [(files[p.path], p.problem) for p in bad])
        except (SparkpointError, OSError) as e:
            log.warning("could not check or repair the primary copy of %s subtask %s: %s", self.operator,
                        self.subtask, e)
            return False
        for path, why in sorted(report.unrepairable.items()):
            log.error("%s/%s cannot be repaired: %s", self.storage.job_url, path, why)
        return bool(report.repaired) and not report.unrepairable

    def _install(self, source: Path, handle: SubtaskStateHandle, cid: int) -> Rdict:
        """Make db/ the state of `handle` from its verified files in `source`: the materialized
        RocksDB files, then the changelog chain replayed in checkpoint order."""
        names = [f.local_name for f in handle.files()]
        materialize(source, self.db_path, [n for n in names if not changelog.is_changelog(n)])
        crash_point("mid-restore")
        db = self._open_restored(cid)
        try:
            self._replay_chain(db, self.db_path, source, handle, cid)
        except CheckpointCorrupted:
            self.db = None
            db.close()
            self._forget_working()
            raise
        return db

    def _replay_chain(self, db: Rdict, db_path: Path, source: Path, handle: SubtaskStateHandle, cid: int) -> None:
        chain = sorted(f.local_name for f in handle.files() if changelog.is_changelog(f.local_name))
        if not chain:
            return
        ensure = lambda names: ensure_column_families(db, str(db_path), names, self.options)  # noqa: E731
        limit = changelog.raw_limit(sum(f.size for f in handle.files()))
        try:
            for name in chain:
                changelog.replay(db, source / name, ensure, max_raw=limit)
        except ChangelogFormatError as e:
            raise CheckpointCorrupted(
                f"checkpoint {cid} cannot be restored: the changelog of {self.operator} subtask {self.subtask} "
                f"does not decode although it matches _metadata ({e}); run `sparkpoint verify`",
                checkpoint_id=cid,
            ) from e
        # The marker written next says db/ is checkpoint `cid`: without a WAL, that holds only
        # once the replayed entries are in SSTs.
        flush_all(db, list_states(str(db_path)))

    def _restore_rescaled(self, handles: list[SubtaskStateHandle], cid: int, started: float) -> RestoreResult:
        """Merge the old subtasks overlapping our key-group range (Flink's rescaling)."""
        self._forget_working()
        if not handles:  # no old subtask held any of our key groups
            self._reset_empty()
            return RestoreResult(cid, "rescale", seconds=time.monotonic() - started)
        for h in handles:
            check_handle_shape(h, cid)
        lower, upper = key_group_bounds(self.key_group_range)
        # The old instance with the largest overlap becomes our database, clipped to our range.
        handles = sorted(handles, key=lambda h: -_overlap(h.key_group_range, self.key_group_range))
        downloaded = 0
        work = self.dir / f"rescale-{uuid.uuid4().hex[:8]}"
        try:
            sources = []
            for i, h in enumerate(handles):
                target = work / str(i)
                downloaded += download_verified(self._source, h, cid, target)
                sources.append(target)
            db = self._install(sources[0], handles[0], cid)
            for source, h in zip(sources[1:], handles[1:]):
                self._replay_in_place(source, h, cid)
            names = self.state_names()
            for name in names:
                cf = db.get_column_family(name)
                if lower > b"\x00\x00":
                    cf.delete_range(b"\x00\x00", lower)
                if upper < b"\x80":  # key groups stop at 0x7fff
                    cf.delete_range(upper, b"\x80")
            for source in sources[1:]:
                self._merge_from(source, lower, upper)
            compact_all(db, self.state_names())  # drop the clipped ranges before the first upload
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return RestoreResult(
            cid, "rescale", files=sum(len(h.shared) + len(h.private) for h in handles),
            downloaded_bytes=downloaded, seconds=time.monotonic() - started,
        )

    def _replay_in_place(self, source: Path, handle: SubtaskStateHandle, cid: int) -> None:
        """Apply a rescale source's changelog chain to its own (scratch) directory."""
        if not any(changelog.is_changelog(f.local_name) for f in handle.files()):
            return
        try:
            db = open_db(str(source), [], self.options, create=False)
        except StateBackendError as e:
            if not is_corruption(e):
                raise _not_corruption(self, cid, e) from e
            raise CheckpointCorrupted(f"RocksDB refuses a verified subtask directory while rescaling: {e}") from e
        try:
            self._replay_chain(db, source, source, handle, cid)
        finally:
            db.close()

    def _open_restored(self, checkpoint_id: int) -> Rdict:
        """Files that match `_metadata` and that RocksDB reports as corrupt are a bad checkpoint,
        not a bad backend: the caller falls back to an older checkpoint, as for a corrupt file.
        Any other refusal (a lock held by another process, too many open files, an I/O error of the
        local disk) is this machine's, not the checkpoint's: the task fails and is retried, and
        no checkpoint or output is touched (DESIGN rule 10)."""
        try:
            return self._open_db()
        except StateBackendError as e:
            if not is_corruption(e):
                raise _not_corruption(self, checkpoint_id, e) from e
            self._forget_working()
            raise CheckpointCorrupted(
                f"checkpoint {checkpoint_id} cannot be restored: RocksDB refuses the files of {self.operator} "
                f"subtask {self.subtask} although they match _metadata ({e}); run `sparkpoint verify` to find a "
                "checkpoint that verifies",
                checkpoint_id=checkpoint_id,
            ) from e

    def _merge_from(self, source: Path, lower: bytes, upper: bytes) -> None:
        from rocksdict import ReadOptions, WriteBatch

        db = self._open_db()
        try:
            other = open_db(str(source), [], self.options, create=False, read_only=True)
        except StateBackendError as e:
            raise CheckpointCorrupted(f"RocksDB refuses a verified subtask directory while rescaling: {e}") from e
        try:
            names = list_states(str(source))
            ensure_column_families(db, str(self.db_path), names, self.options)
            for name in names:
                handle = db.get_column_family_handle(name)
                opts = ReadOptions()
                opts.set_iterate_upper_bound(upper)
                it = other.get_column_family(name).iter(opts)
                try:
                    it.seek(lower)
                    batch, n = WriteBatch(raw_mode=True), 0
                    while it.valid():
                        batch.put(it.key(), it.value(), handle)
                        n += 1
                        if n % _MERGE_BATCH == 0:
                            db.write(batch)
                            batch = WriteBatch(raw_mode=True)
                        it.next()
                    it.status()
                finally:
                    del it  # a live iterator holds `other` open, even from a traceback
                db.write(batch)
        finally:
            other.close()

    def _reset_empty(self) -> None:
        self._forget_working()
        self.forget_base()
        self._drop_local_checkpoints(keep=set())
        self._open_db(create=True)

    def _forget_working(self) -> None:
        (self.dir / _MARKER).unlink(missing_ok=True)
        self._clean = False
        if self.db_path.exists():
            # Out of the way at once, deleted in the background: freeing the blocks of a working
            # database that ran ahead (a compaction's fresh output) took 0.5 s per GB measured,
            # on the critical path of every restore that cannot reuse it.
            trash = self.dir / f"{_TRASH}{uuid.uuid4().hex[:8]}"
            self.db_path.rename(trash)
            _delete_in_background(trash)

    # --- snapshot ------------------------------------------------------------------------------

    def snapshot(self, checkpoint_id: int, *, full: bool = False) -> SubtaskStateHandle:
        """Take checkpoint N of this subtask and upload what the confirmed base lacks.

        `full` (or `incremental=False`) uploads every file: the baseline, and what the first
        checkpoint after a NO_CLAIM restore does anyway (its base is empty). With the changelog
        on, a checkpoint uploads one changelog file until the chain calls for a materialization.
        """
        db = self._open_db()
        names = self.state_names()
        flush_all(db, names)  # db/ on disk must be checkpoint N before the marker says so
        local = self.dir / f"chk-{checkpoint_id}"
        shutil.rmtree(local, ignore_errors=True)  # an earlier attempt at the same id
        if not full:
            self._check_base_on_storage()
        base = None if full else self._chain_base()
        try:
            if base is not None:
                handle = self._snapshot_changelog(checkpoint_id, base, names, local)
            else:
                handle = self._snapshot_files(checkpoint_id, full, local)
        except BaseException:
            shutil.rmtree(local, ignore_errors=True)
            raise
        self._pending[checkpoint_id] = handle
        self._write_marker(checkpoint_id, handle, self.storage.job_url)
        if self._log is not None:
            self._log.clear()
            self._log_base = checkpoint_id
        if not self.local_recovery:
            shutil.rmtree(local, ignore_errors=True)
        crash_point("after-upload")
        return handle

    def _check_base_on_storage(self) -> None:
        """Before re-referencing the confirmed base's stable files, make sure each is still there
        with its size (one listing of the subtask's shared directory). A working database or a
        task-local copy never reads them, so damage would otherwise go unnoticed while every new
        checkpoint re-references it and retention drops the older ones that did not need it.
        A bad file is rewritten from a task-local copy of the recorded size and CRC32; when none
        has it, the base is dropped and this checkpoint uploads the state whole."""
        from sparkpoint.core.repair import repair_files

        handle = self._base_handle
        if handle is None or not handle.shared:
            return
        problems = stored_size_problems(self.storage, list(handle.shared))
        if not problems:
            return
        files = {f.path: f for f in handle.shared}
        report = repair_files(self.storage, self.dir.parent, [(files[p.path], p.problem) for p in problems])
        if report.unrepairable:
            log.error("%s subtask %s: files of the confirmed checkpoint %s are damaged on stable storage and no "
                      "task-local copy repairs them (%s); this checkpoint uploads the state whole", self.operator,
                      self.subtask, self._base_id, "; ".join(f"{p}: {w}" for p, w in report.unrepairable.items()))
            self.forget_base()

    def _chain_base(self) -> SubtaskStateHandle | None:
        """The confirmed handle the next changelog file can extend (None: materialize)."""
        base = self._base_handle
        if self._log is None or not self.incremental or base is None or base.private:
            return None  # a handle with private files was written without the changelog
        if self._log_base != self._base_id:  # the log does not start at the base
            return None
        chain = [f for f in base.shared if changelog.is_changelog(f.local_name)]
        materialized = sum(f.size for f in base.shared if not changelog.is_changelog(f.local_name))
        working = sum(int(f["size"]) for f in self._open_db().live_files())  # flushed: the state now
        if self.changelog.should_materialize(max(materialized, working), sum(f.size for f in chain), len(chain)):
            return None
        return base

    def _snapshot_files(self, checkpoint_id: int, full: bool, local: Path) -> SubtaskStateHandle:
        """RocksDB's own files: a native checkpoint, uploading the SSTs the base lacks."""
        Checkpoint(self._open_db()).create_checkpoint(str(local))
        crash_point("after-native-checkpoint")
        base = {} if full or not self.incremental else self._base
        # With the changelog on, later checkpoints re-reference MANIFEST, CURRENT and OPTIONS
        # too: they go to shared/ (never reused by name, their content changes).
        everything_shared = self._log is not None
        attempt = uuid.uuid4().hex[:12]
        reused: list[FileHandle] = []
        shared_up: list[tuple[str, str]] = []
        private_up: list[tuple[str, str]] = []
        for name in sorted(os.listdir(local)):
            path = str(local / name)
            if name.endswith(SHARED_SUFFIXES):
                prev = base.get(name)
                if prev is not None and prev.size == os.path.getsize(path):
                    reused.append(prev)
                    continue
            if name.endswith(SHARED_SUFFIXES) or everything_shared:
                ext = os.path.splitext(name)[1]
                shared_up.append((path, f"{shared_dir(self.operator, self.subtask)}/{uuid.uuid4().hex}{ext}"))
            else:
                private_up.append((path, f"{private_dir(checkpoint_id, self.operator, self.subtask)}/{attempt}/{name}"))
        try:
            new_shared = self.storage.upload(shared_up, checkpoint_id)
            private = self.storage.upload(private_up, checkpoint_id)
        except BaseException:
            self._delete_quietly([rel for _, rel in shared_up + private_up])
            raise
        if self.local_recovery:  # uploads were checksummed; reused files keep an earlier record
            record_fingerprints(local, [os.path.basename(p) for p, _ in shared_up], self._base_fingerprints())
        return self._handle(checkpoint_id, reused + new_shared, private)

    def _snapshot_changelog(
        self, checkpoint_id: int, base: SubtaskStateHandle, names: list[str], local: Path
    ) -> SubtaskStateHandle:
        """The base's files plus one changelog file of what changed since the base."""
        assert self._log is not None
        local.mkdir(parents=True)
        log_name = changelog.local_name(checkpoint_id)
        self._log.write(local / log_name, names)
        crash_point("after-native-checkpoint")
        rel = f"{shared_dir(self.operator, self.subtask)}/{uuid.uuid4().hex}{changelog.SUFFIX}"
        try:
            new = self.storage.upload([(str(local / log_name), rel)], checkpoint_id)
        except BaseException:
            self._delete_quietly([rel])
            raise
        if self.local_recovery:
            if self._link_local_copy(base, local):
                record_fingerprints(local, [], self._base_fingerprints())
            else:
                shutil.rmtree(local, ignore_errors=True)  # no task-local copy of the base: restore from storage
        return self._handle(checkpoint_id, list(base.shared) + new, [])

    def _base_fingerprints(self) -> dict[str, list[int]]:
        return read_fingerprints(self.dir / f"chk-{self._base_id}") if self._base_id is not None else {}

    def _link_local_copy(self, base: SubtaskStateHandle, local: Path) -> bool:
        """The task-local copy of a changelog checkpoint: the base's copy, linked, plus the new file."""
        previous = self.dir / f"chk-{self._base_id}"
        try:
            for f in base.files():
                os.link(previous / f.local_name, local / f.local_name)
                crash_point("mid-task-local-copy")
        except OSError:
            return False
        return True

    def _handle(self, checkpoint_id: int, shared: list[FileHandle], private: list[FileHandle]) -> SubtaskStateHandle:
        return SubtaskStateHandle(
            operator=self.operator,
            subtask=self.subtask,
            checkpoint_id=checkpoint_id,
            key_group_range=self.key_group_range,
            max_parallelism=self.max_parallelism,
            shared=tuple(sorted(shared, key=lambda f: f.local_name)),
            private=tuple(private),
        )

    def confirm(self, checkpoint_id: int) -> None:
        """Checkpoint N completed: its files become the base of the next incremental snapshot.

        N must be pending here. (Another process learns of N through `restore(N)`, which
        checks its local files against N's handle before taking them as the base.)
        """
        if checkpoint_id in self._pending:
            self._confirm_base(checkpoint_id, self._pending[checkpoint_id])
        elif checkpoint_id != self._base_id:
            raise CheckpointDeclined(f"{self}: checkpoint {checkpoint_id} is not pending here, cannot confirm it")
        self._pending = {k: v for k, v in self._pending.items() if k > checkpoint_id}
        keep = set(self._pending) | ({checkpoint_id} if self.local_recovery else set())
        self._drop_local_checkpoints(keep=keep)

    def abort(self, checkpoint_id: int) -> None:
        """Checkpoint N will never complete: forget it (the coordinator deletes its uploads)."""
        self._pending.pop(checkpoint_id, None)
        if self._log_base == checkpoint_id:  # the changes logged since are relative to nothing retained
            self._log_base = None
        if checkpoint_id != self._base_id:
            shutil.rmtree(self.dir / f"chk-{checkpoint_id}", ignore_errors=True)

    def forget_base(self) -> None:
        """The confirmed base can no longer be trusted (the coordinator declined a reference to it,
        another writer subsumed it): the next snapshot uploads every file again."""
        self._base, self._base_id, self._base_handle = {}, None, None

    def _confirm_base(self, checkpoint_id: int, handle: SubtaskStateHandle) -> None:
        self._base = {f.local_name: f for f in handle.shared}
        self._base_id = checkpoint_id
        self._base_handle = handle

    def _forget_log(self) -> None:
        if self._log is not None:
            self._log.clear()
        self._log_base = None

    # --- housekeeping --------------------------------------------------------------------------

    def compact(self) -> None:
        """Force a full compaction (tests and benchmarks use it to provoke rewritten SSTs)."""
        db = self._open_db()
        self._before_write()
        compact_all(db, self.state_names())

    def close(self) -> None:
        if self.db is not None:
            flush_all(self.db, self.state_names())
            self._release_states()
            self.db.close()
            self.db = None

    def _release_states(self) -> None:
        for state in self._states.values():
            state.release()
        self._states.clear()

    def dispose(self) -> None:
        """Close and delete every local file of this subtask."""
        self.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def discard_local_state(self) -> None:
        """Forget the working database and every task-local copy, without flushing anything: what
        to do when RocksDB reports corruption in them (`rocksdb.is_corruption`). The next
        `restore` reads stable storage."""
        if self.db is not None:
            db, self.db = self.db, None
            self._release_states()
            try:
                db.close()
            except Exception as e:  # noqa: BLE001  rocksdict raises bare Exception; the files go anyway
                log.warning("closing the corrupt database of %s: %s", self, e)
        self._forget_working()
        self._drop_local_checkpoints(keep=set())

    def _open_db(self, *, create: bool = False) -> Rdict:
        if self.db is None:
            if not create and not self.db_path.exists():
                raise StateBackendError(f"{self}: call restore() first (with None to start empty)")
            self.db = open_db(str(self.db_path), [], self.options, create=create)
        return self.db

    def _read_marker(self) -> dict[str, Any] | None:
        try:
            data = json.loads((self.dir / _MARKER).read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def _write_marker(self, checkpoint_id: int, handle: SubtaskStateHandle, job_url: str | None = None) -> None:
        write_replacing(self.dir / _MARKER, json.dumps(self._marker_for(checkpoint_id, handle, job_url)).encode())
        self._clean = True

    def _marker_for(self, checkpoint_id: int, handle: SubtaskStateHandle, job_url: str | None = None) -> dict[str, Any]:
        job = job_url or self._source.job_url
        return {"job": job, "checkpoint_id": checkpoint_id, "digest": handle_digest(handle)}

    def _drop_local_checkpoints(self, *, keep: set[int]) -> None:
        for entry in self.dir.iterdir() if self.dir.exists() else []:
            cid = checkpoint_id_of_dir(entry.name)
            if cid is not None and cid not in keep:
                shutil.rmtree(entry, ignore_errors=True)

    def _drop_leftovers(self) -> None:
        """Scratch directories of a process that died mid-restore."""
        for entry in self.dir.iterdir():
            if entry.name.startswith(_TRASH):
                _delete_in_background(entry)
            elif entry.name.startswith(("download-", "rescale-")) or ".tmp-" in entry.name:
                shutil.rmtree(entry, ignore_errors=True)

    def _delete_quietly(self, rels: list[str]) -> None:
        try:
            self.storage.delete(rels)
        except Exception as e:  # best effort: the orphan sweep gets what is left
            log.warning("could not delete the uploads of a failed snapshot: %s", e)


_TRASH = "trash-"  # a local directory on its way out (`_delete_in_background`)
_deleting: set[Path] = set()
_deleting_lock = threading.Lock()


def _not_corruption(backend: RocksDBStateBackend, checkpoint_id: int, error: BaseException) -> LocalStateError:
    return LocalStateError(
        f"RocksDB cannot open the local state of {backend.operator} subtask {backend.subtask} for checkpoint "
        f"{checkpoint_id}, for a reason that is not corruption ({error}); the task fails and is retried, and "
        "every checkpoint and its output are kept. Look at the local disk of this machine (space, open-file "
        "limit, another process holding the database)"
    )


def _delete_in_background(path: Path) -> None:
    """Delete the directory `path` on a daemon thread, once per process. One left over by a process
    that died first is found by the next restore (`_drop_leftovers`)."""
    with _deleting_lock:
        if path in _deleting:
            return
        _deleting.add(path)

    def delete() -> None:
        try:
            if path.is_symlink():  # the link goes, never what it points to
                path.unlink(missing_ok=True)
            shutil.rmtree(path, ignore_errors=True)
        finally:
            with _deleting_lock:
                _deleting.discard(path)

    threading.Thread(target=delete, name=f"sparkpoint-delete-{path.name}", daemon=True).start()


def _overlap(a: KeyGroupRange, b: KeyGroupRange) -> int:
    return max(0, min(a.end, b.end) - max(a.start, b.start) + 1)


def restore_with_fallback(
    backends: list[RocksDBStateBackend],
    checkpoints: list[CheckpointMetadata],
    *,
    claim_mode: ClaimMode | str = "CLAIM",
    fallback: bool = True,
) -> list[RestoreResult]:
    """Restore every backend from the first of `checkpoints` (newest first) that all can restore.

    The fallback is per checkpoint, never per subtask: all subtasks (and the source offsets the
    caller takes from the same metadata) come from one checkpoint. Without `fallback` the first
    failure is raised; with it, a checkpoint that cannot be restored is logged loudly and the
    next older one is tried, and each result says which ones failed.
    """
    failed: list[int] = []
    problems: list[str] = []
    for meta in checkpoints:
        try:
            results = [b.restore(meta, claim_mode=claim_mode) for b in backends]
        except (OperatorStateMismatch, LocalStateError):
            raise  # an older checkpoint has the same operators, and this machine's trouble: no fallback
        except (CheckpointCorrupted, StateBackendError) as e:
            if not fallback:
                raise
            path = getattr(e, "path", None)
            if path and all(path in m.paths() for m in checkpoints):  # falling back cannot help
                from sparkpoint.core.repair import every_checkpoint_needs

                ids = [m.checkpoint_id for m in checkpoints]
                raise CheckpointCorrupted(every_checkpoint_needs(path, ids, str(e)), path=path) from e
            log.error("checkpoint %s cannot be restored, falling back to an older one: %s", meta.checkpoint_id, e)
            failed.append(meta.checkpoint_id)
            problems.append(str(e))
            continue
        return [replace(r, fell_back_from=tuple(failed), problems=r.problems + tuple(problems)) for r in results]
    if failed:
        raise CheckpointCorrupted(f"no retained checkpoint can be restored (tried {failed}): " + "; ".join(problems))
    return [b.restore(None) for b in backends]


def take_checkpoint(
    coordinator: CheckpointCoordinator,
    backends: list[RocksDBStateBackend],
    *,
    source_offsets: Any = None,
    kind: str = "checkpoint",
    full: bool = False,
    checkpoint_id: int | None = None,
) -> CompletedCheckpoint:
    """One whole checkpoint of in-process subtasks: trigger, snapshot, acknowledge, complete,
    confirm; any failure aborts it everywhere. (Spark runs the snapshots in its tasks instead.)
    `checkpoint_id`: take exactly that id (see `CheckpointCoordinator.trigger`)."""
    expected: dict[str, int] = {}
    for b in backends:
        expected[b.operator] = b.parallelism
    pending = coordinator.trigger(kind=kind, expected=expected, checkpoint_id=checkpoint_id)
    cid = pending.checkpoint_id
    try:
        for b in backends:
            coordinator.acknowledge(cid, b.snapshot(cid, full=full))
        done = coordinator.complete(cid, source_offsets=source_offsets)
    except BaseException as e:
        coordinator.abort(cid, reason="a subtask failed to snapshot")
        for b in backends:
            b.abort(cid)
            if isinstance(e, UnknownSharedState):  # declined reuse: re-upload next time (rule 2)
                b.forget_base()
        raise
    for b in backends:
        b.confirm(cid)
    return done
