"""A materialization in steps (`sparkpoint.state.engine.staging`): slices uploaded over several
checkpoints, kept alive by the registry, then one checkpoint that switches to a RocksDB
materialization made of them. Every checkpoint on the way restores exactly, by every path."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.errors import MetadataError
from sparkpoint.checkpoint.metadata import CheckpointMetadata
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.state.backend import RocksDBStateBackend, take_checkpoint
from sparkpoint.state.codecs import StructCodec
from sparkpoint.state.engine import changelog as cl
from sparkpoint.state.engine.changelog import ChangelogOptions
from sparkpoint.state.engine.staging import SLICE_PREFIX
from tests.support.backends import make_backends

# Not the sample's state: a session window per device (start, end, events) and, per device, the
# set of firmware versions seen, over 2 subtasks.
SESSION = StructCodec[tuple[int, int, int]]("<qqi")
SEEN = StructCodec[tuple[int]]("<i")
STEPS = ChangelogOptions(enabled=True, materialize_share=1.0, max_chain=6, slice_min_bytes=1)
Model = dict[tuple[str, str, str], tuple[int, ...]]


def backends(storage: CheckpointStorage, local: Path, options: ChangelogOptions = STEPS) -> list[RocksDBStateBackend]:
    return make_backends(storage, local, operator="sessions", max_parallelism=16, changelog=options)


def owner(bs: list[RocksDBStateBackend], key: str) -> RocksDBStateBackend:
    from sparkpoint.state.keygroups import key_group_for

    return next(b for b in bs if key_group_for(key, 16) in b.key_group_range)


DEVICES = 2000  # the state's keys; a checkpoint changes about a third of them (what a materialization
# in steps is for: the chain outgrows the state within a few checkpoints), so the count does not matter


def mutate(bs: list[RocksDBStateBackend], model: Model, rng: random.Random, n: int = 750) -> None:
    for _ in range(n):
        device = f"dev-{rng.randrange(DEVICES):05d}"
        b = owner(bs, device)
        if rng.random() < 0.85:
            session = (rng.randrange(1 << 40), rng.randrange(1 << 40), rng.randrange(1000))
            b.value_state("session", SESSION).put(device, session)
            model[("session", device, "")] = session
            fw, seen = f"fw{rng.randrange(12)}", (rng.randrange(100),)
            b.map_state("firmware", SEEN).put(device, fw, seen)
            model[("firmware", device, fw)] = seen
        elif rng.random() < 0.5:
            b.value_state("session", SESSION).delete(device)
            model.pop(("session", device, ""), None)
        else:
            b.map_state("firmware", SEEN).remove_key(device)
            for k in [k for k in model if k[0] == "firmware" and k[1] == device]:
                del model[k]


def read_all(bs: list[RocksDBStateBackend]) -> Model:
    out: Model = {}
    for b in bs:
        out.update({("session", k.decode(), ""): v for k, v in b.value_state("session", SESSION).items()})
        out.update({("firmware", k.decode(), u.decode()): v for k, u, v in b.map_state("firmware", SEEN).items()})
    return out


def restored(storage: CheckpointStorage, meta: CheckpointMetadata, local: Path) -> Model:
    shutil.rmtree(local, ignore_errors=True)
    bs = backends(storage, local)
    try:
        for b in bs:
            assert b.restore(meta).source == "primary"
        return read_all(bs)
    finally:
        for b in bs:
            b.dispose()


def kind(meta: CheckpointMetadata) -> str:
    """What the checkpoint did: files (at once), log, slices (some staged) or switch."""
    kinds = set()
    for h in meta.subtask_handles():
        new = [f for f in h.shared if f.created_by == meta.checkpoint_id]
        if any(f.created_by == meta.checkpoint_id for f in h.staged):
            kinds.add("slices")
        elif any(not cl.is_changelog(f.local_name) for f in new):
            kinds.add("switch" if any(cl.is_changelog(f.local_name) for f in h.shared) else "files")
        else:
            kinds.add("log")
    return "+".join(sorted(kinds))


def started(storage: CheckpointStorage, local: Path, seed: int, retained: int = 2):
    """A new job's subtasks, their coordinator, the model of their state and its random source."""
    bs = backends(storage, local)
    for b in bs:
        b.restore(None)
    return bs, CheckpointCoordinator(storage, num_retained=retained), {}, random.Random(seed)


def test_a_materialization_in_steps_restores_exactly_at_every_checkpoint(local_storage: CheckpointStorage,
                                                                          tmp_path: Path):
    bs, coord, model, rng = started(local_storage, tmp_path / "local", 7)
    kinds = []
    for _ in range(24):
        mutate(bs, model, rng)
        done = take_checkpoint(coord, bs)
        meta = CompletedCheckpointStore(local_storage).load(done.checkpoint_id)  # as written
        kinds.append(kind(meta))
        assert meta.format_version() == (4 if meta.has_staged() else 3 if meta.has_changelog() else 2)
        for h in meta.subtask_handles():
            names = [f.local_name for f in h.files()]
            assert not any(n.startswith(SLICE_PREFIX) for n in names)  # a restore never sees a slice
            assert "CURRENT" in names and any(n.startswith("MANIFEST-") for n in names)
            assert all(f.local_name.startswith(SLICE_PREFIX) for f in h.staged)
        assert restored(local_storage, meta, tmp_path / "fresh") == model
        # the registry keeps exactly what retained checkpoints list, staged slices included
        referenced = {f.path for cp in CompletedCheckpointStore(local_storage).load_all().checkpoints
                      for f in cp.files()}
        assert {f.path for f in local_storage.walk("shared")} == referenced
    assert read_all(bs) == model
    assert kinds[0] == "files"
    assert "files" not in "+".join(kinds[1:]), kinds  # never materialized at once again
    assert sum("switch" in k for k in kinds) >= 2 and sum("slices" in k for k in kinds) >= 2, kinds
    # the working database and the task-local copy of a switched checkpoint restore it too
    last = CompletedCheckpointStore(local_storage).latest()
    assert last is not None
    for b in bs:
        b.close()
    again = backends(local_storage, tmp_path / "local")
    sources = {b.restore(last).source for b in again}
    assert sources == {"working"} and read_all(again) == model
    for b in again:
        (b.dir / "working.json").unlink()
    assert {b.restore(last).source for b in again} == {"local"} and read_all(again) == model


def test_a_new_process_goes_on_with_the_slices_of_the_last(local_storage: CheckpointStorage, tmp_path: Path):
    """Every Dagster run is a new process: the staging record on the local disk carries on."""
    rng, model = random.Random(3), {}
    staged_counts = []
    meta = None
    by_files = ChangelogOptions(enabled=True, materialize_share=100.0, max_chain=8, slice_min_bytes=1)
    for _ in range(20):
        coord = CheckpointCoordinator(local_storage, num_retained=2)
        bs = backends(local_storage, tmp_path / "local", by_files)
        for b in bs:
            b.restore(meta)
        mutate(bs, model, rng)
        done = take_checkpoint(coord, bs)
        meta = done.metadata
        staged_counts.append(max(len(h.staged) for h in meta.subtask_handles()))
        for b in bs:
            b.close()
    assert restored(local_storage, meta, tmp_path / "fresh") == model
    # slices accumulate across processes (1, 2, ... then 0 at the switch), never restart mid-way
    runs = [c for c in staged_counts if c]
    assert runs and max(runs) >= 3, staged_counts
    for before, after in zip(staged_counts, staged_counts[1:]):
        assert after == 0 or after >= before, staged_counts


def test_a_damaged_slice_restarts_the_materialization_and_loses_nothing(local_storage: CheckpointStorage,
                                                                         tmp_path: Path):
    bs, coord, model, rng = started(local_storage, tmp_path / "local", 11, retained=3)
    damaged = None
    for _ in range(24):
        mutate(bs, model, rng)
        done = take_checkpoint(coord, bs)
        staged = [f for h in done.metadata.subtask_handles() for f in h.staged]
        if damaged is None and staged:
            damaged = staged[0]
            local_storage.delete([damaged.path])  # gone from stable storage before the switch
    assert damaged is not None
    last = CompletedCheckpointStore(local_storage).latest()
    assert last is not None and damaged.path not in last.paths()
    assert restored(local_storage, last, tmp_path / "fresh") == model
    assert read_all(bs) == model


def test_at_once_when_asked(local_storage: CheckpointStorage, tmp_path: Path):
    options = ChangelogOptions(enabled=True, materialize_share=1.0, max_chain=6, in_steps=False)
    rng, model = random.Random(5), {}
    coord = CheckpointCoordinator(local_storage, num_retained=2)
    bs = backends(local_storage, tmp_path / "local", options)
    for b in bs:
        b.restore(None)
    kinds = []
    for _ in range(12):
        mutate(bs, model, rng)
        kinds.append(kind(take_checkpoint(coord, bs).metadata))
    assert not any("slices" in k or "switch" in k for k in kinds)
    assert kinds.count("files") >= 2
    assert read_all(bs) == model


@pytest.fixture(scope="module")
def staged_metadata(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """The `_metadata` of the first checkpoint that lists staged slices (one job for every
    hostile variant: each changes its own copy)."""
    root = tmp_path_factory.mktemp("staged")
    storage = CheckpointStorage(f"file://{root}/checkpoints", "job")
    bs, coord, model, rng = started(storage, root / "local", 7)
    try:
        for _ in range(24):
            mutate(bs, model, rng)
            done = take_checkpoint(coord, bs)
            if done.metadata.has_staged():
                return storage.read_bytes(done.metadata.metadata_path)
    finally:
        for b in bs:
            b.dispose()
    raise AssertionError("no checkpoint listed staged slices")


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(version=3), "only version 4 has"),
    (lambda d: next(s for op in d["operators"].values() for s in op["subtasks"] if s.get("staged"))["staged"].append(
        next(s for op in d["operators"].values() for s in op["subtasks"] if s.get("staged"))["shared"][0]),
     "the same stored file twice"),
    (lambda d: next(s for op in d["operators"].values() for s in op["subtasks"] if s.get("staged")).update(
        staged="x"), "staged"),
])
def test_hostile_staged_fields_are_refused(staged_metadata: bytes, change, message):
    from sparkpoint.checkpoint.metadata import content_checksum

    data = json.loads(staged_metadata)
    change(data)
    data.pop("checksum")
    data["checksum"] = content_checksum(data)  # a file written that way, not damaged
    with pytest.raises(MetadataError, match=message):
        CheckpointMetadata.loads(json.dumps(data).encode())


def test_a_savepoint_of_a_checkpoint_with_staged_slices_copies_what_a_restore_reads(local_storage: CheckpointStorage,
                                                                                     tmp_path: Path):
    from sparkpoint.checkpoint.savepoint import take_savepoint

    bs, coord, model, rng = started(local_storage, tmp_path / "local", 7)
    for _ in range(24):
        mutate(bs, model, rng)
        done = take_checkpoint(coord, bs)
        if done.metadata.has_staged():
            break
    assert done.metadata.has_staged()
    result = take_savepoint(local_storage, target=f"file://{tmp_path}/savepoints/sp-1")
    sp_storage = CheckpointStorage(f"file://{tmp_path}/savepoints", "sp-1")
    sp = CompletedCheckpointStore(sp_storage).latest()
    assert sp is not None and not sp.has_staged() and sp.format_version() == 3
    assert all(not f.local_name.startswith(SLICE_PREFIX) for f in sp.files())
    assert restored(sp_storage, sp, tmp_path / "fresh") == model
    assert result is not None


def test_links_planted_in_a_staging_directory_are_never_written_through(local_storage: CheckpointStorage,
                                                                        tmp_path: Path):
    from sparkpoint.state.engine.staging import slice_name

    bs, coord, model, rng = started(local_storage, tmp_path / "local", 7)
    sentinel, elsewhere = tmp_path / "sentinel", tmp_path / "elsewhere"
    sentinel.write_bytes(b"keep")
    elsewhere.mkdir()
    (elsewhere / "inside").write_bytes(b"keep")
    planted = 0
    for _ in range(24):
        mutate(bs, model, rng)
        take_checkpoint(coord, bs)
        for b in bs:
            for d in b.dir.glob("mat-*"):
                at = int(d.name.split("-")[1])
                for seq in range(200):
                    link = d / slice_name(at, seq)
                    if not link.exists() and not link.is_symlink():
                        link.symlink_to(sentinel)
                        planted += 1
                for name in ("built", "final"):
                    if not (d / name).exists():
                        (d / name).symlink_to(elsewhere, target_is_directory=True)
    assert planted
    assert sentinel.read_bytes() == b"keep"
    assert sorted(p.name for p in elsewhere.iterdir()) == ["inside"] and (elsewhere / "inside").read_bytes() == b"keep"
    last = CompletedCheckpointStore(local_storage).latest()
    assert last is not None and restored(local_storage, last, tmp_path / "fresh") == model


def _until_staged(storage: CheckpointStorage, tmp_path: Path, seed: int = 7, slices: int = 2):
    """A job whose latest checkpoint lists at least `slices` staged slices for some subtask."""
    bs, coord, model, rng = started(storage, tmp_path / "local", seed, retained=3)
    for _ in range(24):
        mutate(bs, model, rng)
        done = take_checkpoint(coord, bs)
        if max(len(h.staged) for h in done.metadata.subtask_handles()) >= slices:
            return bs, coord, model, rng, done.metadata
    raise AssertionError("no checkpoint listed staged slices")


def test_a_missing_staged_slice_does_not_fail_the_checkpoints_that_do_not_read_it(local_storage: CheckpointStorage,
                                                                                   tmp_path: Path):
    """No restore reads a staged slice: a checkpoint that lists one that is gone still verifies,
    so that recovery does not fall back past it (discarding it and retracting its output), and
    the repair of the retained checkpoints has nothing to say about it."""
    from sparkpoint.checkpoint.files import stored_size_problems
    from sparkpoint.state.engine.repair import repair_checkpoints
    from sparkpoint.state.engine.verify import verify_checkpoint

    bs, coord, model, rng, meta = _until_staged(local_storage, tmp_path)
    gone = next(f for h in meta.subtask_handles() for f in h.staged)
    local_storage.delete([gone.path])
    assert restored(local_storage, meta, tmp_path / "fresh") == model  # it restores exactly
    assert verify_checkpoint(local_storage, meta) == []
    assert stored_size_problems(local_storage, list(meta.restored_files())) == []
    retained = CompletedCheckpointStore(local_storage).load_all().checkpoints
    report = repair_checkpoints(local_storage, tmp_path / "local", retained)
    assert report.lost == [] and report.unrepairable == {}
    # the staging notices it before switching, starts again, and nothing is lost
    for _ in range(16):
        mutate(bs, model, rng)
        take_checkpoint(coord, bs)
    last = CompletedCheckpointStore(local_storage).latest()
    assert last is not None and gone.path not in last.paths()
    assert verify_checkpoint(local_storage, last) == []
    assert restored(local_storage, last, tmp_path / "fresh") == model


def test_corrupt_staging_files_go_with_the_local_state_they_were_linked_from(local_storage: CheckpointStorage,
                                                                            tmp_path: Path):
    """A staging snapshot is hard links to the working database's SSTs: when RocksDB reports
    corruption, discarding the local state (what a task does then) discards the staging too,
    and the next checkpoint succeeds instead of reading the same rotten block forever."""
    from sparkpoint.state.engine.rocksdb import is_corruption

    bs, coord, model, rng, meta = _until_staged(local_storage, tmp_path, slices=1)
    at: dict[int, Model] = {meta.checkpoint_id: dict(model)}
    rotten = 0
    for b in bs:
        for snap in b.dir.glob("mat-*/snap"):
            for sst in snap.glob("*.sst"):  # a flipped data block in each (a copy: db/ stays good)
                data = bytearray(sst.read_bytes())
                data[len(data) // 4] ^= 0xFF
                sst.unlink()
                sst.write_bytes(bytes(data))
                rotten += 1
    assert rotten
    failures: list[int] = []
    for step in range(12):
        try:
            mutate(bs, model, rng)
            done = take_checkpoint(coord, bs)
        except Exception as e:
            assert is_corruption(e), e
            failures.append(step)
            latest = CompletedCheckpointStore(local_storage).latest()
            assert latest is not None
            for b in bs:
                b.discard_local_state()
                b.restore(latest)
            model = dict(at[latest.checkpoint_id])
            continue
        at[done.checkpoint_id] = dict(model)
    assert len(failures) <= 1 and 11 not in failures, failures  # one failure, then it goes on
    assert read_all(bs) == model
    last = CompletedCheckpointStore(local_storage).latest()
    assert last is not None and restored(local_storage, last, tmp_path / "fresh") == model
