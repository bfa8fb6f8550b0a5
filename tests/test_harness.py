"""`sparkpoint.testing.OperatorHarness`: a user's operator on real RocksDB without Spark, batch by
batch, with clocks the test moves. Each state kind, a sessionization over event-time timers
(late rows dropped and processed) against pandas, TTL on both clocks, rescaling 1 -> 3 -> 2 through
snapshots against an unrescaled harness, and the errors.

The operators are the test's own (sessions, spend, devices, pages, peaks, nudges)."""

from __future__ import annotations

import gc
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from sparkpoint.checkpoint.errors import StateBackendError
from sparkpoint.state.backend import RocksDBStateBackend
from sparkpoint.state.codecs import JsonCodec
from sparkpoint.state.eventtime import EventTimeError
from sparkpoint.state.operators import KeyedOperator, from_micros, to_micros
from sparkpoint.state.ttl import StateTtl
from sparkpoint.testing import HarnessError, OperatorHarness

S = 1_000_000
T0 = 1_764_000_000 * S
ROOT = Path(__file__).resolve().parent.parent
JSON = JsonCodec()


def stamp(us: int) -> pd.Timestamp:
    return pd.Timestamp(us, unit="us", tz="UTC")


def events(rows: list[tuple[str, int]]) -> pd.DataFrame:
    """(user, seconds after T0) as a batch with an event-time column `ts`."""
    return pd.DataFrame({"user": [u for u, _ in rows],
                         "ts": pd.to_datetime([T0 + s * S for _, s in rows], unit="us", utc=True)})


def ordered(df: pd.DataFrame) -> pd.DataFrame:
    if df.empty:
        return df
    return df.sort_values(list(df.columns), kind="stable").reset_index(drop=True)


# --- one operator per state kind, each with its pandas recomputation ----------------------------


def spend_process(batch: pd.DataFrame, state: RocksDBStateBackend) -> pd.DataFrame:
    sums = batch.groupby("user")["amount"].sum()
    totals = state.value_state("total", JSON)
    totals.update_many(sums.index.tolist(), lambda k, old: (old or 0) + int(sums[k]))
    users = sums.index.tolist()
    return pd.DataFrame({"user": users, "total": totals.get_many(users)})


SPEND = KeyedOperator(
    "spend", key="user", columns=("amount",), process=spend_process, emits=True,
    export=lambda s: pd.DataFrame([(k.decode(), v) for k, v in s.value_state("total", JSON).items()],
                                  columns=["user", "total"]),
)


def devices_process(batch: pd.DataFrame, state: RocksDBStateBackend) -> None:
    counts = batch.groupby(["user", "device"]).size()
    seen = state.map_state("devices", JSON)
    old = seen.get_many(list(counts.index))
    seen.put_many((u, d, (o or 0) + int(n)) for (u, d), n, o in zip(counts.index, counts, old))


DEVICES = KeyedOperator(
    "devices", key="user", columns=("device",), process=devices_process,
    export=lambda s: pd.DataFrame([(u.decode(), d.decode(), n) for u, d, n in s.map_state("devices", JSON).items()],
                                  columns=["user", "device", "count"]),
)


PAGES = KeyedOperator(
    "pages", key="user", columns=("page",),
    process=lambda b, s: s.list_state("pages", JSON).add_many(zip(b["user"], b["page"])),
    export=lambda s: pd.DataFrame([(k.decode(), " ".join(v)) for k, v in s.list_state("pages", JSON).items()],
                                  columns=["user", "pages"]),
)


PEAKS = KeyedOperator(
    "peaks", key="user", columns=("amount",),
    process=lambda b, s: s.reducing_state("peak", JSON, max).add_many(zip(b["user"], b["amount"].tolist())),
    export=lambda s: pd.DataFrame([(k.decode(), v) for k, v in s.reducing_state("peak", JSON, max).items()],
                                  columns=["user", "peak"]),
)


def expected_table(op: KeyedOperator, seen: pd.DataFrame) -> pd.DataFrame:
    if op is SPEND:
        return seen.groupby("user")["amount"].sum().rename("total").reset_index()
    if op is DEVICES:
        return seen.groupby(["user", "device"]).size().rename("count").reset_index()
    if op is PAGES:
        return seen.groupby("user")["page"].agg(" ".join).rename("pages").reset_index()
    return seen.groupby("user")["amount"].max().rename("peak").reset_index()


def shop_batches(seed: int, n: int = 3) -> list[pd.DataFrame]:
    rng = np.random.default_rng(seed)
    return [pd.DataFrame({
        "user": [f"u{i}" for i in rng.integers(0, 40, 300)],
        "amount": rng.integers(1, 1000, 300),
        "device": [f"d{i}" for i in rng.integers(0, 4, 300)],
        "page": [f"p{i}" for i in rng.integers(0, 50, 300)],
    }) for _ in range(n)]


@pytest.mark.parametrize("op", [SPEND, DEVICES, PAGES, PEAKS], ids=lambda op: op.name)
def test_each_state_kind_exports_what_pandas_computes_over_every_batch(op: KeyedOperator):
    batches = shop_batches(seed=len(op.name))
    with OperatorHarness(op, parallelism=3, max_parallelism=16) as harness:
        for i, batch in enumerate(batches, start=1):
            out = harness.process(batch)
            seen = pd.concat(batches[:i], ignore_index=True)
            table = harness.export()
            assert ordered(table).equals(ordered(expected_table(op, seen)))
            assert list(table["user"]) == sorted(table["user"]), "the export is sorted by the key"
            if op is SPEND:  # what process returns: each user of the batch with the running total
                assert ordered(out).equals(ordered(expected_table(op, seen).query("user in @batch.user")))
            else:
                assert out.empty


# --- sessions: list state and event-time timers --------------------------------------------------

GAP = int(30.5 * S)  # never equal to a gap between whole seconds


def sessions_process(batch: pd.DataFrame, state: RocksDBStateBackend) -> None:
    times = to_micros(batch["ts"]).tolist()
    state.list_state("events", JSON).add_many(zip(batch["user"], times))
    state.timers.register_many((u, t + GAP) for u, t in zip(batch["user"], times))  # event time: the default


def gap_sessions(times: list[int]) -> list[list[int]]:
    groups: list[list[int]] = []
    for t in sorted(times):
        if groups and t - groups[-1][-1] < GAP:
            groups[-1].append(t)
        else:
            groups.append([t])
    return groups


def sessions_on_timer(fired: pd.DataFrame, state: RocksDBStateBackend) -> pd.DataFrame:
    """A user's sessions whose last event is a gap before the timer close: emitted, then forgotten."""
    log = state.list_state("events", JSON)
    rows = []
    for user, at in zip(fired["key"], to_micros(fired["timestamp"]).tolist()):
        keep = []
        for group in gap_sessions(log.get(user)):
            if group[-1] + GAP <= at:
                rows.append((user, group[0], group[-1], len(group)))
            else:
                keep += group
        log.put(user, keep) if keep else log.delete(user)
    return session_frame(rows)


def session_frame(rows: list[tuple[str, int, int, int]]) -> pd.DataFrame:
    return pd.DataFrame({"user": [r[0] for r in rows], "start": from_micros([r[1] for r in rows]),
                         "end": from_micros([r[2] for r in rows]), "events": [r[3] for r in rows]})


def sessions_export(state: RocksDBStateBackend) -> pd.DataFrame:
    return session_frame([(k.decode(), g[0], g[-1], len(g)) for k, times in state.list_state("events", JSON).items()
                          for g in gap_sessions(times)])


SESSIONS = KeyedOperator("sessions", key="user", columns=("ts",), process=sessions_process,
                         export=sessions_export, on_timer=sessions_on_timer, emits=True)


def pandas_sessions(rows: pd.DataFrame) -> pd.DataFrame:
    """Gap sessions per user, recomputed with pandas."""
    if rows.empty:
        return session_frame([])
    df = pd.DataFrame({"user": rows["user"], "t": to_micros(rows["ts"])}).sort_values(["user", "t"])
    new = (df["user"] != df["user"].shift()) | (df["t"].diff() >= GAP)
    grouped = df.groupby(new.cumsum().to_numpy())
    out = grouped.agg(user=("user", "first"), start=("t", "min"), end=("t", "max"), events=("t", "size"))
    return session_frame(list(out.itertuples(index=False, name=None)))


def pandas_watermarks(batches: list[pd.DataFrame], lateness_s: float) -> tuple[list[int | None], list[pd.Series]]:
    """The watermark after each batch, and each batch's late-row mask, recomputed with pandas."""
    marks: list[int | None] = []
    lates = []
    mark: int | None = None
    for batch in batches:
        times = pd.Series(to_micros(batch["ts"]))
        lates.append(times < mark if mark is not None else pd.Series(False, index=times.index))
        candidate = int(times.max()) - int(lateness_s * S)
        mark = candidate if mark is None else max(mark, candidate)
        marks.append(mark)
    return marks, lates


def test_sessions_close_a_gap_after_their_last_event_as_pandas_computes_with_late_rows_dropped():
    rng = np.random.default_rng(11)
    batches = [events([(f"u{u}", 20 * k + int(d)) for u, d in zip(rng.integers(0, 12, 60), rng.integers(-45, 20, 60))])
               for k in range(8)]
    marks, lates = pandas_watermarks(batches, lateness_s=5)
    kept: list[pd.DataFrame] = []
    emitted: list[pd.DataFrame] = []
    with OperatorHarness(SESSIONS, parallelism=2, max_parallelism=32, event_time="ts", allowed_lateness=5) as h:
        for batch, mark, late in zip(batches, marks, lates):
            emitted.append(h.process(batch))
            kept.append(batch.loc[~late.to_numpy()])
            assert h.watermark == mark
            everything = pandas_sessions(pd.concat(kept))
            closed = everything["end"].astype("int64") + GAP <= mark
            assert ordered(pd.concat(emitted)).equals(ordered(everything.loc[closed].reset_index(drop=True)))
            assert ordered(h.export()).equals(ordered(everything.loc[~closed].reset_index(drop=True)))
        assert h.late_rows == sum(int(late.sum()) for late in lates) > 0
        emitted.append(h.advance_watermark(stamp(T0 + 10_000 * S)))
        assert h.export().empty
    final = ordered(pd.concat(emitted))
    assert final.equals(ordered(pandas_sessions(pd.concat(kept))))
    assert final["events"].sum() == sum(len(b) for b in batches) - sum(int(late.sum()) for late in lates)


@pytest.mark.parametrize("late", ["drop", "process"])
def test_late_rows_are_counted_and_dropped_or_processed_and_a_due_session_closes_in_the_same_call(late: str):
    first = events([("u1", 0), ("u1", 10), ("u2", 100)])  # watermark 95: u1's session closes at 40.5
    second = events([("u2", 90), ("u3", 50), ("u2", 110)])  # 90 and 50 are late; 50 is far from anything
    with OperatorHarness(SESSIONS, parallelism=2, event_time="ts", allowed_lateness=5, late=late) as h:
        out1 = h.process(first)
        assert ordered(out1).equals(ordered(pandas_sessions(events([("u1", 0), ("u1", 10)]))))
        out2 = h.process(second)
        assert h.late_rows == 2 and h.watermark == T0 + 105 * S
        out3 = h.advance_watermark(T0 + 1000 * S)
    if late == "process":  # u3's timer (80.5) is due when process registers it: it fires in this call
        assert ordered(out2).equals(ordered(pandas_sessions(events([("u3", 50)]))))
        kept = pd.concat([first, second])
    else:
        assert out2.empty
        kept = pd.concat([first, second.iloc[[2]]])
    assert ordered(pd.concat([out1, out2, out3])).equals(ordered(pandas_sessions(kept)))


# --- timers registered by on_timer ---------------------------------------------------------------


def chase_on_timer(fired: pd.DataFrame, state: RocksDBStateBackend) -> pd.DataFrame:
    """Every reminder schedules the next one 1 s later, three times in all."""
    sent = state.value_state("sent", JSON)
    for user, at in zip(fired["key"], to_micros(fired["timestamp"]).tolist()):
        count = (sent.get(user) or 0) + 1
        sent.put(user, count)
        if count < 4:
            state.timers.register(user, at + S)
    return pd.DataFrame({"user": fired["key"], "at": fired["timestamp"]})


CHASE = KeyedOperator(
    "chase", key="user", process=lambda b, s: s.timers.register_many((u, T0 + 10 * S) for u in b["user"]),
    export=lambda s: pd.DataFrame([(k.decode(), v) for k, v in s.value_state("sent", JSON).items()],
                                  columns=["user", "sent"]),
    on_timer=chase_on_timer,
)


def test_timers_that_on_timer_registers_for_a_time_already_due_fire_in_the_same_call():
    with OperatorHarness(CHASE, parallelism=2, processing_time=T0) as h:
        assert h.process(pd.DataFrame({"user": ["a", "b"]})).empty
        assert h.advance_processing_time(T0 + 9 * S).empty
        assert h.state_of("a").timers.list("a", clock="processing") == [T0 + 10 * S]
        out = h.advance_processing_time(stamp(T0 + 100 * S))
        assert sorted(zip(out["user"], to_micros(out["at"]).tolist())) == [
            (u, T0 + s * S) for u in "ab" for s in (10, 11, 12, 13)]
        assert h.export().to_dict("records") == [{"user": "a", "sent": 4}, {"user": "b", "sent": 4}]
        assert h.advance_processing_time(T0 + 200 * S).empty, "each timer fires once"


# --- TTL on both clocks ----------------------------------------------------------------------------


def seen_operator(clock: str) -> KeyedOperator:
    ttl = StateTtl(60, clock=clock)
    return KeyedOperator(
        f"seen_{clock}", key="user", columns=("ts",) if clock == "event" else (),
        process=lambda b, s: s.map_state("seen", JSON, ttl=ttl).put_many((u, "any", 1) for u in b["user"]),
        export=lambda s: pd.DataFrame([u.decode() for u, _, _ in s.map_state("seen", JSON, ttl=ttl).items()],
                                      columns=["user"]),
    )


def test_processing_time_ttl_expires_entries_as_the_harness_clock_moves():
    with OperatorHarness(seen_operator("processing"), parallelism=2, processing_time=stamp(T0)) as h:
        h.process(pd.DataFrame({"user": ["u1", "u2", "u3"]}))
        assert h.advance_processing_time(T0 + 30 * S).empty
        assert list(h.export()["user"]) == ["u1", "u2", "u3"]
        h.process(pd.DataFrame({"user": ["u2"]}))  # written again at T0 + 30 s
        h.advance_processing_time(T0 + 61 * S)
        assert list(h.export()["user"]) == ["u2"]
        subtasks = {id(b): b for b in map(h.state_of, ["u1", "u2", "u3"])}.values()
        removed = sum(b.map_state("seen", JSON, ttl=StateTtl(60)).expired_removed for b in subtasks)
        assert removed == 2, "the sweep after the clock moved deleted the expired entries"
        h.advance_processing_time(T0 + 91 * S)
        assert h.export().empty


def test_event_time_ttl_expires_entries_as_the_watermark_moves():
    with OperatorHarness(seen_operator("event"), parallelism=3, event_time="ts") as h:
        h.process(events([("u1", 0), ("u2", 50)]))  # both stamped with the watermark: T0 + 50 s
        h.process(events([("u2", 100)]))  # u2 again at watermark T0 + 100 s
        h.advance_watermark(T0 + 109 * S)
        assert list(h.export()["user"]) == ["u1", "u2"]
        h.advance_watermark(T0 + 111 * S)
        assert list(h.export()["user"]) == ["u2"]
        h.advance_watermark(T0 + 161 * S)
        assert h.export().empty


# --- snapshots and rescaling -----------------------------------------------------------------------


def nudges_process(batch: pd.DataFrame, state: RocksDBStateBackend) -> None:
    """Remember a user for 100 s (processing-time TTL) and nudge them 45 s after their visit."""
    now = state.clock("processing")
    assert now is not None
    state.value_state("visits", JSON, ttl=StateTtl(100)).update_many(
        batch["user"].unique().tolist(), lambda k, old: (old or 0) + 1)
    state.timers.register_many((u, now + 45 * S) for u in batch["user"].unique())


NUDGES = KeyedOperator(
    "nudges", key="user", process=nudges_process,
    export=lambda s: pd.DataFrame([(k.decode(), v) for k, v in s.value_state("visits", JSON, ttl=StateTtl(100))
                                   .items()], columns=["user", "visits"]),
    on_timer=lambda fired, s: pd.DataFrame({"user": fired["key"], "at": fired["timestamp"]}),
)


def sessions_steps(rng: np.random.Generator) -> list[tuple[str, object]]:
    def batch(k: int) -> pd.DataFrame:
        return events([(f"u{u}", 40 * k + int(d)) for u, d in zip(rng.integers(0, 30, 80), rng.integers(-50, 30, 80))])
    return [("process", batch(0)), ("process", batch(1)), ("snapshot", 3),
            ("process", batch(2)), ("watermark", T0 + 130 * S), ("process", batch(3)), ("snapshot", 2),
            ("process", batch(4)), ("watermark", T0 + 400 * S)]


def nudges_steps(rng: np.random.Generator) -> list[tuple[str, object]]:
    def batch() -> pd.DataFrame:
        return pd.DataFrame({"user": [f"u{i}" for i in rng.integers(0, 50, 40)]})
    return [("process", batch()), ("clock", T0 + 20 * S), ("process", batch()), ("snapshot", 3),
            ("clock", T0 + 50 * S), ("process", batch()), ("snapshot", 2), ("clock", T0 + 110 * S),
            ("process", batch()), ("clock", T0 + 200 * S)]


@pytest.mark.parametrize(("op", "steps", "event_time"),
                         [(SESSIONS, sessions_steps, "ts"), (NUDGES, nudges_steps, None)], ids=["sessions", "nudges"])
def test_a_harness_rescaled_1_3_2_through_snapshots_exports_and_fires_as_one_that_never_rescaled(
    op: KeyedOperator, steps, event_time: str | None
):
    script = steps(np.random.default_rng(5))
    settings = dict(max_parallelism=24, event_time=event_time, allowed_lateness=3 if event_time else 0)
    steady = OperatorHarness(op, parallelism=1, processing_time=T0, **settings)
    moving = OperatorHarness(op, parallelism=1, processing_time=T0, **settings)
    fired_rows = 0
    try:
        for what, arg in script:
            if what == "snapshot":
                snap = moving.snapshot()
                moving.close()
                moving = OperatorHarness.restore(snap, parallelism=arg)
                assert (moving.parallelism, moving.max_parallelism) == (arg, 24)
                assert (moving.watermark, moving.processing_time, moving.late_rows) == (
                    steady.watermark, steady.processing_time, steady.late_rows)
            else:
                call = {"process": "process", "watermark": "advance_watermark",
                        "clock": "advance_processing_time"}[what]
                expected, got = getattr(steady, call)(arg), getattr(moving, call)(arg)
                assert ordered(got).equals(ordered(expected))
                fired_rows += len(got)
            assert ordered(moving.export()).equals(ordered(steady.export()))
        assert moving.parallelism == 2 and fired_rows > 0
        if event_time:
            assert moving.late_rows == steady.late_rows > 0
    finally:
        steady.close()
        moving.close()


def test_a_snapshot_outlives_its_harness_and_its_files_go_with_the_last_reference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with OperatorHarness(SPEND, parallelism=2) as h:
        h.process(pd.DataFrame({"user": ["a", "b"], "amount": [1, 2]}))
    assert list(tmp_path.iterdir()) == [], "closing deletes the working files and the unreferenced checkpoints"
    with OperatorHarness(SPEND, parallelism=2) as h:
        h.process(pd.DataFrame({"user": ["a", "b"], "amount": [1, 2]}))
        snap = h.snapshot()
        h.process(pd.DataFrame({"user": ["a"], "amount": [10]}))  # after the snapshot: not in it
    with OperatorHarness.restore(snap, 1) as restored:
        assert restored.export().to_dict("records") == [{"user": "a", "total": 1}, {"user": "b", "total": 2}]
    assert [p.name.startswith("sparkpoint-harness-checkpoints-") for p in tmp_path.iterdir()] == [True]
    del snap
    gc.collect()
    assert list(tmp_path.iterdir()) == []


# --- errors ----------------------------------------------------------------------------------------


def test_bad_input_is_refused_before_the_state_is_touched():
    with OperatorHarness(SESSIONS, parallelism=2, event_time="ts") as h:
        h.process(events([("u1", 0)]))
        before = (h.export(), h.watermark, h.late_rows)
        with pytest.raises(HarnessError, match=r"'user' has 1 null key.*sessions cannot key them"):
            h.process(pd.concat([events([("u2", 5)]), pd.DataFrame({"user": [None], "ts": [stamp(T0)]})]))
        with pytest.raises(EventTimeError, match="'ts' is (object|str), not a timestamp"):
            h.process(pd.DataFrame({"user": ["u2"], "ts": ["yesterday"]}))
        with pytest.raises(EventTimeError, match="null"):
            h.process(pd.DataFrame({"user": ["u2"], "ts": pd.Series([pd.NaT], dtype="datetime64[us, UTC]")}))
        with pytest.raises(HarnessError, match="lacks column.*user"):
            h.process(pd.DataFrame({"name": ["u2"], "ts": [stamp(T0)]}))
        with pytest.raises(HarnessError, match="watermark never goes back"):
            h.advance_watermark(T0 - S)
        with pytest.raises(HarnessError, match="processing time cannot go back"):
            h.advance_processing_time(h.processing_time - 1)
        assert h.export().equals(before[0]) and (h.watermark, h.late_rows) == before[1:]
    with OperatorHarness(PAGES, event_time="ts") as h:  # an operator that does not read the event time
        with pytest.raises(EventTimeError, match="no event-time column 'ts'"):
            h.process(pd.DataFrame({"user": ["u2"], "page": ["/"]}))
        assert h.export().empty and h.watermark is None


def test_settings_the_pipeline_would_refuse_are_refused():
    for kwargs, message in [({"allowed_lateness": -1}, "allowed_lateness"), ({"late": "keep"}, "late must be"),
                            ({"event_time": ""}, "event_time must name"), ({"parallelism": 0}, "parallelism"),
                            ({"parallelism": 9, "max_parallelism": 8}, "parallelism")]:
        with pytest.raises(HarnessError, match=message):
            OperatorHarness(SPEND, **kwargs)
    with OperatorHarness(SPEND) as h, pytest.raises(HarnessError, match="no event_time"):
        h.advance_watermark(T0)
    h.close()
    with pytest.raises(HarnessError, match="closed"):
        h.process(pd.DataFrame({"user": ["a"], "amount": [1]}))


def test_what_the_state_layer_refuses_reaches_the_test():
    silent = KeyedOperator("silent", key="user", process=lambda b, s: s.timers.register_many(
        (u, T0) for u in b["user"]), export=lambda s: pd.DataFrame())
    with OperatorHarness(silent, processing_time=T0) as h, pytest.raises(
            StateBackendError, match="'silent' registered 1 timer.*no on_timer"):
        h.process(pd.DataFrame({"user": ["a"]}))
    with OperatorHarness(seen_operator("event")) as h, pytest.raises(StateBackendError, match="no watermark yet"):
        h.process(events([("u1", 0)]))  # an event-time TTL in a harness without event_time
    wakes = KeyedOperator("wakes", key="user", process=lambda b, s: s.timers.register_many(
        ((u, T0) for u in b["user"]), clock="event"), export=lambda s: pd.DataFrame(), on_timer=lambda f, s: None)
    with OperatorHarness(wakes) as h, pytest.raises(StateBackendError, match="event-time timer would never fire"):
        h.process(pd.DataFrame({"user": ["a"]}))


def test_the_test_tools_import_no_spark_or_orchestrator():
    code = ("import sys, sparkpoint.testing; "
            "print(sorted(m for m in ('pyspark', 'dagster', 'airflow') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr[-2000:]


def test_the_guide_example_runs():
    from tests.support.docs_text import python_blocks, section

    blocks = python_blocks(section("writing-operators.md", "## Testing an operator"))
    assert blocks
    for block in blocks:
        exec(compile(block, "docs/writing-operators.md", "exec"), {})


def test_an_operator_that_raises_leaves_the_watermark_and_late_rows_as_they_were():
    def fussy(batch: pd.DataFrame, state: RocksDBStateBackend) -> None:
        if "boom" in set(batch["user"]):
            raise RuntimeError("boom")

    op = KeyedOperator("fussy", key="user", columns=("ts",), process=fussy, export=lambda s: pd.DataFrame())
    with OperatorHarness(op, parallelism=2, event_time="ts") as h:
        h.process(events([("a", 100)]))
        with pytest.raises(RuntimeError, match="boom"):
            h.process(events([("a", 50), ("boom", 500)]))
        assert (h.watermark, h.late_rows) == (T0 + 100 * S, 0)
        h.process(events([("a", 50)]))
        assert (h.watermark, h.late_rows) == (T0 + 100 * S, 1)
