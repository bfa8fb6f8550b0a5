"""The restore strategy of the RocksDB backend: the working database when its marker names the
checkpoint, else a verified task-local copy, else a verified download from stable storage; the
changelog chain replayed; rescaling by key group. Nothing is opened by RocksDB before every file
was checked against `_metadata` (rule 7): its size, and its CRC32 unless it is a task-local SST
whose inode is unchanged since its content was last checksummed (`restore`); RocksDB's own block
checksums cover such a file on every read.

The restorer decides and verifies; the steps that open, replay and merge a database are its
target's (`RestoreTarget`: the local state, which runs them with `rebuilding`)."""

from __future__ import annotations

import logging
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from sparkpoint.checkpoint.errors import (
    CheckpointCorrupted,
    OperatorStateMismatch,
    SparkpointError,
    StateBackendError,
)
from sparkpoint.checkpoint.files import check_handle_shape, download_verified
from sparkpoint.checkpoint.interleave import storage_step
from sparkpoint.checkpoint.metadata import CheckpointMetadata, KeyGroupRange, SubtaskStateHandle
from sparkpoint.checkpoint.retention import ClaimMode
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.state.engine.restore import local_copy_matches, materialize, record_fingerprints

log = logging.getLogger(__name__)


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
    # The restore's phases (the metrics show them): verifying and installing the task-local copy,
    # downloading from stable storage (verified), opening the database; and the bytes it took from
    # the task-local copy (what a download would have fetched).
    local_seconds: float = 0.0
    download_seconds: float = 0.0
    open_seconds: float = 0.0
    local_bytes: int = 0


class RestoreTarget(Protocol):
    """What the restorer needs of a subtask's local state (`localstate.LocalState` is the engine's):
    its directory, which checkpoint its working database holds, and the steps that touch the
    database, each on files already verified. The restorer decides which steps run; a fake
    target lets its decisions be tested without RocksDB."""

    dir: Path
    operator: str
    subtask: int
    key_group_range: KeyGroupRange
    max_parallelism: int

    def copy_dir(self, checkpoint_id: int | None) -> Path:
        """Where the task-local copy of a checkpoint lives."""

    def holds(self, checkpoint_id: int, handle: SubtaskStateHandle, job_url: str) -> bool:
        """Whether the working database is exactly `handle` of that checkpoint, by its marker."""

    def write_marker(self, checkpoint_id: int, handle: SubtaskStateHandle, job_url: str) -> None:
        """Say the working database is exactly `handle` of that checkpoint."""

    def forget_working(self) -> None:
        """The working database counts as no checkpoint any more, and is moved out of the way."""

    def drop_leftovers(self) -> None:
        """Remove the scratch directories of a process that died mid-restore."""

    def drop_local_checkpoints(self, *, keep: set[int]) -> None:
        """Delete the task-local copies but those of the checkpoints in `keep`."""

    def open_working(self) -> None:
        """Open the working database as it is (StateBackendError: it does not open)."""

    def create_empty(self) -> None:
        """Open a new, empty working database."""

    def install(self, source: Path, handle: SubtaskStateHandle, checkpoint_id: int) -> None:
        """Make the working database `handle`'s state from its verified files in `source`
        (CheckpointCorrupted: RocksDB refuses them)."""

    def install_rescaled(self, sources: list[Path], handles: list[SubtaskStateHandle], checkpoint_id: int) -> None:
        """Make the working database this key-group range of old subtasks' verified files, the
        first grown into it, the others' entries merged in."""


class Restorer:
    """Restores one subtask's local state from a checkpoint (see `RocksDBStateBackend.restore`):
    decides where from (the working database, a verified task-local copy, or stable storage; one
    old subtask or several merged), verifies every file, and has the target do the RocksDB steps."""

    def __init__(self, local: RestoreTarget, storage: CheckpointStorage, *, local_recovery: bool = True):
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
                self.local.open_working()
                took = time.monotonic() - started
                return RestoreResult(cid, "working", files=files, seconds=took, open_seconds=took)
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
                    self.local.install(local, handle, cid)
                except CheckpointCorrupted as e:  # RocksDB's own checks refuse it
                    problems = (f"{local}: {e}",)
                    shutil.rmtree(local, ignore_errors=True)
                else:
                    record_fingerprints(local, [f.local_name for f in handle.files()], {})  # all checked now
                    self.local.write_marker(cid, handle, self._source.job_url)
                    self._repair_primary(handle, deep=False)  # a missing or truncated primary file: rewritten
                    took = time.monotonic() - started
                    return RestoreResult(cid, "local", files=files, seconds=took, local_seconds=took,
                                         local_bytes=sum(f.size for f in handle.files()))
            log.warning("task-local copy of checkpoint %s fails verification, using stable storage: %s", cid,
                        "; ".join(problems))
            # kept until the download replaces it: its good files may repair a bad primary copy
        downloaded, download_seconds, open_seconds = self._download(handle, cid)
        self.local.write_marker(cid, handle, self._source.job_url)
        return RestoreResult(
            cid, "primary", files=files, downloaded_bytes=downloaded, seconds=time.monotonic() - started,
            problems=problems, download_seconds=download_seconds, open_seconds=open_seconds,
        )

    def _download(self, handle: SubtaskStateHandle, cid: int) -> tuple[int, float, float]:
        """Download and verify `handle`'s files, keep the task-local copy, open the database:
        (bytes downloaded, seconds downloading and verifying, seconds keeping and opening)."""
        started = time.monotonic()
        target = self.local.dir / f"download-{uuid.uuid4().hex[:8]}"
        try:
            downloaded = download_verified(self._source, handle, cid, target)
        except CheckpointCorrupted:
            if not self._repair_primary(handle, deep=True):
                raise
            downloaded = download_verified(self._source, handle, cid, target)
        fetched = time.monotonic()
        try:
            if self.local_recovery:  # keep the verified files as the task-local copy
                local = self.local.copy_dir(cid)
                storage_step("write", str(local))
                shutil.rmtree(local, ignore_errors=True)
                names = [f.local_name for f in handle.files()]
                materialize(target, local, names)
                record_fingerprints(local, names, {})  # every file was just checksummed
            self.local.install(target, handle, cid)
        finally:
            shutil.rmtree(target, ignore_errors=True)
        return downloaded, fetched - started, time.monotonic() - fetched

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

    def _restore_rescaled(self, handles: list[SubtaskStateHandle], cid: int, started: float) -> RestoreResult:
        """Merge the old subtasks overlapping our key-group range (Flink's rescaling)."""
        self.local.forget_working()
        if not handles:  # no old subtask held any of our key groups
            self._reset_empty()
            return RestoreResult(cid, "rescale", seconds=time.monotonic() - started)
        for h in handles:
            check_handle_shape(h, cid)
        kg_range = self.local.key_group_range
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
            fetched = time.monotonic()
            self.local.install_rescaled(sources, handles, cid)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return RestoreResult(
            cid, "rescale", files=sum(len(h.shared) + len(h.private) for h in handles),
            downloaded_bytes=downloaded, seconds=time.monotonic() - started,
            download_seconds=fetched - started, open_seconds=time.monotonic() - fetched,
        )

    def _reset_empty(self) -> None:
        self.local.forget_working()
        self.local.drop_local_checkpoints(keep=set())
        self.local.create_empty()


def _overlap(a: KeyGroupRange, b: KeyGroupRange) -> int:
    return max(0, min(a.end, b.end) - max(a.start, b.start) + 1)
