"""State TTL on real RocksDB: per entry, on processing time and on event time, for every kind of
state; never returned once expired; removed by the bounded sweep through the changelog; carried by
checkpoints, restores and rescales; turned on and off across a restore.

A user's own states here (a dedup set, last-seen customers), not the sample's."""

from __future__ import annotations

import math
import random
from functools import partial
from pathlib import Path

import pytest

from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.errors import StateBackendError
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.state.backend import RocksDBStateBackend, take_checkpoint
from sparkpoint.state.codecs import JsonCodec
from sparkpoint.state.engine.changelog import ChangelogOptions
from sparkpoint.state.keygroups import key_group_for
from sparkpoint.state.ttl import StateTtl
from tests.support.backends import make_backend, owned

S = 1_000_000  # microseconds per second
T0 = 1_764_000_000 * S
DAY = StateTtl(24 * 3600)


backend = partial(make_backend, operator="dedup", max_parallelism=16)


def raw_entries(b: RocksDBStateBackend, name: str) -> int:
    """Entries stored in the state's column family, expired or not (the format key aside)."""
    state = b.raw_state(name)
    try:
        return sum(1 for k, _ in state._scan(b"\x00\x00", b"\x80"))
    finally:
        state.release()


@pytest.mark.parametrize("seconds", [0, -1, math.nan, math.inf, True, "60"])
def test_a_ttl_must_be_a_finite_positive_number_of_seconds(seconds):
    with pytest.raises(ValueError, match="finite number of seconds above 0"):
        StateTtl(seconds)


def test_unknown_update_or_clock_is_refused():
    with pytest.raises(ValueError, match="update"):
        StateTtl(10, update="on_read")
    with pytest.raises(ValueError, match="clock"):
        StateTtl(10, clock="wall")


def test_expired_entries_are_never_returned_by_any_kind_of_state(local_storage: CheckpointStorage, tmp_path: Path):
    with backend(local_storage, tmp_path / "local") as b:
        b.restore(None)
        b.set_time(processing_us=T0)
        seen = b.value_state("seen", JsonCodec(), ttl=DAY)
        pages = b.map_state("pages", JsonCodec(), ttl=DAY)
        last = b.list_state("last", JsonCodec(), ttl=DAY)
        total = b.reducing_state("total", JsonCodec(), lambda a, c: a + c, ttl=DAY)
        seen.put_many([("c1", 1), ("c2", 2)])
        pages.put_many([("c1", "/a", 1), ("c1", "/b", 2)])
        last.add_many([("c1", "x"), ("c1", "y")])
        total.add_many([("c1", 5), ("c1", 6)])
        b.set_time(processing_us=T0 + 12 * 3600 * S)  # half a day later: c2 and /b are written again
        seen.put("c2", 3)
        pages.put("c1", "/b", 3)
        last.add("c1", "z")
        b.set_time(processing_us=T0 + DAY.micros + 1)  # one day and a microsecond after the first writes
        assert seen.get("c1") is None and seen.get_many(["c1", "c2"]) == [None, 3]
        assert list(seen.items()) == [(b"c2", 3)]
        assert pages.get("c1", "/a") is None and not pages.contains("c1", "/a")
        assert list(pages.entries("c1")) == [(b"/b", 3)]
        assert pages.put_absent([("c1", "/a", 9), ("c1", "/b", 9)]) == [True, False], "an expired entry is absent"
        assert last.get("c1") == ["z"] and list(last.items()) == [(b"c1", ["z"])]
        assert total.get("c1") is None
        total.add("c1", 1)
        assert total.get("c1") == 1, "an expired value is not folded into"


def test_reads_renew_entries_with_on_read_and_write(local_storage: CheckpointStorage, tmp_path: Path):
    with backend(local_storage, tmp_path / "local") as b:
        b.restore(None)
        b.set_time(processing_us=T0)
        renewed = b.value_state("renewed", JsonCodec(), ttl=StateTtl(60, update="on_read_and_write"))
        written = b.value_state("written", JsonCodec(), ttl=StateTtl(60))
        renewed.put("k", 1)
        written.put("k", 1)
        b.set_time(processing_us=T0 + 50 * S)
        assert renewed.get("k") == 1 and written.get("k") == 1
        b.set_time(processing_us=T0 + 100 * S)
        assert renewed.get("k") == 1, "the read at 50 s renewed it"
        assert written.get("k") is None


def test_event_time_ttl_expires_on_the_watermark(local_storage: CheckpointStorage, tmp_path: Path):
    with backend(local_storage, tmp_path / "local") as b:
        b.restore(None)
        sessions = b.value_state("sessions", JsonCodec(), ttl=StateTtl(600, clock="event"))
        with pytest.raises(StateBackendError, match="no watermark yet"):
            sessions.put("s", 1)
        b.set_time(processing_us=T0, watermark_us=T0)
        sessions.put("s", 1)
        b.set_time(processing_us=T0 + 10_000 * S, watermark_us=T0 + 600 * S)  # processing time flies: no matter
        assert sessions.get("s") == 1, "expired only once the watermark is greater than write + ttl"
        b.set_time(watermark_us=T0 + 600 * S + 1)
        assert sessions.get("s") is None
        b.set_time(watermark_us=T0)
        assert sessions.get("s") is None, "the watermark never goes back"


def test_the_sweep_removes_expired_entries_a_bounded_number_at_a_time(local_storage: CheckpointStorage, tmp_path: Path):
    with backend(local_storage, tmp_path / "local") as b:
        b.restore(None)
        b.set_time(processing_us=T0)
        seen = b.value_state("seen", JsonCodec(), ttl=StateTtl(60))
        seen.put_many((f"old{i}", i) for i in range(1000))
        b.set_time(processing_us=T0 + 30 * S)
        seen.put_many((f"new{i}", i) for i in range(100))
        b.set_time(processing_us=T0 + 61 * S)
        assert b.expire(limit=400) <= 400
        rounds = 1
        while raw_entries(b, "seen") > 100:
            b.expire(limit=400)
            rounds += 1
            assert rounds < 10
        assert rounds >= 3, "each sweep looked at no more than its limit"
        assert len(dict(seen.items())) == 100 and b.expire(limit=400) == 0


def mutate(b: RocksDBStateBackend, model: dict[str, tuple[int, int]], rng: random.Random, now: int, ttl: int):
    """Customers seen in this batch: their last visit, written at `now`."""
    state = b.value_state("last_seen", JsonCodec(), ttl=StateTtl(ttl / S))
    mine = owned(b, (f"c{i}" for i in range(600)))
    batch = {rng.choice(mine): rng.randrange(1000) for _ in range(120)}
    state.put_many(batch.items())
    model.update({k: (v, now) for k, v in batch.items()})
    b.expire()


def live(model: dict[str, tuple[int, int]], now: int, ttl: int) -> dict[str, int]:
    return {k: v for k, (v, at) in model.items() if at >= now - ttl}


def read(b: RocksDBStateBackend, ttl: int) -> dict[str, int]:
    return {k.decode(): v for k, v in b.value_state("last_seen", JsonCodec(), ttl=StateTtl(ttl / S)).items()}


@pytest.mark.parametrize("in_steps", [False, True], ids=["materialize-at-once", "materialize-in-steps"])
def test_stamps_and_removals_survive_changelog_checkpoints_restores_and_a_rescale(
    local_storage: CheckpointStorage, tmp_path: Path, in_steps: bool
):
    rng = random.Random(5)
    ttl = 3 * S  # three batches of one second each
    options = ChangelogOptions(enabled=True, materialize_share=0.5, max_chain=3, in_steps=in_steps,
                               slice_min_bytes=1024)
    coord = CheckpointCoordinator(local_storage, num_retained=2)
    model: dict[str, tuple[int, int]] = {}
    olds = [backend(local_storage, tmp_path / "old", s, 2, changelog=options) for s in range(2)]
    for b in olds:
        b.restore(None)
    now = T0
    for _ in range(10):
        now += S
        for b in olds:
            b.set_time(processing_us=now)
            mutate(b, model, rng, now, ttl)
        take_checkpoint(coord, olds)
    raw = sum(raw_entries(b, "last_seen") for b in olds)
    for b in olds:
        b.dispose()
    latest = CompletedCheckpointStore(local_storage).latest()
    assert latest is not None
    # The restored state expires against the checkpoint's own time until a batch sets its time.
    news = [backend(local_storage, tmp_path / "new", s, 3, changelog=options) for s in range(3)]
    merged: dict[str, int] = {}
    for b in news:
        assert b.restore(latest).source == "rescale"
        b.set_time(processing_us=now)
        merged |= read(b, ttl)
    assert merged == live(model, now, ttl)
    assert raw <= 2 * len(live(model, now, ttl)) + 240, "the sweep kept the stored entries near the live ones"
    later = now + 2 * S
    for b in news:
        b.set_time(processing_us=later)
    assert {k: v for b in news for k, v in read(b, ttl).items()} == live(model, later, ttl)
    for b in news:
        b.dispose()


def test_turning_a_ttl_on_and_off_across_a_restore_keeps_the_values(local_storage: CheckpointStorage, tmp_path: Path):
    coord = CheckpointCoordinator(local_storage, num_retained=2)
    b = backend(local_storage, tmp_path / "local")
    b.restore(None)
    b.value_state("profile", JsonCodec()).put_many([("c1", {"tier": "gold"}), ("c2", {"tier": "free"})])
    first = take_checkpoint(coord, [b])
    b.dispose()
    on = backend(local_storage, tmp_path / "on")
    on.restore(first.metadata)
    on.set_time(processing_us=T0)  # entries without a time stamp get the restore's time
    with_ttl = on.value_state("profile", JsonCodec(), ttl=StateTtl(60))
    assert dict(with_ttl.items()) == {b"c1": {"tier": "gold"}, b"c2": {"tier": "free"}}
    with_ttl.put("c3", {"tier": "new"})
    second = take_checkpoint(coord, [on])
    on.set_time(processing_us=T0 + 61 * S)
    assert dict(with_ttl.items()) == {}
    on.dispose()
    off = backend(local_storage, tmp_path / "off")
    off.restore(second.metadata)
    without = off.value_state("profile", JsonCodec())
    assert dict(without.items()) == {b"c1": {"tier": "gold"}, b"c2": {"tier": "free"}, b"c3": {"tier": "new"}}
    off.dispose()


def test_a_state_is_declared_one_way(local_storage: CheckpointStorage, tmp_path: Path):
    with backend(local_storage, tmp_path / "local") as b:
        b.restore(None)
        b.value_state("seen", JsonCodec(), ttl=DAY)
        with pytest.raises(StateBackendError, match="declare it one way"):
            b.value_state("seen", JsonCodec())


def test_a_rescale_onto_a_subtask_that_never_had_the_state_keeps_the_stamps(
    local_storage: CheckpointStorage, tmp_path: Path
):
    """The merged database grows from the old subtask with the largest overlap; when that one
    never created the state, the stamps' format key must come from the others (else every entry
    would be stamped twice and read back wrong)."""
    coord = CheckpointCoordinator(local_storage, num_retained=2)
    olds = [backend(local_storage, tmp_path / "old", s, 2) for s in range(2)]
    for b in olds:
        b.restore(None)
        b.set_time(processing_us=T0)
    keys = [k for k in (f"c{i}" for i in range(200)) if key_group_for(k, 16) in olds[1].key_group_range]
    olds[1].value_state("seen", JsonCodec(), ttl=StateTtl(60)).put_many((k, {"n": len(k)}) for k in keys)
    done = take_checkpoint(coord, olds)  # subtask 0 never made the state
    for b in olds:
        b.dispose()
    one = backend(local_storage, tmp_path / "one", 0, 1)
    assert one.restore(done.metadata).source == "rescale"
    one.set_time(processing_us=T0 + 30 * S)
    assert dict(one.value_state("seen", JsonCodec(), ttl=StateTtl(60)).items()) == {
        k.encode(): {"n": len(k)} for k in keys}
    one.set_time(processing_us=T0 + 61 * S)
    assert dict(one.value_state("seen", JsonCodec(), ttl=StateTtl(60)).items()) == {}
    one.dispose()


def test_the_sweep_goes_round_across_batches_and_reaches_states_a_batch_did_not_open(
        local_storage: CheckpointStorage, tmp_path: Path):
    """Each batch's backend is new (a Spark task): the sweep goes on where the last batch's stopped
    (else it would stall behind live entries at the front of the key groups), and a state no later
    batch touches (a customer list nobody reads any more) is still emptied, by the TTL its last
    declaration recorded."""
    hour = StateTtl(3600)
    coordinator = CheckpointCoordinator(local_storage, num_retained=1)
    with backend(local_storage, tmp_path / "local") as b:
        b.restore(None)
        b.set_time(processing_us=T0)
        b.value_state("seen", JsonCodec(), ttl=hour).put_many((f"old{i:03d}", i) for i in range(50))
        b.set_time(processing_us=T0 + 3600 * S)
        b.value_state("seen", JsonCodec(), ttl=hour).put_many((f"new{i:03d}", i) for i in range(50))
        take_checkpoint(coordinator, [b])
    removed = []
    for _ in range(11):  # batches 90 minutes later that touch no state, each sweeping 10 entries
        with backend(local_storage, tmp_path / "local") as b:
            b.restore(CompletedCheckpointStore(local_storage).latest())
            b.set_time(processing_us=T0 + 5400 * S)
            removed.append(b.expire(limit=10))
            facts = b.facts()
            take_checkpoint(coordinator, [b])
        assert facts["expired_removed"] == removed[-1]
    assert sum(removed) == 50, removed
    with backend(local_storage, tmp_path / "local") as b:
        b.restore(CompletedCheckpointStore(local_storage).latest())
        assert raw_entries_of(b, "seen") == 50


def raw_entries_of(b: RocksDBStateBackend, name: str) -> int:
    from sparkpoint.state.engine.rocksdb import entry_count

    assert b.db is not None, "restored: the working database is open"
    return entry_count(b.db.get_column_family(name))


def test_a_materialization_in_steps_leaves_out_what_expired_even_unswept(
    local_storage: CheckpointStorage, tmp_path: Path
):
    """The slices of a materialization hold no entry expired when they are written (Flink's TTL
    compaction filter, where sparkpoint rewrites state): with the sweep never run, a restore of the
    checkpoint that switches to them stores only the live entries, and reads them all; a state
    without a TTL keeps every entry."""
    options = ChangelogOptions(enabled=True, materialize_share=100.0, max_chain=4, in_steps=True, slice_min_bytes=1)
    coord = CheckpointCoordinator(local_storage, num_retained=2)
    with backend(local_storage, tmp_path / "local", changelog=options) as b:
        b.restore(None)
        b.set_time(processing_us=T0)
        b.value_state("visits", JsonCodec(), ttl=StateTtl(60)).put_many((f"old{i}", i) for i in range(400))
        b.value_state("plain", JsonCodec()).put_many((f"p{i}", i) for i in range(50))
        take_checkpoint(coord, [b])
        now = T0
        for n in range(10):  # a chain of four calls for a materialization; its slices follow, then the switch
            now += 30 * S
            b.set_time(processing_us=now)
            b.value_state("visits", JsonCodec(), ttl=StateTtl(60)).put_many((f"new{n}-{i}", i) for i in range(20))
            take_checkpoint(coord, [b])
        latest = CompletedCheckpointStore(local_storage).latest()
        assert latest is not None
        (handle,) = latest.operators["dedup"].subtasks
        assert not any(f.created_by == 1 for f in handle.shared), "the first materialization was replaced"
        assert not handle.staged, "by one made of slices"
    expected = {f"new{n}-{i}": i for n in range(7, 10) for i in range(20)}  # written within the last 60 s
    with backend(local_storage, tmp_path / "fresh", changelog=options) as fresh:
        fresh.restore(latest)
        fresh.set_time(processing_us=now)
        visits = fresh.value_state("visits", JsonCodec(), ttl=StateTtl(60))
        assert {k.decode(): v for k, v in visits.items()} == expected
        stored = raw_entries(fresh, "visits")
        assert stored < 400, f"{stored} entries stored: the expired old ones were materialized"
        assert raw_entries(fresh, "plain") == 50
