"""The changelog mode (FLIP-158) on real RocksDB files: what a checkpoint uploads, when it
materializes, and that every way of restoring gives exactly the state that was checkpointed."""

from __future__ import annotations

import random
import shutil
from functools import partial
from pathlib import Path

import pytest

from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.errors import CheckpointCorrupted
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.state.backend import RocksDBStateBackend, restore_with_fallback, take_checkpoint
from sparkpoint.state.codecs import StructCodec
from sparkpoint.state.engine import changelog as cl
from sparkpoint.state.engine.changelog import ChangeLog, ChangelogFormatError, ChangelogOptions
from sparkpoint.state.engine.rocksdb import RocksDBOptions
from tests.support.backends import make_backend, owned

COUNTS = StructCodec[tuple[int]]("<q")
Model = dict[tuple[str, str, str], int]  # (state, key, user key or "") -> value


backend = partial(make_backend, operator="ops", max_parallelism=32,
                  changelog=ChangelogOptions(enabled=True, materialize_share=10.0, max_chain=4))


def mutate(b: RocksDBStateBackend, model: Model, rng: random.Random, n: int = 400, keyspace: int = 3000) -> None:
    """Random puts, deletes, map entries, whole-map removals and an occasional clear."""
    values, maps = b.value_state("values", COUNTS), b.map_state("maps", COUNTS)
    mine = owned(b, (f"k{i}" for i in range(keyspace)))
    for _ in range(n):
        key = rng.choice(mine)
        op = rng.random()
        if op < 0.5:
            v = rng.randrange(1 << 40)
            values.put(key, (v,))
            model[("values", key, "")] = v
        elif op < 0.6:
            values.delete(key)
            model.pop(("values", key, ""), None)
        elif op < 0.9:
            user, v = f"u{rng.randrange(20)}", rng.randrange(1000)
            maps.put(key, user, (v,))
            model[("maps", key, user)] = v
        elif op < 0.99:
            maps.remove_key(key)
            for k in [k for k in model if k[0] == "maps" and k[1] == key]:
                del model[k]
        else:
            maps.clear()
            for k in [k for k in model if k[0] == "maps"]:
                del model[k]
    # a batched write too, the path the sample operators take
    batch = {rng.choice(mine): rng.randrange(1 << 40) for _ in range(50)}
    values.put_many((k, (v,)) for k, v in batch.items())
    model.update({("values", k, ""): v for k, v in batch.items()})


class Subtask:
    """One subtask taking checkpoints with the changelog on, the model of its state, and the
    model as of every checkpoint taken."""

    def __init__(self, storage: CheckpointStorage, local: Path, seed: int, retained: int = 2, **kw):
        self.rng = random.Random(seed)
        self.coord = CheckpointCoordinator(storage, num_retained=retained)
        self.model: Model = {}
        self.states: list[Model] = []
        self.b = backend(storage, local, **kw)
        self.b.restore(None)

    def checkpoint(self):
        mutate(self.b, self.model, self.rng)
        done = take_checkpoint(self.coord, [self.b])
        self.states.append(dict(self.model))
        return done


def read_all(b: RocksDBStateBackend) -> Model:
    out: Model = {("values", k.decode(), ""): v[0] for k, v in b.value_state("values", COUNTS).items()}
    out.update({("maps", k.decode(), u.decode()): v[0] for k, u, v in b.map_state("maps", COUNTS).items()})
    return out


def test_changelog_file_round_trips_puts_deletes_and_range_deletes(tmp_path: Path):
    log = ChangeLog()
    log.put("a", b"\x00\x01k1", b"v1")
    log.put("a", b"\x00\x01k2", b"v2")
    log.delete("a", b"\x00\x01k3")
    log.put("b", b"\x00\x05m", b"")
    log.delete_range("a", b"\x00\x01k2", b"\x00\x01k3")  # drops k2 written before it
    log.put("a", b"\x00\x01k2x", b"after")
    path = tmp_path / cl.local_name(7)
    size = log.write(path, ["a", "b", "empty"])
    assert size == path.stat().st_size
    sections = {s.name: s for s in cl.read(path)}
    assert set(sections) == {"a", "b", "empty"}
    assert sections["a"].ranges == [(b"\x00\x01k2", b"\x00\x01k3")]
    assert sections["a"].entries == [(b"\x00\x01k1", b"v1"), (b"\x00\x01k2x", b"after"), (b"\x00\x01k3", None)]
    assert sections["b"].entries == [(b"\x00\x05m", b"")]
    assert sections["empty"].entries == [] and sections["empty"].ranges == []


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: b"NOTACHLG" + d[8:], "bad magic"),
        (lambda d: d[:-5], "frame sizes do not add up"),
        (lambda d: d[:12] + b"[" + d[13:], "malformed"),  # the JSON header no longer parses
    ],
)
def test_a_damaged_changelog_file_is_a_specific_error(tmp_path: Path, damage, message):
    log = ChangeLog()
    for i in range(100):
        log.put("s", b"key-%d" % i, b"value-%d" % i)
    path = tmp_path / "changelog-000000000001"
    log.write(path, ["s"])
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(ChangelogFormatError, match=message):
        cl.read(path)


@pytest.mark.parametrize(
    "state, materialized, chain_bytes, chain_files, expected, overdue",
    [
        (0, 0, 0, 0, True, True),  # nothing to weigh the chain against
        (1000, 1000, 0, 0, False, False),
        (1000, 1000, 499, 3, False, False),
        (1000, 1000, 500, 3, True, False),  # a restore reads half the state's bytes more than the state holds
        (1000, 1000, 1000, 3, True, True),  # ... twice that: too late to materialize in steps
        (3000, 1000, 2400, 3, False, False),  # a growing state: the chain holds what the state gained
        (400, 1000, 0, 1, True, True),  # expired or deleted since the materialization: the base alone is excess
        (1000, 1000, 10, 4, True, False),  # the chain reached max_chain files
    ],
)
def test_materialization_policy_weighs_what_a_restore_reads_against_the_state(
        state, materialized, chain_bytes, chain_files, expected, overdue):
    options = ChangelogOptions(enabled=True, materialize_share=0.5, max_chain=4)
    assert options.should_materialize(state, materialized, chain_bytes, chain_files) is expected
    assert options.overdue(state, materialized, chain_bytes, chain_files) is overdue


def test_changelog_checkpoints_upload_one_small_file_and_materialize_on_schedule(
    local_storage: CheckpointStorage, tmp_path: Path
):
    at_once = ChangelogOptions(enabled=True, materialize_share=10.0, max_chain=4, in_steps=False)
    s = Subtask(local_storage, tmp_path / "local", seed=1, changelog=at_once)
    kinds = []
    for _ in range(11):
        done = s.checkpoint()
        (handle,) = done.metadata.operators["ops"].subtasks
        assert handle.private == ()  # everything a later checkpoint may re-reference is shared
        new = [f for f in handle.shared if f.created_by == done.checkpoint_id]
        if all(cl.is_changelog(f.local_name) for f in new):
            assert len(new) == 1 and new[0].path.endswith(cl.SUFFIX)
            assert new[0].size < sum(f.size for f in handle.shared if not cl.is_changelog(f.local_name))
            kinds.append("log")
        else:
            assert not any(cl.is_changelog(f.local_name) for f in handle.shared)  # a chain starts anew
            kinds.append("files")
    # max_chain=4: materialize, 4 changelog checkpoints, materialize, ...
    assert kinds == ["files", "log", "log", "log", "log", "files", "log", "log", "log", "log", "files"]
    assert read_all(s.b) == s.model
    s.b.close()
    # Retention 2 after a materialization: the old chain's files are gone from storage.
    referenced = {f.path for cp in CompletedCheckpointStore(local_storage).load_all().checkpoints for f in cp.files()}
    stored = {f.path for f in local_storage.walk("shared")}
    assert stored == referenced


@pytest.mark.parametrize("how", ["working", "local", "primary"])
def test_every_restore_path_replays_the_chain_exactly(any_storage: CheckpointStorage, tmp_path: Path, how):
    s = Subtask(any_storage, tmp_path / "local", seed=2, retained=3)
    for _ in range(3):  # a materialization and a chain of two
        s.checkpoint()
    s.b.close()
    b, model, rng, coord = s.b, s.model, s.rng, s.coord
    latest = CompletedCheckpointStore(any_storage).latest()
    assert latest is not None
    local = tmp_path / "local"
    if how == "local":
        (b.dir / "working.json").unlink()
    elif how == "primary":
        local = tmp_path / "elsewhere"
    again = backend(any_storage, local)
    result = again.restore(latest)
    assert result.source == how
    assert read_all(again) == model
    # and the chain goes on from the restored state
    mutate(again, model, rng)
    done = take_checkpoint(coord, [again])
    again.dispose()
    fresh = backend(any_storage, tmp_path / "third")
    fresh.restore(done.metadata)
    assert read_all(fresh) == model
    fresh.dispose()


@pytest.mark.parametrize("old_p, new_p", [(2, 3), (3, 1)])
def test_rescale_from_changelog_checkpoints(local_storage: CheckpointStorage, tmp_path: Path, old_p, new_p):
    rng = random.Random(3)
    coord = CheckpointCoordinator(local_storage, num_retained=2)
    models = [dict() for _ in range(old_p)]
    olds = [backend(local_storage, tmp_path / "old", s, old_p) for s in range(old_p)]
    for b in olds:
        b.restore(None)
    for _ in range(3):
        for b, m in zip(olds, models):
            mutate(b, m, rng, n=200)
        take_checkpoint(coord, olds)
    for b in olds:
        b.dispose()
    everything: Model = {k: v for m in models for k, v in m.items()}
    latest = CompletedCheckpointStore(local_storage).latest()
    news = [backend(local_storage, tmp_path / "new", s, new_p) for s in range(new_p)]
    got: Model = {}
    for b in news:
        assert b.restore(latest).source == "rescale"
        part = read_all(b)
        assert not set(part) & set(got)
        got.update(part)
        b.dispose()
    assert got == everything


def test_an_aborted_checkpoint_breaks_no_chain(local_storage: CheckpointStorage, tmp_path: Path):
    s = Subtask(local_storage, tmp_path / "local", seed=4)
    s.checkpoint()
    b, model, rng, coord = s.b, s.model, s.rng, s.coord
    mutate(b, model, rng)
    pending = coord.trigger(expected={"ops": 1})
    b.snapshot(pending.checkpoint_id)  # its changelog holds the second batch of changes ...
    coord.abort(pending.checkpoint_id, reason="test")
    b.abort(pending.checkpoint_id)  # ... and is gone: the next one cannot extend it
    mutate(b, model, rng)
    done = take_checkpoint(coord, [b])
    (handle,) = done.metadata.operators["ops"].subtasks
    assert not any(cl.is_changelog(f.local_name) for f in handle.shared)  # materialized
    b.dispose()
    fresh = backend(local_storage, tmp_path / "fresh")
    fresh.restore(done.metadata)
    assert read_all(fresh) == model
    fresh.dispose()


def test_switching_the_changelog_on_and_off_keeps_the_state(local_storage: CheckpointStorage, tmp_path: Path):
    rng = random.Random(5)
    coord = CheckpointCoordinator(local_storage, num_retained=2)
    model: Model = {}
    for round_, enabled in enumerate([False, True, True, False, True]):
        b = backend(local_storage, tmp_path / f"local{round_ % 2}", changelog=ChangelogOptions(enabled=enabled))
        b.restore(CompletedCheckpointStore(local_storage).latest())
        assert read_all(b) == model
        mutate(b, model, rng)
        take_checkpoint(coord, [b])
        b.close()
    fresh = backend(local_storage, tmp_path / "fresh")
    fresh.restore(CompletedCheckpointStore(local_storage).latest())
    assert read_all(fresh) == model
    fresh.dispose()


def test_a_corrupt_changelog_on_storage_falls_back_to_an_older_checkpoint(
    local_storage: CheckpointStorage, tmp_path: Path
):
    s = Subtask(local_storage, tmp_path / "local", seed=6, retained=3)
    for _ in range(3):
        s.checkpoint()
    s.b.dispose()
    newest = CompletedCheckpointStore(local_storage).latest()
    assert newest is not None
    (handle,) = newest.operators["ops"].subtasks
    last = max((f for f in handle.shared if cl.is_changelog(f.local_name)), key=lambda f: f.local_name)
    path = Path(local_storage.abspath(last.path))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    fresh = backend(local_storage, tmp_path / "fresh")
    with pytest.raises(CheckpointCorrupted, match=last.path):
        fresh.restore(newest)
    retained = CompletedCheckpointStore(local_storage).load_all().checkpoints  # newest first
    (result,) = restore_with_fallback([fresh], retained)
    assert result.checkpoint_id == newest.checkpoint_id - 1 and result.fell_back_from == (newest.checkpoint_id,)
    assert read_all(fresh) == s.states[-2]
    fresh.dispose()


def test_task_local_copy_of_a_changelog_checkpoint_is_verified(local_storage: CheckpointStorage, tmp_path: Path):
    s = Subtask(local_storage, tmp_path / "local", seed=8)
    for _ in range(2):
        done = s.checkpoint()
    s.b.close()
    (s.b.dir / "working.json").unlink()
    local_log = s.b.dir / f"chk-{done.checkpoint_id}" / cl.local_name(done.checkpoint_id)
    data = bytearray(local_log.read_bytes())
    data[-3] ^= 0xFF
    local_log.write_bytes(bytes(data))
    again = backend(local_storage, tmp_path / "local")
    result = again.restore(done.metadata)
    assert result.source == "primary" and any(cl.local_name(done.checkpoint_id) in p for p in result.problems)
    assert read_all(again) == s.model
    again.dispose()
    shutil.rmtree(tmp_path / "local", ignore_errors=True)


_RESTORE_AND_DIE = """
import os, sys
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.state.backend import RocksDBStateBackend
from sparkpoint.state.engine.changelog import ChangelogOptions
storage = CheckpointStorage(sys.argv[1], "job")
b = RocksDBStateBackend(storage, "ops", 0, parallelism=1, max_parallelism=32, local_dir=sys.argv[2],
                        changelog=ChangelogOptions(enabled=True, materialize_share=10.0, max_chain=4))
assert b.restore(CompletedCheckpointStore(storage).latest()).source == "primary"
os._exit(0)  # killed right after the restore: no close, no flush
"""


def test_a_process_killed_after_replaying_leaves_a_working_database_that_is_the_checkpoint(
    local_storage: CheckpointStorage, tmp_path: Path
):
    import subprocess
    import sys

    s = Subtask(local_storage, tmp_path / "local", seed=9)
    for _ in range(3):
        done = s.checkpoint()
    s.b.dispose()
    subprocess.run(
        [sys.executable, "-c", _RESTORE_AND_DIE, local_storage.url, str(tmp_path / "other")], check=True
    )
    again = backend(local_storage, tmp_path / "other")
    assert again.restore(done.metadata).source == "working"
    assert read_all(again) == s.model
    again.dispose()


def test_range_deletes_drop_only_the_entries_written_before_them(tmp_path: Path):
    log = ChangeLog()
    log.put("s", b"a1", b"before")  # covered by the range below: dropped
    log.put("s", b"b1", b"outside")
    log.put("s", b"a2", b"before, rewritten after")
    log.delete_range("s", b"a", b"b")
    log.write_batch("s", [(b"a2", b"after")], [b"a3"])  # after the range: kept
    log.delete_range("s", b"a0", b"a1x")  # a later, nested range
    log.put("s", b"a1", b"last")  # ... and a write after it
    path = tmp_path / cl.local_name(1)
    log.write(path, ["s"])
    (section,) = cl.read(path)
    assert section.entries == [(b"a1", b"last"), (b"a2", b"after"), (b"a3", None), (b"b1", b"outside")]
    assert section.ranges == [(b"a", b"b"), (b"a0", b"a1x")]


def test_many_map_removals_in_one_checkpoint_stay_linear(local_storage: CheckpointStorage, tmp_path: Path):
    b = backend(local_storage, tmp_path / "local", max_parallelism=1)
    b.restore(None)
    maps = b.map_state("sessions", COUNTS)
    keys = [f"user-{i:06d}" for i in range(20_000)]
    maps.put_many((k, "e", (1,)) for k in keys)
    for k in keys[::2]:
        maps.remove_key(k)  # 10,000 range deletes over 20,000 logged entries
    coord = CheckpointCoordinator(local_storage)
    take_checkpoint(coord, [b])  # materializes: the first checkpoint
    maps.put_many((k, "f", (2,)) for k in keys[:4])
    for k in keys[:2]:
        maps.remove_key(k)
    done = take_checkpoint(coord, [b])
    b.dispose()
    fresh = backend(local_storage, tmp_path / "fresh", max_parallelism=1)
    fresh.restore(done.metadata)
    got = {(k.decode(), u.decode()) for k, u, _ in fresh.map_state("sessions", COUNTS).items()}
    assert got == {(k, "e") for k in keys[3::2]} | {(keys[2], "f"), (keys[3], "f")}
    fresh.dispose()


def test_a_changelog_that_compresses_very_well_and_spans_frames_reads_back(tmp_path: Path):
    log = ChangeLog()
    for i in range(9_000):  # 72 MiB of zero values: more than one 64 MiB frame, compressed ~10,000x
        log.put("sketches", b"k%06d" % i, bytes(8192))
    path = tmp_path / cl.local_name(3)
    size = log.write(path, ["sketches"])
    assert size < 200_000
    (section,) = cl.read(path)
    assert len(section.entries) == 9_000 and section.entries[-1] == (b"k008999", bytes(8192))


def test_hostile_changelog_contents_are_refused(tmp_path: Path):
    log = ChangeLog()
    log.put("s", b"k", b"v")
    log.delete_range("s", b"z", b"a")  # ends before it starts
    path = tmp_path / cl.local_name(1)
    log.write(path, ["s"])
    with pytest.raises(ChangelogFormatError, match="ends before it starts"):
        cl.read(path)


def test_metadata_of_a_chain_is_version_3_and_a_version_2_file_listing_one_is_refused(
    local_storage: CheckpointStorage, tmp_path: Path
):
    import json

    from sparkpoint.checkpoint.errors import MetadataError
    from sparkpoint.checkpoint.metadata import CheckpointMetadata, content_checksum

    s = Subtask(local_storage, tmp_path / "local", seed=10)
    first, second = s.checkpoint(), s.checkpoint()
    s.b.dispose()
    assert json.loads(first.metadata.dumps())["version"] == 2  # no chain: older readers still read it
    raw = json.loads(second.metadata.dumps())
    assert raw["version"] == 3
    raw["version"] = 2
    raw["checksum"] = content_checksum(raw)
    with pytest.raises(MetadataError, match="version.*changelog files"):
        CheckpointMetadata.loads(json.dumps(raw).encode())


def test_deep_verify_decodes_changelog_files(local_storage: CheckpointStorage, tmp_path: Path):
    import json
    import zlib

    from sparkpoint.checkpoint.metadata import CheckpointMetadata, content_checksum
    from sparkpoint.state.engine.verify import verify_checkpoint

    s = Subtask(local_storage, tmp_path / "local", seed=11)
    s.checkpoint()
    done = s.checkpoint()
    s.b.dispose()
    assert verify_checkpoint(local_storage, done.metadata) == []
    raw = json.loads(done.metadata.dumps())
    garbage = cl.MAGIC + b"\x05\x00\x00\x00{}}}}"
    for sub in raw["operators"]["ops"]["subtasks"]:  # a changelog written wrong, recorded faithfully
        for f in sub["shared"]:
            if cl.is_changelog(f["local_name"]) and f["created_by"] == done.checkpoint_id:
                local_storage.fs.pipe_file(local_storage.abspath(f["path"]), garbage)
                f.update(size=len(garbage), crc32=zlib.crc32(garbage))
    raw["checksum"] = content_checksum(raw)
    problems = verify_checkpoint(local_storage, CheckpointMetadata.loads(json.dumps(raw).encode()))
    assert len(problems) == 1 and "does not decode" in problems[0].problem


def test_a_growing_state_is_weighed_as_it_is_now_not_as_first_materialized(
    local_storage: CheckpointStorage, tmp_path: Path
):
    """New keys at every checkpoint make the chain outgrow the first, small materialization long
    before it is a share of the state: the chain is weighed against the larger of the two, so the
    state is not uploaded again for growing. Rewriting the same keys grows the chain, not the
    state, and materializes; every checkpoint restores exactly."""
    options = ChangelogOptions(enabled=True, materialize_share=1.0, max_chain=64)
    # L0 trigger 2: compactions soon merge the rewritten runs, so the working SSTs are the state
    b = backend(local_storage, tmp_path / "local", changelog=options, options=RocksDBOptions(level0_trigger=2))
    b.restore(None)
    coord = CheckpointCoordinator(local_storage, num_retained=2)
    values = b.value_state("values", COUNTS)
    rng = random.Random(5)
    model: dict[str, int] = {}
    kinds, chain_over_first = [], []

    def checkpoint(updates: dict[str, int], *, compacted: bool = False) -> None:
        values.put_many((k, (v,)) for k, v in updates.items())
        model.update(updates)
        if compacted:
            b.compact()
        done = take_checkpoint(coord, [b])
        (handle,) = done.metadata.operators["ops"].subtasks
        new = [f for f in handle.shared if f.created_by == done.checkpoint_id]
        kinds.append("log" if all(cl.is_changelog(f.local_name) for f in new) else "files")
        chain = sum(f.size for f in handle.shared if cl.is_changelog(f.local_name))
        chain_over_first.append(chain / sum(f.size for f in handle.shared if not cl.is_changelog(f.local_name)))
        restored = backend(local_storage, tmp_path / f"restored-{done.checkpoint_id}")
        restored.restore(done.metadata)
        assert dict((k.decode(), v[0]) for k, v in restored.value_state("values", COUNTS).items()) == model
        restored.dispose()

    checkpoint({f"first{i}": rng.randrange(1 << 60) for i in range(200)})
    for round_ in range(5):  # growing: 3,000 new keys each
        checkpoint({f"new{round_}-{i}": rng.randrange(1 << 60) for i in range(3000)})
    assert kinds == ["files"] + ["log"] * 5
    assert max(chain_over_first) > 2  # the old rule (chain ÷ first materialization) had materialized
    for _ in range(5):  # rewriting every key: the chain grows by a whole state each time
        # The rewrite merged before the checkpoint weighs it, not when background compaction gets
        # round to it: on a busy machine it lagged (even after a compaction before the writes, the
        # flush's runs were still being merged, inputs and outputs both live), the working SSTs
        # stayed several states large and outweighed the chain for all five rounds. Compacted,
        # the working SSTs are the state, once.
        checkpoint({k: rng.randrange(1 << 60) for k in model}, compacted=True)
    assert "files" in kinds[6:]
    b.dispose()


# A reading per device (not the sample's state): an overwritten state, the chain all excess.
READING = StructCodec[tuple[int, float, int]]("<qdq")


def test_the_chain_is_weighed_against_the_state_compacted_not_its_working_ssts(
    local_storage: CheckpointStorage, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The working database's SSTs hold the overwritten versions until a full compaction: a chain
    that calls for a materialization against the compacted state must not wait for that
    compaction (at 10% churn it put one off by several checkpoints)."""
    options = ChangelogOptions(enabled=True, materialize_share=0.3, max_chain=64, in_steps=False)
    b = make_backend(local_storage, tmp_path / "local", operator="meters", changelog=options)
    b.restore(None)
    coord = CheckpointCoordinator(local_storage, num_retained=3)
    rng = random.Random(3)
    devices = [f"dev-{i:05d}" for i in range(3000)]

    def overwrite(share: float) -> None:
        chosen = sorted(rng.sample(devices, int(share * len(devices))))
        b.value_state("readings", READING).put_many(
            (d, (rng.randrange(1000), rng.random(), rng.randrange(1 << 40))) for d in chosen)

    local = b._local
    real_live, real_compact = local.live_bytes, local.compact
    garbage = {"on": True}  # until compacted, db/ reports half its bytes again in overwritten versions
    compactions = []
    monkeypatch.setattr(local, "live_bytes", lambda: real_live() * (3 if garbage["on"] else 2) // 2)
    monkeypatch.setattr(local, "compact", lambda: (garbage.update(on=False), compactions.append(1), real_compact()))

    overwrite(1.0)
    take_checkpoint(coord, [b])  # the first: RocksDB's files
    overwrite(0.4)
    second = take_checkpoint(coord, [b])  # the chain before it is empty: a changelog checkpoint
    assert [cl.is_changelog(f.local_name) for f in second.metadata.files() if f.created_by == 2] == [True]
    assert compactions == []
    overwrite(0.4)
    third = take_checkpoint(coord, [b])  # the chain holds 40% of the state, all of it overwritten
    new = [f for f in third.metadata.files() if f.created_by == 3]
    assert compactions, "db/ was not compacted before the chain was weighed against it"
    assert new and not any(cl.is_changelog(f.local_name) for f in new), "the chain did not materialize"
    b.dispose()


def test_a_materialization_writes_its_ssts_smaller_than_the_working_database(tmp_path: Path):
    """The slices of a materialization are written once and read by every restore: larger blocks,
    harder compression (`rocksdb.MATERIALIZED_BLOCK_BYTES`)."""
    import rocksdict

    rng = random.Random(5)
    entries = sorted((f"dev-{i:06d}".encode(), READING.encode((rng.randrange(50), round(rng.random() * 1e3, 2),
                                                                1_767_225_600_000_000 + rng.randrange(10**9))))
                     for i in range(20_000))
    sizes = {}
    for materialized in (False, True):
        path = tmp_path / f"{materialized}.sst"
        writer = rocksdict.SstFileWriter(options=RocksDBOptions().build(create=True, materialized=materialized))
        writer.open(str(path))
        for key, value in entries:
            writer[key] = value
        writer.finish()
        sizes[materialized] = path.stat().st_size
    assert sizes[True] < 0.95 * sizes[False]


def test_raw_bytes_counts_the_keys_and_values_as_written(tmp_path: Path):
    """What a materialization's format saves is weighed per raw byte (`Staging.written_ratio`):
    RocksDB's table properties, without its own 8 bytes per key, give the bytes put."""
    from sparkpoint.state.engine.rocksdb import open_db, raw_bytes

    db = open_db(str(tmp_path / "db"), ["readings"], RocksDBOptions(), create=True)
    rng = random.Random(9)
    entries = {f"dev-{i:05d}".encode(): rng.randbytes(rng.randrange(1, 60)) for i in range(2000)}
    cf = db.get_column_family("readings")
    for key, value in entries.items():
        cf[key] = value
    cf.flush()
    try:
        assert raw_bytes(db, ["readings"]) == sum(len(k) + len(v) for k, v in entries.items())
    finally:
        db.close()
