"""The snapshot strategy of the RocksDB backend: a native checkpoint (or a changelog file), the
files the confirmed base lacks uploaded under fresh names (rules 1 and 2), the base's stable files
checked before they are re-referenced; confirm and abort.

Invariants:

1. Only the last *confirmed* checkpoint's shared files are re-referenced (rule 2); pending
   checkpoints never see each other's uploads.
2. Every upload gets a fresh unique name under `shared/<operator>/<subtask>/` or
   `chk-<N>/<operator>/<subtask>/<attempt>/` (rule 1), so racing attempts never overwrite or
   delete each other's files.
3. With the changelog on (see `changelog`), a checkpoint that only writes a changelog file
   builds on the confirmed base, and only when the changes logged since are exactly the
   changes since that base; anything else materializes. Such handles hold no private files:
   everything a later checkpoint re-references lives under `shared/`.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from sparkpoint.checkpoint.crash import crash_point
from sparkpoint.checkpoint.errors import CheckpointDeclined
from sparkpoint.checkpoint.files import stored_size_problems
from sparkpoint.checkpoint.interleave import storage_step
from sparkpoint.checkpoint.metadata import FileHandle, KeyGroupRange, SubtaskStateHandle, metadata_path
from sparkpoint.checkpoint.paths import private_dir, shared_dir
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.lazy import lazy_module
from sparkpoint.state.engine import changelog, staging
from sparkpoint.state.engine.changelog import ChangeLog, ChangelogOptions
from sparkpoint.state.engine.restore import SHARED_SUFFIXES, read_fingerprints, record_fingerprints
from sparkpoint.state.engine.rocksdb import RocksDBOptions

if TYPE_CHECKING:
    import rocksdict
    from rocksdict import Rdict
else:
    rocksdict = lazy_module("rocksdict")

log = logging.getLogger(__name__)


class SnapshotSource(Protocol):
    """What the snapshotter needs of a subtask's local state (`LocalState`)."""

    operator: str
    subtask: int
    key_group_range: KeyGroupRange
    max_parallelism: int
    dir: Path
    options: RocksDBOptions
    log: ChangeLog | None

    def open_db(self) -> Rdict: ...

    def flush(self) -> list[str]: ...

    def native_checkpoint(self, target: Path) -> None: ...

    def live_bytes(self) -> int: ...

    def oldest_run_bytes(self) -> int: ...

    def compact(self) -> None: ...

    def copy_dir(self, checkpoint_id: int | None) -> Path: ...

    def write_marker(self, checkpoint_id: int, handle: SubtaskStateHandle, job_url: str) -> None: ...

    def drop_local_checkpoints(self, *, keep: set[int]) -> None: ...

    @property
    def switched(self) -> bool: ...

    def mark_switched(self, checkpoint_id: int) -> None: ...

    def unmark_switched(self) -> None: ...


def _as_is(handle: SubtaskStateHandle) -> SubtaskStateHandle:
    return handle


class Snapshotter:
    """Snapshots one subtask's local state for checkpoint N, and keeps its confirmed base: the
    last checkpoint that completed and was confirmed here, whose shared files the next
    snapshot may re-reference."""

    def __init__(self, local: SnapshotSource, storage: CheckpointStorage, *, incremental: bool = True,
                 local_recovery: bool = True, changelog: ChangelogOptions | None = None):
        self.local = local
        self.storage = storage
        self.incremental = incremental
        self.local_recovery = local_recovery
        self.changelog = changelog or ChangelogOptions()
        self._base: dict[str, FileHandle] = {}  # confirmed: local name -> uploaded shared file
        self.base_id: int | None = None
        self._base_handle: SubtaskStateHandle | None = None
        self._pending: dict[int, SubtaskStateHandle] = {}
        self._native_pending: set[int] = set()  # pending snapshots of db/'s own files
        self._staged_now: list[FileHandle] = []  # the slices the snapshot being taken lists
        self.log_base: int | None = None  # the checkpoint the logged changes start from
        self._expired_before: dict[str, int] = {}  # of the snapshot being taken (see `snapshot`)
        # SSTs of the local state that are placeholders (`partial`): never uploaded
        self.placeholders: frozenset[str] = frozenset()
        # What the last materialization in steps wrote ÷ the working database's SSTs it was written
        # from, compacted, per raw byte (`Staging.written_ratio`): the formats differ
        # (`rocksdb.MATERIALIZED_BLOCK_BYTES`), and the chain is weighed against the state as a
        # materialization would write it. 1 until the first.
        self._written_ratio = 1.0

    def rebase(self, checkpoint_id: int, handle: SubtaskStateHandle) -> None:
        """The local state is exactly `handle` of checkpoint N, which completed: N is the base, and
        the changes logged from now on are relative to it."""
        self._base = {f.local_name: f for f in handle.shared}
        self.base_id = checkpoint_id
        self._base_handle = handle

    def forget_base(self) -> None:
        """The confirmed base can no longer be trusted (the coordinator declined a reference to it,
        another writer subsumed it): the next snapshot uploads every file again."""
        self._base, self.base_id, self._base_handle = {}, None, None

    def forget_pending(self) -> None:
        """A restore replaces the local state: no pending snapshot and no logged change count any more."""
        self._pending.clear()
        self.log_base = None

    def snapshot(self, checkpoint_id: int, *, full: bool = False,
                 annotate: Callable[[SubtaskStateHandle], SubtaskStateHandle] = _as_is,
                 expired_before: Mapping[str, int] | None = None) -> SubtaskStateHandle:
        """Take checkpoint N of this subtask and upload what the confirmed base lacks.

        `full` (or `incremental=False`) uploads every file: the baseline, and what the first
        checkpoint after a NO_CLAIM restore does anyway (its base is empty). With the changelog
        on, a checkpoint uploads one changelog file until the chain calls for a materialization.
        `annotate` adds to the handle what the state model knows (facts, declarations) before
        it is recorded as pending; `expired_before` (per state with a TTL, the stamp before
        which its entries are expired now) is what the slices of a materialization leave out.
        """
        self._expired_before = dict(expired_before or {})
        names = self.local.flush()  # db/ on disk must be checkpoint N before the marker says so
        local = self.local.copy_dir(checkpoint_id)
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
        handle = annotate(handle)
        self._pending[checkpoint_id] = handle
        self.local.write_marker(checkpoint_id, handle, self.storage.job_url)
        if self.local.log is not None:
            self.local.log.clear()
            self.log_base = checkpoint_id
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
        from sparkpoint.state.engine.repair import repair_files

        handle = self._base_handle
        if handle is None or not handle.shared:
            return
        problems = stored_size_problems(self.storage, list(handle.shared))
        if not problems:
            return
        if self.base_id is None or not self.storage.exists(metadata_path(self.base_id)):
            log.warning("%s subtask %s: the confirmed checkpoint %s is gone from stable storage; this checkpoint "
                        "uploads the state whole", self.local.operator, self.local.subtask, self.base_id)
            self.forget_base()
            return
        files = {f.path: f for f in handle.shared}
        report = repair_files(self.storage, self.local.dir.parent, [(files[p.path], p.problem) for p in problems])
        if report.unrepairable:
            log.error("%s subtask %s: files of the confirmed checkpoint %s are damaged on stable storage and no "
                      "task-local copy repairs them (%s); this checkpoint uploads the state whole", self.local.operator,
                      self.local.subtask, self.base_id, "; ".join(f"{p}: {w}" for p, w in report.unrepairable.items()))
            self.forget_base()

    def _chain_base(self) -> tuple[SubtaskStateHandle | None, staging.Staging | bool | None]:
        """The confirmed handle the next changelog file can extend (None: materialize now), and
        the materialization in steps going on, or True when this checkpoint starts one."""
        base = self._base_handle
        if self.local.log is None or not self.incremental or base is None or base.private:
            return None, None  # a handle with private files was written without the changelog
        if self.log_base != self.base_id:  # the log does not start at the base
            return None, None
        state, materialized, chain_bytes, chain_files = self._chain_figures(base)
        if self.changelog.in_steps:
            steps = staging.Staging.resume(self.local.dir, base)
            if steps is not None:
                return (None, None) if steps.overdue(chain_bytes, chain_files) else (base, steps)
        calls, compacted = self._calls_for_materialization(state, materialized, chain_bytes, chain_files)
        if not calls:
            return base, None
        if not compacted:  # what a materialization writes comes from db/ compacted: the slices'
            self.local.compact()  # snapshot then reads no overwritten entry, and one at once uploads none
        if not self.changelog.in_steps or self.changelog.overdue(state, materialized, chain_bytes, chain_files):
            return None, None
        return base, True

    def _chain_figures(self, base: SubtaskStateHandle) -> tuple[int, int, int, int]:
        """(state bytes, materialized bytes, chain bytes, chain files) as `ChangelogOptions` weighs
        them: the state's bytes are the working database's SSTs now (flushed), as a materialization
        would write them (`_written_ratio`), and the materialization's are its SSTs (its MANIFEST,
        OPTIONS and CURRENT, a few KB whatever the state, are no excess a materialization would
        remove)."""
        chain = [f for f in base.shared if changelog.is_changelog(f.local_name)]
        materialized = sum(f.size for f in base.shared if f.local_name.endswith(".sst"))
        return self._as_written(self.local.live_bytes()), materialized, sum(f.size for f in chain), len(chain)

    def _as_written(self, working_bytes: int) -> int:
        return round(working_bytes * self._written_ratio)

    def _calls_for_materialization(
        self, state: int, materialized: int, chain_bytes: int, chain_files: int
    ) -> tuple[bool, bool]:
        """Whether the chain calls for a materialization, weighed against the state compacted, and
        whether db/ was compacted to tell. The working database's SSTs overstate the state by the
        entries overwritten since its last full compaction (a quarter and more while one is
        pending), enough to put a materialization off by several checkpoints at 10% churn: when
        only those keep the chain from calling for one (weighed against db/'s oldest run alone,
        it would), db/ is compacted whole and measured again. Locally only: with the changelog on
        no upload depends on its SSTs. That is about once per materialization of a state that is
        overwritten (which then writes the whole state anyway), and for a growing one about as
        often as its own compactions are."""
        calls = self.changelog.should_materialize
        if calls(state, materialized, chain_bytes, chain_files):
            return True, False
        oldest = self._as_written(self.local.oldest_run_bytes())
        if oldest >= state or not calls(oldest, materialized, chain_bytes, chain_files):
            return False, False
        self.local.compact()
        return calls(self._as_written(self.local.live_bytes()), materialized, chain_bytes, chain_files), True

    def _snapshot_files(self, checkpoint_id: int, full: bool, local: Path) -> SubtaskStateHandle:
        """RocksDB's own files: a native checkpoint, uploading the SSTs the base lacks."""
        storage_step("write", str(local))  # the task-local copy (hard links)
        self.local.native_checkpoint(local)
        crash_point("after-native-checkpoint")
        staging.drop_all(self.local.dir)  # this materialization supersedes any in steps
        # After a materialization in steps switched, the base's RocksDB files are another
        # database's: a name alike in the working database is not the same file.
        foreign = self.local.switched
        base = {} if full or not self.incremental or foreign else self._base
        # With the changelog on, later checkpoints re-reference MANIFEST, CURRENT and OPTIONS
        # too: they go to shared/ (never reused by name, their content changes).
        everything_shared = self.local.log is not None
        attempt = uuid.uuid4().hex[:12]
        private_prefix = private_dir(checkpoint_id, self.local.operator, self.local.subtask)
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
                shared_up.append((path, f"{self._shared_dir()}/{uuid.uuid4().hex}{ext}"))
            else:
                private_up.append((path, f"{private_prefix}/{attempt}/{name}"))
        self._refuse_placeholders(shared_up)
        try:
            new_shared = self.storage.upload(shared_up, checkpoint_id)
            private = self.storage.upload(private_up, checkpoint_id)
        except BaseException:
            self._delete_quietly([rel for _, rel in shared_up + private_up])
            raise
        if self.local_recovery:  # uploads were checksummed; reused files keep an earlier record
            record_fingerprints(local, [os.path.basename(p) for p, _ in shared_up], self._base_fingerprints())
        return self._handle(checkpoint_id, reused + new_shared, private)

    def _refuse_placeholders(self, uploads: list[tuple[str, str]]) -> None:
        """No placeholder leaves this machine (`partial`): not one named as such, and no SST that
        does not end as a table does, when the local state holds placeholders."""
        if not self.placeholders:
            return
        from sparkpoint.state.engine.partial import PlaceholderReached, is_table_file

        bad = [p for p, _ in uploads if os.path.basename(p) in self.placeholders
               or (p.endswith(".sst") and not is_table_file(Path(p)))]
        if bad:
            raise PlaceholderReached(
                f"{self.local.operator} subtask {self.local.subtask}: refusing to upload {', '.join(sorted(bad))}: "
                "a placeholder of a partial restore (never read, not the checkpoint's bytes)")

    def _snapshot_changelog(
        self, checkpoint_id: int, base: SubtaskStateHandle, names: list[str], local: Path,
        steps: staging.Staging | bool | None,
    ) -> SubtaskStateHandle:
        """The base's files plus one changelog file of what changed since the base; with a
        materialization in steps going on, its next slices too, or the switch to it."""
        assert self.local.log is not None
        local.mkdir(parents=True)
        log_name = changelog.local_name(checkpoint_id)
        self.local.log.write(local / log_name, names)
        crash_point("after-native-checkpoint")
        rel = f"{self._shared_dir()}/{uuid.uuid4().hex}{changelog.SUFFIX}"
        try:
            new = self.storage.upload([(str(local / log_name), rel)], checkpoint_id)
        except BaseException:
            self._delete_quietly([rel])
            raise
        self._staged_now = []
        if steps is True:
            state, _, chain_bytes, chain_files = self._chain_figures(base)
            kg_range = self.local.key_group_range
            staging.Staging.start(self.local.dir, self.local.open_db(), checkpoint_id, new[0].path,
                                  chain=(chain_bytes, chain_files), threshold=self.changelog.thresholds(state),
                                  key_groups=(kg_range.start, kg_range.end))
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
        fresh = steps.write_slices(pace, self.local.options, minimum=minimum, expired_before=self._expired_before)
        prefix = self._shared_dir()
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
                        "it starts again", self.local.operator, self.local.subtask, "; ".join(map(str, problems[:3])))
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
            final, ingested = steps.build(self.local.options)
        except Exception as e:  # rocksdict raises bare Exception; a local failure, nothing stored is touched
            log.warning("%s subtask %s: the materialization in steps of checkpoint %s could not be built (%s); "
                        "it starts again", self.local.operator, self.local.subtask, steps.at, e)
            steps.drop()
            return None
        slices = {f.local_name: f for f in self._staged_now}
        materialized = []
        for name, piece in sorted(ingested.items()):
            stored = slices[steps.name_of(piece)]
            materialized.append(FileHandle(name, stored.path, stored.size, stored.crc32, stored.created_by))
        prefix = self._shared_dir()
        small = [(str(final / n), f"{prefix}/{uuid.uuid4().hex}{os.path.splitext(n)[1]}")
                 for n in sorted(os.listdir(final)) if n not in ingested]
        try:
            materialized += self.storage.upload(small, checkpoint_id)
        except BaseException:
            self._delete_quietly([rel for _, rel in small])
            raise
        self.local.mark_switched(checkpoint_id)
        measured = steps.written_ratio()
        if measured is not None:
            self._written_ratio = min(1.0, measured)
        if self.local_recovery and not self._link_switched_copy(final, chain, local):
            shutil.rmtree(local, ignore_errors=True)
        elif self.local_recovery:
            record_fingerprints(local, list(ingested), {})  # the slices' bytes, checksummed when uploaded
        log.info("%s subtask %s: checkpoint %s switches to the materialization of checkpoint %s (%d slices)",
                 self.local.operator, self.local.subtask, checkpoint_id, steps.at, len(ingested))
        self._staged_now = []
        return self._handle(checkpoint_id, materialized + chain, [])

    def _link_switched_copy(self, final: Path, chain: list[FileHandle], local: Path) -> bool:
        previous = self.local.copy_dir(self.base_id)
        try:
            for name in os.listdir(final):
                os.link(final / name, local / name)
            for f in chain[:-1]:  # the last is this checkpoint's, written in `local` already
                os.link(previous / f.local_name, local / f.local_name)
        except OSError:
            return False
        return True

    def _base_fingerprints(self) -> dict[str, list[int]]:
        return read_fingerprints(self.local.copy_dir(self.base_id)) if self.base_id is not None else {}

    def _link_local_copy(self, base: SubtaskStateHandle, local: Path) -> bool:
        """The task-local copy of a changelog checkpoint: the base's copy, linked, plus the new file."""
        previous = self.local.copy_dir(self.base_id)
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
            operator=self.local.operator,
            subtask=self.local.subtask,
            checkpoint_id=checkpoint_id,
            key_group_range=self.local.key_group_range,
            max_parallelism=self.local.max_parallelism,
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
            self.rebase(checkpoint_id, self._pending[checkpoint_id])
            if checkpoint_id in self._native_pending:  # the base is the working database's own files again
                self.local.unmark_switched()
            self._native_pending = {c for c in self._native_pending if c > checkpoint_id}
        elif checkpoint_id != self.base_id:
            raise CheckpointDeclined(f"{self.local}: checkpoint {checkpoint_id} is not pending here, cannot confirm it")
        self._pending = {k: v for k, v in self._pending.items() if k > checkpoint_id}
        keep = set(self._pending) | ({checkpoint_id} if self.local_recovery else set())
        self.local.drop_local_checkpoints(keep=keep)

    def abort(self, checkpoint_id: int) -> None:
        """Checkpoint N will never complete: forget it (the coordinator deletes its uploads)."""
        self._pending.pop(checkpoint_id, None)
        if self.log_base == checkpoint_id:  # the changes logged since are relative to nothing retained
            self.log_base = None
        if checkpoint_id != self.base_id:
            shutil.rmtree(self.local.copy_dir(checkpoint_id), ignore_errors=True)


    def _shared_dir(self) -> str:
        """Where this subtask's shared files go on stable storage (each under a fresh name)."""
        return shared_dir(self.local.operator, self.local.subtask)

    def _delete_quietly(self, rels: list[str]) -> None:
        try:
            self.storage.delete(rels)
        except Exception as e:  # best effort: the orphan sweep gets what is left
            log.warning("could not delete the uploads of a failed snapshot: %s", e)
