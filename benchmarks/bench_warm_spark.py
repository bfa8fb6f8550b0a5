"""Per landed file on the embedded default, before and after the warm local Spark: a Dagster run
and an Airflow DAG run of one batch, each a new process as the orchestrators make them.

* Dagster: `dagster dev` (webserver + daemon) serving `benchmarks.latency_location`: one
  `user_totals` pipeline (parallelism 2, retain 2, exactly-once sink) whose Spark resource is the
  default, the **warm** local Spark (`sparkpoint.spark.warm`, a Spark Connect server started by the
  first run), or `master: local[2]` (**own**: a Spark in each run's process, as before). A file
  lands, the input sensor launches `<name>_checkpoint`; timed per file: *run to commit* = the run's
  start (Dagster's) to `chk-N/_metadata`, and landing to commit.
* Airflow: `airflow standalone` (LocalExecutor, SQLite) with the sample pipeline's DAG on the
  default (warm) and a copy with `master="local[2]"` (own), triggered through the REST API after a
  file landed; timed per run: the DAG run's start to its end (Airflow's), every task a new process.

The first run of each is reported apart: on *warm* it starts the server (its extra cost), on *own*
it records the JVM's class archive. Workload: 20,000 events per file over 20,000 users.

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.bench_warm_spark [--files 5] [--only dagster|airflow]

It prints a table and writes benchmarks/results/warm_spark.json (~10 minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from benchmarks.bench_latency import RUN_TIMES, land
from benchmarks.bench_vs_spark import log
from benchmarks.latency_location import REMOTE_ENV, ROOT_ENV, WORKLOADS_ENV, pipeline_name
from sparkpoint.spark.generate import generate
from tests.support.waiting import wait_for

RESULTS = Path(__file__).parent / "results"
EVENTS, USERS = 20_000, 20_000
GOALS = {"dagster": 3.0, "airflow": 5.0}
MODES = {"warm": "", "own": "local[2]"}


def batches(root: Path, files: int) -> list[Path]:
    generate(str(root), batches=files, events_per_batch=EVENTS, users=USERS, items=500, seed=11)
    return sorted(root.glob("*.parquet"))


def stop_warm(env: dict[str, str]) -> None:
    from sparkpoint.spark.warm import stop

    stop(directory=Path(env["SPARKPOINT_WARM_SPARK_DIR"]))


# --- Dagster ---------------------------------------------------------------------------------------


def dagster_mode(root: Path, mode: str, files: list[Path], env: dict[str, str]) -> list[dict[str, Any]]:
    from tests.support.dagster_server import DagsterServer

    workload = f"warm-{mode}"
    name = pipeline_name(workload)
    where = root / "dagster-data"
    (where / workload / "in").mkdir(parents=True)
    extra = {ROOT_ENV: str(where), REMOTE_ENV: MODES[mode], WORKLOADS_ENV: workload, **env}
    server = DagsterServer(root / f"dagster-{mode}", module="benchmarks.latency_location", env=extra)
    server.start()
    rows = []
    try:
        for i, f in enumerate(files):
            checkpoint_id = i + 1
            metadata = where / workload / "checkpoints" / name / f"chk-{checkpoint_id}" / "_metadata"
            landed = land(f, where / workload / "in")
            committed = wait_for(lambda m=metadata: m.exists() and time.time(), 600, 0.02, f"chk-{checkpoint_id}")
            runs = [server.wait_run(r["runId"], timeout=600) for r in server.runs({"sparkpoint/landed": f.name})
                    if r["jobName"] == f"{name}_checkpoint"]
            ok = [r for r in runs if r["status"] == "SUCCESS"]
            assert len(ok) == 1 and len(runs) == 1, f"runs of {f.name}: {runs}\n{server.log_tail()}"
            run = ok[0]
            times = server.gql(RUN_TIMES, {"id": run["runId"]})["runOrError"]
            row = {"file": f.name, "first": i == 0, "run_to_commit_s": committed - times["startTime"],
                   "landing_to_commit_s": committed - landed, "run_s": times["endTime"] - times["startTime"]}
            log(f"  dagster/{mode} chk-{checkpoint_id}: run start to commit {row['run_to_commit_s']:.2f} s, "
                f"landing to commit {row['landing_to_commit_s']:.2f} s")
            rows.append(row)
    finally:
        server.stop()
        stop_warm(env)
    return rows


# --- Airflow ---------------------------------------------------------------------------------------

DAG_FILE = """
from sparkpoint.airflow import sparkpoint_dag
from sparkpoint.pipeline.spec import Pipeline
from sparkpoint.state.sample import user_totals

for mode, master in (("warm", None), ("own", "local[2]")):
    pipeline = Pipeline(f"bench_{{mode}}", [user_totals], input_url=f"{root}/{{mode}}/in",
                        checkpoints_url=f"{root}/{{mode}}/checkpoints", output_url=f"{root}/{{mode}}/out",
                        parallelism=2)
    globals()[f"dag_{{mode}}"] = sparkpoint_dag(pipeline, master=master)
"""


def airflow_runs(root: Path, files: list[Path], env: dict[str, str]) -> dict[str, list[dict[str, Any]]]:
    from tests.test_airflow_standalone import Airflow

    os.environ.update(env)  # the servers' environment: the warm Spark's directory
    airflow = Airflow(root / "airflow", dags={"bench_dag.py": DAG_FILE.format(root=root / "airflow" / "data")},
                      expect={"sparkpoint_bench_warm", "sparkpoint_bench_own"})
    rows: dict[str, list[dict[str, Any]]] = {}
    try:
        airflow.start(timeout=300)
        for mode in ("warm", "own"):
            dag_id = f"sparkpoint_bench_{mode}"
            airflow.api("PATCH", f"/dags/{dag_id}", {"is_paused": False})
            inbox = airflow.root / "data" / mode / "in"
            inbox.mkdir(parents=True, exist_ok=True)
            rows[mode] = []
            for i, f in enumerate(files):
                land(f, inbox)
                run_id = airflow.trigger(dag_id)
                run = airflow.wait_run(dag_id, run_id, timeout=600)
                assert run["state"] == "success", airflow.tail()
                start, end = (datetime.fromisoformat(run[k].replace("Z", "+00:00")) for k in ("start_date", "end_date"))
                row = {"file": f.name, "first": i == 0, "run_s": (end - start).total_seconds(),
                       "tasks_s": task_durations(airflow, dag_id, run_id)}
                log(f"  airflow/{mode} run {i + 1}: {row['run_s']:.2f} s; tasks "
                    + ", ".join(f"{t} {d:.2f}" for t, d in row["tasks_s"].items()))
                rows[mode].append(row)
            if mode == "warm":
                stop_warm(env)
    finally:
        airflow.stop()
        stop_warm(env)
    return rows


def task_durations(airflow: Any, dag_id: str, run_id: str) -> dict[str, float]:
    """Each task instance's own duration (Airflow's), in seconds; the run's time beyond their
    chain is the scheduler's (queueing a task, starting its process)."""
    from urllib.parse import quote

    got = airflow.api("GET", f"/dags/{dag_id}/dagRuns/{quote(run_id, safe='')}/taskInstances")
    return {t["task_id"]: float(t["duration"] or 0.0) for t in got["task_instances"] if t["state"] == "success"}


# --- report ----------------------------------------------------------------------------------------


def summary(rows: list[dict[str, Any]], key: str) -> dict[str, float]:
    later = [r[key] for r in rows if not r["first"]]
    first = [r[key] for r in rows if r["first"]]
    return {"first": first[0] if first else float("nan"), "median": statistics.median(later), "max": max(later)}


def report(results: dict[str, Any]) -> str:
    lines = [f"{'per landed file':<34} {'first run':>10} {'later: median':>14} {'max':>7}  goal"]
    for what, key, label in (("dagster", "run_to_commit_s", "Dagster run start to commit"),
                             ("dagster", "landing_to_commit_s", "Dagster landing to commit"),
                             ("airflow", "run_s", "Airflow DAG run")):
        for mode, rows in results.get(what, {}).items():
            s = summary(rows, key)
            goal = GOALS[what] if key != "landing_to_commit_s" else None
            verdict = "" if goal is None else f"<= {goal:.0f} s: {'met' if s['median'] <= goal else 'MISSED'}"
            lines.append(f"{label + ', ' + mode:<34} {s['first']:>9.2f}s {s['median']:>13.2f}s {s['max']:>6.2f}s  "
                         + (verdict if mode == "warm" else "(before)"))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=5, help="landed files per mode (the first is reported apart)")
    parser.add_argument("--only", choices=["dagster", "airflow"])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="sparkpoint-warm-"))
    env = {"SPARKPOINT_WARM_SPARK": "on", "SPARKPOINT_WARM_SPARK_DIR": str(root / "warm-spark")}
    results: dict[str, Any] = {}
    try:
        files = batches(root / "files", args.files)
        if args.only != "airflow":
            results["dagster"] = {mode: dagster_mode(root, mode, files, env) for mode in MODES}
        if args.only != "dagster":
            results["airflow"] = airflow_runs(root, files, env)
    finally:
        stop_warm(env)
        shutil.rmtree(root, ignore_errors=True)
    print(report(results))
    args.out.mkdir(parents=True, exist_ok=True)
    target = args.out / "warm_spark.json"
    kept: dict[str, Any] = {}
    if args.only and target.exists():  # the other side's figures of an earlier run stay
        kept = {k: v for k, v in json.loads(target.read_text()).items() if k in ("dagster", "airflow")}
    target.write_text(json.dumps({
        "when": datetime.now().isoformat(timespec="seconds"), "machine": platform.platform(),
        "cpus": os.cpu_count(), "events_per_file": EVENTS, "goals_s": GOALS, **kept, **results}, indent=2))


if __name__ == "__main__":
    main()
