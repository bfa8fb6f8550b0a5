"""The restore strategy of the RocksDB backend: the working database when its marker names the
checkpoint, else a verified task-local copy, else a verified download from stable storage; the
changelog chain replayed; rescaling by key group. Nothing is opened by RocksDB before every file
was checked against `_metadata` (rule 7): its size, and its CRC32 unless it is a task-local SST
whose inode is unchanged since its content was last checksummed (`restore`); RocksDB's own block
checksums cover such a file on every read."""

from __future__ import annotations

import logging
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from rocksdict import Rdict, WriteBatch

from sparkpoint.checkpoint.crash import crash_point
from sparkpoint.checkpoint.errors import (
    CheckpointCorrupted,
    LocalStateError,
    OperatorStateMismatch,
    SparkpointError,
    StateBackendError,
)
from sparkpoint.checkpoint.files import check_handle_shape, download_verified
from sparkpoint.checkpoint.interleave import storage_step
from sparkpoint.checkpoint.metadata import CheckpointMetadata, KeyGroupRange, SubtaskStateHandle
from sparkpoint.checkpoint.retention import ClaimMode
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.state.engine import changelog
from sparkpoint.state.engine.changelog import ChangelogFormatError
from sparkpoint.state.engine.localstate import LocalState
from sparkpoint.state.engine.restore import local_copy_matches, materialize, record_fingerprints
from sparkpoint.state.engine.rocksdb import (
    compact_all,
    ensure_column_families,
    flush_all,
    is_corruption,
    list_states,
    open_db,
    scan_options,
)
from sparkpoint.state.kinds.base import SIDECAR_KEYS, key_group_bounds

log = logging.getLogger(__name__)
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
    migrated: int = 0  # entries rewritten because their RecordCodec's fields changed


class Restorer:
    """Restores one subtask's local state from a checkpoint (see `RocksDBStateBackend.restore`)."""

    def __init__(self, local: LocalState, storage: CheckpointStorage, *, local_recovery: bool = True):
        self.local = local
        self.storage = storage
        self.local_recovery = local_recovery
        self._source = storage  # the job directory the restore going on reads from

    def restore(
        self,
        checkpoint: CheckpointMetadata | None,
        *,
        claim_mode: ClaimMode | str = "CLAIM",
        source: CheckpointStorage | None = None,
        allow_missing: bool = False,
    ) -> tuple[RestoreResult, SubtaskStateHandle | None]:
        """Make the local state `checkpoint`'s (None: empty); db/ is closed. Returns how, and the
        handle the next snapshot may build on (None: it starts a fresh incremental history)."""
        started = time.monotonic()
        self._source = source or self.storage
        foreign = self._source.job_url != self.storage.job_url
        self.local.dir.mkdir(parents=True, exist_ok=True)
        self.local.drop_leftovers()
        claim = ClaimMode(claim_mode)
        if checkpoint is not None and self.local.operator not in checkpoint.operators and not allow_missing:
            raise OperatorStateMismatch(
                f"checkpoint {checkpoint.checkpoint_id} holds no state of operator {self.local.operator!r} (it has "
                f"{', '.join(sorted(checkpoint.operators))}); restoring it would start {self.local.operator} empty. "
                "Allow new operators explicitly to do so."
            )
        if checkpoint is None or self.local.operator not in checkpoint.operators:
            self._reset_empty()
            return RestoreResult(None, "empty", seconds=time.monotonic() - started), None
        op = checkpoint.operators[self.local.operator]
        if op.max_parallelism != self.local.max_parallelism:
            raise OperatorStateMismatch(
                f"checkpoint {checkpoint.checkpoint_id} stores {self.local.operator} with max parallelism "
                f"{op.max_parallelism}, this job uses {self.local.max_parallelism}: key groups would not match. "
                f"Run with --max-parallelism {op.max_parallelism}."
            )
        kg_range = self.local.key_group_range
        handles = [h for h in op.subtasks if h.key_group_range.intersects(kg_range)]
        cid = checkpoint.checkpoint_id
        base: SubtaskStateHandle | None = None  # rescaled: a fresh incremental history
        if len(handles) == 1 and handles[0].key_group_range == kg_range:
            result = self._restore_one(handles[0], cid, started)
            # NO_CLAIM: the first checkpoint is full, it owns nothing of the restored one
            base = handles[0] if claim is ClaimMode.CLAIM and not foreign else None
        else:
            result = self._restore_rescaled(handles, cid, started)
        self.local.drop_local_checkpoints(keep={cid} if self.local_recovery and result.source != "rescale" else set())
        return result, base

    def _restore_one(self, handle: SubtaskStateHandle, cid: int, started: float) -> RestoreResult:
        check_handle_shape(handle, cid)
        files = len(handle.shared) + len(handle.private)
        if self.local.holds(cid, handle, self._source.job_url):
            try:
                self.local.open_db()
                self.local.clean = True
                return RestoreResult(cid, "working", files=files, seconds=time.monotonic() - started)
            except StateBackendError as e:  # a copy replaces it: no checkpoint is touched either way
                log.warning("working database of checkpoint %s does not open (%s); restoring a copy", cid, e)
        self.local.forget_working()
        local = self.local.copy_dir(cid)
        problems: tuple[str, ...] = ()
        if self.local_recovery and local.is_dir():
            storage_step("read", str(local))  # the task-local copy
            problems = tuple(str(p) for p in local_copy_matches(local, handle))
            if not problems:
                try:
                    self._install(local, handle, cid)
                except CheckpointCorrupted as e:  # RocksDB's own checks refuse it
                    problems = (f"{local}: {e}",)
                    shutil.rmtree(local, ignore_errors=True)
                else:
                    record_fingerprints(local, [f.local_name for f in handle.files()], {})  # all checked now
                    self.local.write_marker(cid, handle, self._source.job_url)
                    self._repair_primary(handle, deep=False)  # a missing or truncated primary file: rewritten
                    return RestoreResult(cid, "local", files=files, seconds=time.monotonic() - started)
            log.warning("task-local copy of checkpoint %s fails verification, using stable storage: %s", cid,
                        "; ".join(problems))
            # kept until the download replaces it: its good files may repair a bad primary copy
        downloaded = self._download(handle, cid)
        self.local.write_marker(cid, handle, self._source.job_url)
        return RestoreResult(
            cid, "primary", files=files, downloaded_bytes=downloaded, seconds=time.monotonic() - started,
            problems=problems,
        )

    def _download(self, handle: SubtaskStateHandle, cid: int) -> int:
        target = self.local.dir / f"download-{uuid.uuid4().hex[:8]}"
        try:
            downloaded = download_verified(self._source, handle, cid, target)
        except CheckpointCorrupted:
            if not self._repair_primary(handle, deep=True):
                raise
            downloaded = download_verified(self._source, handle, cid, target)
        try:
            if self.local_recovery:  # keep the verified files as the task-local copy
                local = self.local.copy_dir(cid)
                storage_step("write", str(local))
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
        from sparkpoint.state.engine.repair import problems_of_handle_files, repair_files

        if self._source.job_url != self.storage.job_url:
            return False
        files = {f.path: f for f in handle.files()}
        try:
            bad = problems_of_handle_files(self.storage, list(files.values()), deep=deep)
            report = repair_files(self.storage, self.local.dir.parent, [(files[p.path], p.problem) for p in bad])
        except (SparkpointError, OSError) as e:
            log.warning("could not check or repair the primary copy of %s subtask %s: %s", self.local.operator,
                        self.local.subtask, e)
            return False
        for path, why in sorted(report.unrepairable.items()):
            log.error("%s/%s cannot be repaired: %s", self.storage.job_url, path, why)
        return bool(report.repaired) and not report.unrepairable

    def _install(self, source: Path, handle: SubtaskStateHandle, cid: int) -> Rdict:
        """Make db/ the state of `handle` from its verified files in `source`: the materialized
        RocksDB files, then the changelog chain replayed in checkpoint order."""
        names = [f.local_name for f in handle.files()]
        materialize(source, self.local.db_path, [n for n in names if not changelog.is_changelog(n)])
        crash_point("mid-restore")
        db = self._open_restored(cid)
        try:
            self._replay_chain(db, self.local.db_path, source, handle, cid)
        except CheckpointCorrupted:
            self.local.close()
            self.local.forget_working()
            raise
        return db

    def _replay_chain(self, db: Rdict, db_path: Path, source: Path, handle: SubtaskStateHandle, cid: int) -> None:
        chain = sorted(f.local_name for f in handle.files() if changelog.is_changelog(f.local_name))
        if not chain:
            return
        ensure = lambda names: ensure_column_families(db, str(db_path), names, self.local.options)  # noqa: E731
        limit = changelog.raw_limit(sum(f.size for f in handle.files()))
        try:
            for name in chain:
                changelog.replay(db, source / name, ensure, max_raw=limit)
        except ChangelogFormatError as e:
            raise CheckpointCorrupted(
                f"checkpoint {cid} cannot be restored: the changelog of {self.local.operator} subtask "
                f"{self.local.subtask} does not decode although it matches _metadata ({e}); run `sparkpoint verify`",
                checkpoint_id=cid,
            ) from e
        # The marker written next says db/ is checkpoint `cid`: without a WAL, that holds only
        # once the replayed entries are in SSTs.
        flush_all(db, list_states(str(db_path)))

    def _restore_rescaled(self, handles: list[SubtaskStateHandle], cid: int, started: float) -> RestoreResult:
        """Merge the old subtasks overlapping our key-group range (Flink's rescaling)."""
        self.local.forget_working()
        if not handles:  # no old subtask held any of our key groups
            self._reset_empty()
            return RestoreResult(cid, "rescale", seconds=time.monotonic() - started)
        for h in handles:
            check_handle_shape(h, cid)
        kg_range = self.local.key_group_range
        lower, upper = key_group_bounds(kg_range)
        # The old instance with the largest overlap becomes our database, clipped to our range.
        handles = sorted(handles, key=lambda h: -_overlap(h.key_group_range, kg_range))
        downloaded = 0
        work = self.local.dir / f"rescale-{uuid.uuid4().hex[:8]}"
        try:
            sources = []
            for i, h in enumerate(handles):
                target = work / str(i)
                downloaded += download_verified(self._source, h, cid, target)
                sources.append(target)
            db = self._install(sources[0], handles[0], cid)
            for source, h in zip(sources[1:], handles[1:]):
                self._replay_in_place(source, h, cid)
            for name in self.local.state_names():
                cf = db.get_column_family(name)
                if lower > b"\x00\x00":
                    cf.delete_range(b"\x00\x00", lower)
                if upper < b"\x80":  # key groups stop at 0x7fff
                    cf.delete_range(upper, b"\x80")
            for source in sources[1:]:
                self._merge_from(source, lower, upper)
            compact_all(db, self.local.state_names())  # drop the clipped ranges before the first upload
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
            db = open_db(str(source), [], self.local.options, create=False)
        except StateBackendError as e:
            if not is_corruption(e):
                raise _not_corruption(self.local, cid, e) from e
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
            return self.local.open_db()
        except StateBackendError as e:
            if not is_corruption(e):
                raise _not_corruption(self.local, checkpoint_id, e) from e
            self.local.forget_working()
            raise CheckpointCorrupted(
                f"checkpoint {checkpoint_id} cannot be restored: RocksDB refuses the files of {self.local.operator} "
                f"subtask {self.local.subtask} although they match _metadata ({e}); run `sparkpoint verify` to find a "
                "checkpoint that verifies",
                checkpoint_id=checkpoint_id,
            ) from e

    def _merge_from(self, source: Path, lower: bytes, upper: bytes) -> None:
        db = self.local.open_db()
        try:
            other = open_db(str(source), [], self.local.options, create=False, read_only=True)
        except StateBackendError as e:
            if not is_corruption(e):
                raise _not_corruption(self.local, None, e) from e
            raise CheckpointCorrupted(f"RocksDB refuses a verified subtask directory while rescaling: {e}") from e
        try:
            names = list_states(str(source))
            self.local.ensure_states(names)
            for name in names:
                handle = db.get_column_family_handle(name)
                opts = scan_options(upper)  # held while the iterator lives: it reads the bound from it
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
                # A state's format key (its entries carry TTL stamps) lies beyond every key group:
                # the database we grew from may lack the state, or the key, altogether.
                for sidecar in SIDECAR_KEYS:
                    stamped = other.get_column_family(name).get(sidecar)
                    if stamped is not None:
                        batch.put(sidecar, stamped, handle)
                db.write(batch)
        finally:
            other.close()

    def _reset_empty(self) -> None:
        self.local.forget_working()
        self.local.drop_local_checkpoints(keep=set())
        self.local.open_db(create=True)


def _not_corruption(local: LocalState, checkpoint_id: int | None, error: BaseException) -> LocalStateError:
    which = f" for checkpoint {checkpoint_id}" if checkpoint_id is not None else ""
    return LocalStateError(
        f"RocksDB cannot open the local state of {local.operator} subtask {local.subtask}{which}, "
        f"for a reason that is not corruption ({error}); the task fails and is retried, and "
        "every checkpoint and its output are kept. Look at the local disk of this machine (space, open-file "
        "limit, another process holding the database)"
    )


def _overlap(a: KeyGroupRange, b: KeyGroupRange) -> int:
    return max(0, min(a.end, b.end) - max(a.start, b.start) + 1)
