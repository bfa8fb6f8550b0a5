"""The checkpoint protocol on real storage: counts, deletion, aborts, races, claim modes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.errors import CheckpointAlreadyExists, CheckpointDeclined, UnknownSharedState
from sparkpoint.checkpoint.metadata import RestoreLineage, metadata_path
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.checkpoint.sweep import sweep_orphans
from sparkpoint.state.engine.verify import verify_checkpoint
from tests.support.helpers import FakeSubtask


def shared_counts(coord: CheckpointCoordinator, sub: FakeSubtask, names: list[str]) -> dict[str, int]:
    paths = {}
    for handles in [sub.confirmed, *sub.pending.values()]:
        for name, f in handles.items():
            paths.setdefault(name, f.path)
    return {n: coord.registry.count(paths[n]) for n in names if n in paths}


def run_checkpoint(coord: CheckpointCoordinator, sub: FakeSubtask, names: list[str]):
    pending = coord.trigger(expected={sub.operator: 1})
    coord.acknowledge(pending.checkpoint_id, sub.snapshot(pending.checkpoint_id, names))
    done = coord.complete(pending.checkpoint_id, source_offsets={"files": pending.checkpoint_id})
    sub.confirm(pending.checkpoint_id)
    return done


def test_blog_example_four_checkpoints_with_two_retained(storage: CheckpointStorage, tmp_path: Path):
    coord = CheckpointCoordinator(storage, num_retained=2)
    sub = FakeSubtask(storage, tmp_path / "db")
    for name in ["s1", "s2", "s3", "s4", "s5", "s123", "s456"]:
        sub.write(name)
    paths: dict[str, str] = {}

    def remember() -> None:
        for name, f in sub.confirmed.items():
            paths.setdefault(name, f.path)

    run_checkpoint(coord, sub, ["s1", "s2"])
    remember()
    assert {n: coord.registry.count(paths[n]) for n in ["s1", "s2"]} == {"s1": 1, "s2": 1}

    run_checkpoint(coord, sub, ["s1", "s2", "s3", "s4"])
    remember()
    assert {n: coord.registry.count(paths[n]) for n in paths} == {"s1": 2, "s2": 2, "s3": 1, "s4": 1}

    done3 = run_checkpoint(coord, sub, ["s123", "s4", "s5"])
    remember()
    assert done3.subsumed == (1,)
    assert {n: coord.registry.count(paths[n]) for n in paths} == {
        "s1": 1, "s2": 1, "s3": 1, "s4": 2, "s5": 1, "s123": 1,
    }
    assert all(storage.exists(p) for p in paths.values()), "nothing is physically deleted at checkpoint 3"
    assert not storage.exists(metadata_path(1))

    done4 = run_checkpoint(coord, sub, ["s123", "s456"])
    remember()
    assert done4.subsumed == (2,)
    assert {n: coord.registry.count(paths[n]) for n in paths} == {
        "s1": 0, "s2": 0, "s3": 0, "s4": 1, "s5": 1, "s123": 2, "s456": 1,
    }
    for gone in ["s1", "s2", "s3"]:
        assert not storage.exists(paths[gone]), f"{gone} must be deleted at checkpoint 4"
    for kept in ["s4", "s5", "s123", "s456"]:
        assert storage.exists(paths[kept]), f"{kept} must remain"
    assert CompletedCheckpointStore(storage).checkpoint_ids() == [4, 3]


def test_metadata_records_sizes_crc_and_stats(storage: CheckpointStorage, tmp_path: Path):
    coord = CheckpointCoordinator(storage, num_retained=3)
    sub = FakeSubtask(storage, tmp_path / "db")
    sub.write("a", b"x" * 100)
    sub.write("b", b"y" * 50)
    first = run_checkpoint(coord, sub, ["a"])
    second = run_checkpoint(coord, sub, ["a", "b"])
    raw = json.loads(storage.read_bytes(metadata_path(2)))
    assert raw["job_id"] == storage.job_id and raw["checkpoint_id"] == 2 and raw["kind"] == "checkpoint"
    assert raw["source_offsets"] == {"files": 2}
    entry = raw["operators"]["op"]["subtasks"][0]
    assert entry["subtask"] == 0
    assert {f["local_name"] for f in entry["shared"]} == {"a", "b"}
    assert all(0 <= f["crc32"] <= 0xFFFFFFFF for f in entry["shared"] + entry["private"])
    manifest_size = first.metadata.stats.state_size - 100
    assert raw["stats"]["state_size"] == 150 + manifest_size
    assert raw["stats"]["checkpointed_size"] == 50 + manifest_size
    assert second.files_new == 2 and second.files_reused == 1


def test_declined_checkpoint_keeps_reused_file_until_next_completes(storage: CheckpointStorage, tmp_path: Path):
    coord = CheckpointCoordinator(storage, num_retained=1)
    sub = FakeSubtask(storage, tmp_path / "db")
    sub.write("base")
    sub.write("extra")
    run_checkpoint(coord, sub, ["base"])
    base_path = sub.confirmed["base"].path

    pending = coord.trigger(expected={"op": 1})
    handle = sub.snapshot(pending.checkpoint_id, ["base", "extra"])
    coord.acknowledge(pending.checkpoint_id, handle)
    coord.abort(pending.checkpoint_id, reason="declined by a subtask")
    sub.abort(pending.checkpoint_id)
    extra_path = next(f.path for f in handle.shared if f.local_name == "extra")
    assert not storage.exists(extra_path), "the declined checkpoint's own upload is deleted"
    assert storage.exists(base_path) and coord.registry.count(base_path) == 1

    done = run_checkpoint(coord, sub, ["base", "extra"])
    assert done.subsumed == (1,)
    assert storage.exists(base_path) and coord.registry.count(base_path) == 1
    assert sub.confirmed["base"].path == base_path


def test_a_metadata_no_reader_would_open_is_never_committed(storage: CheckpointStorage, tmp_path: Path,
                                                             monkeypatch):
    from sparkpoint.checkpoint import store

    coord = CheckpointCoordinator(storage, num_retained=1)
    sub = FakeSubtask(storage, tmp_path / "db")
    sub.write("base")
    run_checkpoint(coord, sub, ["base"])
    for name in ("a", "b", "c"):
        sub.write(name)
    monkeypatch.setattr(store, "MAX_METADATA_BYTES", len(storage.read_bytes(metadata_path(1))) + 50)
    pending = coord.trigger(expected={"op": 1})
    handle = sub.snapshot(pending.checkpoint_id, ["base", "a", "b", "c"])
    coord.acknowledge(pending.checkpoint_id, handle)
    with pytest.raises(CheckpointDeclined, match=r"checkpoint 2 is not committed: its _metadata would be \d+ bytes"):
        coord.complete(pending.checkpoint_id)
    assert storage.completed_checkpoint_ids() == [1], "nothing committed: checkpoint 1 stays the latest"
    assert not any(storage.exists(f.path) for f in handle.shared if f.local_name != "base"), "its uploads deleted"
    assert CompletedCheckpointStore(storage).load(1).checkpoint_id == 1


def test_same_local_sst_in_two_pending_checkpoints_is_two_files(storage: CheckpointStorage, tmp_path: Path):
    coord = CheckpointCoordinator(storage, num_retained=2)
    sub = FakeSubtask(storage, tmp_path / "db")
    sub.write("000010.sst")
    first = coord.trigger(expected={"op": 1})
    second = coord.trigger(expected={"op": 1})
    h1 = sub.snapshot(first.checkpoint_id, ["000010.sst"])
    h2 = sub.snapshot(second.checkpoint_id, ["000010.sst"])
    p1, p2 = h1.shared[0].path, h2.shared[0].path
    assert p1 != p2
    coord.acknowledge(first.checkpoint_id, h1)
    coord.acknowledge(second.checkpoint_id, h2)
    coord.abort(first.checkpoint_id)
    assert not storage.exists(p1) and storage.exists(p2)
    coord.complete(second.checkpoint_id)
    assert coord.registry.count(p2) == 1 and coord.registry.count(p1) == 0
    assert storage.exists(p2)


def test_reference_to_unconfirmed_file_is_rejected(storage: CheckpointStorage, tmp_path: Path):
    coord = CheckpointCoordinator(storage)
    sub = FakeSubtask(storage, tmp_path / "db")
    sub.write("s")
    first = coord.trigger(expected={"op": 1})
    h1 = sub.snapshot(first.checkpoint_id, ["s"])
    second = coord.trigger(expected={"op": 1})
    sub.confirmed = dict(sub.pending[first.checkpoint_id])  # a buggy backend reusing an unconfirmed file
    h2 = sub.snapshot(second.checkpoint_id, ["s"])
    coord.acknowledge(second.checkpoint_id, h2)
    with pytest.raises(UnknownSharedState, match="re-upload"):
        coord.complete(second.checkpoint_id)
    assert storage.exists(h1.shared[0].path), "the other pending checkpoint's file is untouched"
    assert not storage.exists(metadata_path(second.checkpoint_id))


def test_missing_acknowledgement_declines(storage: CheckpointStorage, tmp_path: Path):
    coord = CheckpointCoordinator(storage)
    sub = FakeSubtask(storage, tmp_path / "db", subtask=0)
    sub.write("s")
    pending = coord.trigger(expected={"op": 2})
    handle = sub.snapshot(pending.checkpoint_id, ["s"])
    coord.acknowledge(pending.checkpoint_id, handle)
    with pytest.raises(CheckpointDeclined, match=r"\('op', 1\)"):
        coord.complete(pending.checkpoint_id)
    assert not storage.exists(handle.shared[0].path)
    assert CompletedCheckpointStore(storage).checkpoint_ids() == []


def test_two_coordinators_racing_for_one_id_exactly_one_commits(storage: CheckpointStorage, tmp_path: Path):
    a = CheckpointCoordinator(storage)
    b = CheckpointCoordinator(storage)
    sa = FakeSubtask(storage, tmp_path / "a")
    sb = FakeSubtask(storage, tmp_path / "b")
    sa.write("s")
    sb.write("s")
    pa, pb = a.trigger(expected={"op": 1}), b.trigger(expected={"op": 1})
    assert pa.checkpoint_id == pb.checkpoint_id == 1
    ha, hb = sa.snapshot(1, ["s"]), sb.snapshot(1, ["s"])
    a.acknowledge(1, ha)
    b.acknowledge(1, hb)
    a.complete(1, source_offsets="a")
    with pytest.raises(CheckpointAlreadyExists):
        b.complete(1, source_offsets="b")
    meta = CompletedCheckpointStore(storage).load(1)
    assert meta.source_offsets == "a"
    assert all(storage.exists(f.path) for f in ha.files()), "the winner's files stay"
    assert not any(storage.exists(f.path) for f in hb.files()), "the loser cleans up what it uploaded"


def test_zombie_writer_rebuilds_registry_before_deleting(storage: CheckpointStorage, tmp_path: Path):
    live = CheckpointCoordinator(storage, num_retained=1)
    sub = FakeSubtask(storage, tmp_path / "live")
    sub.write("s")
    run_checkpoint(live, sub, ["s"])
    zombie = CheckpointCoordinator(storage, num_retained=1)
    run_checkpoint(live, sub, ["s"])  # chk-2 reuses s; the zombie does not know chk-2
    zsub = FakeSubtask(storage, tmp_path / "zombie")
    zsub.write("z")
    run_checkpoint(zombie, zsub, ["z"])  # chk-3; subsumes 1 and 2 after a rebuild
    assert zombie.registry.checkpoint_ids() == [3]
    assert CompletedCheckpointStore(storage).checkpoint_ids() == [3]
    # and nothing that chk-3 references is gone
    assert all(storage.exists(p) for p in CompletedCheckpointStore(storage).load(3).paths())


def test_savepoints_and_latest_are_never_subsumed(storage: CheckpointStorage, tmp_path: Path):
    coord = CheckpointCoordinator(storage, num_retained=1)
    sub = FakeSubtask(storage, tmp_path / "db")
    sub.write("s")
    run_checkpoint(coord, sub, ["s"])
    sp = coord.trigger(kind="savepoint", expected={"op": 1})
    coord.acknowledge(sp.checkpoint_id, sub.snapshot(sp.checkpoint_id, ["s"]))
    coord.complete(sp.checkpoint_id)
    sub.confirm(sp.checkpoint_id)
    run_checkpoint(coord, sub, ["s"])
    run_checkpoint(coord, sub, ["s"])
    assert CompletedCheckpointStore(storage).checkpoint_ids() == [4, 2]
    assert CompletedCheckpointStore(storage).load(2).kind == "savepoint"


def test_unreadable_metadata_blocks_deletion(storage: CheckpointStorage, tmp_path: Path):
    coord = CheckpointCoordinator(storage, num_retained=1)
    sub = FakeSubtask(storage, tmp_path / "db")
    sub.write("a")
    sub.write("b")
    run_checkpoint(coord, sub, ["a"])
    a_path = sub.confirmed["a"].path
    storage.fs.rm_file(storage.abspath(metadata_path(1)))
    storage.write_bytes(metadata_path(1), b'{"format": "sparkpoint-checkpoint", "version": 1, "job_')

    restarted = CheckpointCoordinator(storage, num_retained=1)
    assert restarted.registry.deletion_blocked
    sub.confirmed = {}
    done = run_checkpoint(restarted, sub, ["b"])
    done = run_checkpoint(restarted, sub, ["b"])
    assert done.subsumed == () and done.deletion_blocked and "chk-1/_metadata" in done.deletion_blocked
    assert storage.exists(a_path), "a file of the unreadable checkpoint must not be deleted"
    assert CompletedCheckpointStore(storage).checkpoint_ids() == [3, 2, 1]


@pytest.mark.parametrize(
    ("claim_mode", "restored_files_deleted"), [("CLAIM", True), ("NO_CLAIM", False)]
)
def test_claim_mode_decides_deletion_after_rebuild(
    storage: CheckpointStorage, tmp_path: Path, claim_mode: str, restored_files_deleted: bool
):
    first_run = CheckpointCoordinator(storage, num_retained=1)
    sub = FakeSubtask(storage, tmp_path / "db")
    sub.write("old")
    sub.write("new")
    run_checkpoint(first_run, sub, ["old"])
    restored = CompletedCheckpointStore(storage).load(1)
    old_files = restored.paths() | {restored.metadata_path}

    unowned = frozenset(old_files) if claim_mode == "NO_CLAIM" else frozenset()
    second_run = CheckpointCoordinator(
        storage,
        num_retained=1,
        lineage=RestoreLineage(restored_from=restored.metadata_path, claim_mode=claim_mode),
        unowned=unowned,
    )
    sub.confirmed = {} if claim_mode == "NO_CLAIM" else sub.confirmed  # NO_CLAIM: first checkpoint is full
    run_checkpoint(second_run, sub, ["old", "new"])
    # a third run rebuilds the registry from storage alone
    third_run = CheckpointCoordinator(storage, num_retained=1)
    run_checkpoint(third_run, sub, ["new"])
    run_checkpoint(third_run, sub, ["new"])
    still_there = {p for p in old_files if storage.exists(p)}
    if restored_files_deleted:
        assert still_there == set()
    else:
        assert still_there == old_files
        assert CompletedCheckpointStore(storage).load(4).unowned == unowned
        assert CompletedCheckpointStore(storage).load(4).lineage.claim_mode == "NO_CLAIM"


@pytest.mark.parametrize(
    ("retention", "status", "discarded"),
    [
        ("RETAIN_ON_CANCELLATION", "CANCELED", False),
        ("DELETE_ON_CANCELLATION", "CANCELED", True),
        ("DELETE_ON_CANCELLATION", "FAILED", False),
        ("NO_EXTERNALIZED_CHECKPOINTS", "SUSPENDED", True),
    ],
)
def test_shutdown_applies_retention(storage: CheckpointStorage, tmp_path: Path, retention, status, discarded):
    coord = CheckpointCoordinator(storage, num_retained=2, retention=retention)
    sub = FakeSubtask(storage, tmp_path / "db")
    sub.write("s")
    run_checkpoint(coord, sub, ["s"])
    sp = coord.trigger(kind="savepoint", expected={"op": 1})
    coord.acknowledge(sp.checkpoint_id, sub.snapshot(sp.checkpoint_id, ["s"]))
    coord.complete(sp.checkpoint_id)
    sub.confirm(sp.checkpoint_id)
    run_checkpoint(coord, sub, ["s"])
    pending = coord.trigger(expected={"op": 1})
    pending_handle = sub.snapshot(pending.checkpoint_id, ["s"])
    coord.acknowledge(pending.checkpoint_id, pending_handle)
    coord.shutdown(status)
    assert not any(storage.exists(f.path) for f in pending_handle.new_files()), "shutdown aborts pending"
    ids = CompletedCheckpointStore(storage).checkpoint_ids()
    assert ids == ([2] if discarded else [3, 2, 1])
    savepoint = CompletedCheckpointStore(storage).load(2)
    assert all(storage.exists(p) for p in savepoint.paths()), "savepoints survive every shutdown"
    assert coord.pending == {}


def test_commit_with_lost_response_reads_back_and_keeps_its_files(storage: CheckpointStorage, tmp_path: Path):
    coord = CheckpointCoordinator(storage)
    sub = FakeSubtask(storage, tmp_path / "db")
    sub.write("s")
    original = storage.commit_exclusive

    def write_then_lose_the_answer(rel: str, data: bytes) -> None:
        original(rel, data)
        raise TimeoutError("response lost")  # what a retried S3 PUT turns into

    storage.commit_exclusive = write_then_lose_the_answer  # type: ignore[method-assign]
    done = run_checkpoint(coord, sub, ["s"])
    assert done.checkpoint_id == 1
    assert all(storage.exists(f.path) for f in done.metadata.files()), "committed files are never deleted"


def test_commit_with_unknown_outcome_deletes_nothing(storage: CheckpointStorage, tmp_path: Path):
    coord = CheckpointCoordinator(storage)
    sub = FakeSubtask(storage, tmp_path / "db")
    sub.write("s")
    pending = coord.trigger(expected={"op": 1})
    handle = sub.snapshot(pending.checkpoint_id, ["s"])
    coord.acknowledge(pending.checkpoint_id, handle)

    def fail(*_args: object) -> None:
        raise ConnectionError("storage unreachable")

    storage.commit_exclusive = fail  # type: ignore[method-assign]
    storage.read_bytes = fail  # type: ignore[method-assign]
    with pytest.raises(ConnectionError):
        coord.complete(pending.checkpoint_id)
    assert all(storage.exists(f.path) for f in handle.files()), "when in doubt, do not delete"
    assert coord.pending == {}


def test_a_commit_overtaken_by_a_newer_checkpoint_is_withdrawn_before_it_subsumes(
    storage: CheckpointStorage, tmp_path: Path
):
    """A slow writer passes its checks for chk-2, another writer completes chk-3 before the slow
    one's `_metadata` lands: the slow chk-2 is withdrawn and subsumes nothing (rule 9)."""
    from sparkpoint.checkpoint.errors import CheckpointSuperseded

    slow = CheckpointCoordinator(storage, num_retained=1)
    sub = FakeSubtask(storage, tmp_path / "slow")
    sub.write("s")
    run_checkpoint(slow, sub, ["s"])
    pending = slow.trigger(expected={"op": 1})
    handle = sub.snapshot(pending.checkpoint_id, ["s"])
    slow.acknowledge(pending.checkpoint_id, handle)
    other = CheckpointCoordinator(storage, num_retained=3)  # it subsumes nothing: only its id is newer
    osub = FakeSubtask(storage, tmp_path / "other")
    osub.write("o")
    commit = storage.commit_exclusive

    def newer_first(rel: str, data: bytes) -> None:
        if rel == metadata_path(2):
            other.trigger(expected={"op": 1}, checkpoint_id=3)
            other.acknowledge(3, osub.snapshot(3, ["o"]))
            other.complete(3, source_offsets="other")
        commit(rel, data)

    storage.commit_exclusive = newer_first  # type: ignore[method-assign]
    with pytest.raises(CheckpointSuperseded, match="newer checkpoint 3"):
        slow.complete(2, source_offsets="slow")
    assert CompletedCheckpointStore(storage).checkpoint_ids() == [3, 1], "chk-2 withdrawn, chk-1 not subsumed by it"
    assert all(storage.exists(f.path) for f in CompletedCheckpointStore(storage).load(3).files())
    assert not any(storage.exists(f.path) for f in handle.new_files()), "the withdrawn checkpoint's uploads go"


def test_retention_keeps_older_checkpoints_while_the_newest_reuses_a_damaged_file(
    storage: CheckpointStorage, tmp_path: Path
):
    coord = CheckpointCoordinator(storage, num_retained=2)
    sub = FakeSubtask(storage, tmp_path / "db")
    for name in ("a", "b", "c"):
        sub.write(name)
    run_checkpoint(coord, sub, ["a"])
    run_checkpoint(coord, sub, ["a", "b"])
    storage.delete([sub.confirmed["b"].path])  # lost on stable storage; only chk-2 and later need it
    done = run_checkpoint(coord, sub, ["a", "b", "c"])
    assert done.subsumed == () and done.deletion_blocked and "damaged" in done.deletion_blocked
    assert sorted(CompletedCheckpointStore(storage).checkpoint_ids()) == [1, 2, 3], "chk-1 still restores"


def test_prune_keeps_older_checkpoints_while_the_newest_needs_a_damaged_file(
    storage: CheckpointStorage, tmp_path: Path
):
    """The retention guard holds for a later `subsume()` too (`prune` after num_retained was
    lowered), not only inside `complete()`."""
    coord = CheckpointCoordinator(storage, num_retained=3)
    sub = FakeSubtask(storage, tmp_path / "db")
    for name in ("a", "b", "c"):
        sub.write(name)
    run_checkpoint(coord, sub, ["a"])
    run_checkpoint(coord, sub, ["a", "b"])
    run_checkpoint(coord, sub, ["a", "b", "c"])
    storage.delete([sub.confirmed["b"].path])  # chk-2 and chk-3 need it; chk-1 does not
    lowered = CheckpointCoordinator(storage, num_retained=1)
    subsumed, deleted, blocked = lowered.subsume()
    assert subsumed == [] and deleted == 0 and blocked and "damaged" in blocked
    assert sorted(CompletedCheckpointStore(storage).checkpoint_ids()) == [1, 2, 3]


def test_retention_reads_back_only_the_reused_files_the_subsumed_checkpoint_lacks(storage: CheckpointStorage,
                                                                                 tmp_path: Path):
    """Rule 15, and its cost: the blog's checkpoint 3 (s123, s4, s5) subsumes checkpoint 1 (s1, s2);
    of what 3 reuses, only s4 (new in 2) is not in 1, so only s4 is read back to check its CRC32."""
    from sparkpoint.checkpoint.interleave import set_step_hook

    coord = CheckpointCoordinator(storage, num_retained=2)
    sub = FakeSubtask(storage, tmp_path / "db")
    for name in ["s1", "s2", "s3", "s4", "s5", "s123"]:
        sub.write(name)
    run_checkpoint(coord, sub, ["s1", "s2"])
    run_checkpoint(coord, sub, ["s1", "s2", "s3", "s4"])
    s4 = sub.confirmed["s4"].path
    reads: list[str] = []
    previous = set_step_hook(lambda op, path: reads.append(path) if op == "read" and "/shared/" in path else None)
    try:
        done = run_checkpoint(coord, sub, ["s123", "s4", "s5"])
    finally:
        set_step_hook(previous)
    assert done.subsumed == (1,) and done.deletion_blocked is None
    assert [r.rsplit("/", 1)[-1] for r in reads] == [s4.rsplit("/", 1)[-1]]


def test_a_savepoint_kept_in_the_job_directory_does_not_hide_a_damaged_reused_file(
    storage: CheckpointStorage, tmp_path: Path
):
    """Rule 15 with a savepoint beside the checkpoints: a savepoint holds copies of its own, so
    counting it among the checkpoints that must reference a reused file switched the check off."""
    from sparkpoint.checkpoint.savepoint import take_savepoint

    coord = CheckpointCoordinator(storage, num_retained=2)
    sub = FakeSubtask(storage, tmp_path / "db")
    for name in ("a", "b", "c"):
        sub.write(name)
    run_checkpoint(coord, sub, ["a"])
    run_checkpoint(coord, sub, ["a", "b"])
    assert take_savepoint(storage).metadata.checkpoint_id == 3  # into the job directory
    b = storage.abspath(sub.confirmed["b"].path)
    data = storage.fs.cat_file(b)
    storage.fs.pipe_file(b, bytes([data[0] ^ 0x01]) + data[1:])  # one flipped byte, same size
    coord = CheckpointCoordinator(storage, num_retained=2)
    done = run_checkpoint(coord, sub, ["a", "b", "c"])
    assert done.checkpoint_id == 4 and done.subsumed == ()
    assert done.deletion_blocked and "DAMAGED SHARED FILE" in done.deletion_blocked
    assert sorted(CompletedCheckpointStore(storage).checkpoint_ids()) == [1, 2, 3, 4], "chk-1 still restores"


def test_a_savepoint_whose_copies_a_sweep_took_while_it_copied_commits_nothing(
    storage: CheckpointStorage, tmp_path: Path
):
    """Its copies are referenced by nothing until its `_metadata` lands: a recovery's orphan sweep
    (grace 0 up to the failure) may take them. The savepoint then fails, saying so, instead of
    committing a latest checkpoint whose files are gone."""
    from sparkpoint.checkpoint.errors import StorageError
    from sparkpoint.checkpoint.interleave import set_step_hook
    from sparkpoint.checkpoint.savepoint import take_savepoint

    coord = CheckpointCoordinator(storage, num_retained=2)
    sub = FakeSubtask(storage, tmp_path / "db")
    for name in ("a", "b"):
        sub.write(name)
    run_checkpoint(coord, sub, ["a", "b"])
    swept: list[str] = []

    def sweep_a_copy(op: str, path: str) -> None:
        if op == "write" and "/chk-2/" in path and not swept:
            swept.append(path)
        elif swept and op != "write" and len(swept) == 1 and storage.fs.exists(swept[0]):
            storage.fs.rm_file(swept[0])  # the sweep's delete, once the copy was written
            swept.append("done")

    previous = set_step_hook(sweep_a_copy)
    try:
        with pytest.raises(StorageError, match="an orphan sweep .* took them; nothing was committed"):
            take_savepoint(storage)
    finally:
        set_step_hook(previous)
    assert swept[-1] == "done", "the sweep ran while the savepoint copied"
    assert CompletedCheckpointStore(storage).checkpoint_ids() == [1], "no savepoint without its files"


def test_second_coordinator_cannot_reuse_a_file_the_first_one_deleted(local_storage: CheckpointStorage, tmp_path: Path):
    """A completes 2 and deletes an SST of 1; B, resumed from 1, must not commit 3 reusing it."""
    storage = local_storage
    a = CheckpointCoordinator(storage, num_retained=1)
    sa = FakeSubtask(storage, tmp_path / "a")
    sa.write("000007.sst")
    sa.write("000008.sst")
    run_checkpoint(a, sa, ["000007.sst"])
    reused = sa.confirmed["000007.sst"].path

    b = CheckpointCoordinator(storage, num_retained=1)  # resumed from 1: its registry knows `reused`
    sb = FakeSubtask(storage, tmp_path / "b")
    sb.confirmed = dict(sa.confirmed)

    p2 = a.trigger(expected={"op": 1}).checkpoint_id
    a.acknowledge(p2, sa.snapshot(p2, ["000008.sst"]))
    a.complete(p2)  # subsumes 1: `reused` is deleted
    assert not storage.exists(reused)

    p3 = b.trigger(expected={"op": 1}).checkpoint_id  # next_id None: the highest known + 1
    b.acknowledge(p3, sb.snapshot(p3, ["000007.sst"]))
    with pytest.raises(UnknownSharedState, match="re-upload"):
        b.complete(p3)
    store = CompletedCheckpointStore(storage)
    assert store.checkpoint_ids() == [2], "A's good checkpoint survives, B's never commits"
    assert verify_checkpoint(storage, store.load(2)) == []


class CommitHook(CheckpointStorage):
    """Runs `before_commit` once, right before `_metadata` is created: another writer acts there."""

    before_commit = None

    def commit_exclusive(self, rel: str, data: bytes) -> None:
        hook, type(self).before_commit = type(self).before_commit, None
        if hook:
            hook()
        super().commit_exclusive(rel, data)


def test_file_deleted_by_another_writer_between_check_and_commit_withdraws_the_checkpoint(tmp_path: Path):
    url = f"file://{tmp_path}/ck"
    storage = CommitHook(url, "job")
    a = CheckpointCoordinator(CheckpointStorage(url, "job"), num_retained=1)
    sa = FakeSubtask(a.storage, tmp_path / "a")
    sa.write("000007.sst")
    sa.write("000008.sst")
    run_checkpoint(a, sa, ["000007.sst"])

    b = CheckpointCoordinator(storage, num_retained=1)
    sb = FakeSubtask(storage, tmp_path / "b")
    sb.confirmed = dict(sa.confirmed)
    p3 = b.trigger(expected={"op": 1}, checkpoint_id=3).checkpoint_id
    b.acknowledge(p3, sb.snapshot(p3, ["000007.sst"]))

    def a_completes_2() -> None:
        p2 = a.trigger(expected={"op": 1}, checkpoint_id=2).checkpoint_id
        a.acknowledge(p2, sa.snapshot(p2, ["000008.sst"]))
        a.complete(p2)

    CommitHook.before_commit = a_completes_2
    with pytest.raises(UnknownSharedState, match="withdrawn"):
        b.complete(p3)
    store = CompletedCheckpointStore(storage)
    assert store.checkpoint_ids() == [2]
    assert verify_checkpoint(storage, store.load(2)) == []


class FlakyDeletes(CheckpointStorage):
    failures = 0

    def delete(self, rels):  # type: ignore[no-untyped-def]
        rels = list(rels)
        if rels and type(self).failures:
            type(self).failures -= 1
            raise OSError("503 Slow Down")
        return super().delete(rels)


def test_subsumption_delete_failing_after_the_commit_leaves_the_checkpoint_complete(tmp_path: Path):
    storage = FlakyDeletes(f"file://{tmp_path}/ck", "job")
    coord = CheckpointCoordinator(storage, num_retained=1)
    sub = FakeSubtask(storage, tmp_path / "db")
    for name in ("a.sst", "b.sst", "c.sst"):
        sub.write(name)
    for names in (["a.sst"], ["b.sst"]):
        cid = coord.trigger(expected={"op": 1}).checkpoint_id
        coord.acknowledge(cid, sub.snapshot(cid, names))
        if cid == 2:
            FlakyDeletes.failures = 1
        done = coord.complete(cid)
        sub.confirm(cid)
    assert done.checkpoint_id == 2 and done.deletion_blocked and "503" in done.deletion_blocked
    assert storage.exists(metadata_path(2))
    cid = coord.trigger(expected={"op": 1}).checkpoint_id
    coord.acknowledge(cid, sub.snapshot(cid, ["c.sst"]))
    done = coord.complete(cid)
    assert done.deletion_blocked is None
    assert CompletedCheckpointStore(storage).checkpoint_ids() == [3]
    sweep = sweep_orphans(storage, grace_seconds=0)
    stored = {f.path for f in storage.walk("shared")} | {f.path for c in storage.checkpoint_dirs()
                                                         for f in storage.walk(f"chk-{c}")}
    assert stored == CompletedCheckpointStore(storage).load(3).paths() | {metadata_path(3)}
    assert sweep.deleted


class FlakyListing(CheckpointStorage):
    """The `fail_on`-th listing of the checkpoints fails (a 503 right after a commit)."""

    calls = 0
    fail_on = 0

    def completed_checkpoint_ids(self) -> list[int]:
        type(self).calls += 1
        if type(self).calls == type(self).fail_on:
            raise OSError("503 Slow Down")
        return super().completed_checkpoint_ids()


def test_a_listing_error_right_after_the_commit_leaves_the_checkpoint_complete(tmp_path: Path):
    storage = FlakyListing(f"file://{tmp_path}/ck", "job")
    coord = CheckpointCoordinator(storage, num_retained=1)
    sub = FakeSubtask(storage, tmp_path / "db")
    sub.write("a.sst")
    sub.write("b.sst")
    first = coord.trigger(expected={"op": 1}).checkpoint_id
    coord.acknowledge(first, sub.snapshot(first, ["a.sst"]))
    coord.complete(first)
    sub.confirm(first)
    cid = coord.trigger(expected={"op": 1}).checkpoint_id
    coord.acknowledge(cid, sub.snapshot(cid, ["b.sst"]))
    FlakyListing.calls, FlakyListing.fail_on = 0, 2  # the first listing is the check before the commit
    done = coord.complete(cid)
    assert FlakyListing.calls >= 2
    assert done.checkpoint_id == cid and done.deletion_blocked and "503" in done.deletion_blocked
    assert done.subsumed == (), "in doubt about other writers: nothing is subsumed"
    assert CompletedCheckpointStore(storage).checkpoint_ids() == [cid, first]
    assert verify_checkpoint(storage, CompletedCheckpointStore(storage).load(cid)) == []


def test_registry_created_by_equals_a_recount_after_subsumption(local_storage: CheckpointStorage, tmp_path: Path):
    coord = CheckpointCoordinator(local_storage, num_retained=1)
    sub = FakeSubtask(local_storage, tmp_path / "db")
    sub.write("000007.sst")
    for _ in range(3):
        cid = coord.trigger(expected={"op": 1}).checkpoint_id
        coord.acknowledge(cid, sub.snapshot(cid, ["000007.sst"]))
        coord.complete(cid)
        sub.confirm(cid)
    path = sub.confirmed["000007.sst"].path
    live = coord.registry.entry(path)
    rebuilt = CompletedCheckpointStore(local_storage).rebuild_registry().entry(path)
    assert live is not None and rebuilt is not None
    assert (live.created_by, live.last_used, live.count) == (rebuilt.created_by, rebuilt.last_used, rebuilt.count)
    assert rebuilt.created_by == 1 and rebuilt.last_used == 3
