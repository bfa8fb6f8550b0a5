"""List state and reducing state on real RocksDB, through every checkpoint mechanism: the
changelog with materialization at once and in steps, incremental uploads, a restore from stable
storage and from the task-local copy, and rescaling by key groups.

The operator here is a user's own: the last events of a session per key (a list) and the largest
amount per key (a reducing state), not the sample's."""

from __future__ import annotations

import random
from functools import partial
from pathlib import Path

import pytest

from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.errors import StateBackendError
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.state.backend import RocksDBStateBackend, take_checkpoint
from sparkpoint.state.codecs import JsonCodec, StructCodec
from sparkpoint.state.engine.changelog import ChangelogOptions
from sparkpoint.state.keygroups import key_group_for
from sparkpoint.state.kinds import ListState
from tests.support.backends import make_backend, owned

EVENT = StructCodec[tuple[int, float]]("<qd")
AMOUNT = StructCodec[tuple[float]]("<d")
Lists = dict[str, list[tuple[int, float]]]


def biggest(a: tuple[float], b: tuple[float]) -> tuple[float]:
    return a if a[0] >= b[0] else b


backend = partial(make_backend, operator="sessions", max_parallelism=32)


def test_list_and_reducing_state_round_trip(local_storage: CheckpointStorage, tmp_path: Path):
    with backend(local_storage, tmp_path / "local") as b:
        b.restore(None)
        events = b.list_state("events", EVENT)
        top = b.reducing_state("top", AMOUNT, biggest)
        events.add("s1", (1, 1.5))
        events.add_many([("s2", (2, 2.0)), ("s1", (3, 0.5)), ("s1", (4, 9.0)), ("s2", (5, 1.0))])
        assert events.get("s1") == [(1, 1.5), (3, 0.5), (4, 9.0)]
        assert events.get_many(["s2", "none"]) == [[(2, 2.0), (5, 1.0)], []]
        events.put("s2", [(7, 7.0)])
        assert events.get("s2") == [(7, 7.0)]
        events.add("s2", (8, 8.0))
        assert events.get("s2") == [(7, 7.0), (8, 8.0)], "appends after a put go after what it wrote"
        events.delete("s1")
        assert sorted(events.items()) == [(b"s2", [(7, 7.0), (8, 8.0)])]
        top.add_many([("s1", (3.0,)), ("s1", (9.0,)), ("s2", (1.0,))])
        top.add("s1", (4.0,))
        assert top.get_many(["s1", "s2", "s3"]) == [(9.0,), (1.0,), None]
        top.delete("s2")
        assert list(top.items()) == [(b"s1", (9.0,))]
        with pytest.raises(StateBackendError, match="not a ListState"):
            b.list_state("top", EVENT)
        with pytest.raises(StateBackendError, match="not a ReducingState"):
            b.reducing_state("events", AMOUNT, biggest)


def test_an_append_reads_none_of_the_list(local_storage: CheckpointStorage, tmp_path: Path, monkeypatch):
    with backend(local_storage, tmp_path / "local") as b:
        b.restore(None)
        events = b.list_state("events", JsonCodec())
        events.add_many(("hot", i) for i in range(10_000))
        monkeypatch.setattr(ListState, "_scan", lambda *a: (_ for _ in ()).throw(AssertionError("scanned the list")))
        events.add("hot", 10_000)
        events.add_many([("hot", 10_001), ("cold", 0)])
        monkeypatch.undo()
        assert events.get("hot")[-3:] == [9_999, 10_000, 10_001] and len(events.get("hot")) == 10_002


def mutate(b: RocksDBStateBackend, lists: Lists, tops: dict[str, float], rng: random.Random, keyspace: int = 400):
    """A batch of appends, some replaced and deleted lists, and maxima."""
    events, top = b.list_state("events", EVENT), b.reducing_state("top", AMOUNT, biggest)
    mine = owned(b, (f"s{i}" for i in range(keyspace)))
    appends = [(rng.choice(mine), (rng.randrange(1 << 40), rng.random() * 100)) for _ in range(300)]
    events.add_many(appends)
    for key, value in appends:
        lists.setdefault(key, []).append(value)
    for key in rng.sample(mine, 3):
        if rng.random() < 0.5:
            events.delete(key)
            lists.pop(key, None)
        else:
            fresh = [(rng.randrange(100), 1.0)]
            events.put(key, fresh)
            lists[key] = list(fresh)
    amounts = [(rng.choice(mine), (rng.random() * 1000,)) for _ in range(200)]
    top.add_many(amounts)
    for key, (amount,) in amounts:
        tops[key] = max(tops.get(key, amount), amount)


def read(b: RocksDBStateBackend) -> tuple[Lists, dict[str, float]]:
    lists = {k.decode(): v for k, v in b.list_state("events", EVENT).items()}
    tops = {k.decode(): v[0] for k, v in b.reducing_state("top", AMOUNT, biggest).items()}
    return lists, tops


@pytest.mark.parametrize("in_steps", [False, True], ids=["materialize-at-once", "materialize-in-steps"])
def test_lists_and_maxima_survive_changelog_checkpoints_and_both_restores(
    local_storage: CheckpointStorage, tmp_path: Path, in_steps: bool
):
    rng = random.Random(11)
    options = ChangelogOptions(enabled=True, materialize_share=0.5, max_chain=3, in_steps=in_steps,
                               slice_min_bytes=1024)
    coord = CheckpointCoordinator(local_storage, num_retained=2)
    lists: Lists = {}
    tops: dict[str, float] = {}
    b = backend(local_storage, tmp_path / "local", changelog=options)
    b.restore(None)
    kinds = set()
    for _ in range(9):
        mutate(b, lists, tops, rng)
        done = take_checkpoint(coord, [b])
        (handle,) = done.metadata.operators["sessions"].subtasks
        kinds.add("changelog" if any(f.local_name.startswith("changelog-") for f in handle.shared) else "full")
    assert kinds == {"changelog", "full"}, "the run took changelog checkpoints and materialized"
    b.close()
    latest = CompletedCheckpointStore(local_storage).latest()
    assert latest is not None
    local = backend(local_storage, tmp_path / "local", changelog=options)
    assert local.restore(latest).source in ("working", "local")
    assert read(local) == (lists, tops)
    local.dispose()
    primary = backend(local_storage, tmp_path / "elsewhere", changelog=options)
    assert primary.restore(latest).source == "primary"
    assert read(primary) == (lists, tops)
    mutate(primary, lists, tops, rng)  # appends after a restore continue each list in order
    assert read(primary) == (lists, tops)
    primary.dispose()


@pytest.mark.parametrize(("old_p", "new_p"), [(2, 3), (3, 1)])
def test_a_rescale_gives_each_subtask_its_keys_whole_lists(
    local_storage: CheckpointStorage, tmp_path: Path, old_p: int, new_p: int
):
    rng = random.Random(old_p * 7 + new_p)
    coord = CheckpointCoordinator(local_storage, num_retained=2)
    lists: Lists = {}
    tops: dict[str, float] = {}
    olds = [backend(local_storage, tmp_path / "old", s, old_p, changelog=ChangelogOptions(enabled=True))
            for s in range(old_p)]
    for b in olds:
        b.restore(None)
    for _ in range(3):
        for b in olds:
            mutate(b, lists, tops, rng)
        take_checkpoint(coord, olds)
    for b in olds:
        b.dispose()
    at_checkpoint = ({k: list(v) for k, v in lists.items()}, dict(tops))
    latest = CompletedCheckpointStore(local_storage).latest()
    news = [backend(local_storage, tmp_path / "new", s, new_p) for s in range(new_p)]
    got_lists: Lists = {}
    got_tops: dict[str, float] = {}
    for b in news:
        assert b.restore(latest).source == "rescale"
        part_lists, part_tops = read(b)
        assert all(key_group_for(k, 32) in b.key_group_range for k in [*part_lists, *part_tops])
        got_lists |= part_lists
        got_tops |= part_tops
        mutate(b, lists, tops, rng)  # and they go on from there
    assert (got_lists, got_tops) == at_checkpoint
    done = take_checkpoint(coord, news)
    for b in news:
        b.dispose()
    again = [backend(local_storage, tmp_path / "again", s, new_p) for s in range(new_p)]
    final_lists: Lists = {}
    final_tops: dict[str, float] = {}
    for b in again:
        b.restore(done.metadata)
        part_lists, part_tops = read(b)
        final_lists |= part_lists
        final_tops |= part_tops
        b.dispose()
    assert (final_lists, final_tops) == (lists, tops)
