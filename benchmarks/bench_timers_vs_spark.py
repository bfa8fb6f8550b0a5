"""Timers at scale: sessionization with an event-time timer per user, sparkpoint against Spark's
`transformWithStateInPandas` on the same files in one run (issue 32).

The input is a clickstream in the sessions example's columns (`event_id`, `user`, `page`,
`clicked_at`; `examples/sessions`): `--batches` Parquet files, batch i holding the clicks of
[i, i + 1) x `BATCH_SECONDS` of event time, no click late. Each of `--users` users is in a
session or idle: a user in a session clicks 1-3 times in every batch (so its clicks never lie
`GAP` apart), ends the session after a batch with probability `END`, then stays idle 4 + a
geometric number of batches (mean 10 in all). About half the users are in a session at any time;
each of them moves its one timer every batch (a delete and a register), and about 10% of the
pending timers fire per batch. The default, 40,000 users x 50 batches, registers about 10^6
timers over the job; `--quick` is a smoke test.

Three jobs, each on the same files, in one process on `local[2]` with 4 partitions:

* sparkpoint/sessions: the example's `sessions` operator (list state of a user's open clicks, an
  event-time timer at the earliest session's last click + GAP, `on_timer` emits closed sessions
  to the exactly-once Parquet sink), watermark = max event time - `LATENESS`, parallelism 4,
  changelog checkpoints (the defaults), one checkpoint per file;
* sparkpoint/appends: the same job without timers: every click appended to the same list state,
  sessions never closed (the state's cost without the timers);
* spark/tws: `groupBy("user").transformWithStateInPandas` with a `StatefulProcessor` doing what
  the example's operator does (ListState of open clicks, `registerTimer` / `deleteTimer` at the
  earliest session's end, `handleExpiredTimer` emits closed sessions), `TimeMode` EventTime,
  `withWatermark(clicked_at, LATENESS)`, as a streaming query over the input directory with
  `maxFilesPerTrigger` 1 and `trigger(availableNow=True)`, Parquet file sink; Spark's RocksDB
  state store provider with changelog checkpointing on, the store settings of
  `bench_vs_spark` (4 shuffle partitions, minBatchesToRetain 5, maintenance every 2 s).

Measured: events/s = input events ÷ wall time of the whole run (ours: from the pipeline's start
to its last checkpoint; Spark: from `start()` to the query's end), both after a warm-up run of
every job on small data; bytes written to the checkpoint location, counted as `bench_vs_spark`
counts them (files new or changed size since the previous listing, hidden files left out): for
ours the directory is listed after every checkpoint, for Spark (its batches run back to back)
a thread lists it every `POLL_S` seconds while the query runs and each file counts once, at the
largest size seen; bytes per checkpoint = that total ÷ the checkpoints (Spark: committed
batches, its no-data batches included). The live state at the end is what a restore reads
(`bench_vs_spark.ours_state` / `spark_state`). Closed sessions per user of ours and of Spark are
compared with each other and with a pandas recomputation from the input (sessions whose last
click + GAP is at or below the final watermark).

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.bench_timers_vs_spark            # ~10^6 timers
    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.bench_timers_vs_spark --users 8000 --batches 25 --repeat 2
    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.bench_timers_vs_spark --quick    # ~2 min, smoke test

The default (40,000 users x 50 files, about 2 million events) has not been run on this machine:
from the second line's run (~10^5 timers, 16 minutes for two runs of each job) it would take
about an hour, two thirds of it Spark's.
    ... --example DIR   # the sessions example's project directory (default examples/sessions)

Prints a table, writes benchmarks/results/timers_vs_spark.json (timers_vs_spark_quick.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from benchmarks.bench_vs_spark import SPARK_CHANGELOG, SPARK_CONF, listing, new_files, ours_state, spark_state
from sparkpoint import JsonCodec, KeyedOperator, Pipeline

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
BATCH_SECONDS = 240  # event time per batch: 2 x 240 s < GAP, so a user clicking every batch stays in one session
LATENESS = 60  # seconds the watermark trails the latest click
END = 0.10  # a session ends after a batch with this probability
IDLE_MIN, IDLE_MEAN = 4, 10  # batches a user stays idle after a session (4 x 240 s > GAP + LATENESS)
PARALLELISM = 4
POLL_S = 0.25
START = pd.Timestamp("2026-11-01", tz="UTC")
CLICK = JsonCodec()  # the example's codec for one click
SCHEMA = "event_id string, user string, page string, clicked_at timestamp"
OUTPUT = "user string, session_start timestamp, session_end timestamp, clicks long, pages string"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def use_example(directory: Path) -> Any:
    """The sessions example's operators module, importable here and in Spark's Python workers."""
    if not (directory / "sessions" / "operators.py").exists():
        raise SystemExit(f"no sessions example at {directory} (pass --example DIR, the example's project directory)")
    sys.path.insert(0, str(directory))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(directory), os.environ.get("PYTHONPATH")]))
    import sessions.operators as example

    return example


# --- input -------------------------------------------------------------------------------------


def make_inputs(directory: Path, users: int, batches: int, seed: int) -> dict[str, Any]:
    """The batch files; returns per batch the clicks and the users that clicked (each moves its timer)."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True)
    active = rng.random(users) < 0.5  # about the steady state from the first batch on
    idle_left = np.where(active, 0, rng.integers(1, 2 * IDLE_MEAN - IDLE_MIN, size=users))
    clicks, clicking = [], []
    for i in range(batches):
        who = np.flatnonzero(active)
        per_user = rng.integers(1, 4, size=len(who))
        ids = np.repeat(who, per_user)
        ms = rng.integers(0, BATCH_SECONDS * 1000, size=len(ids))  # whole milliseconds: Spark's timers are ms
        order = rng.permutation(len(ids))
        frame = pd.DataFrame({
            "event_id": pd.array([f"e{i:05d}-{j:07d}" for j in range(len(ids))], dtype="string"),
            "user": pd.array([f"u{u:07d}" for u in ids[order]], dtype="string"),
            "page": pd.array([f"/p/{p}" for p in rng.integers(0, 50, size=len(ids))], dtype="string"),
            "clicked_at": pd.Series(START + pd.to_timedelta(i * BATCH_SECONDS * 1000 + ms[order], unit="ms")
                                    ).astype("datetime64[us, UTC]"),
        })
        frame.to_parquet(directory / f"clicks-{i:05d}.parquet", index=False)
        clicks.append(len(frame))
        clicking.append(len(who))
        # after the batch: sessions end, idle users count down and come back
        ending = active & (rng.random(users) < END)
        idle_left[ending] = IDLE_MIN + rng.geometric(1 / (IDLE_MEAN - IDLE_MIN + 1), size=int(ending.sum())) - 1
        active &= ~ending
        waiting = ~active & ~ending
        idle_left[waiting] -= 1
        active |= waiting & (idle_left <= 0)
    return {"events": clicks, "users_clicking": clicking}


def expected_sessions(directory: Path, gap_us: int, final_watermark_us: int) -> set[tuple[str, int, int, int]]:
    """(user, first click µs, last click µs, clicks) of every session closed by the final watermark."""
    frame = pd.read_parquet(directory, columns=["user", "clicked_at"])
    at = frame["clicked_at"].astype("datetime64[us, UTC]").astype("int64")
    frame = frame.assign(at=at).sort_values(["user", "at"]).reset_index(drop=True)
    users = frame["user"].astype(str).to_numpy()
    at_us = frame["at"].to_numpy()
    new_session = np.ones(len(frame), dtype=bool)
    new_session[1:] = (users[1:] != users[:-1]) | (np.diff(at_us) >= gap_us)
    frame["session"] = np.cumsum(new_session)
    s = frame.groupby("session").agg(user=("user", "first"), start=("at", "min"), end=("at", "max"),
                                     clicks=("at", "size"))
    s = s[s["end"] + gap_us <= final_watermark_us]
    return set(zip(s["user"].astype(str), s["start"].tolist(), s["end"].tolist(), s["clicks"].tolist()))


def utc_micros(timestamps: pd.Series) -> list[int]:
    """Timestamps as int µs since the epoch (naive ones, as Spark writes them here, taken as UTC)."""
    return pd.to_datetime(timestamps, utc=True).astype("datetime64[us, UTC]").astype("int64").tolist()


def sessions_in(output: Path) -> set[tuple[str, int, int, int]]:
    if not output.exists() or not any(output.glob("*.parquet")):
        return set()
    frame = pd.read_parquet(output, columns=["user", "session_start", "session_end", "clicks"])
    start, end = utc_micros(frame["session_start"]), utc_micros(frame["session_end"])
    return set(zip(frame["user"].astype(str), start, end, frame["clicks"].astype("int64").tolist()))


# --- sparkpoint --------------------------------------------------------------------------------


def append_clicks(batch: pd.DataFrame, state: Any) -> None:
    """The baseline: every click appended to the user's list, as the example stores it; no timers."""
    at = batch["clicked_at"].astype("datetime64[us, UTC]").astype("int64").tolist()
    state.list_state("clicks", CLICK).add_many(
        zip(batch["user"].tolist(), [[a, e, p] for a, e, p in zip(at, batch["event_id"].tolist(),
                                                                   batch["page"].tolist())]))


def export_nothing(state: Any) -> pd.DataFrame:
    return pd.DataFrame({"user": pd.Series([], dtype="string")})


APPENDS = KeyedOperator("sessions", key="user", columns=("clicked_at", "event_id", "page"), process=append_clicks,
                        export=export_nothing)


def run_ours(spark: Any, operator: KeyedOperator, inputs: Path, run_dir: Path) -> dict[str, Any]:
    from sparkpoint.checkpoint.metadata import state_facts
    from sparkpoint.checkpoint.store import CompletedCheckpointStore
    from sparkpoint.pipeline.driver import StatefulPipeline

    spec = Pipeline("bench-sessions", [operator], input_url=f"file://{inputs}",
                    checkpoints_url=f"file://{run_dir / 'ckpt'}", output_url=f"file://{run_dir / 'out'}",
                    local_dir=str(run_dir / "local"), parallelism=PARALLELISM, num_retained=5,
                    event_time="clicked_at", allowed_lateness=LATENESS)
    started = time.perf_counter()
    pipeline = StatefulPipeline(spark, spec.config(), spec.operators)
    store = CompletedCheckpointStore(pipeline.storage)
    job_dir = run_dir / "ckpt" / spec.effective_job_id
    before: dict[str, int] = {}
    batches, bookkeeping = [], 0.0
    for report in pipeline.batches():
        mark = time.perf_counter()  # our listing and reading of facts is left out of the wall time
        after = listing(job_dir)
        written = sum(new_files(before, after).values())
        facts = state_facts(store.load(report.checkpoint_id).operators[operator.name].subtasks)
        batches.append({"batch": len(batches) + 1, "rows": report.rows, "seconds": report.seconds,
                        "written_bytes": written, "checkpointed_size": report.checkpointed_size,
                        "state_size": report.state_size, "watermark": report.watermark,
                        "late_rows": report.late_rows, "timers_pending": facts.get("timers_pending", 0),
                        "timers_fired": facts.get("timers_fired", 0),
                        "entries": facts.get("states", {}).get("clicks", {}).get("entries")})
        before = after
        bookkeeping += time.perf_counter() - mark
    wall = time.perf_counter() - started - bookkeeping
    last = batches[-1]
    state = ours_state(pipeline.storage, before, last["batch"])
    return {"wall_s": wall, "batches": batches, "checkpoints": len(batches),
            "written_bytes": sum(b["written_bytes"] for b in batches), "state_bytes_final": state["state_bytes"],
            "final_watermark_us": last["watermark"], "late_rows": sum(b["late_rows"] for b in batches),
            "timers_fired": sum(b["timers_fired"] for b in batches), "timers_pending_final": last["timers_pending"],
            "sessions": sessions_in(run_dir / "out")}


# --- Spark -------------------------------------------------------------------------------------


def spark_processor(example: Any) -> Any:
    """The example's operator as a Spark `StatefulProcessor` (times in µs as the example keeps
    them; Spark's timers are milliseconds, and every click time is a whole millisecond)."""
    from pyspark.sql.streaming import StatefulProcessor

    split_sessions, first_end, micros = example.split_sessions, example.first_end, example.micros
    gap_us = example.GAP_US

    class Sessions(StatefulProcessor):
        def init(self, handle: Any) -> None:
            self.handle = handle
            self.clicks = handle.getListState("clicks", "at long, event_id string, page string")

        def handleInputRows(self, key: Any, rows: Iterator[pd.DataFrame], timerValues: Any) -> Iterator[pd.DataFrame]:
            batch = pd.concat(list(rows))
            new = list(zip(micros(batch["clicked_at"]), batch["event_id"].tolist(), batch["page"].tolist()))
            old = [tuple(c) for c in self.clicks.get()] if self.clicks.exists() else []
            self.clicks.appendList(new)
            before, after = first_end(old), first_end(old + new)
            if after != before:
                if before is not None:
                    self.handle.deleteTimer(before // 1000)
                self.handle.registerTimer(after // 1000)
            return iter([])

        def handleExpiredTimer(self, key: Any, timerValues: Any, expiredTimerInfo: Any) -> Iterator[pd.DataFrame]:
            due = expiredTimerInfo.getExpiryTimeInMs() * 1000
            sessions = split_sessions(tuple(c) for c in self.clicks.get())
            still_open = [s for s in sessions if s[-1][0] + gap_us > due]
            closed = [s for s in sessions if s[-1][0] + gap_us <= due]
            if still_open:
                self.clicks.put([c for s in still_open for c in s])
                self.handle.registerTimer((still_open[0][-1][0] + gap_us) // 1000)
            else:
                self.clicks.clear()
            if closed:
                yield pd.DataFrame({
                    "user": [key[0]] * len(closed),
                    "session_start": pd.to_datetime([s[0][0] for s in closed], unit="us"),  # naive: UTC
                    "session_end": pd.to_datetime([s[-1][0] for s in closed], unit="us"),
                    "clicks": [len(s) for s in closed],
                    "pages": [" ".join(c[2] for c in s) for s in closed],
                })

        def close(self) -> None:
            pass

    return Sessions()


class Poller(threading.Thread):
    """Lists a directory every POLL_S seconds; keeps each file's largest size seen."""

    def __init__(self, root: Path):
        super().__init__(daemon=True)
        self.root, self.stop_event = root, threading.Event()
        self.seen: dict[str, int] = {}

    def run(self) -> None:
        while not self.stop_event.is_set():
            self.poll()
            self.stop_event.wait(POLL_S)

    def poll(self) -> None:
        if self.root.exists():
            for rel, size in listing(self.root).items():
                if size > self.seen.get(rel, -1):
                    self.seen[rel] = size


def run_spark(spark: Any, example: Any, inputs: Path, run_dir: Path) -> dict[str, Any]:
    for key, value in SPARK_CONF.items():
        spark.conf.set(key, value)
    spark.conf.set(SPARK_CHANGELOG, "true")
    ckpt, out = run_dir / "ckpt", run_dir / "out"
    poller = Poller(ckpt)
    started = time.perf_counter()
    events = spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).parquet(str(inputs))
    sessions = (events.withWatermark("clicked_at", f"{LATENESS} seconds").groupBy("user")
                .transformWithStateInPandas(spark_processor(example), OUTPUT, "Append", "EventTime"))
    query = (sessions.writeStream.format("parquet").option("path", str(out)).option("checkpointLocation", str(ckpt))
             .trigger(availableNow=True).start())
    poller.start()
    try:
        query.awaitTermination()
    finally:
        poller.stop_event.set()
        poller.join()
    wall = time.perf_counter() - started
    poller.poll()
    final = listing(ckpt)
    progress = [json.loads(p.json) for p in query.recentProgress]
    committed = [p for p in poller.seen if p.startswith("commits/") and p.split("/")[1].isdigit()]
    state = spark_state(ckpt, final)
    ops = [(p.get("stateOperators") or [{}])[0] for p in progress]
    return {"wall_s": wall, "checkpoints": len(committed), "written_bytes": sum(poller.seen.values()),
            "written_state_bytes": sum(s for p, s in poller.seen.items() if p.startswith("state/")),
            "state_bytes_final": state["state_bytes"], "files_seen": len(poller.seen),
            "batches": [{"batch": int(p["batchId"]), "rows": p.get("numInputRows"),
                         "durationMs": p.get("durationMs", {}), "watermark": p.get("eventTime", {}).get("watermark"),
                         "numRowsTotal": o.get("numRowsTotal"), "numRowsUpdated": o.get("numRowsUpdated"),
                         "customMetrics": o.get("customMetrics", {})} for p, o in zip(progress, ops)],
            "sessions": sessions_in(out)}


# --- where ours spends its time ------------------------------------------------------------------

PROFILED = [  # (file suffix, function) -> what it is
    ("operators.py", "open_sessions", "process: the example's open_sessions"),
    ("handles.py", "get", "  ListState.get (one scan per user)"),
    ("operators.py", "first_end", "  first_end (split_sessions, twice per user)"),
    ("handles.py", "add_many", "  ListState.add_many (one write per user)"),
    ("timers.py", "delete", "  timers.delete"),
    ("timers.py", "register", "  timers.register"),
    ("groupby/ops.py", "get_iterator", "  pandas groupby iteration"),
    ("operators.py", "close_sessions", "on_timer: the example's close_sessions"),
    ("timers.py", "pop_due", "pop_due (due timers, deleted)"),
    ("handles.py", "expire", "TTL sweep"),
]


def profile_ours(example: Any, inputs: Path, batches: int) -> list[dict[str, Any]]:
    """The example's operator over the first `batches` files in `OperatorHarness` (real RocksDB,
    parallelism 1, no Spark) under cProfile: cumulative seconds per batch of its parts."""
    import cProfile
    import pstats

    from sparkpoint.testing import OperatorHarness

    files = sorted(inputs.glob("clicks-*.parquet"))[:batches]
    profiler = cProfile.Profile()
    total = 0.0
    with OperatorHarness(example.sessions, parallelism=1, event_time="clicked_at",
                         allowed_lateness=LATENESS) as harness:
        harness.process(pd.read_parquet(files[0]))  # the first batch only registers: not profiled
        for f in files[1:]:
            frame = pd.read_parquet(f)
            started = time.perf_counter()
            profiler.enable()
            harness.process(frame)
            profiler.disable()
            total += time.perf_counter() - started
    table = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    n = max(1, len(files) - 1)
    out = [{"what": "harness.process, whole batch", "seconds_per_batch": total / n, "calls": n}]
    for suffix, name, what in PROFILED:
        seconds, calls = 0.0, 0
        for (filename, _, funcname), (_, nc, _, ct, _) in table.items():
            if filename.endswith(suffix) and funcname == name:
                seconds, calls = seconds + ct, calls + nc
        out.append({"what": what, "seconds_per_batch": seconds / n, "calls": calls})
    return out


# --- main --------------------------------------------------------------------------------------


def run_all(spark: Any, example: Any, inputs: Path, work: Path, tag: str) -> dict[str, dict[str, Any]]:
    out = {}
    for label in ("sparkpoint/sessions", "sparkpoint/appends", "spark/tws"):
        log(f"{tag}: {label}")
        run_dir = work / tag / label.replace("/", "_")
        if label == "spark/tws":
            out[label] = run_spark(spark, example, inputs, run_dir)
        else:
            op = example.sessions if label == "sparkpoint/sessions" else APPENDS
            out[label] = run_ours(spark, op, inputs, run_dir)
        r = out[label]
        log(f"  {r['wall_s']:.1f} s, {r['checkpoints']} checkpoints, {r['written_bytes'] / 1e6:.2f} MB written, "
            f"live state {r['state_bytes_final'] / 1e6:.2f} MB, {len(r['sessions'])} sessions")
    return out


def table(title: str, header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join([title, fmt.format(*header), "  ".join("-" * w for w in widths),
                      *(fmt.format(*r) for r in rows), ""])


def summarize(runs: list[dict[str, dict[str, Any]]], events: int) -> dict[str, dict[str, Any]]:
    out = {}
    for label in runs[0]:
        rs = [r[label] for r in runs]
        out[label] = {
            "events_per_s": [events / r["wall_s"] for r in rs],
            "events_per_s_median": statistics.median(events / r["wall_s"] for r in rs),
            "bytes_per_checkpoint": [r["written_bytes"] / r["checkpoints"] for r in rs],
            "bytes_per_checkpoint_median": statistics.median(r["written_bytes"] / r["checkpoints"] for r in rs),
            "checkpoints": rs[0]["checkpoints"],
            "state_bytes_final": statistics.median(r["state_bytes_final"] for r in rs),
        }
    return out


def report(results: dict[str, Any]) -> str:
    s = results["summary"]
    spark = s["spark/tws"]
    rows = []
    for label, x in s.items():
        rows.append([label, " / ".join(f"{v:,.0f}" for v in x["events_per_s"]), f"{x['events_per_s_median']:,.0f}",
                     f"{x['events_per_s_median'] / spark['events_per_s_median']:.2f}",
                     " / ".join(f"{v / 1e3:,.0f}" for v in x["bytes_per_checkpoint"]), str(x["checkpoints"]),
                     f"{x['bytes_per_checkpoint_median'] / spark['bytes_per_checkpoint_median']:.2f}",
                     f"{x['state_bytes_final'] / 1e6:.2f}"])
    c = results["config"]
    out = [table(f"{c['events']:,} events in {c['batches']} files, ~{c['timers_registered']:,} timers registered "
                 f"(runs: {results['config']['repeat']}; per run, then the median)",
                 ["job", "events/s per run", "median", "÷ Spark", "kB per checkpoint per run", "checkpoints",
                  "÷ Spark", "live state MB (end)"], rows)]
    ours = s["sparkpoint/sessions"]
    out.append(f"goal events/s ≥ 2x Spark: {ours['events_per_s_median'] / spark['events_per_s_median']:.2f}x; "
               f"goal bytes per checkpoint ≤ 0.5 x Spark: "
               f"{ours['bytes_per_checkpoint_median'] / spark['bytes_per_checkpoint_median']:.2f}x\n")
    a = results["agreement"]
    out.append(table("Closed sessions (user, start, end, clicks), last run", ["", "count"],
                     [[k, f"{v:,}"] for k, v in a.items()]))
    t = results["timers"]
    out.append(f"timers: registered ~{c['timers_registered']:,} (users clicking per batch, summed), fired "
               f"{t['fired']:,}, pending at the end {t['pending_final']:,}; fired ÷ pending before the batch: "
               f"median {t['fired_share_median']:.3f}\n")
    if results["profile"]:
        out.append(table("Where ours' operator spends a batch (OperatorHarness, parallelism 1, no Spark, cProfile; "
                         "s per batch, cumulative)", ["part", "s", "calls"],
                         [[p["what"], f"{p['seconds_per_batch']:.3f}", str(p["calls"])] for p in results["profile"]]))
    return "\n".join(out)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--users", type=int, default=40_000)
    p.add_argument("--batches", type=int, default=50)
    p.add_argument("--repeat", type=int, default=1, help="runs of the three jobs, one after the other (default 1)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="smoke test: 2,000 users, 8 batches")
    p.add_argument("--no-warmup", dest="warmup", action="store_false")
    p.add_argument("--profile", type=int, default=6, metavar="N",
                   help="profile the example's operator without Spark over the first N files (0: skip; default 6)")
    p.add_argument("--example", type=Path, default=REPO / "examples" / "sessions",
                   help="the sessions example's project directory")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.quick:  # figures that make sense, timings that do not: no warm-up, a short profile
        args.users, args.batches, args.warmup, args.profile = 2_000, 8, False, min(args.profile, 3)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    example = use_example(args.example.resolve())
    from sparkpoint.spark.session import spark_session

    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="sparkpoint-timers-"))
    spark = spark_session("local[2]", app_name="bench_timers_vs_spark")
    try:
        data = make_inputs(work / "in", args.users, args.batches, args.seed)
        log(f"{sum(data['events']):,} events in {args.batches} files, {sum(data['users_clicking']):,} user-batches")
        if args.warmup:
            make_inputs(work / "warm-in", 500, 3, args.seed + 1)
            run_all(spark, example, work / "warm-in", work, "warmup")
        runs = [run_all(spark, example, work / "in", work, f"run{k + 1}") for k in range(args.repeat)]
        profile = profile_ours(example, work / "in", min(args.profile, args.batches)) if args.profile > 1 else []
        expected = expected_sessions(work / "in", example.GAP_US, runs[-1]["sparkpoint/sessions"]["final_watermark_us"])
    finally:
        spark.stop()
        shutil.rmtree(work, ignore_errors=True)
    last = runs[-1]
    ours, theirs = last["sparkpoint/sessions"], last["spark/tws"]
    fired = [b["timers_fired"] for b in ours["batches"]]
    pending = [b["timers_pending"] for b in ours["batches"]]
    shares = [f / p for f, p in zip(fired[1:], pending[:-1]) if p]
    import pyspark

    events = sum(data["events"])
    results = {
        "config": {"users": args.users, "batches": args.batches, "repeat": args.repeat, "seed": args.seed,
                   "events": events, "events_per_batch": data["events"],
                   "timers_registered": sum(data["users_clicking"]), "users_clicking": data["users_clicking"],
                   "batch_seconds": BATCH_SECONDS, "gap_seconds": example.GAP_US / 1e6,
                   "lateness_seconds": LATENESS, "parallelism": PARALLELISM, "spark_conf": SPARK_CONF,
                   "spark_changelog": True, "master": "local[2]", "quick": args.quick, "warmup": args.warmup,
                   "poll_s": POLL_S},
        "summary": summarize(runs, events),
        "agreement": {
            "sparkpoint": len(ours["sessions"]), "spark": len(theirs["sessions"]),
            "both": len(ours["sessions"] & theirs["sessions"]),
            "only sparkpoint": len(ours["sessions"] - theirs["sessions"]),
            "only spark": len(theirs["sessions"] - ours["sessions"]),
            "pandas recomputation": len(expected), "sparkpoint = recomputation": int(ours["sessions"] == expected),
            "spark = recomputation": int(theirs["sessions"] == expected),
        },
        "timers": {"fired": sum(fired), "pending_final": pending[-1],
                   "fired_share_median": statistics.median(shares) if shares else 0.0,
                   "fired_per_batch": fired, "pending_per_batch": pending},
        "profile": profile,
        "runs": [{label: {k: v for k, v in r.items() if k != "sessions"} for label, r in run.items()} for run in runs],
        "runtime_s": time.perf_counter() - started,
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "pyspark": pyspark.__version__},
    }
    print(report(results))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / ("timers_vs_spark_quick.json" if args.quick else "timers_vs_spark.json")
    path.write_text(json.dumps(results, indent=1, default=float) + "\n")
    print(f"wrote {path} ({results['runtime_s']:.0f} s)")


if __name__ == "__main__":
    # Under its module name, so that Spark's workers import the operator's functions from it
    # (a function of `__main__` cannot be shipped).
    from benchmarks.bench_timers_vs_spark import main as _main

    _main()
