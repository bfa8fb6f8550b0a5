"""Latency a user feels: from a batch file landing in the input directory to its checkpoint
committed, and materialized in Dagster, through the pipeline's input sensor on a Spark that is
already up (Spark Connect), beside Spark Structured Streaming's own in the same run.

* ours: a Spark Connect server on 127.0.0.1 (`local[2]`, started here) and `dagster dev`
  (webserver + daemon, the instance `sparkpoint.ops.instance` writes) serving
  `benchmarks.latency_location`: `build_pipeline_defs` of one `user_totals` pipeline per workload,
  parallelism 4, retain 5, exactly-once sink, its Spark resource `remote=` the server. Nothing but
  the file landing starts a run: the `<name>_input_sensor` sees it, launches `<name>_checkpoint`
  (a run queued, dequeued, launched as a new process; the SSTable step runs the batch on the
  server, the checkpoint step commits). Measured per file, wall clock from the file's `os.link`
  into the input directory: *committed* = `chk-N/_metadata` exists (polled every 20 ms);
  *materialized* = the checkpoint asset's materialization event (Dagster's own timestamp); and
  the run's creation, start and end (Dagster's), which split the total into the sensor's pick-up,
  the queue and launch, and the run itself;
* Spark: Structured Streaming on `local[2]` in this process, already running (default trigger:
  it polls the directory every 10 ms), `readStream.parquet` -> `groupBy(user_id)` with
  user_totals' aggregates -> `foreachBatch` Parquet, RocksDB state store, 4 shuffle partitions,
  changelog checkpointing off and on (`bench_vs_spark`'s query): landing to `commits/<batch>`;
* Flink 2.3 (quoted, measured earlier on this machine with its job already running): 2.3-2.8 s
  per checkpoint of 20k events at 10% churn, 3.7-3.8 s per checkpoint of 40k events on a growing
  stream. That is a checkpoint's duration, not a landing-to-commit latency: Flink's file source
  discovers files on its own interval on top.

And `sparkpoint run --follow` (`--only follow`, or as a third part of a full run), on local Spark:

* ours: the follow loop (`sparkpoint.pipeline.follow`, what `run --follow` runs) in this process on
  `local[2]`, one Spark session for its life, `user_totals` at parallelism 4, default poll (0.2 s);
* Spark: the same Structured Streaming query (`maxFilesPerTrigger` 1), changelog off and on;
* each in turn, on the same files: (1) one file per second (`--rate`) of `--follow-events` events
  over 100k users: landing (`os.link`) to the commit (`chk-N/_metadata`'s mtime; Spark:
  `commits/<batch>`'s), median, p95, max; (2) the same files landed at once: events/s from the
  landing to the last commit, a checkpoint per file in both; (3) tiny files (20 events) at one
  per second: landing to commit, and a checkpoint's own duration (ours: trigger to commit; Spark:
  `durationMs.triggerExecution` of the micro-batch).

And Dagster's own floor beside ours (`--only floor`), on one instance and one `dagster dev`:

* floor: `benchmarks.latency_floor_location`, a code location of its own (Dagster alone, a code
  server of its own): an asset that does nothing, materialized by a job of it alone (in-process
  executor, as ours) that a sensor launches for each file landed in its directory, with the
  interval of ours' input sensor (read from ours' definitions; both recorded). Timed per file:
  landing (`os.link`) -> the asset's materialization event (Dagster's timestamp);
* ours: `benchmarks.latency_location` on the growing workload, as above: landing -> committed
  (`chk-N/_metadata`) and -> materialized;
* `--files` timed files per side (default 10), in turn (floor, ours, floor, ...), each landed at a
  random moment of the sensor loop once the previous run has ended and a 1 s gap, so no file waits
  behind the other side's run (ours' own maintenance runs, recorded, are ours' path); the first of
  each side is not timed (it warms the code servers and the Connect session). Median and p95 of
  each, ours minus the floor's, the medians of the sensor pick-up, queue + launch and run of each
  side, the load average before, after and at each file. The goal: ours' landing -> committed
  within 1 s of the floor, median and p95.

Workloads: fixed-10pct (200k users created by a first batch, then update batches of 20k events
touching 10% of them: `bench_startup`'s data) and growing (`generate()`'s skewed events, 40k per
batch over 200k users). The first batch of each is processed before anything is timed (it warms
the server's Python workers, as a running Spark's are).

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.bench_latency [--updates 5] [--out DIR]
    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.bench_latency --only follow [--follow-files 40]

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.bench_latency --only floor [--files 10]

It prints a table and writes benchmarks/results/latency.json (~8 minutes); `--only follow` writes
benchmarks/results/latency_follow.json (~6 minutes); `--only floor` writes
benchmarks/results/latency_dagster.json (~30 s a file per side under load, ~6 minutes for 10).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from benchmarks.bench_vs_spark import (
    SPARK_CHANGELOG,
    Workload,
    fixed_workload,
    growing_workload,
    log,
    make_session,
    spark_query,
)
from benchmarks.latency_location import REMOTE_ENV, ROOT_ENV, WORKLOADS_ENV, pipeline_name
from tests.support.waiting import wait_for

RESULTS = Path(__file__).parent / "results"
USERS, ITEMS = 200_000, 5_000
FLINK = {"fixed-10pct": "2.3-2.8 s per checkpoint (20k events)", "growing": "3.7-3.8 s per checkpoint (40k events)"}
GOAL_S = 10.0
SENSOR_LOOP_S = 5.0  # Dagster's sensor daemon looks at its sensors every 5 s at most (fixed)
PHASES = random.Random(7)

RUN_TIMES = """
query Run($id: ID!) { runOrError(runId: $id) { __typename
  ... on Run { runId status creationTime startTime endTime tags { key value }
    stepStats { stepKey startTime endTime } } } }
"""


def workloads(root: Path, updates: int) -> list[Workload]:
    return [
        fixed_workload(root, "fixed-10pct", users=USERS, items=ITEMS, fraction=0.10, updates=updates, seed=3),
        growing_workload(root, "growing", batches=updates + 1, events=40_000, users=USERS, items=ITEMS, seed=1),
    ]


# --- ours: Dagster on Spark Connect ----------------------------------------------------------------


def land(f: Path, directory: Path) -> float:
    """The file appears at once (a hard link: no half-written file is ever listed); its wall time."""
    landed = time.time()
    os.link(f, directory / f.name)
    return landed


def run_phases(server: Any, run_id: str, landed: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """A finished successful run's times (Dagster's) and the phases of a file landed at `landed`:
    the sensor's pick-up (to the run's creation), the queue and launch (to its start), the run, and
    each step's start and end from the run's start."""
    run = server.wait_run(run_id)
    assert run["status"] == "SUCCESS", f"{run}\n{server.log_tail()}"
    times = server.gql(RUN_TIMES, {"id": run_id})["runOrError"]
    start = times["startTime"]
    return times, {"sensor_s": times["creationTime"] - landed, "queue_and_launch_s": start - times["creationTime"],
                   "run_s": times["endTime"] - start,
                   "steps_s": {st["stepKey"]: [st["startTime"] - start, st["endTime"] - start]
                               for st in times["stepStats"] if st["startTime"] and st["endTime"]}}


def ours_file(server: Any, workload: str, f: Path, checkpoint_id: int, timeout: float = 300) -> dict[str, Any]:
    name = pipeline_name(workload)
    where = Path(os.environ[ROOT_ENV]) / workload
    metadata = where / "checkpoints" / name / f"chk-{checkpoint_id}" / "_metadata"
    # Files land at any moment of the sensor daemon's 5 s loop, not in step with it.
    time.sleep(PHASES.uniform(0, SENSOR_LOOP_S))
    landed = land(f, where / "in")
    committed = wait_for(lambda: metadata.exists() and time.time(), timeout, 0.02, f"chk-{checkpoint_id}/_metadata")

    def materialized() -> float | None:
        for m in server.materializations("checkpoint", prefix=name):
            if int(m["metadata"]["checkpoint_id"]) == checkpoint_id:
                return int(m["timestamp"]) / 1000
        return None

    materialized_at = wait_for(materialized, timeout, 0.1, f"the materialization of chk-{checkpoint_id}")
    (run,) = [r for r in server.runs({"sparkpoint/landed": f.name}) if r["jobName"] == f"{name}_checkpoint"]
    times, phases_s = run_phases(server, run["runId"], landed)
    row = {"file": f.name, "checkpoint_id": checkpoint_id, "committed_s": committed - landed,
           "materialized_s": materialized_at - landed, "run_to_commit_s": committed - times["startTime"], **phases_s}
    log(f"  ours/{workload} chk-{checkpoint_id}: committed {row['committed_s']:.2f} s, materialized "
        f"{row['materialized_s']:.2f} s (sensor {row['sensor_s']:.2f}, queue+launch {row['queue_and_launch_s']:.2f}, "
        f"run to commit {row['run_to_commit_s']:.2f})")
    return row


def measure_ours(root: Path, loads: list[Workload]) -> dict[str, list[dict[str, Any]]]:
    from tests.support.connect_server import connect_server
    from tests.support.dagster_server import DagsterServer

    rows: dict[str, list[dict[str, Any]]] = {}
    with connect_server(root / "connect") as connect:
        os.environ.update({ROOT_ENV: str(root / "ours"), REMOTE_ENV: connect.url,
                           WORKLOADS_ENV: ",".join(w.name for w in loads)})
        for w in loads:
            (root / "ours" / w.name / "in").mkdir(parents=True)
        server = DagsterServer(root / "dagster", module="benchmarks.latency_location",
                               env={k: os.environ[k] for k in (ROOT_ENV, REMOTE_ENV, WORKLOADS_ENV)})
        server.start()
        try:
            for w in loads:
                log(f"ours/{w.name}: first batch (not timed)")
                ours_file(server, w.name, w.files[0], 1, timeout=600)
                rows[w.name] = [ours_file(server, w.name, f, i + 2) for i, f in enumerate(w.files[1:])]
        finally:
            server.stop()
    return rows


# --- Dagster's own floor beside ours, on one instance and one `dagster dev` --------------------------

FLOOR_WORKLOAD = "growing"
FLOOR_GOAL_S = 1.0  # ours' landing -> committed checkpoint within this of the floor, median and p95
FLOOR_GAP_S = 1.0  # after a run has ended, before the next file's phase: runs never queue behind each other

FLOOR_SENSORS = """
{ repositoriesOrError { __typename ... on RepositoryConnection { nodes { location { name }
  sensors { name minIntervalSeconds sensorState { status } } } } } }
"""


def input_sensor_interval() -> int:
    """The `minimum_interval_seconds` of sparkpoint's input sensor, from the definitions the
    location builds (the environment is set): the floor's sensor takes the same."""
    from benchmarks.latency_location import location

    name = f"{pipeline_name(FLOOR_WORKLOAD)}_input_sensor"
    (sensor,) = [s for s in location().sensors if s.name == name]
    return int(sensor.minimum_interval_seconds or 0)


def sensor_intervals(server: Any) -> dict[str, int] | None:
    """Every sensor's interval once both locations are loaded and their sensors running (None before)."""
    repos = server.gql(FLOOR_SENSORS)["repositoriesOrError"]
    sensors = [s for n in repos.get("nodes", []) for s in n["sensors"]]
    wanted = {f"{pipeline_name(FLOOR_WORKLOAD)}_input_sensor", "latency_floor_sensor"}
    running = {s["name"]: s["minIntervalSeconds"] for s in sensors if s["sensorState"]["status"] == "RUNNING"}
    return running if wanted <= running.keys() else None


def floor_file(server: Any, f: Path, directory: Path, timeout: float = 300) -> dict[str, Any]:
    """One file through the floor's sensor and run: landing -> the empty asset's materialization."""
    from benchmarks.latency_floor_location import JOB, PREFIX, TAG

    time.sleep(PHASES.uniform(0, SENSOR_LOOP_S))
    landed = land(f, directory)
    run = wait_for(lambda: next((r for r in server.runs({TAG: f.name}) if r["jobName"] == JOB), None), timeout, 0.1,
                   f"the floor's run of {f.name}")

    def materialized() -> float | None:
        return next((int(m["timestamp"]) / 1000 for m in server.materializations("landed", prefix=PREFIX)
                     if m["runId"] == run["runId"]), None)

    materialized_at = wait_for(materialized, timeout, 0.1, f"the floor's materialization of {f.name}")
    _, phases_s = run_phases(server, run["runId"], landed)
    row = {"file": f.name, "materialized_s": materialized_at - landed, **phases_s, "load_1m": os.getloadavg()[0]}
    log(f"  floor {f.name}: materialized {row['materialized_s']:.2f} s (sensor {row['sensor_s']:.2f}, queue+launch "
        f"{row['queue_and_launch_s']:.2f}, run {row['run_s']:.2f})")
    return row


def measure_floor(root: Path, files: int) -> dict[str, Any]:
    """`files` timed files through each of ours and the floor, in turn (floor, ours, floor, ...),
    each landed at a random moment of the sensor loop once the previous run has ended; the
    first of each is not timed (it warms the code servers and the Connect session)."""
    from benchmarks.latency_floor_location import DIR_ENV, INTERVAL_ENV
    from tests.support.connect_server import connect_server
    from tests.support.dagster_server import DagsterServer

    load = growing_workload(root / "data", FLOOR_WORKLOAD, batches=files + 1, events=40_000, users=USERS,
                            items=ITEMS, seed=1)
    floor_dir = root / "floor" / "in"
    floor_dir.mkdir(parents=True)
    (root / "ours" / FLOOR_WORKLOAD / "in").mkdir(parents=True)
    results: dict[str, Any] = {"files": files, "workload": load.description, "commit": commit(),
                               "load_before": os.getloadavg()}
    with connect_server(root / "connect") as connect:
        os.environ.update({ROOT_ENV: str(root / "ours"), REMOTE_ENV: connect.url, WORKLOADS_ENV: FLOOR_WORKLOAD,
                           DIR_ENV: str(floor_dir)})
        os.environ[INTERVAL_ENV] = str(input_sensor_interval())
        server = DagsterServer(root / "dagster", module="benchmarks.latency_location",
                               more_modules=("benchmarks.latency_floor_location",),
                               env={k: os.environ[k] for k in (ROOT_ENV, REMOTE_ENV, WORKLOADS_ENV, DIR_ENV,
                                                               INTERVAL_ENV)})
        server.start()
        try:
            results["intervals_s"] = server.wait_for("both sensors running", lambda: sensor_intervals(server), 120)
            log("floor: first files (not timed)")
            floor_file(server, load.files[0], floor_dir, timeout=600)
            ours_file(server, FLOOR_WORKLOAD, load.files[0], 1, timeout=600)
            floor_rows: list[dict[str, Any]] = []
            ours_rows: list[dict[str, Any]] = []
            for i, f in enumerate(load.files[1:]):
                time.sleep(FLOOR_GAP_S)
                floor_rows.append(floor_file(server, f, floor_dir))
                time.sleep(FLOOR_GAP_S)
                ours_rows.append({**ours_file(server, FLOOR_WORKLOAD, f, i + 2), "load_1m": os.getloadavg()[0]})
            results["other_runs"] = other_runs(server)
        finally:
            server.stop()
    results.update(floor=floor_rows, ours=ours_rows, load_after=os.getloadavg())
    results["summary"] = floor_summary(floor_rows, ours_rows)
    return results


def other_runs(server: Any) -> list[dict[str, Any]]:
    """The instance's runs of neither checkpoint job (ours' maintenance: prune, recover), with
    Dagster's times: a file landed while one was in flight waited for it."""
    from benchmarks.latency_floor_location import JOB

    skip = {JOB, f"{pipeline_name(FLOOR_WORKLOAD)}_checkpoint"}
    return [{k: t[k] for k in ("runId", "status", "creationTime", "startTime", "endTime")} | {"job": r["jobName"]}
            for r in server.runs() if r["jobName"] not in skip
            for t in [server.gql(RUN_TIMES, {"id": r["runId"]})["runOrError"]]]


def commit() -> str:
    """The checkout's commit (with `+dirty` when it has changes): what the figures measured."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=Path(__file__).parent, capture_output=True, text=True,
                              check=False).stdout.strip()

    return git("rev-parse", "--short", "HEAD") + ("+dirty" if git("status", "--porcelain", "--untracked-files=no")
                                                  else "")


def floor_summary(floor: list[dict[str, Any]], ours: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and p95 of the floor's landing -> materialized, ours' landing -> committed and ->
    materialized, and ours minus the floor's of each statistic; the goal: committed within
    FLOOR_GOAL_S of the floor at both."""
    def stats(rows: list[dict[str, Any]], key: str) -> dict[str, float]:
        return percentiles([r[key] for r in rows])

    out: dict[str, Any] = {"floor_materialized_s": stats(floor, "materialized_s"),
                           "ours_committed_s": stats(ours, "committed_s"),
                           "ours_materialized_s": stats(ours, "materialized_s")}
    for what in ("committed", "materialized"):
        out[f"ours_{what}_minus_floor_s"] = {
            s: out[f"ours_{what}_s"][s] - out["floor_materialized_s"][s] for s in ("median", "p95")}
    out["phases_median_s"] = {side: {k: statistics.median(r[k] for r in rows) for k in
                                     ("sensor_s", "queue_and_launch_s", "run_s")}
                              for side, rows in (("floor", floor), ("ours", ours))}
    out["ours_run_to_commit_median_s"] = statistics.median(r["run_to_commit_s"] for r in ours)
    out["steps_median_s"] = {side: steps_median(rows) for side, rows in (("floor", floor), ("ours", ours))}
    out["goal_s"] = FLOOR_GOAL_S
    out["goal_met"] = all(d <= FLOOR_GOAL_S for d in out["ours_committed_minus_floor_s"].values())
    return out


def steps_median(rows: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Each step's median start and end from its run's start, over the runs that ran it."""
    keys = sorted({k for r in rows for k in r.get("steps_s", {})}, key=lambda k: statistics.median(
        r["steps_s"][k][0] for r in rows if k in r.get("steps_s", {})))
    return {k: [statistics.median(r["steps_s"][k][i] for r in rows if k in r.get("steps_s", {})) for i in (0, 1)]
            for k in keys}


def floor_report(results: dict[str, Any]) -> str:
    s = results["summary"]
    lines = [f"a landed file through Dagster, {results['files']} files per side ({results['workload']}; sensors every "
             f"{min(results['intervals_s'].values())} s; load {results['load_before'][0]:.1f} before, "
             f"{results['load_after'][0]:.1f} after)",
             f"{'':<44}{'median':>10}{'p95':>10}{'max':>10}"]
    for label, key in (("Dagster's floor: landing -> materialized", "floor_materialized_s"),
                       ("ours: landing -> committed checkpoint", "ours_committed_s"),
                       ("ours: landing -> materialized", "ours_materialized_s")):
        lines.append(f"{label:<44}" + "".join(f"{s[key][k]:>9.2f}s" for k in ("median", "p95", "max")))
    for label, key in (("ours committed - floor", "ours_committed_minus_floor_s"),
                       ("ours materialized - floor", "ours_materialized_minus_floor_s")):
        lines.append(f"{label:<44}" + "".join(f"{s[key][k]:>+9.2f}s" for k in ("median", "p95")))
    lines.append(f"{'medians':<44}{'sensor':>10}{'launch':>10}{'run':>10}")
    for side, phases_s in s["phases_median_s"].items():
        lines.append(f"{side:<44}" + "".join(f"{phases_s[k]:>9.2f}s" for k in
                                             ("sensor_s", "queue_and_launch_s", "run_s")))
    for side, steps in s["steps_median_s"].items():
        lines.append(f"{side} steps, median start-end from the run's start: "
                     + ", ".join(f"{k} {a:.2f}-{b:.2f} s" for k, (a, b) in steps.items()))
    lines.append(f"ours: the run's start to the commit, median {s['ours_run_to_commit_median_s']:.2f} s")
    diff = s["ours_committed_minus_floor_s"]
    lines.append(f"goal: ours' committed within {FLOOR_GOAL_S:g} s of the floor at the median and p95: "
                 f"{diff['median']:+.2f} s / {diff['p95']:+.2f} s ({'met' if s['goal_met'] else 'MISSED'})")
    return "\n".join(lines)


# --- Spark Structured Streaming, already running -----------------------------------------------------


def measure_spark(root: Path, loads: list[Workload]) -> dict[str, dict[str, list[dict[str, Any]]]]:
    spark = make_session()
    rows: dict[str, dict[str, list[dict[str, Any]]]] = {}
    try:
        for changelog in (False, True):
            label = f"spark/changelog-{'on' if changelog else 'off'}"
            spark.conf.set(SPARK_CHANGELOG, str(changelog).lower())
            for w in loads:
                run_dir = root / label.replace("/", "-") / w.name
                (run_dir / "in").mkdir(parents=True)
                query = spark_query(spark, run_dir)
                commits = run_dir / "checkpoints" / "commits"
                try:
                    out = []
                    for batch_id, f in enumerate(w.files):
                        landed = land(f, run_dir / "in")
                        marker = commits / str(batch_id)
                        committed = wait_for(lambda m=marker: m.exists() and time.time(), 600, 0.01,
                                             f"{label} commit {batch_id}")
                        if query.exception() is not None:
                            raise RuntimeError(f"{label}: {query.exception()}")
                        if batch_id:  # the first batch is not timed, as for ours
                            out.append({"file": f.name, "batch_id": batch_id, "committed_s": committed - landed})
                            log(f"  {label}/{w.name} batch {batch_id}: committed {committed - landed:.2f} s")
                finally:
                    query.stop()
                rows.setdefault(label, {})[w.name] = out
    finally:
        spark.stop()
    return rows


# --- run --follow on local Spark, beside Structured Streaming ---------------------------------------

FOLLOW_USERS = 100_000
TINY_EVENTS = 20


def follow_workloads(root: Path, files: int, events: int) -> dict[str, Workload]:
    return {"steady": growing_workload(root, "steady", batches=files + 1, events=events, users=FOLLOW_USERS,
                                       items=ITEMS, seed=11),
            "tiny": growing_workload(root, "tiny", batches=max(files // 2, 8) + 1, events=TINY_EVENTS, users=1_000,
                                     items=50, seed=12)}


def landed_at_rate(files: list[Path], directory: Path, rate: float) -> list[float]:
    """Land `files` one every 1/`rate` seconds (at once when `rate` is 0); their wall times."""
    start, out = time.time(), []
    for i, f in enumerate(files):
        if rate:
            time.sleep(max(0.0, start + i / rate - time.time()))
        out.append(land(f, directory))
    return out


class CommitWatch:
    """Records when each commit marker appears (its mtime), from a thread polling every 10 ms
    while files land: retention deletes old markers (ours `num_retained`, Spark's commit log
    `minBatchesToRetain`) before a wait after the landing would look."""

    def __init__(self, marker: Callable[[int], Path], ids: list[int]):
        self.marker, self.pending = marker, list(ids)
        self.seen: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while self.pending and not self._stop.wait(0.01):
            for i in list(self.pending):
                try:
                    self.seen[i] = self.marker(i).stat().st_mtime
                except FileNotFoundError:
                    continue
                self.pending.remove(i)

    def times(self, timeout: float = 600) -> list[float]:
        wait_for(lambda: not self.pending, timeout, 0.05, "every commit")
        self._stop.set()
        return [self.seen[i] for i in sorted(self.seen)]


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, max(0, round(0.95 * len(ordered)) - 1))]
    return {"median": statistics.median(ordered), "p95": p95, "max": ordered[-1], "n": len(ordered)}


def phases(label: str, run_dir: Callable[[str], Path], start: Callable[[Path], Callable[[], None]],
           marker: Callable[[Path, int], Path], loads: dict[str, Workload], rate: float,
           durations: Callable[[Path], list[float]]) -> dict[str, Any]:
    """The three phases for one system: `start(dir)` starts it on `dir/in` and returns its stop;
    `marker(dir, k)` is the commit marker of its k-th batch (0-based); `durations(dir)` the
    duration of each of its checkpoints after the first."""
    out: dict[str, Any] = {}
    for phase, load, at in (("steady", loads["steady"], rate), ("backlog", loads["steady"], 0.0),
                            ("tiny", loads["tiny"], rate)):
        where = run_dir(f"{label}-{phase}")
        (where / "in").mkdir(parents=True)
        stop = start(where)
        try:
            land(load.files[0], where / "in")  # the first batch warms up (not timed)
            CommitWatch(functools.partial(marker, where), [0]).times()
            files = load.files[1:]
            commits = CommitWatch(functools.partial(marker, where), list(range(1, len(files) + 1)))
            landed = landed_at_rate(files, where / "in", at)
            committed = commits.times()
        finally:
            stop()
        latency = [c - t for c, t in zip(committed, landed)]
        row: dict[str, Any] = {"latency_s": percentiles(latency)}
        if phase == "backlog":
            row["events_per_s"] = sum(load.events[1:]) / (committed[-1] - landed[0])
        if phase == "tiny":
            row["checkpoint_s"] = percentiles(durations(where))
        out[phase] = row
        log(f"  {label}/{phase}: landing to commit median {row['latency_s']['median']:.2f} s, p95 "
            f"{row['latency_s']['p95']:.2f} s, max {row['latency_s']['max']:.2f} s"
            + (f", {row['events_per_s']:,.0f} events/s" if "events_per_s" in row else "")
            + (f", a checkpoint {row['checkpoint_s']['median']:.3f} s" if "checkpoint_s" in row else ""))
    return out


def measure_follow(root: Path, files: int, events: int, rate: float) -> dict[str, Any]:
    from benchmarks.bench_vs_spark import OURS_VARIANTS, System, ours_pipeline
    from sparkpoint.pipeline.follow import FollowOptions, follow

    loads = follow_workloads(root / "data", files, events)
    spark = make_session()
    results: dict[str, Any] = {"files": files, "events_per_file": events, "rate_per_s": rate,
                               "load_before": os.getloadavg()}
    ours = System("ours/user_totals", "ours", OURS_VARIANTS[0][1], ("user_totals",))
    seconds: dict[Path, list[float]] = {}
    queries: dict[Path, Any] = {}

    def start_ours(where: Path) -> Callable[[], None]:
        pipeline = ours_pipeline(spark, ours, where)
        stopping = threading.Event()
        failed: list[BaseException] = []

        def loop() -> None:
            try:
                for done in follow(pipeline, FollowOptions(), stop=stopping.is_set):
                    seconds.setdefault(where, []).append(done.report.seconds)
            except BaseException as e:  # noqa: BLE001  said by stop()
                failed.append(e)

        thread = threading.Thread(target=loop, daemon=True)
        thread.start()

        def stop() -> None:
            stopping.set()
            thread.join(60)
            if failed:
                raise failed[0]
        return stop

    def ours_marker(where: Path, k: int) -> Path:
        return where / "checkpoints" / "bench" / f"chk-{k + 1}" / "_metadata"

    try:
        log("follow: ours (run --follow's loop, local[2] in this process)")
        results["ours"] = phases("ours", lambda n: root / n, start_ours, ours_marker, loads, rate,
                                 lambda where: seconds[where][1:])
        for changelog in (False, True):
            label = f"spark/changelog-{'on' if changelog else 'off'}"
            log(f"follow: {label}")
            spark.conf.set(SPARK_CHANGELOG, str(changelog).lower())

            def start_spark(where: Path) -> Callable[[], None]:
                query = queries[where] = spark_query(spark, where)
                return query.stop

            def spark_durations(where: Path) -> list[float]:
                ran = [json.loads(p.json if not callable(p.json) else p.json()) for p in queries[where].recentProgress]
                return [p["durationMs"]["triggerExecution"] / 1000 for p in ran  # idle reports have no rows
                        if p["batchId"] > 0 and p.get("numInputRows", 0) > 0]

            results[label] = phases(label.replace("/", "-"), lambda n: root / n, start_spark,
                                    lambda where, k: where / "checkpoints" / "commits" / str(k), loads, rate,
                                    spark_durations)
    finally:
        spark.stop()
    results["load_after"] = os.getloadavg()
    return results


def follow_report(results: dict[str, Any]) -> str:
    systems = [s for s in ("ours", "spark/changelog-off", "spark/changelog-on") if s in results]
    lines = [f"run --follow on local[2] at {results['rate_per_s']:g} file/s, {results['events_per_file']:,} events "
             f"per file, {results['files']} files (load {results['load_before'][0]:.1f} before, "
             f"{results['load_after'][0]:.1f} after)",
             f"{'':<28}" + "".join(f"{s:>22}" for s in systems)]

    def row(name: str, value: Callable[[dict[str, Any]], str]) -> None:
        lines.append(f"{name:<28}" + "".join(f"{value(results[s]):>22}" for s in systems))

    for phase in ("steady", "tiny"):
        for stat in ("median", "p95", "max"):
            row(f"{phase}: landing->commit {stat}", lambda r, p=phase, s=stat: f"{r[p]['latency_s'][s]:.2f} s")
    row("tiny: a checkpoint, median", lambda r: f"{r['tiny']['checkpoint_s']['median']:.3f} s")
    row("backlog: events/s", lambda r: f"{r['backlog']['events_per_s']:,.0f}")
    p95 = results["ours"]["steady"]["latency_s"]["p95"]
    lines.append(f"goal: landing to commit <= {FOLLOW_GOAL_S:g} s at the 95th percentile: {p95:.2f} s "
                 f"({'met' if p95 <= FOLLOW_GOAL_S else 'MISSED'})")
    return "\n".join(lines)


FOLLOW_GOAL_S = 2.0


# --- report -----------------------------------------------------------------------------------------


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} s (max {max(values):.2f})"


def report(results: dict[str, Any]) -> str:
    lines = [f"{'workload':<12} {'ours: committed':>22} {'ours: materialized':>22} {'Spark, changelog off':>22} "
             f"{'Spark, changelog on':>22}  Flink (job running)"]
    for name, ours in results["ours"].items():
        spark = [results["spark"][label][name] for label in ("spark/changelog-off", "spark/changelog-on")]
        lines.append(f"{name:<12} {spread([r['committed_s'] for r in ours]):>22} "
                     f"{spread([r['materialized_s'] for r in ours]):>22} "
                     + " ".join(f"{spread([r['committed_s'] for r in s]):>22}" for s in spark)
                     + f"  {FLINK[name]}")
    lines.append("")
    lines.append(f"{'ours, median':<12} {'sensor pick-up':>16} {'queue + launch':>16} {'run to commit':>16} "
                 f"{'whole run':>12}")
    for name, ours in results["ours"].items():
        lines.append(f"{name:<12} " + " ".join(
            f"{statistics.median(r[k] for r in ours):>15.2f}s" for k in
            ("sensor_s", "queue_and_launch_s", "run_to_commit_s"))
            + f" {statistics.median(r['run_s'] for r in ours):>11.2f}s")
    every = [r["materialized_s"] for rows in results["ours"].values() for r in rows]
    within = sum(1 for t in every if t <= GOAL_S)
    lines.append("")
    lines.append(f"goal: landing to committed and materialized <= {GOAL_S:.0f} s on Spark Connect: median "
                 f"{statistics.median(every):.2f} s ({'met' if statistics.median(every) <= GOAL_S else 'MISSED'}), "
                 f"{within} of {len(every)} files within it, slowest {max(every):.2f} s")
    return "\n".join(lines)


def write_results(path: Path, results: dict[str, Any]) -> None:
    """`results` as JSON at `path`, after when and where they were measured."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"when": datetime.now().isoformat(timespec="seconds"),
                                "machine": platform.platform(), "cpus": os.cpu_count(), **results}, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=5, help="timed batches per workload")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--only", choices=["ours", "spark", "follow", "floor"],
                        help="measure one side only (follow: run --follow beside Structured Streaming only; floor: "
                             "ours beside Dagster's own floor, writes latency_dagster.json)")
    parser.add_argument("--files", type=int, default=10, help="timed files per side of the floor part")
    parser.add_argument("--follow-files", type=int, default=40, help="timed files of the follow part")
    parser.add_argument("--follow-events", type=int, default=5_000, help="events per file of the follow part")
    parser.add_argument("--rate", type=float, default=1.0, help="files landed per second in the follow part")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (Dagster's instance, logs)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="sparkpoint-latency-"))
    log(f"work directory {root}")
    try:
        if args.only == "follow":
            follow = measure_follow(root / "follow", args.follow_files, args.follow_events, args.rate)
            print(follow_report(follow))
            write_results(args.out / "latency_follow.json", {"goal_s": FOLLOW_GOAL_S, **follow})
            return
        if args.only == "floor":
            floor = measure_floor(root, args.files)
            print(floor_report(floor))
            write_results(args.out / "latency_dagster.json", floor)
            return
        loads = workloads(root / "data", args.updates)
        results: dict[str, Any] = {"ours": {}, "spark": {}}
        if args.only != "spark":
            results["ours"] = measure_ours(root, loads)
        if args.only != "ours":
            results["spark"] = measure_spark(root, loads)
        if not args.only:
            results["follow"] = measure_follow(root / "follow", args.follow_files, args.follow_events, args.rate)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    if not args.only:
        print(report(results))
        print(follow_report(results["follow"]))
    write_results(args.out / "latency.json", {"users": USERS, "updates": args.updates, "goal_s": GOAL_S,
                                              "flink": FLINK, **results})


if __name__ == "__main__":
    main()
