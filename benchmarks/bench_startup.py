"""Start-up and restore in a new process: a Spark of the run's own (`local[2]`) against a Spark
that is already up (Spark Connect, a server on 127.0.0.1 started here and warmed once).

Every measured run is a new `sparkpoint run` process (as every Dagster run is), timed from its
spawn until it exits after one checkpoint:

* restore: 200,000 users' `user_totals` state (a first batch with one event per user), then one
  batch touching 10% of them (20,000 events); the run restores from checkpoint storage (a fresh
  task-local directory) and takes one checkpoint. Repeated from a copy of the same state;
* restore, task-local: the same, with the task-local copy left by the previous run (what a
  long-running Connect server keeps between runs; with a Spark of its own the copy is on the
  driver's disk too, but the JVM and the Python workers start again);
* new job: empty state, one batch of 20,000 events.

With a Spark of its own, the driver JVM maps the class archive an earlier start recorded
(`sparkpoint.spark.classcache`; the first, untimed run records it when there is none):
`SPARKPOINT_JVM_CACHE=off` measures without it.

Flink's figures on the same data (quoted from the issue, measured earlier on this machine): restore
22.9 s (changelog backend 19.7 s), new job 12.7 s.

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.bench_startup [--repeat 3] [--out DIR]

It prints a table and writes benchmarks/results/startup.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from benchmarks.bench_vs_spark import fixed_workload
from sparkpoint.pipeline.spec import Pipeline
from sparkpoint.spark.classcache import cache_dir
from sparkpoint.state.sample import user_totals

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
FLINK = {"restore": 22.9, "restore (Flink changelog)": 19.7, "new job": 12.7}
USERS, CHURN, PARALLELISM = 200_000, 0.10, 4

# What the measured processes run (`--pipeline benchmarks.bench_startup:pipeline`).
pipeline = Pipeline("bench", [user_totals], parallelism=PARALLELISM, num_retained=5)


def run(work: Path, input_dir: Path, local_dir: Path, remote: str | None) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "sparkpoint.cli", "run", "--pipeline", "benchmarks.bench_startup:pipeline",
           "--input", str(input_dir), "--checkpoints", str(work / "ckpt"), "--local-dir", str(local_dir),
           "--max-batches", "1", "--json", "--master", "local[2]"]
    if remote:
        cmd += ["--remote", remote]
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    total = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"run failed ({done.returncode}): {done.stderr[-3000:]}")
    (report,) = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {"total_s": round(total, 3), "checkpoint_s": report["seconds"], "restored": report["restored"],
            "checkpoint_id": report["checkpoint_id"]}


def measure(scenario: str, root: Path, batch: Path, remote: str | None, repeat: int, *, restore: bool,
            task_local: bool = False) -> dict[str, Any]:
    """`repeat` new processes, each from the same starting point at the same paths: the saved
    state (`restore`) or nothing, with the saved task-local copy (`task_local`) or none."""
    runs = []
    work, local = root / "work", root / "local"
    for _ in range(repeat):
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(local, ignore_errors=True)
        if restore:
            shutil.copytree(root / "saved", work)
        else:
            (work / "in").mkdir(parents=True)
        if task_local:
            shutil.copytree(root / "saved-local", local)
        os.link(batch, work / "in" / batch.name)
        runs.append(run(work, work / "in", local, remote))
    totals = [r["total_s"] for r in runs]
    row = {"scenario": scenario, "spark": "Connect" if remote else "own local[2]",
           "median_s": statistics.median(totals), "runs_s": totals,
           "checkpoint_s": statistics.median(r["checkpoint_s"] for r in runs),
           "restored": sorted({s for r in runs for s in r["restored"]})}
    print(f"  {row['spark']:>13} {scenario:<22} {row['median_s']:6.1f} s  (runs {totals}; "
          f"checkpoint {row['checkpoint_s']:.2f} s; restored {row['restored']})", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    from tests.support.connect_server import connect_server

    root = Path(tempfile.mkdtemp(prefix="sparkpoint-startup-"))
    try:
        data = fixed_workload(root / "data", "fixed-10pct", users=USERS, items=5_000, fraction=CHURN, updates=0,
                              seed=3)
        first, update = data.files[0], data.restart_file
        work = root / "work"
        (work / "in").mkdir(parents=True)
        os.link(first, work / "in" / first.name)
        print(f"initial state: {USERS:,} users (one run of its own Spark)", flush=True)
        run(work, work / "in", root / "local", None)
        work.rename(root / "saved")
        (root / "local").rename(root / "saved-local")
        rows = []
        for remote in (None, "connect"):
            # The server's executors use each run's --local-dir (fresh or saved, as with our own Spark).
            server_cm = connect_server(root / "connect", own_local_dir=False) if remote else None
            if server_cm is not None:
                remote = server_cm.__enter__().url
                warm = root / "warm"
                (warm / "in").mkdir(parents=True)
                os.link(update, warm / "in" / update.name)
                run(warm, warm / "in", root / "local-warm", remote)  # the server's Python workers start once
            try:
                rows.append(measure("restore", root, update, remote, args.repeat, restore=True))
                rows.append(measure("restore, task-local", root, update, remote, args.repeat, restore=True,
                                    task_local=True))
                rows.append(measure("new job", root, update, remote, args.repeat, restore=False))
            finally:
                if server_cm is not None:
                    server_cm.__exit__(None, None, None)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print()
    print(f"{'scenario':<22} {'own local[2]':>13} {'Connect':>9} {'Flink':>7}")
    for scenario in ("restore", "restore, task-local", "new job"):
        own = next(r for r in rows if r["scenario"] == scenario and r["spark"] != "Connect")
        con = next(r for r in rows if r["scenario"] == scenario and r["spark"] == "Connect")
        flink = FLINK.get(scenario)
        print(f"{scenario:<22} {own['median_s']:>11.1f} s {con['median_s']:>7.1f} s "
              f"{(f'{flink:.1f} s' if flink else '-'):>7}")
    print(f"(Flink's changelog backend, restore: {FLINK['restore (Flink changelog)']} s)")
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "startup.json"
    out.write_text(json.dumps({
        "when": datetime.now().isoformat(timespec="seconds"), "machine": platform.platform(),
        "cpus": os.cpu_count(), "users": USERS, "churn": CHURN, "parallelism": PARALLELISM,
        "repeat": args.repeat, "flink": FLINK, "rows": rows,
        # The driver JVM's class archive (sparkpoint.spark.classcache): SPARKPOINT_JVM_CACHE=off for none.
        "jvm_class_archive": "off" if cache_dir() is None else str(cache_dir()),
    }, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
