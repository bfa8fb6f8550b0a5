"""A 50 GB state across 32 subtasks, restored on a cluster: the model, fed with what
`bench_state_backend` measured on one subtask of 1-2 GB here (file:// and S3 on moto).

No benchmark runs here: this reads `bench_state_backend` results (one subtask's restore from
primary storage and from the task-local copy, the S3 request counts, one small GET's latency and
one GET stream's throughput on moto) and extrapolates. The model, per subtask restored from
object storage (`primary`):

    t_primary = t_open + requests x latency / threads + bytes / min(threads x stream, worker / k)

`bytes` and `requests` grow with the subtask's state (measured: bytes = its live SSTs plus
MANIFEST, CURRENT, OPTIONS; requests = the GETs counted per file, files = bytes / the SST size);
`threads` is the storage's download threads (8); `stream` one GET stream's throughput; `worker`
the bandwidth of one worker's network (or its disk, whichever is lower), shared by the k = 32 / N
subtasks a worker of N restores at once; `t_open` the rest (CRC32 of every copy, RocksDB's
open), measured as a CRC32 pass over the files plus a task-local restore. With task-local recovery
a subtask whose copy is on its worker restores in `t_local` (hard links, sizes, fingerprints:
measured, no term in bytes), and only the subtasks of a lost worker take `t_primary`, spread over
the N - 1 others. The job's restore is its slowest worker's.

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.restore_model results/state_backend_1600.json ...

It prints the tables and writes benchmarks/results/restore_model.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
GB = 1e9
MB = 1e6
STATE_BYTES = 50 * GB
SUBTASKS = 32
THREADS = 8  # CheckpointStorage(max_workers=8): the downloads of one subtask
# Assumed, not measured here: AWS S3 Standard from EC2 in the same region (AWS's performance
# guidelines: about 85-90 MB/s per GET stream; first-byte latency in tens of ms, where S3 Express
# One Zone claims single-digit ms), and workers with 10 or 25 Gbit/s networks and NVMe disks.
S3_STREAM = 85 * MB
S3_LATENCY = 0.030
WORKER_BANDWIDTHS = {"10 Gbit/s": 1.25 * GB, "25 Gbit/s": 3.1 * GB}
DISK_WRITE = 2.0 * GB  # a worker's local NVMe: the copies land there
WORKERS = (4, 8, 16, 32)


def measured(path: Path) -> dict[str, Any]:
    """The inputs one `bench_state_backend` run gives the model."""
    r = json.loads(path.read_text())
    restore = r["restore"]
    s3 = restore.get("primary on s3 (moto)")
    file_transfer = r["transfer"]["file"]
    out: dict[str, Any] = {
        "source": path.name,
        "state_bytes": restore["primary"]["downloaded_bytes"],
        "files": restore["primary"]["files"],
        "primary_file_s": restore["primary"]["wall_s"],
        "local_s": restore["local"]["wall_s"],
        "local_verify_s": restore["local"]["verify_s"],
        "working_s": restore["working"]["wall_s"],
        # What a primary restore spends beyond copying the bytes: CRC32 of every copy (timed alone
        # over the same files) and what the task-local restore does (links, checks, the open).
        "open_s": restore["local"]["verify_deep_s"] + restore["local"]["wall_s"],
        "file_get_s": file_transfer["get_s"],
    }
    if s3 is not None:
        out |= {"primary_s3_s": s3["wall_s"], "s3_get_s": r["transfer"]["s3 (moto)"]["get_s"],
                "s3_requests": s3.get("requests"), "probe": s3.get("probe")}
    return out


def t_primary(state: float, requests: float, open_s: float, latency: float, stream: float, worker: float,
              per_worker: int) -> float:
    """One subtask's restore from object storage while `per_worker` subtasks restore on its worker."""
    bandwidth = min(THREADS * stream, min(worker, DISK_WRITE) / per_worker)
    return open_s + requests * latency / THREADS + state / bandwidth


def requests(p: dict[str, Any]) -> float:
    """S3 requests of one measured restore (GETs; s3fs reads a large file in several ranges)."""
    counted = p.get("s3_requests")
    return float(sum(counted.values())) if counted else 2.0 * p["files"]


def check(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The model against what moto did here: its own latency and stream throughput, the one
    process moto is (its throughput is the 'worker' term), on the measured sizes."""
    rows = []
    for p in points:
        if "primary_s3_s" not in p or not p.get("probe"):
            continue
        probe = p["probe"]
        moto = p["state_bytes"] / p["s3_get_s"]  # 8 threads through the one moto process
        predicted = t_primary(p["state_bytes"], requests(p), p["open_s"], probe["small_get_s"],
                              probe["stream_mb_per_s"] * 2**20, moto, 1)
        rows.append({"state_gb": p["state_bytes"] / GB, "files": p["files"], "measured_s": p["primary_s3_s"],
                     "predicted_s": predicted, "moto_bytes_per_s": moto, "latency_s": probe["small_get_s"]})
    return rows


def extrapolate(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """50 GB / 32 subtasks on N workers, per worker bandwidth: all from S3, all task-local, one
    worker lost (its subtasks from S3, the others task-local)."""
    per_subtask = STATE_BYTES / SUBTASKS
    biggest = max(points, key=lambda p: p["state_bytes"])
    bytes_per_file = biggest["state_bytes"] / biggest["files"]
    files = round(per_subtask / bytes_per_file)
    per_file = requests(biggest) / biggest["files"]
    n_requests = per_file * files
    open_s = biggest["open_s"] * per_subtask / biggest["state_bytes"]  # CRC32 and the open grow with the bytes
    local_s = max(p["local_s"] for p in points)
    rows = []
    for label, worker in WORKER_BANDWIDTHS.items():
        for n in WORKERS:
            k = -(-SUBTASKS // n)
            every = t_primary(per_subtask, n_requests, open_s, S3_LATENCY, S3_STREAM, worker, k)
            # The lost worker's k subtasks go to the N - 1 others (Spark reschedules a lost
            # executor's tasks anywhere), which restore theirs from their task-local copies.
            spread = -(-k // (n - 1)) if n > 1 else k
            lost = max(local_s, t_primary(per_subtask, n_requests, open_s, S3_LATENCY, S3_STREAM, worker, spread))
            rows.append({"workers": n, "subtasks_per_worker": k, "worker_bandwidth": label,
                         "all_from_s3_s": every, "all_from_s3_gb": STATE_BYTES / GB,
                         "bytes_per_worker_gb": k * per_subtask / GB, "requests_per_subtask": n_requests,
                         "all_task_local_s": local_s, "one_worker_lost_s": lost,
                         "one_worker_lost_from_s3_gb": k * per_subtask / GB})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", type=Path, help="bench_state_backend JSON files (one per subtask size)")
    p.add_argument("--out", type=Path, default=RESULTS / "restore_model.json")
    args = p.parse_args()
    points = sorted((measured(path) for path in args.results), key=lambda x: x["state_bytes"])
    checked = check(points)
    rows = extrapolate(points)
    print("measured (one subtask):")
    for x in points:
        print(f"  {x['state_bytes'] / GB:.2f} GB, {x['files']} files: primary file:// {x['primary_file_s']:.2f} s "
              f"(plain get {x['file_get_s']:.2f} s), S3 (moto) {x.get('primary_s3_s', float('nan')):.2f} s, "
              f"task-local {x['local_s']:.3f} s; S3 requests {x.get('s3_requests')}")
    print("the model against moto here:")
    for c in checked:
        print(f"  {c['state_gb']:.2f} GB: measured {c['measured_s']:.2f} s, model {c['predicted_s']:.2f} s "
              f"(moto {c['moto_bytes_per_s'] / MB:.0f} MB/s, a GET {c['latency_s'] * 1000:.1f} ms)")
    print(f"50 GB / {SUBTASKS} subtasks ({STATE_BYTES / SUBTASKS / GB:.2f} GB each), S3 Standard assumed "
          f"({S3_STREAM / MB:.0f} MB/s a stream, {S3_LATENCY * 1000:.0f} ms a request):")
    print(f"  {'workers':>7} {'per worker':>10} {'network':>10} {'all from S3':>12} {'all task-local':>15} "
          f"{'one worker lost':>16}")
    for r in rows:
        print(f"  {r['workers']:>7} {r['subtasks_per_worker']:>10} {r['worker_bandwidth']:>10} "
              f"{r['all_from_s3_s']:>10.1f} s {r['all_task_local_s']:>13.3f} s {r['one_worker_lost_s']:>14.1f} s")
    args.out.write_text(json.dumps({
        "model": "t_primary = t_open + requests x latency / threads + bytes / min(threads x stream, "
                 "min(worker, disk) / subtasks_per_worker); t_local measured; the job's restore is its "
                 "slowest worker's",
        "assumed": {"s3_stream_bytes_per_s": S3_STREAM, "s3_latency_s": S3_LATENCY, "threads": THREADS,
                    "worker_bandwidths": WORKER_BANDWIDTHS, "disk_write_bytes_per_s": DISK_WRITE},
        "measured": points, "model_vs_moto": checked, "extrapolation": rows,
        "open_s_per_gb": statistics.fmean(x["open_s"] / (x["state_bytes"] / GB) for x in points),
    }, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
