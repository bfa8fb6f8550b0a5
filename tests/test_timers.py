"""Timers in RocksDB: registered per key and clock, fired in timestamp order once each, part of
every checkpoint (changelog included), following their key on a rescale; fired after a batch into
the operator's `on_timer`, whose rows are committed with that batch's checkpoint.

A user's own operator (reminders per account), not the sample's."""

from __future__ import annotations

import random
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.errors import StateBackendError
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.state.backend import RocksDBStateBackend, take_checkpoint
from sparkpoint.state.codecs import JsonCodec
from sparkpoint.state.engine.changelog import ChangelogOptions
from sparkpoint.state.keygroups import key_group_for
from sparkpoint.state.operators import KeyedOperator, fire_timers
from tests.support.backends import make_backend, owned

S = 1_000_000
T0 = 1_764_000_000 * S


backend = partial(make_backend, operator="reminders", max_parallelism=16)


def test_timers_are_listed_deleted_and_due_in_timestamp_order(local_storage: CheckpointStorage, tmp_path: Path):
    with backend(local_storage, tmp_path / "local", max_parallelism=64) as b:
        b.restore(None)
        with pytest.raises(StateBackendError, match="event-time timer would never fire"):
            b.timers.register("a", T0, clock="event")  # this subtask gets no watermark
        b.default_clock = "event"  # as with a pipeline that has an event time
        timers = b.timers
        timers.default_clock = "processing"
        timers.register("a", T0 + 30 * S)
        timers.register_many([("b", pd.Timestamp(T0 + 10 * S, unit="us", tz="UTC")),
                              ("a", np.datetime64(T0 + 20 * S, "us")),
                              ("c", datetime.fromtimestamp((T0 + 5 * S) / S, tz=UTC)),
                              ("old", -5 * S)])  # before the epoch: sorts first
        timers.register("a", T0 + 25 * S, clock="event")
        assert timers.list("a") == [T0 + 20 * S, T0 + 30 * S]
        assert timers.list("a", clock="event") == [T0 + 25 * S]
        timers.delete("a", T0 + 30 * S)
        assert timers.list("a") == [T0 + 20 * S]
        assert [k for _, k in timers.due("processing", T0 + 20 * S)] == [b"old", b"c", b"b", b"a"]
        fired = timers.pop_due(processing=T0 + 10 * S, event=T0 + 25 * S)
        assert list(fired.columns) == ["key", "timestamp"] and str(fired["timestamp"].dtype) == "datetime64[us, UTC]"
        assert list(fired["key"]) == ["old", "c", "b", "a"]
        assert list(fired["timestamp"].astype("int64")) == [-5 * S, T0 + 5 * S, T0 + 10 * S, T0 + 25 * S]
        assert timers.pop_due(processing=T0 + 10 * S, event=T0 + 25 * S).empty, "a timer fires once"
        assert timers.pending() == (1, T0 + 20 * S)
        with pytest.raises(TypeError):
            timers.register("a", "tomorrow")
        with pytest.raises(ValueError, match="clock"):
            timers.register("a", T0, clock="wall")


def remind(batch: pd.DataFrame, state: RocksDBStateBackend) -> None:
    state.timers.register_many(zip(batch["acct"], batch["due_us"]))


def chase(fired: pd.DataFrame, state: RocksDBStateBackend) -> pd.DataFrame:
    """Each fired reminder is logged; a first reminder schedules a second one 1 s later, due at once."""
    log = state.list_state("sent", JsonCodec())
    rows = []
    for key, ts in zip(fired["key"], fired["timestamp"].astype("int64")):
        sent = len(log.get(key))
        log.add(key, int(ts))
        if sent == 0:
            state.timers.register(key, int(ts) + S)
        rows.append((key, int(ts)))
    return pd.DataFrame(rows, columns=["acct", "fired_us"])


REMINDERS = KeyedOperator("reminders", key="acct", columns=("due_us",), process=remind,
                          export=lambda s: pd.DataFrame(), on_timer=chase, emits=True)


def test_fired_timers_go_to_on_timer_once_and_timers_it_registers_that_are_due_fire_in_the_same_batch(
    local_storage: CheckpointStorage, tmp_path: Path
):
    with backend(local_storage, tmp_path / "local") as b:
        b.restore(None)
        b.set_time(processing_us=T0 + 100 * S)
        REMINDERS.process(pd.DataFrame({"acct": ["x", "y"], "due_us": [T0 + 50 * S, T0 + 500 * S]}), b)
        out = pd.concat(fire_timers(REMINDERS, b, processing_us=T0 + 100 * S, watermark_us=None))
        assert list(zip(out["acct"], out["fired_us"])) == [("x", T0 + 50 * S), ("x", T0 + 51 * S)]
        assert fire_timers(REMINDERS, b, processing_us=T0 + 100 * S, watermark_us=None) == []
        assert b.timers.list("y") == [T0 + 500 * S]


def test_timers_without_on_timer_are_refused_naming_the_operator(local_storage: CheckpointStorage, tmp_path: Path):
    silent = KeyedOperator("silent_reminders", key="acct", columns=("due_us",), process=remind,
                           export=lambda s: pd.DataFrame())
    with backend(local_storage, tmp_path / "local") as b:
        b.restore(None)
        silent.process(pd.DataFrame({"acct": ["x"], "due_us": [T0]}), b)
        with pytest.raises(StateBackendError, match="'silent_reminders' registered 1 timer.*no on_timer"):
            fire_timers(silent, b, processing_us=T0, watermark_us=None)


@pytest.mark.parametrize(("old_p", "new_p"), [(2, 3), (3, 1)])
def test_timers_are_checkpointed_and_follow_their_keys_on_a_rescale(
    local_storage: CheckpointStorage, tmp_path: Path, old_p: int, new_p: int
):
    rng = random.Random(old_p + 10 * new_p)
    coord = CheckpointCoordinator(local_storage, num_retained=2)
    model: dict[str, list[int]] = {}
    olds = [backend(local_storage, tmp_path / "old", s, old_p, changelog=ChangelogOptions(enabled=True))
            for s in range(old_p)]
    for b in olds:
        b.restore(None)
    for _ in range(3):
        for b in olds:
            mine = owned(b, (f"a{i}" for i in range(300)))
            pairs = [(rng.choice(mine), T0 + rng.randrange(1000) * S) for _ in range(50)]
            b.timers.register_many(pairs)
            for k, at in pairs:
                model.setdefault(k, [])
                if at not in model[k]:
                    model[k].append(at)
        take_checkpoint(coord, olds)
    for b in olds:
        b.dispose()
    latest = CompletedCheckpointStore(local_storage).latest()
    news = [backend(local_storage, tmp_path / "new", s, new_p) for s in range(new_p)]
    seen: dict[str, list[int]] = {}
    fired: list[tuple[str, int]] = []
    for b in news:
        assert b.restore(latest).source == "rescale"
        for k in model:
            if key_group_for(k, 16) in b.key_group_range:
                seen[k] = b.timers.list(k)
        out = b.timers.pop_due(processing=T0 + 500 * S, event=None)
        fired += list(zip(out["key"], out["timestamp"].astype("int64")))
        assert list(out["timestamp"]) == sorted(out["timestamp"])
        b.dispose()
    assert seen == {k: sorted(v) for k, v in model.items()}
    assert sorted(fired) == sorted((k, at) for k, v in model.items() for at in v if at <= T0 + 500 * S)


def test_what_timers_emit_is_committed_with_the_batch_that_fired_them(tmp_path: Path):
    """Through the pipeline's own batch (the subtasks in this process, no JVM): the fired rows land
    in the sink with the checkpoint of the batch whose time made them due, exactly once."""
    from sparkpoint.pipeline.runtime import PipelineConfig
    from tests.support.interleavings import InProcessPipeline

    (tmp_path / "in").mkdir()
    now = int(pd.Timestamp.now(tz="UTC").value // 1000)
    pd.DataFrame({"acct": ["x", "y", "z"], "due_us": [now - 60 * S, now - 30 * S, now + 3600 * S]}).to_parquet(
        tmp_path / "in" / "b000.parquet")
    pd.DataFrame({"acct": ["w"], "due_us": [now - 10 * S]}).to_parquet(tmp_path / "in" / "b001.parquet")
    config = PipelineConfig(input_url=str(tmp_path / "in"), checkpoints_url=f"file://{tmp_path}/ckpt",
                            job_id="reminders", output_url=f"file://{tmp_path}/out", parallelism=2,
                            max_parallelism=16, local_dir=str(tmp_path / "local"))
    reports = InProcessPipeline(None, config, (REMINDERS,)).run()
    assert [r.checkpoint_id for r in reports] == [1, 2]
    out = pd.read_parquet(tmp_path / "out")
    got = sorted(zip(out["checkpoint_id"], out["acct"], out["fired_us"]))
    assert got == sorted([(1, "x", now - 60 * S), (1, "x", now - 59 * S), (1, "y", now - 30 * S),
                          (1, "y", now - 29 * S), (2, "w", now - 10 * S), (2, "w", now - 9 * S)])
