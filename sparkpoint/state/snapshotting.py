"""The snapshot half of the RocksDB backend: a native checkpoint (or a changelog file), the
files the confirmed base lacks uploaded under fresh names (rules 1 and 2), the base's stable files
checked before they are re-referenced; confirm and abort."""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from rocksdict import Checkpoint

from sparkpoint.checkpoint.coordinator import CheckpointCoordinator, CompletedCheckpoint
from sparkpoint.checkpoint.crash import crash_point
from sparkpoint.checkpoint.errors import (
    CheckpointDeclined,
    UnknownSharedState,
)
from sparkpoint.checkpoint.files import stored_size_problems
from sparkpoint.checkpoint.interleave import storage_step
from sparkpoint.checkpoint.metadata import FileHandle, SubtaskStateHandle, metadata_path
from sparkpoint.checkpoint.paths import private_dir, shared_dir
from sparkpoint.state import changelog, staging
from sparkpoint.state.localfiles import write_replacing
from sparkpoint.state.restore import (
    SHARED_SUFFIXES,
    read_fingerprints,
    record_fingerprints,
)
from sparkpoint.state.rocksdb import (
    flush_all,
)
from sparkpoint.state.subtask import SWITCHED, SubtaskState

log = logging.getLogger(__name__)


class Snapshotting(SubtaskState):
    """Snapshotting a subtask for checkpoint N (see `RocksDBStateBackend.snapshot`)."""

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
        base, steps = (None, None) if full else self._chain_base()
        try:
            if base is not None:
                handle = self._snapshot_changelog(checkpoint_id, base, names, local, steps)
            else:
                handle = self._snapshot_files(checkpoint_id, full, local)
                self._native_pending.add(checkpoint_id)
        except BaseException:
            shutil.rmtree(local, ignore_errors=True)
            raise
        handle = replace(handle, facts=self.facts(), states=self.declarations or None)
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
        A bad file is rewritten from a task-local copy of the recorded size and CRC32 while the
        base checkpoint is still retained (then the file is damage, and older checkpoints need it
        too); when the base is gone (another writer's retention subsumed it and deleted its files
        rightly) or no copy has it, the base is dropped and this checkpoint uploads the state whole
        under fresh names: rewriting a rightly deleted file would only leave an orphan."""
        from sparkpoint.state.repair import repair_files

        handle = self._base_handle
        if handle is None or not handle.shared:
            return
        problems = stored_size_problems(self.storage, list(handle.shared))
        if not problems:
            return
        if self._base_id is None or not self.storage.exists(metadata_path(self._base_id)):
            log.warning("%s subtask %s: the confirmed checkpoint %s is gone from stable storage; this checkpoint "
                        "uploads the state whole", self.operator, self.subtask, self._base_id)
            self.forget_base()
            return
        files = {f.path: f for f in handle.shared}
        report = repair_files(self.storage, self.dir.parent, [(files[p.path], p.problem) for p in problems])
        if report.unrepairable:
            log.error("%s subtask %s: files of the confirmed checkpoint %s are damaged on stable storage and no "
                      "task-local copy repairs them (%s); this checkpoint uploads the state whole", self.operator,
                      self.subtask, self._base_id, "; ".join(f"{p}: {w}" for p, w in report.unrepairable.items()))
            self.forget_base()

    def _chain_base(self) -> tuple[SubtaskStateHandle | None, staging.Staging | bool | None]:
        """The confirmed handle the next changelog file can extend (None: materialize now), and
        the materialization in steps going on, or True when this checkpoint starts one."""
        base = self._base_handle
        if self._log is None or not self.incremental or base is None or base.private:
            return None, None  # a handle with private files was written without the changelog
        if self._log_base != self._base_id:  # the log does not start at the base
            return None, None
        state, chain_bytes, chain_files = self._chain_figures(base)
        if self.changelog.in_steps:
            steps = staging.Staging.resume(self.dir, base)
            if steps is not None:
                return (None, None) if steps.overdue(chain_bytes, chain_files) else (base, steps)
        if not self.changelog.should_materialize(state, chain_bytes, chain_files):
            return base, None
        if not self.changelog.in_steps or self.changelog.overdue(state, chain_bytes, chain_files):
            return None, None
        return base, True

    def _chain_figures(self, base: SubtaskStateHandle) -> tuple[int, int, int]:
        """(state bytes, chain bytes, chain files) as `ChangelogOptions` weighs them."""
        chain = [f for f in base.shared if changelog.is_changelog(f.local_name)]
        materialized = sum(f.size for f in base.shared if not changelog.is_changelog(f.local_name))
        working = sum(int(f["size"]) for f in self._open_db().live_files())  # flushed: the state now
        return max(materialized, working), sum(f.size for f in chain), len(chain)

    def _snapshot_files(self, checkpoint_id: int, full: bool, local: Path) -> SubtaskStateHandle:
        """RocksDB's own files: a native checkpoint, uploading the SSTs the base lacks."""
        storage_step("write", str(local))  # the task-local copy (hard links)
        Checkpoint(self._open_db()).create_checkpoint(str(local))
        crash_point("after-native-checkpoint")
        staging.drop_all(self.dir)  # this materialization supersedes any in steps
        # After a materialization in steps switched, the base's RocksDB files are another
        # database's: a name alike in the working database is not the same file.
        foreign = (self.dir / SWITCHED).exists()
        base = {} if full or not self.incremental or foreign else self._base
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
        self, checkpoint_id: int, base: SubtaskStateHandle, names: list[str], local: Path,
        steps: staging.Staging | bool | None,
    ) -> SubtaskStateHandle:
        """The base's files plus one changelog file of what changed since the base; with a
        materialization in steps going on, its next slices too, or the switch to it."""
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
        self._staged_now = []
        if steps is True:
            state, chain_bytes, chain_files = self._chain_figures(base)
            staging.Staging.start(self.dir, self._open_db(), checkpoint_id, new[0].path,
                                  chain=(chain_bytes, chain_files), threshold=self.changelog.thresholds(state),
                                  key_groups=(self.key_group_range.start, self.key_group_range.end))
        elif isinstance(steps, staging.Staging):
            switched = self._step(checkpoint_id, base, steps, new[0], local)
            if switched is not None:
                return switched
        if self.local_recovery:
            if self._link_local_copy(base, local):
                record_fingerprints(local, [], self._base_fingerprints())
            else:
                shutil.rmtree(local, ignore_errors=True)  # no task-local copy of the base: restore from storage
        return self._handle(checkpoint_id, list(base.shared) + new, [], list(self._staged_now))

    def _step(
        self, checkpoint_id: int, base: SubtaskStateHandle, steps: staging.Staging, log_file: FileHandle, local: Path
    ) -> SubtaskStateHandle | None:
        """Upload the slices due now; after the last one, the handle that switches to them (else
        None, and `_staged_now` lists the slices so far)."""
        since = [f for f in base.shared if (staging.changelog_id(f.local_name) or 0) > steps.at] + [log_file]
        pace = steps.pace(sum(f.size for f in since), len(since))
        # a small state is cut into at most about 64 slices, a large one into slices of at least the minimum
        minimum = min(self.changelog.slice_min_bytes, steps.total // 64)
        fresh = steps.write_slices(pace, self.options, minimum=minimum)
        prefix = shared_dir(self.operator, self.subtask)
        pairs = [(str(steps.dir / steps.name_of(s)), f"{prefix}/{uuid.uuid4().hex}.sst") for s in fresh]
        try:
            uploads = self.storage.upload(pairs, checkpoint_id)
        except BaseException:
            self._delete_quietly([rel for _, rel in pairs])
            raise
        steps.uploaded(uploads)
        self._staged_now = list(base.staged) + uploads
        if not steps.done:
            return None
        problems = stored_size_problems(self.storage, list(base.staged))
        if problems:
            log.warning("%s subtask %s: slices of the materialization in steps are damaged on stable storage (%s); "
                        "it starts again", self.operator, self.subtask, "; ".join(map(str, problems[:3])))
            steps.drop()
            self._delete_quietly([f.path for f in uploads])
            self._staged_now = []
            return None
        return self._switch(checkpoint_id, steps, since, local)

    def _switch(
        self, checkpoint_id: int, steps: staging.Staging, chain: list[FileHandle], local: Path
    ) -> SubtaskStateHandle | None:
        """The handle of a RocksDB materialization made of the slices, plus the chain after it
        (None when RocksDB will not build it: this checkpoint is a plain changelog one, and the
        next materialization starts again)."""
        try:
            final, ingested = steps.build(self.options)
        except Exception as e:  # rocksdict raises bare Exception; a local failure, nothing stored is touched
            log.warning("%s subtask %s: the materialization in steps of checkpoint %s could not be built (%s); "
                        "it starts again", self.operator, self.subtask, steps.at, e)
            steps.drop()
            return None
        slices = {f.local_name: f for f in self._staged_now}
        materialized = []
        for name, piece in sorted(ingested.items()):
            stored = slices[steps.name_of(piece)]
            materialized.append(FileHandle(name, stored.path, stored.size, stored.crc32, stored.created_by))
        prefix = shared_dir(self.operator, self.subtask)
        small = [(str(final / n), f"{prefix}/{uuid.uuid4().hex}{os.path.splitext(n)[1]}")
                 for n in sorted(os.listdir(final)) if n not in ingested]
        try:
            materialized += self.storage.upload(small, checkpoint_id)
        except BaseException:
            self._delete_quietly([rel for _, rel in small])
            raise
        write_replacing(self.dir / SWITCHED, str(checkpoint_id).encode())
        if self.local_recovery and not self._link_switched_copy(final, chain, local):
            shutil.rmtree(local, ignore_errors=True)
        elif self.local_recovery:
            record_fingerprints(local, list(ingested), {})  # the slices' bytes, checksummed when uploaded
        log.info("%s subtask %s: checkpoint %s switches to the materialization of checkpoint %s (%d slices)",
                 self.operator, self.subtask, checkpoint_id, steps.at, len(ingested))
        self._staged_now = []
        return self._handle(checkpoint_id, materialized + chain, [])

    def _link_switched_copy(self, final: Path, chain: list[FileHandle], local: Path) -> bool:
        previous = self.dir / f"chk-{self._base_id}"
        try:
            for name in os.listdir(final):
                os.link(final / name, local / name)
            for f in chain[:-1]:  # the last is this checkpoint's, written in `local` already
                os.link(previous / f.local_name, local / f.local_name)
        except OSError:
            return False
        return True

    def _base_fingerprints(self) -> dict[str, list[int]]:
        return read_fingerprints(self.dir / f"chk-{self._base_id}") if self._base_id is not None else {}

    def _link_local_copy(self, base: SubtaskStateHandle, local: Path) -> bool:
        """The task-local copy of a changelog checkpoint: the base's copy, linked, plus the new file."""
        previous = self.dir / f"chk-{self._base_id}"
        storage_step("write", str(local))
        try:
            for f in base.files():
                os.link(previous / f.local_name, local / f.local_name)
                crash_point("mid-task-local-copy")
        except OSError:
            return False
        return True

    def _handle(
        self, checkpoint_id: int, shared: list[FileHandle], private: list[FileHandle],
        staged: list[FileHandle] | None = None,
    ) -> SubtaskStateHandle:
        return SubtaskStateHandle(
            operator=self.operator,
            subtask=self.subtask,
            checkpoint_id=checkpoint_id,
            key_group_range=self.key_group_range,
            max_parallelism=self.max_parallelism,
            shared=tuple(sorted(shared, key=lambda f: f.local_name)),
            private=tuple(private),
            staged=tuple(staged or ()),
        )

    def confirm(self, checkpoint_id: int) -> None:
        """Checkpoint N completed: its files become the base of the next incremental snapshot.

        N must be pending here. (Another process learns of N through `restore(N)`, which
        checks its local files against N's handle before taking them as the base.)
        """
        if checkpoint_id in self._pending:
            self._confirm_base(checkpoint_id, self._pending[checkpoint_id])
            if checkpoint_id in self._native_pending:  # the base is the working database's own files again
                (self.dir / SWITCHED).unlink(missing_ok=True)
            self._native_pending = {c for c in self._native_pending if c > checkpoint_id}
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


def take_checkpoint(
    coordinator: CheckpointCoordinator,
    backends: Sequence[Snapshotting],
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
