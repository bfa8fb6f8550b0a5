"""Random checkpoint histories on real storage keep the registry, storage and retention consistent.

A Hypothesis state machine drives trigger / acknowledge / complete / abort / compaction / restart /
orphan sweep against `CheckpointCoordinator`, with one operator of two fake subtasks that upload
real local files under Flink's reuse rule. A second coordinator on the same job directory (a
zombie driver, a retried run) resumes from whatever checkpoint was latest when it started and
completes checkpoints of its own in between, with a base that the first one may have subsumed.
After every step it checks the invariants stated in sparkpoint/checkpoint/registry.py and
coordinator.py against what storage holds, and compares the coordinators with a model made of
plain sets and dicts.
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.errors import CheckpointDeclined, UnknownSharedState
from sparkpoint.checkpoint.metadata import CheckpointMetadata, SubtaskStateHandle, metadata_path
from sparkpoint.checkpoint.storage import CheckpointStorage, crc32_of_file
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.checkpoint.sweep import sweep_orphans
from tests.support.helpers import FakeSubtask

OPERATOR = "op"
PARALLELISM = 2
LOCAL_NAMES = ("000007.sst", "000008.sst", "000009.sst", "000010.sst", "000011.sst")
MAX_PENDING = 3

KINDS = st.sampled_from(["checkpoint"] * 5 + ["savepoint"])  # savepoints pile up: they are never subsumed
NOTIFIED = st.sampled_from([True, True, True, False])
HISTORY_SETTINGS = settings(max_examples=100, stateful_step_count=30, deadline=None)


@dataclass
class PendingModel:
    """A triggered checkpoint: its kind and the handle each subtask acknowledged."""

    kind: str
    handles: dict[int, SubtaskStateHandle] = field(default_factory=dict)
    # per subtask, the local names that become its base once this checkpoint is confirmed
    base_names: dict[int, set[str]] = field(default_factory=dict)

    def paths(self) -> set[str]:
        return {f.path for h in self.handles.values() for f in h.files()}

    def new_paths(self) -> set[str]:
        return {f.path for h in self.handles.values() for f in h.new_files()}

    def reused_paths(self) -> set[str]:
        return self.paths() - self.new_paths()


@dataclass
class BaseModel:
    """What one subtask may re-reference: the local names of its last confirmed checkpoint."""

    checkpoint_id: int | None = None
    names: set[str] = field(default_factory=set)
    highest_confirmed: int = 0  # notifications older than this are ignored, as in Flink


class CheckpointHistory(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.workdir = Path(tempfile.mkdtemp(prefix="sparkpoint-stateful-"))
        self.storage = self.make_storage()
        self.store = CompletedCheckpointStore(self.storage)
        self.num_retained = 1
        self.coord = CheckpointCoordinator(self.storage, num_retained=self.num_retained)
        self.subtasks = [
            FakeSubtask(self.storage, self.workdir / f"sub-{i}", OPERATOR, i, PARALLELISM) for i in range(PARALLELISM)
        ]
        self.version = 0
        for sub in self.subtasks:
            for name in LOCAL_NAMES:
                self._write(sub, name)
        # the model
        self.retained: dict[int, set[str]] = {}  # checkpoint id -> every path it references, _metadata included
        self.kinds: dict[int, str] = {}  # kind of every retained checkpoint
        self.completed: dict[int, str] = {}  # kind of every checkpoint that ever completed
        self.pending: dict[int, PendingModel] = {}
        self.orphans: set[str] = set()  # uploads of pending checkpoints lost in a restart
        self.verified: set[str] = set()  # stored files whose bytes matched their _metadata once
        self.bases = [BaseModel() for _ in range(PARALLELISM)]
        self.triggered_since_restart = False  # restarting twice in a row tells nothing new
        self.stored_since_sweep = False  # nor does sweeping twice in a row
        self._last_triggered = 0
        # the second writer: its coordinator, subtasks, and the last id it used
        self.other: CheckpointCoordinator | None = None
        self.other_subtasks: list[FakeSubtask] = []
        self.other_generation = 0
        self.other_last = 0
        self.acted_since_other_started = True
        self.registry_owner = self.coord  # the coordinator that last synced with storage

    def make_storage(self) -> CheckpointStorage:
        return CheckpointStorage(f"memory://stateful-{uuid.uuid4().hex}", "job")

    def teardown(self) -> None:
        if self.storage.job_dir_exists():
            self.storage.fs.rm(self.storage.root, recursive=True)
        shutil.rmtree(self.workdir, ignore_errors=True)

    # --- helpers -------------------------------------------------------------------------------

    def _write(self, sub: FakeSubtask, name: str) -> None:
        self.version += 1
        sub.write(name, f"{name} of subtask {sub.subtask}, version {self.version}\n".encode() * 4)

    def _pick(self, data: st.DataObject, ids: list[int]) -> int:
        return data.draw(st.sampled_from(sorted(ids)), label="checkpoint")

    def _unacknowledged(self, checkpoint_id: int) -> list[int]:
        return [i for i in range(PARALLELISM) if i not in self.pending[checkpoint_id].handles]

    def _acknowledgeable(self) -> list[int]:
        return [cid for cid in self.pending if self._unacknowledged(cid)]

    def _retained_paths(self) -> set[str]:
        return set().union(*self.retained.values())

    def _pending_paths(self) -> set[str]:
        return set().union(*(p.paths() for p in self.pending.values()))

    def _pending_new_paths(self) -> set[str]:
        return set().union(*(p.new_paths() for p in self.pending.values()))

    def _stored_paths(self) -> set[str]:
        """Every file in the job directory, wherever it is."""
        found = self.storage.fs.find(self.storage.root) if self.storage.job_dir_exists() else []
        return {self.storage.relpath(p) for p in found}

    def _listing(self) -> list[CheckpointMetadata]:
        listing = self.store.load_all()
        assert not listing.unreadable, f"unreadable _metadata: {listing.unreadable}"
        return listing.checkpoints

    def _forget(self, checkpoint_id: int) -> None:
        self.pending.pop(checkpoint_id)
        for sub in self.subtasks:
            sub.abort(checkpoint_id)

    def _apply_retention(self) -> list[int]:
        """The model's retention: keep the newest `num_retained` checkpoints and every savepoint."""
        checkpoints = sorted(cid for cid, kind in self.kinds.items() if kind == "checkpoint")
        doomed = checkpoints[: max(0, len(checkpoints) - self.num_retained)]
        for cid in doomed:
            del self.retained[cid]
            del self.kinds[cid]
        return doomed

    def _restore(self, index: int, meta: CheckpointMetadata | None) -> None:
        """A restarted subtask restores the latest completed checkpoint; its files become the base."""
        sub, base = self.subtasks[index], self.bases[index]
        _restore_into(self.storage, sub, meta)
        if meta is None:
            self.bases[index] = BaseModel()
            return
        base.checkpoint_id = meta.checkpoint_id
        base.names = set(sub.confirmed)
        base.highest_confirmed = meta.checkpoint_id

    # --- rules ---------------------------------------------------------------------------------

    @initialize(num_retained=st.integers(min_value=1, max_value=3))
    def start(self, num_retained: int) -> None:
        self.num_retained = num_retained
        self.coord = self.registry_owner = CheckpointCoordinator(self.storage, num_retained=num_retained)

    @precondition(lambda self: len(self.pending) < MAX_PENDING)
    @rule(kind=KINDS)
    def trigger(self, kind: str) -> None:
        cid = self._last_triggered = self.coord.trigger(kind=kind, expected={OPERATOR: PARALLELISM}).checkpoint_id
        assert cid not in self.pending
        assert cid > max(self.completed, default=0), f"checkpoint id {cid} reuses the id of a completed checkpoint"
        self.pending[cid] = PendingModel(kind)
        self.triggered_since_restart = True
        self.acted_since_other_started = True

    @precondition(lambda self: bool(self._acknowledgeable()))
    @rule(data=st.data())
    def acknowledge(self, data: st.DataObject) -> None:
        cid = self._pick(data, self._acknowledgeable())
        index = data.draw(st.sampled_from(self._unacknowledged(cid)), label="subtask")
        self._snapshot_and_acknowledge(data, cid, index)

    def _snapshot_and_acknowledge(self, data: st.DataObject, cid: int, index: int) -> None:
        pending = self.pending[cid]
        names = sorted(data.draw(st.sets(st.sampled_from(LOCAL_NAMES)), label=f"local names of subtask {index}"))
        sub = self.subtasks[index]
        handle = sub.snapshot(cid, names)
        reused = {f.local_name for f in handle.shared if f.created_by != cid}
        assert reused == set(names) & self.bases[index].names, "only files of the confirmed base are reused"
        for f in handle.shared:
            assert f.crc32 == crc32_of_file(str(sub.workdir / f.local_name)), f"{f.local_name} is stale in the handle"
        self.coord.acknowledge(cid, handle)
        pending.handles[index] = handle
        pending.base_names[index] = {f.local_name for f in handle.shared}
        self.stored_since_sweep = True

    @rule(data=st.data(), kind=KINDS, notified=NOTIFIED)
    def run_checkpoint(self, data: st.DataObject, kind: str, notified: bool) -> None:
        """Trigger, acknowledge and complete one checkpoint in a row, as a quiet pipeline does."""
        self.trigger(kind)
        self._complete(data, self._last_triggered, notified)

    @precondition(lambda self: bool(self.pending))
    @rule(data=st.data(), notified=NOTIFIED)
    def complete(self, data: st.DataObject, notified: bool) -> None:
        """The subtasks that have not acknowledged yet do so, then the coordinator completes.

        `notified=False`: the completion notification to the subtasks is lost (it is best effort).
        """
        self._complete(data, self._pick(data, list(self.pending)), notified)

    def _complete(self, data: st.DataObject, cid: int, notified: bool) -> None:
        pending = self.pending[cid]
        for index in self._unacknowledged(cid):
            self._snapshot_and_acknowledge(data, cid, index)
        expected = self._expected_decline(cid)
        self.registry_owner = self.coord  # complete rebuilds from storage when another writer acted
        try:
            done = self.coord.complete(cid, source_offsets={"batch": cid})
        except (CheckpointDeclined, UnknownSharedState) as e:
            assert expected is not None, f"checkpoint {cid} declined, the model expected it to complete: {e}"
            assert isinstance(e, expected[0]) and expected[1] in str(e), f"expected {expected}, got {e!r}"
            event(f"complete declined: {expected[1]}")
            self._forget(cid)
            if isinstance(e, UnknownSharedState):
                # "The subtask must re-upload it": a subtask whose base is gone starts from a full upload.
                for sub, base in zip(self.subtasks, self.bases):
                    if base.checkpoint_id not in self.retained:
                        sub.confirmed = {}
                        base.checkpoint_id, base.names = None, set()
            return
        assert expected is None, f"checkpoint {cid} completed, the model expected a decline: {expected}"
        self.pending.pop(cid)
        if pending.kind == "checkpoint":  # it subsumes the older pending checkpoints, as in Flink
            for older in [c for c, p in self.pending.items() if c < cid and p.kind == "checkpoint"]:
                self._forget(older)
        self.retained[cid] = pending.paths() | {metadata_path(cid)}
        self.kinds[cid] = self.completed[cid] = pending.kind
        freed_before = self._retained_paths()
        subsumed = self._apply_retention()
        freed = freed_before - self._retained_paths() - {metadata_path(s) for s in subsumed}
        assert cid in self.retained, "a checkpoint is never subsumed by its own completion"
        assert sorted(done.subsumed) == subsumed
        assert done.files_deleted == len(freed)
        assert done.files_new == len(pending.new_paths())
        assert done.files_reused == len(pending.reused_paths())
        event("complete" + ("" if notified else " (not notified)"))
        if not notified:
            return
        for index, (sub, base) in enumerate(zip(self.subtasks, self.bases)):
            if cid > base.highest_confirmed:
                sub.confirm(cid)
                base.checkpoint_id = base.highest_confirmed = cid
                base.names = set(pending.base_names[index])

    def _expected_decline(self, cid: int) -> tuple[type[Exception], str] | None:
        """Why the model expects `complete(cid)` to fail (exception, words of its message), or None."""
        pending = self.pending[cid]
        if pending.kind == "checkpoint" and any(done > cid for done in self.retained):
            return CheckpointDeclined, "is subsumed"
        if self._unacknowledged(cid):
            return CheckpointDeclined, "lacks acknowledgements"
        if any(f.created_by > cid for h in pending.handles.values() for f in h.files()):
            # a subtask confirmed a newer checkpoint before snapshotting this one and reused its files
            return CheckpointDeclined, "created by the later checkpoint"
        if pending.reused_paths() - self._retained_paths():
            return UnknownSharedState, "re-upload"
        return None

    @precondition(lambda self: bool(self.pending))
    @rule(data=st.data(), early_completion=st.booleans())
    def decline(self, data: st.DataObject, early_completion: bool) -> None:
        """A subtask declines (abort), or the checkpoint is completed before every acknowledgement."""
        cid = self._pick(data, list(self.pending))
        expected = self._expected_decline(cid)
        if early_completion and self._unacknowledged(cid):
            assert expected is not None
            self.registry_owner = self.coord
            with pytest.raises(expected[0], match=expected[1]):
                self.coord.complete(cid)
            event("declined: completed before every acknowledgement")
        else:
            self.coord.abort(cid, reason="declined by a subtask")
            event("declined: aborted")
        self._forget(cid)

    @precondition(lambda self: any(base.names for base in self.bases))
    @rule(index=st.integers(min_value=0, max_value=PARALLELISM - 1), name=st.sampled_from(LOCAL_NAMES))
    def compact(self, index: int, name: str) -> None:
        """The same local name reappears with other bytes (as after a restore): a new file, never the base's."""
        sub = self.subtasks[index]
        self._write(sub, name)
        sub.confirmed.pop(name, None)
        for future_base in sub.pending.values():
            future_base.pop(name, None)
        self.bases[index].names.discard(name)
        for pending in self.pending.values():
            pending.base_names.get(index, set()).discard(name)

    @precondition(lambda self: self.triggered_since_restart)
    @rule(graceful=st.booleans())
    def restart(self, graceful: bool) -> None:
        """A new coordinator on the same storage.

        Graceful: the old one shuts down and aborts its pending checkpoints. Otherwise it crashed:
        their uploads are left behind for the sweep.
        """
        if graceful:
            assert self.coord.shutdown("SUSPENDED") == [], "a suspended job keeps its retained checkpoints"
        else:
            for pending in self.pending.values():
                self.orphans |= pending.new_paths()
        for cid in list(self.pending):
            self._forget(cid)
        self.triggered_since_restart = False
        self.stored_since_sweep = True
        self.coord = self.registry_owner = CheckpointCoordinator(self.storage, num_retained=self.num_retained)
        latest = self.store.latest()
        assert (latest.checkpoint_id if latest else None) == max(self.retained, default=None)
        for index in range(PARALLELISM):
            self._restore(index, latest)

    @precondition(lambda self: self.acted_since_other_started)
    @rule(data=st.data())
    def start_other_writer(self, data: st.DataObject) -> None:
        """A second coordinator starts on the same job directory from any retained checkpoint
        (a zombie driver that resumed from an older one)."""
        self.other_generation += 1
        self.other = self.registry_owner = CheckpointCoordinator(self.storage, num_retained=self.num_retained)
        retained = self._listing()
        latest = data.draw(st.sampled_from(retained), label="other writer resumes from") if retained else None
        self.other_subtasks = []
        for i in range(PARALLELISM):
            sub = FakeSubtask(self.storage, self.workdir / f"other-{self.other_generation}-{i}", OPERATOR, i,
                              PARALLELISM)
            _restore_into(self.storage, sub, latest)
            for name in LOCAL_NAMES:
                if not (sub.workdir / name).exists():
                    self._write(sub, name)
            self.other_subtasks.append(sub)
        self.acted_since_other_started = False

    @precondition(lambda self: self.other is not None)
    @rule(data=st.data(), kind=KINDS)
    def other_writer_checkpoint(self, data: st.DataObject, kind: str) -> None:
        """The second coordinator triggers, snapshots and completes one checkpoint in a row.

        Its subtasks reuse their own base, which the first coordinator may have subsumed since:
        then the completion must be declined (the registry is checked against storage), and
        nothing of the first coordinator's retained checkpoints may be lost.
        """
        assert self.other is not None
        cid = max([self._last_triggered, *self.completed, *self.pending, self.other_last]) + 1
        self.other_last = cid
        model = PendingModel(kind)
        for index, sub in enumerate(self.other_subtasks):
            names = sorted(data.draw(st.sets(st.sampled_from(LOCAL_NAMES)), label=f"other writer, subtask {index}"))
            model.handles[index] = sub.snapshot(cid, names)
        self.other.trigger(kind=kind, expected={OPERATOR: PARALLELISM}, checkpoint_id=cid)
        for handle in model.handles.values():
            self.other.acknowledge(cid, handle)
        self.registry_owner = self.other
        self.acted_since_other_started = True
        self.stored_since_sweep = True
        gone = model.reused_paths() - self._retained_paths()
        try:
            done = self.other.complete(cid, source_offsets={"batch": cid, "writer": "other"})
        except UnknownSharedState:
            assert gone, f"the second writer's checkpoint {cid} was declined, the model expected it to complete"
            event("other writer declined: its base was subsumed")
            for sub in self.other_subtasks:
                sub.abort(cid)
                sub.confirmed = {}
            return
        assert not gone, f"checkpoint {cid} reuses {sorted(gone)}, which no retained checkpoint holds"
        self.retained[cid] = model.paths() | {metadata_path(cid)}
        self.kinds[cid] = self.completed[cid] = kind
        assert sorted(done.subsumed) == self._apply_retention()
        event("other writer completed")
        for sub in self.other_subtasks:
            sub.confirm(cid)

    @precondition(lambda self: self.stored_since_sweep)
    @rule(dry_run_first=st.booleans())
    def sweep(self, dry_run_first: bool) -> None:
        pending_paths = self._pending_paths()
        if dry_run_first:
            before = self._stored_paths()
            dry = sweep_orphans(self.storage, grace_seconds=0, dry_run=True, pending_paths=pending_paths)
            assert {f.path for f in dry.orphans} == self.orphans, "the dry run lists exactly the lost uploads"
            assert self._stored_paths() == before, "a dry run deletes nothing"
        report = sweep_orphans(self.storage, grace_seconds=0, pending_paths=pending_paths)
        assert {f.path for f in report.orphans} == self.orphans, "the sweep deletes exactly the lost uploads"
        event(f"sweep deleted {'some' if self.orphans else 'no'} orphans")
        self.orphans.clear()
        self.stored_since_sweep = False
        stored = self._stored_paths()
        unreferenced = stored - self._retained_paths() - pending_paths
        assert not unreferenced, f"unreferenced files survive the sweep: {sorted(unreferenced)}"
        assert self._pending_new_paths() <= stored, "the sweep deleted a pending checkpoint's upload"

    # --- invariants ----------------------------------------------------------------------------

    @invariant()
    def storage_registry_and_retention_agree_with_the_model(self) -> None:
        listing = self._listing()  # read storage once per step: parsing every _metadata is what costs
        stored = self._stored_paths()
        self._check_retained_and_pending_checkpoints_are_the_models(listing)
        self._check_every_file_of_a_retained_checkpoint_is_stored_with_its_recorded_content(listing, stored)
        self._check_registry_counts_equal_a_recount_of_retained_metadata(listing)
        self._check_storage_holds_exactly_retained_pending_and_lost_uploads(stored)
        self._check_retention_keeps_num_retained_checkpoints_the_latest_and_every_savepoint(listing)

    def _check_retained_and_pending_checkpoints_are_the_models(self, listing: list[CheckpointMetadata]) -> None:
        assert sorted(m.checkpoint_id for m in listing) == sorted(self.retained), "retained checkpoint ids"
        for meta in listing:
            assert meta.paths() | {meta.metadata_path} == self.retained[meta.checkpoint_id], meta.metadata_path
            assert meta.kind == self.kinds[meta.checkpoint_id], meta.metadata_path
        assert sorted(self.coord.pending) == sorted(self.pending), "pending checkpoint ids"

    def _check_every_file_of_a_retained_checkpoint_is_stored_with_its_recorded_content(
        self, listing: list[CheckpointMetadata], stored: set[str]
    ) -> None:
        for meta in listing:
            for f in meta.files():
                assert f.path in stored, f"chk-{meta.checkpoint_id} lists {f.path}, which is gone"
                if f.path in self.verified:  # stored files are never rewritten: every upload has a fresh name
                    continue
                data = self.storage.read_bytes(f.path)
                assert (len(data), zlib.crc32(data)) == (f.size, f.crc32), f"{f.path} differs from its _metadata"
                self.verified.add(f.path)

    def _check_registry_counts_equal_a_recount_of_retained_metadata(self, listing: list[CheckpointMetadata]) -> None:
        expected: Counter[str] = Counter()
        for meta in listing:
            expected.update(meta.paths() | {meta.metadata_path})
        registry = self.registry_owner.registry
        assert registry.paths() == set(expected), "the registry knows exactly the paths of retained checkpoints"
        assert {p: registry.count(p) for p in expected} == dict(expected), "registry counts differ from a recount"
        assert registry.checkpoint_ids() == sorted(m.checkpoint_id for m in listing), "registered checkpoint ids"
        assert not registry.deletion_blocked, registry.blocked_reasons

    def _check_storage_holds_exactly_retained_pending_and_lost_uploads(self, stored: set[str]) -> None:
        expected = self._retained_paths() | self._pending_new_paths() | self.orphans
        assert not expected - stored, f"missing from storage: {sorted(expected - stored)}"
        assert not stored - expected, f"left in storage: {sorted(stored - expected)}"

    def _check_retention_keeps_num_retained_checkpoints_the_latest_and_every_savepoint(
        self, listing: list[CheckpointMetadata]
    ) -> None:
        kinds = {m.checkpoint_id: m.kind for m in listing}
        assert sum(1 for kind in kinds.values() if kind == "checkpoint") <= self.num_retained
        completed_checkpoints = [cid for cid, kind in self.completed.items() if kind == "checkpoint"]
        if completed_checkpoints:
            assert max(completed_checkpoints) in kinds, "the latest completed checkpoint was subsumed"
        savepoints = {cid for cid, kind in self.completed.items() if kind == "savepoint"}
        assert savepoints <= set(kinds), "a savepoint was deleted"

    @invariant()
    def subtasks_reuse_only_their_confirmed_base(self) -> None:
        for sub, base in zip(self.subtasks, self.bases):
            assert set(sub.confirmed) == base.names, f"base of subtask {sub.subtask}"
            if base.checkpoint_id in self.retained:
                base_paths = {f.path for f in sub.confirmed.values()}
                assert base_paths <= self.retained[base.checkpoint_id], f"base of subtask {sub.subtask}"
                unknown = {p for p in base_paths if not self.registry_owner.registry.is_known(p)}
                assert not unknown, f"subtask {sub.subtask} may reuse files the registry does not know: {unknown}"


def _restore_into(storage: CheckpointStorage, sub: FakeSubtask, meta: CheckpointMetadata | None) -> None:
    """Download subtask `sub`'s shared files of `meta` into its directory; they become its base."""
    sub.pending.clear()
    if meta is None:
        sub.confirmed = {}
        return
    handle = next(h for h in meta.subtask_handles() if h.subtask == sub.subtask)
    storage.get_files([(f.path, str(sub.workdir / f.local_name)) for f in handle.shared])
    sub.confirmed = {f.local_name: f for f in handle.shared}


class CheckpointHistoryOnLocalFiles(CheckpointHistory):
    """The same histories on `file://`: atomic link commit and empty-directory removal are local-only."""

    def make_storage(self) -> CheckpointStorage:
        return CheckpointStorage(f"file://{self.workdir}/checkpoints", "job")


# unittest-style so that `pytest --hypothesis-show-statistics` shows how often each outcome happened
# make test draws a sample of histories on each storage; make soak draws four times as many.
class TestRandomHistoriesKeepRegistryStorageAndRetentionConsistentOnMemoryStorage(CheckpointHistory.TestCase):
    settings = settings(HISTORY_SETTINGS, max_examples=25)


class TestRandomHistoriesKeepRegistryStorageAndRetentionConsistentOnLocalFiles(CheckpointHistoryOnLocalFiles.TestCase):
    settings = settings(HISTORY_SETTINGS, max_examples=8)


@pytest.mark.soak
class TestManyRandomHistoriesOnMemoryStorage(CheckpointHistory.TestCase):
    settings = HISTORY_SETTINGS


@pytest.mark.soak
class TestManyRandomHistoriesOnLocalFiles(CheckpointHistoryOnLocalFiles.TestCase):
    settings = settings(HISTORY_SETTINGS, max_examples=30)


@pytest.mark.parametrize("older_kind", ["checkpoint", "savepoint"])
def test_older_checkpoint_reusing_a_newer_ones_file_is_declined_not_committed_unreadable(
    storage: CheckpointStorage, tmp_path: Path, older_kind: str
) -> None:
    """Found by the state machine: `_metadata` listing a file created by a later checkpoint does not load.

    Committing it made the checkpoint unreadable, which blocks every deletion and the orphan sweep.
    """
    coord = CheckpointCoordinator(storage, num_retained=2)
    sub = FakeSubtask(storage, tmp_path / "db")
    sub.write("000007.sst")
    older = coord.trigger(kind=older_kind, expected={OPERATOR: 1}).checkpoint_id
    newer = coord.trigger(expected={OPERATOR: 1}).checkpoint_id
    coord.acknowledge(newer, sub.snapshot(newer, ["000007.sst"]))
    coord.complete(newer)
    sub.confirm(newer)
    # the older snapshot re-references the confirmed base: a file created by `newer`
    with pytest.raises(CheckpointDeclined):
        coord.acknowledge(older, sub.snapshot(older, ["000007.sst"]))
        coord.complete(older)
    assert not storage.exists(metadata_path(older))
    assert CompletedCheckpointStore(storage).load_all().unreadable == {}
    assert not CheckpointCoordinator(storage, num_retained=2).registry.deletion_blocked
    assert sweep_orphans(storage, grace_seconds=0).deleted
    assert CompletedCheckpointStore(storage).checkpoint_ids() == [newer]
