"""How checkpoint and restore costs grow with the state: `bench_state_backend` at 10 MB, 100 MB and
1 GB of live state (5 GB with `--large`, for `make bench` only), 1% of the keys changed per
checkpoint, each size in a process of its own.

Per size: the mean incremental checkpoint (seconds, MB uploaded), uploaded ÷ changed bytes
(amplification: 1.0 = only what changed) and seconds per MB changed, the restore from primary
storage and from the task-local copy, and the benchmark process's peak memory (VmHWM, polled:
loading the state, the checkpoints and the restores; RocksDB's block cache is 256 MB). Then a
task, as a Spark task's Python worker runs it, in a process of its own (`scale_task`): restore
the latest checkpoint, read and write 100,000 random keys (the same batch at every size), take a
checkpoint; once into an empty directory (primary restore), once more in a new process from what
the first left locally. Its peak is the task's memory. The goals: upload and checkpoint time grow
with the change, not the state (amplification and seconds per changed MB within 1.5x from 100 MB
to 1 GB), and a task's peak is bounded by the block cache and the batch, not the state.

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.bench_scale [--large] [--out DIR]

It prints a table and writes benchmarks/results/scale.json. Registry rebuild (100 checkpoints x
1,000 files) and the orphan sweep at 10^5 files are `bench_bookkeeping`'s.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
CHURN = 0.01
MB = 1024 * 1024
TASK_BATCH = 100_000  # keys a task reads and writes, the same at every size


def peak_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


# What the interval that ends with a line of the benchmark's log did (its lines follow the work).
PHASES = [(r"\] calibration:", "build the state"), (r"\] loaded ", "build the state"),
          ("initial checkpoint", "first checkpoint (everything new)"), (r"% #\d", "incremental checkpoints"),
          ("% full", "full checkpoint"), ("restore from", "restores"), ("transfer on", "bench's own put/get")]
TASK_PHASES = ("incremental checkpoints", "full checkpoint", "restores")


def reset_peak(pid: int) -> None:
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := current RSS
    except OSError:
        pass


def phase_peaks(proc: subprocess.Popen[str], lines: list[str]) -> dict[str, int]:
    """Peak KiB per phase: at each line the child logs, the high-water mark since the last line goes
    to that line's phase, and is reset. `lines` collects the log."""
    peaks: dict[str, int] = {}
    assert proc.stderr is not None
    for line in proc.stderr:
        lines.append(line)
        phase = next((name for pattern, name in PHASES if re.search(pattern, line)), "other")
        peaks[phase] = max(peaks.get(phase, 0), peak_kib(proc.pid))
        reset_peak(proc.pid)
    return peaks


def one_size(state_mb: int, work: Path) -> dict[str, Any]:
    out = work / f"state-{state_mb}.json"
    storage_url = f"file://{work}/checkpoints-{state_mb}"
    cmd = [sys.executable, "-m", "benchmarks.bench_state_backend", "--state-mb", str(state_mb), "--changes",
           str(CHURN), "--checkpoints", "3", "--repeat", "1", "--no-s3", "--out", str(out), "--storage", storage_url,
           "--keep-storage"]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    peaks: dict[str, int] = {}
    reader = threading.Thread(target=lambda: peaks.update(phase_peaks(proc, lines)), daemon=True)
    reader.start()
    reader.join()
    proc.wait()
    stderr = "".join(lines)
    peak = max(peaks.values(), default=0)
    if proc.returncode != 0:
        raise RuntimeError(f"{state_mb} MB failed ({proc.returncode}): {stderr[-3000:]}")
    r = json.loads(out.read_text())
    tasks = [task(r["storage"], r["load"]["keys"], work / f"task-{state_mb}", seed) for seed in (1, 2)]
    shutil.rmtree(work / f"task-{state_mb}", ignore_errors=True)
    shutil.rmtree(work / f"checkpoints-{state_mb}", ignore_errors=True)
    phase = r["phases"][0]
    changed = phase["fraction"] * phase["mean_state_bytes"]
    row = {
        "state_mb": state_mb,
        "state_bytes": phase["mean_state_bytes"],
        "checkpoint_s": phase["mean_wall_s"],
        "uploaded_bytes": phase["mean_uploaded_bytes"],
        "amplification": phase["amplification"],
        "s_per_changed_mb": phase["mean_wall_s"] / (changed / MB),
        "restore_primary_s": r["restore"]["primary"]["wall_s"],
        "restore_local_s": r["restore"]["local"]["wall_s"],
        "peak_rss_mb": peak / 1024,
        "peak_rss_mb_by_phase": {name: kib / 1024 for name, kib in peaks.items()},
        "task_peak_rss_mb": max((peaks.get(name, 0) for name in TASK_PHASES), default=0) / 1024,
        "tasks": tasks,
        "wall_s": time.perf_counter() - started,
    }
    print(f"  {state_mb:>5} MB: checkpoint {row['checkpoint_s']:.2f} s, uploaded {row['uploaded_bytes'] / MB:.1f} MB "
          f"(amplification {row['amplification']:.2f}), restore primary {row['restore_primary_s']:.2f} s / local "
          f"{row['restore_local_s']:.3f} s, peak {row['peak_rss_mb']:.0f} MB (checkpoints and restores "
          f"{row['task_peak_rss_mb']:.0f} MB)", flush=True)
    for t in tasks:
        cache = t["rocksdb_at_end_mb"]
        print(f"         a task ({t['restored_from']} restore, {t['batch_keys']:,} keys read and written, checkpoint): "
              f"peak {t['peak_mb']:.0f} MB (from {t['baseline_mb']:.0f} MB at start); at its end block cache "
              f"{cache['block-cache-usage']:.0f} MB, memtables {cache['cur-size-all-mem-tables']:.0f} MB", flush=True)
    print("         peak by phase: " + ", ".join(f"{name} {mb:.0f} MB" for name, mb in
                                                row["peak_rss_mb_by_phase"].items()), flush=True)
    return row


def task(storage: dict[str, Any], keys: int, local: Path, seed: int) -> dict[str, Any]:
    """One task in a process of its own (`scale_task`): restore, a batch of TASK_BATCH keys, a checkpoint."""
    cmd = [sys.executable, "-m", "benchmarks.scale_task", "--storage", storage["url"], "--job-id", storage["job_id"],
           "--keys", str(keys), "--batch-keys", str(TASK_BATCH), "--local", str(local), "--seed", str(seed)]
    done = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the task process failed ({done.returncode}): {done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--large", action="store_true", help="also 5 GB (make bench)")
    parser.add_argument("--sizes", help="comma-separated MB instead (e.g. 1024,5120)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else [10, 100, 1024] + ([5120] if args.large else [])
    rows = []
    with tempfile.TemporaryDirectory(prefix="sparkpoint-scale-") as work:
        for size in sizes:
            rows.append(one_size(size, Path(work)))
    print()
    print(f"{'state':>8} {'checkpoint':>11} {'uploaded':>10} {'ampl.':>6} {'s/changed MB':>13} "
          f"{'restore primary':>16} {'restore local':>14} {'peak RSS':>9} {'a task: primary / local':>24}")
    for r in rows:
        print(f"{r['state_mb']:>5} MB {r['checkpoint_s']:>9.2f} s {r['uploaded_bytes'] / MB:>7.1f} MB "
              f"{r['amplification']:>6.2f} {r['s_per_changed_mb']:>13.3f} {r['restore_primary_s']:>14.2f} s "
              f"{r['restore_local_s']:>12.3f} s {r['peak_rss_mb']:>6.0f} MB "
              f"{r['tasks'][0]['peak_mb']:>12.0f} / {r['tasks'][1]['peak_mb']:.0f} MB")
    print(f"A task reads and writes {TASK_BATCH:,} random keys at every size: its peak is bounded by the block cache"
          " (256 MB) and that batch, not by the state, when it stops growing once the state outgrows the cache.")
    by = {r["state_mb"]: r for r in rows}
    growth = {key: by[1024][key] / by[100][key] for key in ("amplification", "s_per_changed_mb")} \
        if {100, 1024} <= set(by) else None
    if growth:
        print(f"100 MB -> 1 GB at {CHURN:.0%} churn: amplification x{growth['amplification']:.2f}, seconds per "
              f"changed MB x{growth['s_per_changed_mb']:.2f} (goal: within 1.5x)")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "scale.json"
    path.write_text(json.dumps({"when": datetime.now().isoformat(timespec="seconds"), "machine": platform.platform(),
                                "cpus": os.cpu_count(), "churn": CHURN, "rows": rows, "growth_100mb_to_1gb": growth},
                               indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
