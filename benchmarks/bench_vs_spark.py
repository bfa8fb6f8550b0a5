"""Side by side with Spark's own RocksDB state store: bytes uploaded per checkpoint, state, speed.

The same Parquet files (columns event_id, user_id, item_id, amount, ts) go, in one process on
`local[2]`, through:

* ours: `StatefulPipeline` with parallelism 4, 5 retained checkpoints, one checkpoint per input
  file and the exactly-once Parquet sink, once with both sample operators (user_totals +
  item_reach) and once with user_totals alone, for every variant in OURS_VARIANTS (settings go
  through `resolve_settings`, so Flink keys work; `--ours-setting LABEL:KEY=VALUE` adds more);
* Spark: Structured Streaming `readStream.parquet` (maxFilesPerTrigger 1), `groupBy(user_id)`
  with user_totals' aggregates (count, sum/min/max of amount, max ts), update mode, `foreachBatch`
  to Parquet, `RocksDBStateStoreProvider`, 4 shuffle partitions, minBatchesToRetain 5, state
  maintenance every 2 s (so Spark deletes old versions during the run), changelog checkpointing
  off and on. Files are put into its input directory one at a time; a batch is done when
  `commits/<batch>` exists.

Workloads: fixed 500k users, a first batch with one event per user, then 12 update batches
touching 1% (fixed-1pct) or 10% (fixed-10pct) of the users at random, one event each; and a
growing stream, `generate()`'s 16 x 20k skewed events over 200k users. One more file per
workload is kept back for the cold restart.

Measured per system and workload, from the storage itself (the checkpoint directory is listed
after every batch):

* uploaded: bytes of the files that are new or changed size since the previous listing: every
  file the system writes for state and progress (SSTs, zips, changelogs, `_metadata`,
  offsets/commits logs). Hidden files are left out: Hadoop's `.crc` sidecars of the local
  filesystem (they do not exist on S3 or HDFS) and in-flight temporary files. Spark uploads
  changelog-mode snapshots and deletes old versions in background maintenance: those bytes count
  for the batch during which they appeared;
* live state = the bytes a restore of the latest checkpoint reads from checkpoint storage.
  Ours: chk-N/_metadata and every file it references. Spark, per partition: the newest
  `<v>.zip` at or below the latest version, every SST its metadata lists, the `<v>.changelog`
  files after it; plus the latest offsets and commits entries. The same definition for both,
  free of compaction or flush timing on local disk, and it is what a cold restart pays for
  (RocksDB SST bytes alone are in the JSON as `state_sst_bytes`);
* upload/state per batch: mean, median, max over the update batches (all but the first);
  >half = update batches uploading more than half the state;
* the checkpoint directory's bytes and files after the last batch, and ÷ state;
* events/s = events of the update batches ÷ their wall time (ours: from resuming the pipeline's
  generator until it yields the batch's report; Spark: from the file landing until its commit);
  the speed table and the JSON's `speed_vs_spark` give ours ÷ Spark's better mode (the faster of
  changelog off and on) per workload, the figure the throughput goal of 2x is about; beside it
  the same per CPU second: CPU (user + system) of the bench's whole process tree (driver, JVM,
  Python workers) during the batch, which other processes' load on the machine stretches far
  less than wall time;
* cold restart: a fresh Python process creates the Spark session and processes exactly one more
  file from the existing checkpoint; seconds from session creation to that batch committed.
  The restore table puts it beside what a restore reads (the live state: the last batch's, the
  mean and the largest over the update batches) and the uploads, ours ÷ each Spark mode's
  (`restore_vs_spark` in the JSON).
  Ours gets a fresh local directory, so it restores from checkpoint storage as Spark does (its
  RocksDB working copies die with the JVM). Median of --restart-repeat runs (default 3), each
  from the same state; the session start alone varies by seconds between runs;
* amplification: Σ uploaded by the update batches ÷ Σ (share of the state's entries changed or
  added by the batch x state), per operator (ours: files under shared/<op>/ and chk-N/<op>/;
  Spark: state/). The shares come from the input data: user_totals = distinct users in the
  batch ÷ users so far; item_reach = (distinct items + new (item, user) pairs) ÷ (items +
  pairs so far). 1.0 means a checkpoint uploads only what changed;
* profile of ours (a separate run on fixed-10pct with Python's profilers on): driver cProfile,
  Spark's own Python UDF profiler (`spark.sql.pyspark.udf.profiler=perf`) in the tasks, job and
  stage times from Spark's REST API. Spark's side from its progress reports.

Run (about 15-25 minutes after a short warm-up of every system; --quick: the fixed-10pct workload
alone unless --workloads names more, 3,000 users, 3 batches, one cold restart run in the background,
about a minute, timings meaningless):

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.bench_vs_spark
    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.bench_vs_spark --quick --out /tmp/results
    ... --workloads fixed-1pct --ours-setting changelog:state.backend.changelog.enabled=true

It prints tables, writes benchmarks/results/vs_spark.json and vs_spark.png (vs_spark_quick.*
with --quick; --out DIR puts them elsewhere).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import zipfile
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.pipeline.settings import resolve_settings
from sparkpoint.spark.generate import START, generate
from sparkpoint.state.operators import KeyedOperator
from sparkpoint.state.sample import SAMPLE_OPERATORS, user_totals

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
MB = 1024 * 1024
JOB = "bench"

# Variants of our engine: (label, settings resolved by sparkpoint.pipeline.settings.resolve_settings).
OURS_VARIANTS: list[tuple[str, dict[str, str]]] = [
    ("ours", {"state.backend.changelog.enabled": "true"}),  # the default: changelog checkpoints
    # RocksDB files only: --ours-setting ours-files:state.backend.changelog.enabled=false (make bench adds it)
]
OPERATOR_SETS: dict[str, tuple[KeyedOperator, ...]] = {"both": SAMPLE_OPERATORS, "user_totals": (user_totals,)}
SPARK_VARIANTS: list[tuple[str, bool]] = [("spark/changelog-off", False), ("spark/changelog-on", True)]
QUICK_WORKLOAD = "fixed-10pct"  # --quick's one workload: the profile's, with the most change per batch

SPARK_PROVIDER = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
SPARK_CHANGELOG = "spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled"
SPARK_CONF = {
    "spark.sql.streaming.stateStore.providerClass": SPARK_PROVIDER,
    "spark.sql.streaming.minBatchesToRetain": "5",
    "spark.sql.streaming.stateStore.maintenanceInterval": "2s",
    "spark.sql.shuffle.partitions": "4",
}
SPARK_SCHEMA = "event_id long, user_id string, item_id string, amount double, ts timestamp"
PARALLELISM, RETAINED = 4, 5

LIVE_STATE = (
    "bytes a restore of the latest checkpoint reads from checkpoint storage: ours chk-N/_metadata + every "
    "file it references; Spark per partition the newest <v>.zip at or below the latest version + the SSTs "
    "its metadata lists + the <v>.changelog files after it, plus the latest offsets/commits entries"
)
UPLOADED = (
    "bytes of files in the checkpoint directory that are new or changed size since the listing after the "
    "previous batch (hidden files, i.e. Hadoop .crc sidecars and temporaries, left out)"
)
AMPLIFICATION = (
    "sum of bytes uploaded by the update batches / sum over them of (share of the state's entries changed "
    "or added by the batch x state bytes), per operator; 1.0 = only what changed is uploaded"
)
AMPLIFICATION_COMPACT = (
    "the same with the state a compact one: changed or added entries x the bytes per entry of the first "
    "checkpoint (one flush of every entry); a state bloated by uncompacted overwrites does not lower it "
    "('-' for Spark's changelog mode: its first checkpoint is a changelog, not SSTs)"
)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- workloads ---------------------------------------------------------------------------------


@dataclass
class Workload:
    name: str
    description: str
    files: list[Path]  # in processing order
    restart_file: Path  # one more batch, for the cold restart
    events: list[int]
    shares: list[dict[str, float]]  # per batch and operator: share of the state's entries changed or added
    entries: list[dict[str, int]]  # per batch and operator: the state's entries after it


def events_frame(index: int, users: np.ndarray, items: np.ndarray, rng: np.random.Generator) -> pd.DataFrame:
    """One batch in `generate()`'s format: one event per (user, item) given, in one hour."""
    n = len(users)
    offsets = np.sort(rng.integers(0, 3_600_000_000, size=n))
    return pd.DataFrame({
        "event_id": np.arange(index * 10_000_000, index * 10_000_000 + n, dtype="int64"),
        "user_id": pd.array([f"u{i:07d}" for i in users], dtype="string"),
        "item_id": pd.array([f"i{i:06d}" for i in items], dtype="string"),
        "amount": np.round(rng.gamma(2.0, 20.0, size=n), 2),
        "ts": pd.Series(START + pd.to_timedelta(index * 3_600_000_000 + offsets, unit="us")).astype(
            "datetime64[us, UTC]"),
    })


def fixed_workload(root: Path, name: str, users: int, items: int, fraction: float, updates: int,
                   seed: int) -> Workload:
    """A first batch creating every user, then `updates` (+1 for the restart) touching `fraction`."""
    rng = np.random.default_rng(seed)
    touched = max(1, round(fraction * users))
    ids = [rng.permutation(users)] + [rng.choice(users, size=touched, replace=False) for _ in range(updates + 1)]
    out = root / name
    out.mkdir(parents=True)
    files, indices = [], []
    for index, u in enumerate(ids):
        it = rng.integers(0, items, size=len(u))
        events_frame(index, u, it, rng).to_parquet(out / f"batch-{index:06d}.parquet", index=False)
        files.append(out / f"batch-{index:06d}.parquet")
        indices.append((u, it))
    desc = f"{users:,} users, first batch creates all, {updates} updates touching {fraction:.0%} ({touched:,})"
    return _workload(name, desc, files, indices, items)


def growing_workload(root: Path, name: str, batches: int, events: int, users: int, items: int,
                     seed: int) -> Workload:
    urls = generate(str(root / name), batches=batches + 1, events_per_batch=events, users=users, items=items,
                    seed=seed)
    files = [Path(u.removeprefix("file://")) for u in urls]
    indices = []
    for f in files:
        frame = pd.read_parquet(f, columns=["user_id", "item_id"])
        indices.append((frame["user_id"].str.slice(1).astype("int64").to_numpy(),
                        frame["item_id"].str.slice(1).astype("int64").to_numpy()))
    desc = f"generate(): {batches} x {events:,} skewed events over {users:,} users, {items:,} items"
    return _workload(name, desc, files, indices, items)


def _workload(name: str, desc: str, files: list[Path], indices: list[tuple[np.ndarray, np.ndarray]],
              items: int) -> Workload:
    """Shares of changed or added state entries per batch, counted from the input data."""
    seen_users: set[int] = set()
    seen_items: set[int] = set()
    seen_pairs: set[int] = set()
    shares, entries = [], []
    for u, it in indices[:-1]:
        batch_users, batch_items = np.unique(u), np.unique(it)
        pairs = np.unique(u.astype("int64") * max(items, int(it.max()) + 1) + it).tolist()
        new_pairs = sum(1 for p in pairs if p not in seen_pairs)
        seen_users.update(batch_users.tolist())
        seen_items.update(batch_items.tolist())
        seen_pairs.update(pairs)
        reach_entries = len(seen_items) + len(seen_pairs)
        shares.append({"user_totals": len(batch_users) / len(seen_users),
                       "item_reach": (len(batch_items) + new_pairs) / reach_entries})
        entries.append({"user_totals": len(seen_users), "item_reach": reach_entries})
    events = [len(u) for u, _ in indices[:-1]]
    return Workload(name, desc, files[:-1], files[-1], events, shares, entries)


def make_workloads(root: Path, args: argparse.Namespace) -> list[Workload]:
    out = []
    for name in args.workloads:
        log(f"generating {name}")
        if name == "fixed-1pct":
            out.append(fixed_workload(root, name, args.users, args.items, 0.01, args.updates, args.seed))
        elif name == "fixed-10pct":
            out.append(fixed_workload(root, name, args.users, args.items, 0.10, args.updates, args.seed + 1))
        else:
            g = args.growing
            out.append(growing_workload(root, name, g["batches"], g["events"], g["users"], g["items"], args.seed))
    return out


# --- what is in storage ----------------------------------------------------------------------------


def listing(root: Path) -> dict[str, int]:
    """Relative path -> size of every file under `root`, hidden files left out."""
    out = {}
    for dirpath, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in names:
            if name.startswith(".") or name.endswith(".tmp"):
                continue
            path = os.path.join(dirpath, name)
            try:
                out[os.path.relpath(path, root)] = os.path.getsize(path)
            except FileNotFoundError:  # deleted while we listed (Spark's maintenance)
                pass
    return out


def hidden_bytes(root: Path) -> int:
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(root) for n in names
               if n.startswith("."))


@dataclass(frozen=True)
class TreeCpu:
    """One look at this process's tree in /proc: per process (pid and start time, so a reused pid
    is another process) its parent, its own CPU ticks and those of the children it reaped."""
    parent: dict[tuple[int, int], int]
    own: dict[tuple[int, int], int]
    reaped: dict[tuple[int, int], int]


def tree_cpu_seconds() -> TreeCpu | None:
    """This process and every process below it (the JVM, Spark's Python daemon and workers), from
    /proc; None without /proc. Other sessions' load stretches wall time, far less the CPU a batch
    needs. `cpu_since` turns two looks into CPU seconds."""
    if not os.path.isdir("/proc/self"):
        return None
    parent: dict[int, int] = {}
    stats: dict[int, tuple[int, int, int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                stat = f.read()
        except OSError:  # gone while we listed
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        pid = int(entry.name)
        parent[pid] = int(fields[1])
        # utime + stime, cutime + cstime, start time
        stats[pid] = (int(fields[11]) + int(fields[12]), int(fields[13]) + int(fields[14]), int(fields[19]))
    mine = os.getpid()
    look = TreeCpu({}, {}, {})
    for pid, (own, reaped, start) in stats.items():
        p = pid
        while p > 1 and p != mine:
            p = parent.get(p, 0)
        if p == mine:
            key = (pid, start)
            look.own[key], look.reaped[key] = own, reaped
            look.parent[key] = parent[pid]
    return look


def new_files(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {p: s for p, s in after.items() if before.get(p) != s}


def ours_state(storage: CheckpointStorage, files: dict[str, int], checkpoint_id: int) -> dict[str, Any]:
    meta = CompletedCheckpointStore(storage).load(checkpoint_id)
    per_op = {name: sum(f.size for h in op.subtasks for f in h.files()) for name, op in meta.operators.items()}
    sst = sum(f.size for h in meta.subtask_handles() for f in h.files() if f.local_name.endswith(".sst"))
    return {"state_bytes": sum(per_op.values()) + files[meta.metadata_path], "state_sst_bytes": sst,
            "state_by_operator": per_op}


def ours_operator_of(rel: str) -> str:
    """shared/<op>/... and chk-N/<op>/... belong to <op>; chk-N/_metadata to the checkpoint."""
    parts = rel.split("/")
    return parts[1] if len(parts) > 2 else "_metadata"


def spark_state(ckpt: Path, files: dict[str, int]) -> dict[str, Any]:
    """Restore bytes of Spark's latest version (see LIVE_STATE) and the SST bytes in it."""
    versions: dict[str, dict[str, dict[int, int]]] = defaultdict(lambda: {"zip": {}, "changelog": {}})
    for rel, size in files.items():
        parts = rel.split("/")
        if len(parts) == 4 and parts[0] == "state":
            stem, _, ext = parts[3].partition(".")
            if ext in ("zip", "changelog") and stem.isdigit():
                versions["/".join(parts[:3])][ext][int(stem)] = size
    if not versions:
        raise RuntimeError(f"no RocksDB state versions under {ckpt}/state: is the RocksDB provider in use?")
    total = sst = 0
    for part, kinds in versions.items():
        latest = max([*kinds["zip"], *kinds["changelog"]])
        base = max((v for v in kinds["zip"] if v <= latest), default=0)
        if base:
            total += kinds["zip"][base]
            for f in zip_ssts(ckpt / part / f"{base}.zip"):
                size = files.get(f"{part}/SSTs/{f['dfsSstFileName']}", int(f["sizeBytes"]))
                total, sst = total + size, sst + size
        total += sum(s for v, s in kinds["changelog"].items() if base < v <= latest)
    logs = files.get("metadata", 0)
    for log_dir in ("offsets", "commits"):
        ids = [int(p.split("/")[1]) for p in files if p.startswith(f"{log_dir}/") and p.split("/")[1].isdigit()]
        logs += files[f"{log_dir}/{max(ids)}"] if ids else 0
    return {"state_bytes": total + logs, "state_sst_bytes": sst, "state_store_bytes": total}


def zip_ssts(path: Path) -> list[dict[str, Any]]:
    """The SST files a Spark RocksDB snapshot zip lists in its `metadata` entry ("v1\\n{json}")."""
    with zipfile.ZipFile(path) as z:
        text = z.read("metadata").decode("utf-8")
    return list(json.loads(text.split("\n", 1)[1])["sstFiles"])


# --- the systems -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class System:
    label: str
    kind: str  # ours | spark
    settings: dict[str, str] = field(default_factory=dict)
    operators: tuple[str, ...] = ("user_totals",)
    changelog: bool = False


def systems(ours_variants: list[tuple[str, dict[str, str]]],
            operator_sets: list[str] | None = None) -> list[System]:
    out = [
        System(f"{label}/{ops}", "ours", settings, tuple(op.name for op in OPERATOR_SETS[ops]))
        for label, settings in ours_variants
        for ops in (operator_sets or list(OPERATOR_SETS))
    ]
    return out + [System(label, "spark", changelog=on) for label, on in SPARK_VARIANTS]


def make_session() -> Any:
    from sparkpoint.spark.session import spark_session

    spark = spark_session("local[2]", app_name="bench_vs_spark", ui=True)
    for key, value in SPARK_CONF.items():
        spark.conf.set(key, value)
    return spark


def link_inputs(files: list[Path], directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for f in files:
        os.link(f, directory / f.name)


def ours_pipeline(spark: Any, system: System, run_dir: Path, **overrides: Any) -> Any:
    from sparkpoint.pipeline.driver import StatefulPipeline
    from sparkpoint.pipeline.runtime import PipelineConfig

    config = PipelineConfig(
        input_url=f"file://{run_dir / 'in'}", checkpoints_url=f"file://{run_dir / 'checkpoints'}", job_id=JOB,
        num_retained=RETAINED, parallelism=PARALLELISM, output_url=f"file://{run_dir / 'out'}",
        files_per_checkpoint=1, local_dir=str(run_dir / "local"),
    )
    config = replace(config, **resolve_settings(system.settings), **overrides)
    by_name = {op.name: op for op in SAMPLE_OPERATORS}
    return StatefulPipeline(spark, config, tuple(by_name[n] for n in system.operators))


def run_ours(spark: Any, system: System, workload: Workload, run_dir: Path,
             on_batch: Callable[[int, Any], None] | None = None, files: int | None = None) -> list[dict[str, Any]]:
    link_inputs(workload.files[:files], run_dir / "in")
    pipeline = ours_pipeline(spark, system, run_dir)
    job_dir = run_dir / "checkpoints" / JOB
    before: dict[str, int] = {}
    batches = []
    started, cpu = time.perf_counter(), tree_cpu_seconds()
    for index, report in enumerate(pipeline.batches()):
        wall = time.perf_counter() - started
        cpu_s = cpu_since(cpu)
        after = listing(job_dir)
        new = new_files(before, after)
        state = ours_state(pipeline.storage, after, report.checkpoint_id)
        by_op: dict[str, dict[str, int]] = {op: {"uploaded": 0, "state": size}
                                            for op, size in state.pop("state_by_operator").items()}
        for rel, size in new.items():
            if (op := ours_operator_of(rel)) in by_op:
                by_op[op]["uploaded"] += size
        batches.append(batch_record(index, workload, wall, before, after, new, state) | {
            "operators": by_op, "engine_checkpointed_size": report.checkpointed_size,
            "engine_state_size": report.state_size, "restored": sorted(set(report.restored)), "cpu_s": cpu_s,
        })
        log_batch(system, batches[-1])
        if on_batch:
            on_batch(index, report)
        before = after
        started, cpu = time.perf_counter(), tree_cpu_seconds()
    return batches


def cpu_since(before: TreeCpu | None) -> float | None:
    """CPU seconds the tree used since `before`: what each process used itself since then (all of it
    for one born since), plus, for a process alive at both looks, what the children it reaped since
    then had used after `before` (their totals less what `before` already counted of them). A
    process that left the tree unreaped (reparented, or auto-reaped) takes only what it used after
    `before` with it: the figure can miss a little, never go below zero. Summing each process's
    cumulative figures instead went negative whenever such a process ended."""
    now = tree_cpu_seconds()
    if now is None or before is None:
        return None
    ticks = sum(own - before.own.get(key, 0) for key, own in now.own.items())
    gone: dict[int, int] = {}
    for key, own in before.own.items():
        if key not in now.own:
            gone[before.parent[key]] = gone.get(before.parent[key], 0) + own + before.reaped[key]
    for key, reaped in now.reaped.items():
        if key in before.reaped:
            ticks += max(0, reaped - before.reaped[key] - gone.get(key[0], 0))
    return ticks / os.sysconf("SC_CLK_TCK")


def batch_record(index: int, workload: Workload, wall: float, before: dict[str, int], after: dict[str, int],
                 new: dict[str, int], state: dict[str, Any]) -> dict[str, Any]:
    return {
        "batch": index, "events": workload.events[index], "wall_s": wall,
        "uploaded_bytes": sum(new.values()), "uploaded_files": len(new),
        "deleted_files": len(set(before) - set(after)), **state,
        "upload_over_state": sum(new.values()) / state["state_bytes"],
        "ckpt_bytes": sum(after.values()), "ckpt_files": len(after),
    }


def log_batch(system: System, b: dict[str, Any]) -> None:
    log(f"  {system.label} #{b['batch']}: {b['wall_s']:.2f} s, uploaded {b['uploaded_bytes'] / MB:.2f} MB "
        f"of {b['state_bytes'] / MB:.2f} MB ({b['upload_over_state']:.3f}), dir {b['ckpt_bytes'] / MB:.1f} MB "
        f"in {b['ckpt_files']} files")


def spark_query(spark: Any, run_dir: Path) -> Any:
    from pyspark.sql import functions as F

    events = spark.readStream.schema(SPARK_SCHEMA).option("maxFilesPerTrigger", 1).parquet(str(run_dir / "in"))
    totals = events.groupBy("user_id").agg(
        F.count("*").alias("count"), F.sum("amount").alias("amount_sum"), F.min("amount").alias("amount_min"),
        F.max("amount").alias("amount_max"), F.max("ts").alias("last_ts"),
    )
    out = str(run_dir / "out")

    def write(batch: Any, batch_id: int) -> None:
        batch.write.mode("overwrite").parquet(f"{out}/batch={batch_id}")

    return (totals.writeStream.outputMode("update").foreachBatch(write)
            .option("checkpointLocation", str(run_dir / "checkpoints")).start())


def start_spark(spark: Any, system: System, run_dir: Path) -> Any:
    for key, value in SPARK_CONF.items():  # set again: a run of ours may have changed the shared session
        spark.conf.set(key, value)
    spark.conf.set(SPARK_CHANGELOG, str(system.changelog).lower())
    (run_dir / "in").mkdir(parents=True, exist_ok=True)
    return spark_query(spark, run_dir)


def await_commit(query: Any, ckpt: Path, batch_id: int, timeout: float = 1800) -> None:
    """processAllAvailable can return before a file that just landed is seen: wait for its commit."""
    deadline = time.monotonic() + timeout
    while not (ckpt / "commits" / str(batch_id)).exists():
        query.processAllAvailable()  # raises if the query failed
        if time.monotonic() > deadline:
            raise TimeoutError(f"Spark did not commit batch {batch_id} within {timeout:.0f} s")
        time.sleep(0.005)


def progress(query: Any) -> dict[int, dict[str, Any]]:
    out = {}
    for p in query.recentProgress:
        raw = p.json if not callable(p.json) else p.json()
        data = json.loads(raw)
        out[int(data["batchId"])] = data
    return out


def run_spark(spark: Any, system: System, workload: Workload, run_dir: Path) -> list[dict[str, Any]]:
    query = start_spark(spark, system, run_dir)
    ckpt = run_dir / "checkpoints"
    before: dict[str, int] = {}
    batches = []
    try:
        for index, f in enumerate(workload.files):
            started, cpu = time.perf_counter(), tree_cpu_seconds()
            os.link(f, run_dir / "in" / f.name)
            await_commit(query, ckpt, index)
            wall = time.perf_counter() - started
            cpu_s = cpu_since(cpu)
            after = listing(ckpt)
            new = new_files(before, after)
            state = spark_state(ckpt, after)
            uploaded = sum(s for p, s in new.items() if p.startswith("state/"))
            batches.append(batch_record(index, workload, wall, before, after, new, state) | {
                "operators": {"user_totals": {"uploaded": uploaded, "state": state["state_store_bytes"]}},
                "cpu_s": cpu_s,
                "zip_files": sum(1 for p in after if p.endswith(".zip")),
                "changelog_files": sum(1 for p in after if p.endswith(".changelog")),
            })
            log_batch(system, batches[-1])
            before = after
        reports = progress(query)
    finally:
        query.stop()
    for b in batches:
        p = reports.get(b["batch"], {})
        ops = p.get("stateOperators") or [{}]
        b["spark_progress"] = {"durationMs": p.get("durationMs", {}), "numRowsTotal": ops[0].get("numRowsTotal"),
                               "numRowsUpdated": ops[0].get("numRowsUpdated"),
                               "commitTimeMs": ops[0].get("commitTimeMs"),
                               "customMetrics": ops[0].get("customMetrics", {})}
    return batches


# --- cold restart ------------------------------------------------------------------------------------


def start_restart(system: System, workload: Workload, run_dir: Path) -> subprocess.Popen[str]:
    """One more file, to be processed by a fresh process from the existing checkpoint."""
    os.link(workload.restart_file, run_dir / "in" / workload.restart_file.name)
    spec = {"system": system.__dict__ | {"operators": list(system.operators)}, "run_dir": str(run_dir),
            "batch": len(workload.files)}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return subprocess.Popen(
        [sys.executable, "-m", "benchmarks.bench_vs_spark", "--restart-child", json.dumps(spec)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def finish_restart(system: System, proc: subprocess.Popen[str]) -> dict[str, Any]:
    stdout, stderr = proc.communicate(timeout=1800)
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"cold restart of {system.label} failed ({proc.returncode}): {stderr[-3000:]}")
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT "):])
    log(f"  {system.label} cold restart: {result['total_s']:.1f} s (session {result['session_s']:.1f} s)")
    return result


def repeated_restart(system: System, workload: Workload, run_dir: Path, repeat: int) -> dict[str, Any]:
    """`repeat` cold restarts, each from the same state (the run directory is put back between
    them, at the same path: Spark's source log holds absolute paths); medians, and every run."""
    backup = run_dir.with_name(run_dir.name + ".before-restart")
    shutil.copytree(run_dir, backup, symlinks=True)
    runs = []
    try:
        for n in range(repeat):
            if n:
                shutil.rmtree(run_dir)
                shutil.copytree(backup, run_dir, symlinks=True)
            runs.append(finish_restart(system, start_restart(system, workload, run_dir)))
    finally:
        shutil.rmtree(backup, ignore_errors=True)
    median = {k: statistics.median(r[k] for r in runs) for k in ("total_s", "session_s", "batch_s")}
    return runs[-1] | median | {"runs": runs}


def restart_child(spec: dict[str, Any]) -> None:
    raw = spec["system"]
    system = System(raw["label"], raw["kind"], raw["settings"], tuple(raw["operators"]), raw["changelog"])
    run_dir = Path(spec["run_dir"])
    started = time.perf_counter()
    spark = make_session()
    session_s = time.perf_counter() - started
    extra: dict[str, Any] = {}
    if system.kind == "ours":
        fresh = run_dir / "local-restart"  # no task-local state: restore from checkpoint storage
        reports = ours_pipeline(spark, system, run_dir, local_dir=str(fresh), max_batches=1).run()
        total = time.perf_counter() - started
        if len(reports) != 1:
            raise RuntimeError(f"expected one batch after the restart, got {len(reports)}")
        extra["restored"] = sorted(set(reports[0].restored))
    else:
        query = start_spark(spark, system, run_dir)
        try:
            await_commit(query, run_dir / "checkpoints", spec["batch"])
            total = time.perf_counter() - started
        finally:
            query.stop()
    spark.stop()
    print("RESULT " + json.dumps({"total_s": total, "session_s": session_s, "batch_s": total - session_s} | extra))


# --- profile of ours -------------------------------------------------------------------------------

# (file, function) -> what it is; cumulative seconds come from cProfile in the tasks.
WORKER_FUNCS = [
    ("tasks.py", "run_slots", "subtask tasks: all Python in the tasks"),
    ("tasks.py", "run_subtask", "  one operator's subtask: restore, process, snapshot"),
    ("tasks.py", "read_unit", "  read Parquet (once per task)"),
    ("tasks.py", "rows_of_subtask", "  keep each operator's keys of the subtask"),
    ("restoring.py", "restore", "  restore (working db reopened)"),
    ("sample.py", "_user_totals_process", "  user_totals process (pandas + RocksDB)"),
    ("sample.py", "_item_reach_process", "  item_reach process (pandas + RocksDB)"),
    ("parquet.py", "stage", "  sink: stage changed rows (Parquet)"),
    ("snapshotting.py", "snapshot", "  snapshot: flush, native checkpoint, upload"),
    ("storage.py", "upload", "    upload (copy, CRC32, fsync)"),
    ("~", "create_checkpoint", "    RocksDB native checkpoint"),
    ("subtask.py", "close", "  close (flush, close db)"),
]
DRIVER_FUNCS = [
    ("protocol.py", "run_spark_half", "Spark half (trigger + Spark job)"),
    ("driver.py", "run_spark", "  Spark job (plan, run, collect)"),
    ("protocol.py", "complete_attempt", "completing half"),
    ("protocol.py", "_check_uploads_present", "  check uploads present"),
    ("coordinator.py", "acknowledge", "  acknowledge handles"),
    ("coordinator.py", "complete", "  complete: _metadata, retention, deletes"),
    ("parquet.py", "commit", "  sink commit (move staged files)"),
]


def cumulative(stats: pstats.Stats, funcs: list[tuple[str, str, str]], per: int) -> list[dict[str, Any]]:
    table = stats.stats  # type: ignore[attr-defined]
    out = []
    for file_part, name, what in funcs:
        seconds, calls = 0.0, 0
        for (filename, _, funcname), (_, nc, _, ct, _) in table.items():
            hit = name in funcname if file_part == "~" else filename.endswith(file_part) and funcname == name
            if hit:
                seconds, calls = seconds + ct, calls + nc
        out.append({"what": what, "function": name, "seconds_per_batch": seconds / per, "calls": calls})
    return out


def rest(spark: Any, path: str) -> Any:
    url = f"{spark.sparkContext.uiWebUrl}/api/v1/applications/{spark.sparkContext.applicationId}/{path}"
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def _ts(text: str) -> float:
    return datetime.strptime(text.replace("GMT", "+0000"), "%Y-%m-%dT%H:%M:%S.%f%z").timestamp()


def spark_jobs_since(spark: Any, known: set[int]) -> list[dict[str, Any]]:
    """Jobs Spark ran that are not in `known`: duration and its stages' durations and task times."""
    out = []
    for job in rest(spark, "jobs"):
        if job["jobId"] in known or job.get("status") != "SUCCEEDED":
            continue
        stages = []
        for sid in sorted(job["stageIds"]):
            for s in rest(spark, f"stages/{sid}"):
                if s.get("status") == "COMPLETE":
                    stages.append({"stage": sid, "name": s.get("name", ""), "tasks": s.get("numTasks"),
                                   "duration_s": _ts(s["completionTime"]) - _ts(s["submissionTime"]),
                                   "executor_run_s": s.get("executorRunTime", 0) / 1000,
                                   "executor_deserialize_s": s.get("executorDeserializeTime", 0) / 1000})
        out.append({"job": job["jobId"], "duration_s": _ts(job["completionTime"]) - _ts(job["submissionTime"]),
                    "stages": stages})
    return out


def profile_ours(spark: Any, system: System, workload: Workload, run_dir: Path, updates: int) -> dict[str, Any]:
    """Ours on the first 1 + `updates` files with the profilers on for the update batches."""
    from sparkpoint.pipeline.driver import StatefulPipeline

    driver = cProfile.Profile()
    per_batch: list[dict[str, Any]] = []
    jobs_known = {j["jobId"] for j in rest(spark, "jobs")}
    spark_calls: list[dict[str, Any]] = []
    original = StatefulPipeline.run_spark

    def timed_run_spark(self: Any, spec: Any, urls: list[str], *route: Any) -> list[dict[str, Any]]:
        started = time.perf_counter()
        rows = original(self, spec, urls, *route)
        spark_calls.append({"wall_s": time.perf_counter() - started, "task_seconds": [r["seconds"] for r in rows]})
        return rows

    def on_batch(index: int, report: Any) -> None:
        nonlocal jobs_known
        driver.disable()
        if index > 0:
            jobs = spark_jobs_since(spark, jobs_known)
            jobs_known |= {j["job"] for j in jobs}
            call = spark_calls[-1]
            per_batch.append({"batch": index, "report_s": report.seconds, **call, "spark_jobs": jobs})
        else:  # profile the update batches only
            jobs_known |= {j["jobId"] for j in rest(spark, "jobs")}
            spark.profile.clear(type="perf")
            spark.conf.set("spark.sql.pyspark.udf.profiler", "perf")
        driver.enable()

    StatefulPipeline.run_spark = timed_run_spark  # type: ignore[method-assign]  # only to read task seconds
    try:
        batches = run_ours(spark, system, workload, run_dir, on_batch=on_batch, files=1 + updates)
    finally:
        driver.disable()
        StatefulPipeline.run_spark = original  # type: ignore[method-assign]
        spark.conf.unset("spark.sql.pyspark.udf.profiler")
    n = max(1, len(per_batch))
    dump = run_dir / "udf-profiles"
    spark.profile.dump(str(dump), type="perf")
    worker_files = sorted(str(p) for p in dump.glob("*.pstats")) if dump.exists() else []
    worker = cumulative(pstats.Stats(*worker_files), WORKER_FUNCS, n) if worker_files else []
    spark.profile.clear(type="perf")
    return summarize_profile(system, batches[1:], per_batch, worker,
                             cumulative(pstats.Stats(driver), DRIVER_FUNCS, n))


def summarize_profile(system: System, batches: list[dict[str, Any]], per_batch: list[dict[str, Any]],
                      worker: list[dict[str, Any]], driver: list[dict[str, Any]]) -> dict[str, Any]:
    def mean(values: list[float]) -> float:
        return statistics.fmean(values) if values else 0.0

    n = max(1, len(per_batch))
    jobs = [j for b in per_batch for j in b["spark_jobs"]]
    stage_s: dict[tuple[int, int, int], float] = defaultdict(float)  # (position, of, tasks) -> seconds
    for b in per_batch:
        ordered = sorted((s for j in b["spark_jobs"] for s in j["stages"]), key=lambda s: s["stage"])
        for i, s in enumerate(ordered):
            stage_s[(i + 1, len(ordered), s["tasks"])] += s["duration_s"]
    run_spark = mean([b["wall_s"] for b in per_batch])
    task_seconds = [t for b in per_batch for t in b["task_seconds"]]
    phases = {
        "batch wall (pipeline generator resumed -> report)": mean([b["wall_s"] for b in batches]),
        "BatchReport.seconds (trigger -> completed)": mean([b["report_s"] for b in per_batch]),
        "run_spark (driver: plan, Spark job, collect)": run_spark,
        "  Spark jobs (REST: submission -> completion)": sum(j["duration_s"] for j in jobs) / n,
        **{f"    stage {i} of {k}: {tasks} task(s)": seconds / n for (i, k, tasks), seconds in sorted(stage_s.items())},
        "  outside Spark jobs (plan, submit, collect)": run_spark - sum(j["duration_s"] for j in jobs) / n,
        "after the job (acknowledge, _metadata, retention, sink commit)": mean(
            [b["report_s"] - b["wall_s"] for b in per_batch]),
        "Python in the subtasks: 'seconds' summed over subtasks": sum(task_seconds) / n,
        "Python in the subtasks: slowest subtask": mean([max(b["task_seconds"]) for b in per_batch]),
    }
    last_stage_tasks = [max(stage_s)[2]] if stage_s else []
    return {"system": system.label, "profiled_batches": len(per_batch), "phases_s": phases,
            "expected_tasks": PARALLELISM, "last_stage_tasks": last_stage_tasks[0] if stage_s else 0,
            "worker_functions": worker, "driver_functions": driver, "per_batch": per_batch}


# --- summaries ---------------------------------------------------------------------------------------


def summarize(batches: list[dict[str, Any]], shares: list[dict[str, float]],
              entries: list[dict[str, int]]) -> dict[str, Any]:
    """Figures over the update batches (all but the first) of one system on one workload."""
    updates, first, last = batches[1:], batches[0], batches[-1]
    ratios = [b["upload_over_state"] for b in updates]
    wall = sum(b["wall_s"] for b in updates)
    cpus = [b["cpu_s"] for b in updates if b.get("cpu_s") is not None]
    cpus = cpus if len(cpus) == len(updates) else []
    amp: dict[str, float] = {}
    amp_compact: dict[str, float | None] = {}
    # Without SSTs in the first checkpoint (Spark's changelog mode) there is no compact size to use.
    has_compact = first["state_sst_bytes"] > 0
    expected_total = expected_compact_total = 0.0
    for op in sorted(first["operators"]):
        uploaded = sum(b["operators"][op]["uploaded"] for b in updates)
        expected = sum(shares[b["batch"]][op] * b["operators"][op]["state"] for b in updates)
        # The first batch's state is one flush of every entry it holds: the compact size per entry.
        per_entry = first["operators"][op]["state"] / entries[0][op]
        compact = sum(shares[b["batch"]][op] * entries[b["batch"]][op] * per_entry for b in updates)
        amp[op] = uploaded / expected if expected else 0.0
        amp_compact[op] = uploaded / compact if compact and has_compact else None
        expected_total, expected_compact_total = expected_total + expected, expected_compact_total + compact
    uploaded_total = sum(b["uploaded_bytes"] for b in updates)
    return {
        "update_batches": len(updates),
        "upload_over_state_mean": statistics.fmean(ratios) if ratios else 0.0,
        "upload_over_state_median": statistics.median(ratios) if ratios else 0.0,
        "upload_over_state_max": max(ratios, default=0.0),
        "rewrites": sum(1 for r in ratios if r > 0.5),
        "uploaded_bytes_mean": uploaded_total / len(updates) if updates else 0.0,
        "uploaded_bytes_total": uploaded_total,
        "state_bytes_first": first["state_bytes"],
        "state_bytes_final": last["state_bytes"],
        "ckpt_bytes_final": last["ckpt_bytes"],
        "ckpt_files_final": last["ckpt_files"],
        "ckpt_over_state": last["ckpt_bytes"] / last["state_bytes"],
        "events_per_s": sum(b["events"] for b in updates) / wall if wall else 0.0,
        "cpu_s_per_batch": statistics.fmean(cpus) if cpus else None,
        "events_per_cpu_s": sum(b["events"] for b in updates) / sum(cpus) if cpus and sum(cpus) else None,
        "batch_s_median": statistics.median([b["wall_s"] for b in updates]) if updates else 0.0,
        "first_batch_s": first["wall_s"],
        "amplification": amp,
        "amplification_total": uploaded_total / expected_total if expected_total else 0.0,
        "amplification_compact": amp_compact,
        "amplification_compact_total": (uploaded_total / expected_compact_total
                                        if expected_compact_total and has_compact else None),
    }


def speed_vs_spark(systems: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """Ours ÷ Spark's better mode in events/s over the update batches, per system of ours (None
    without a Spark system): the figure the throughput goal (≥ 2x on every workload) is about."""
    spark = {label: s["summary"]["events_per_s"] for label, s in systems.items() if s["kind"] == "spark"}
    if not spark:
        return None
    best = max(spark, key=lambda label: spark[label])
    out: dict[str, Any] = {
        "spark_best": best, "spark_best_events_per_s": spark[best],
        "ours": {label: s["summary"]["events_per_s"] / spark[best] if spark[best] else 0.0
                 for label, s in systems.items() if s["kind"] == "ours"}}
    per_cpu = {label: s["summary"].get("events_per_cpu_s") for label, s in systems.items()}
    spark_cpu = {label: v for label, v in per_cpu.items() if systems[label]["kind"] == "spark" and v}
    if spark_cpu:  # the same by CPU: events per CPU second of the whole process tree
        cpu_best = max(spark_cpu, key=lambda label: spark_cpu[label])
        out["spark_best_by_cpu"], out["spark_best_events_per_cpu_s"] = cpu_best, spark_cpu[cpu_best]
        out["ours_by_cpu"] = {label: v / spark_cpu[cpu_best] for label, v in per_cpu.items()
                              if systems[label]["kind"] == "ours" and v}
    return out


def restore_vs_spark(systems: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per system, what a restore of its latest checkpoint reads (live state, the last batch's and
    the mean over the update batches), what it uploads per update batch (mean, largest ÷ mean)
    and its cold restart (a new process: session, restore, one batch), and per system of ours the
    same ÷ each Spark mode's (below 1: ours reads, uploads or takes less)."""
    out: dict[str, Any] = {}
    for label, s in systems.items():
        updates = s["batches"][1:]
        uploads = [b["uploaded_bytes"] for b in updates] or [0]
        mean_up = statistics.fmean(uploads)
        out[label] = {
            "kind": s["kind"],
            "state_bytes_final": s["summary"]["state_bytes_final"],
            "state_bytes_mean": statistics.fmean(b["state_bytes"] for b in updates) if updates else 0.0,
            "state_bytes_max": max((b["state_bytes"] for b in updates), default=0),
            "uploaded_bytes_mean": mean_up,
            "uploaded_largest_over_mean": max(uploads) / mean_up if mean_up else 0.0,
            "restart_s": (s.get("restart") or {}).get("total_s"),
        }
    for x in out.values():
        if x["kind"] != "ours":
            continue
        x["vs"] = {}
        for other, y in out.items():
            if y["kind"] != "spark":
                continue
            x["vs"][other] = {
                k: (x[k] / y[k] if x[k] is not None and y[k] else None)
                for k in ("state_bytes_final", "state_bytes_mean", "state_bytes_max", "uploaded_bytes_mean",
                          "restart_s")}
    return out


def entry_shares(shares: list[dict[str, float]], entries: list[dict[str, int]]) -> dict[str, dict[str, float]]:
    """Per operator, means over the update batches: the share of the state's entries the batch
    changed or added, and the share it added. An added entry is information no earlier checkpoint
    holds, so some form of it must be uploaded."""
    out = {}
    for op in entries[0]:
        changed = [s[op] for s in shares[1:]]
        added = [(now[op] - before[op]) / now[op] for before, now in zip(entries, entries[1:])]
        out[op] = {"changed_mean": statistics.fmean(changed) if changed else 0.0,
                   "added_mean": statistics.fmean(added) if added else 0.0}
    return out


# --- report --------------------------------------------------------------------------------------------


def table(title: str, header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join([title, fmt.format(*header), "  ".join("-" * w for w in widths),
                      *(fmt.format(*r) for r in rows), ""])


def ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def mb(n: float) -> str:
    return f"{n / MB:,.2f}"


def report(results: dict[str, Any]) -> str:
    out = [f"live state = {LIVE_STATE}\nuploaded = {UPLOADED}\namplification = {AMPLIFICATION}\n"
           f"amp (compact) = {AMPLIFICATION_COMPACT}\n"]
    for name, w in results["workloads"].items():
        out.append(f"{name}: {w['description']}")
    out.append("")
    rows = []
    for name, w in results["workloads"].items():
        for label, s in w["systems"].items():
            x = s["summary"]
            rows.append([
                name, label, str(x["update_batches"]), f"{x['upload_over_state_mean']:.3f}",
                f"{x['upload_over_state_median']:.3f}", f"{x['upload_over_state_max']:.3f}", str(x["rewrites"]),
                mb(x["uploaded_bytes_mean"]), mb(x["state_bytes_final"]),
                f"{x['state_bytes_final'] / x['state_bytes_first']:.2f}", mb(x["ckpt_bytes_final"]),
                str(x["ckpt_files_final"]), f"{x['ckpt_over_state']:.2f}", f"{x['amplification_total']:.2f}",
                ratio(x["amplification_compact_total"]),
            ])
    out.append(table(
        "Entries per update batch, from the input data (means over the update batches). An added entry is new "
        "information: a checkpoint's up/state falls below the added share only as far as the upload stores an "
        "entry in fewer bytes than the live state does",
        ["workload", "operator", "changed or added / entries", "added / entries"],
        [[name, op, f"{x['changed_mean']:.3f}", f"{x['added_mean']:.3f}"]
         for name, w in results["workloads"].items() for op, x in entry_shares(w["shares"], w["entries"]).items()],
    ))
    out.append(table(
        "Checkpoint bytes, from storage listings (up/state mean, median, max over the update batches)",
        ["workload", "system", "upd", "up/state", "median", "max", ">half", "MB up/batch", "state MB",
         "state/1st", "dir MB", "files", "dir/state", "amplif.", "amp (compact)"],
        rows,
    ))
    rows = []
    for name, w in results["workloads"].items():
        versus = speed_vs_spark(w["systems"]) or {"ours": {}}
        for label, s in w["systems"].items():
            x, r = s["summary"], s.get("restart") or {}
            ratio_ = versus["ours"].get(label)
            cpu_ratio = versus.get("ours_by_cpu", {}).get(label)
            per_cpu = x.get("events_per_cpu_s")
            rows.append([name, label, f"{x['events_per_s']:,.0f}",
                         f"{ratio_:.2f}x" if ratio_ is not None else "-",
                         f"{per_cpu:,.0f}" if per_cpu else "-", f"{cpu_ratio:.2f}x" if cpu_ratio else "-",
                         f"{x['batch_s_median']:.2f}",
                         f"{x['first_batch_s']:.1f}", f"{r['total_s']:.1f}" if r else "-",
                         f"{r['session_s']:.1f}" if r else "-", f"{r['batch_s']:.1f}" if r else "-"])
    out.append(table(
        "Speed (events/s over the update batches; ours ÷ Spark's better mode in events/s; events per CPU second "
        "of the whole process tree and the same ratio; median batch wall; cold restart: session + one batch, in "
        "a fresh process)",
        ["workload", "system", "events/s", "÷ Spark best", "events/CPU-s", "÷ Spark best", "batch s",
         "1st batch s", "restart s", "of it session s", "of it batch s"], rows,
    ))
    rows = []
    for name, w in results["workloads"].items():
        restore = restore_vs_spark(w["systems"])
        for label, x in restore.items():
            vs = x.get("vs") or {}
            rows.append([name, label, mb(x["state_bytes_final"]), mb(x["state_bytes_mean"]), mb(x["state_bytes_max"]),
                         mb(x["uploaded_bytes_mean"]), f"{x['uploaded_largest_over_mean']:.2f}",
                         f"{x['restart_s']:.1f}" if x["restart_s"] is not None else "-",
                         " / ".join(ratio(v["state_bytes_final"]) for v in vs.values()) or "-",
                         " / ".join(ratio(v["state_bytes_mean"]) for v in vs.values()) or "-",
                         " / ".join(ratio(v["uploaded_bytes_mean"]) for v in vs.values()) or "-",
                         " / ".join(ratio(v["restart_s"]) for v in vs.values()) or "-"])
    out.append(table(
        "What a restore reads and a cold restart, side by side (live state = the bytes a restore of the latest "
        "checkpoint reads; cold restart = a new process: session, restore from checkpoint storage, one batch; "
        "ours ÷ Spark changelog off / on)",
        ["workload", "system", "live MB last", "mean", "max", "MB up/batch", "largest÷mean", "restart s",
         "÷ Spark: live last", "live mean", "up/batch", "restart"], rows,
    ))
    rows = []
    for name, w in results["workloads"].items():
        for label, s in w["systems"].items():
            for op, a in s["summary"]["amplification"].items():
                ups = [b["operators"][op] for b in s["batches"][1:]]
                rows.append([name, label, op, f"{a:.2f}", ratio(s["summary"]["amplification_compact"][op]),
                             mb(sum(u["uploaded"] for u in ups)), mb(s["batches"][0]["operators"][op]["state"]),
                             mb(ups[-1]["state"] if ups else 0)])
    out.append(table("Amplification per operator (update batches; the operator's own state files)",
                     ["workload", "system", "operator", "amplif.", "amp (compact)", "uploaded MB",
                      "1st state MB", "final state MB"], rows))
    for prof in results.get("profile", []):
        out.append(table(f"Where a batch's time goes: {prof['system']}, {prof['profiled_batches']} profiled "
                         "update batches (mean s per batch; the profilers slow it down against the tables above)",
                         ["phase", "s"], [[k, f"{v:.3f}"] for k, v in prof["phases_s"].items()]))
        if 0 < prof.get("last_stage_tasks", 0) != prof.get("expected_tasks", 0):
            out.append(f"  NOTE: the last stage ran {prof['last_stage_tasks']} task(s), not one per subtask "
                       f"index ({prof['expected_tasks']}).\n")
        out.append(table("  ... inside the tasks (cProfile in the Python workers, cumulative s per batch, summed "
                         "over tasks)", ["function", "s", "calls"],
                         [[f["what"], f"{f['seconds_per_batch']:.3f}", str(f["calls"])]
                          for f in prof["worker_functions"]]))
        out.append(table("  ... on the driver (cProfile, cumulative s per batch)", ["function", "s", "calls"],
                         [[f["what"], f"{f['seconds_per_batch']:.3f}", str(f["calls"])]
                          for f in prof["driver_functions"]]))
    rows = []
    for name, w in results["workloads"].items():
        for label, s in w["systems"].items():
            progress_rows = [b["spark_progress"] for b in s["batches"][1:] if "spark_progress" in b]
            if not progress_rows:
                continue

            def med(get: Callable[[dict[str, Any]], Any], rows: list[dict[str, Any]] = progress_rows) -> str:
                values = [v for v in (get(p) for p in rows) if v is not None]
                return f"{statistics.median(values) / 1000:.2f}" if values else "-"

            rows.append([name, label, med(lambda p: p["durationMs"].get("triggerExecution")),
                         med(lambda p: p["durationMs"].get("addBatch")),
                         med(lambda p: p["durationMs"].get("walCommit")),
                         med(lambda p: p["durationMs"].get("commitOffsets")),
                         med(lambda p: p["commitTimeMs"]),
                         med(lambda p: p["customMetrics"].get("rocksdbCommitCheckpointLatency")),
                         med(lambda p: p["customMetrics"].get("rocksdbCommitFlushLatency"))])
    if rows:
        out.append(table("Spark's batch time from its progress reports (median s over update batches; commit "
                         "and RocksDB latencies are summed over the 4 partitions)",
                         ["workload", "system", "trigger", "addBatch", "walCommit", "commitOffsets",
                          "state commit", "rocksdb ckpt", "rocksdb flush"], rows))
    out.append(f"total runtime {results['runtime_s']:.0f} s")
    return "\n".join(out)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["workloads"])
    fig, axes = plt.subplots(2, len(names), figsize=(5.5 * len(names), 7.5), squeeze=False)
    for col, name in enumerate(names):
        w = results["workloads"][name]
        for label, s in w["systems"].items():
            xs = [b["batch"] + 1 for b in s["batches"]]
            axes[0][col].plot(xs, [b["upload_over_state"] for b in s["batches"]], marker="o", ms=3, label=label)
            axes[1][col].plot(xs, [b["ckpt_bytes"] / MB for b in s["batches"]], marker="o", ms=3, label=label)
        axes[0][col].set_title(f"{name}\n{w['description']}", fontsize=8)
        axes[0][col].set_yscale("log")
        axes[0][col].set_ylabel("uploaded ÷ live state")
        axes[1][col].set_ylabel("checkpoint directory MB")
        axes[1][col].set_xlabel("batch (checkpoint)")
        for ax in axes[:, col]:
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Per checkpoint: bytes uploaded ÷ live state (restore bytes), and checkpoint directory size",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- main ------------------------------------------------------------------------------------------------


def run_dir_of(work: Path, workload: Workload, system: System) -> Path:
    return work / "runs" / workload.name / system.label.replace("/", "_")


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    workloads = make_workloads(work / "data", args)
    chosen = systems(args.ours_variants, args.operator_sets)
    spark = make_session()
    results: dict[str, Any] = {"workloads": {}, "profile": []}
    background: list[tuple[System, subprocess.Popen[str]]] = []
    try:
        if args.warmup:
            log("warm-up (not measured)")
            warm = fixed_workload(work / "data", "warmup", 2000, 200, 0.1, 2, args.seed + 7)
            for system in chosen:
                runner = run_ours if system.kind == "ours" else run_spark
                runner(spark, system, warm, work / "warmup" / system.label.replace("/", "_"))
        for k, workload in enumerate(workloads):
            entry: dict[str, Any] = {"description": workload.description, "events": workload.events,
                                     "shares": workload.shares, "entries": workload.entries,
                                     "entry_shares": entry_shares(workload.shares, workload.entries), "systems": {}}
            results["workloads"][workload.name] = entry
            order = chosen[k % len(chosen):] + chosen[: k % len(chosen)]  # a different system goes first
            for system in order:
                log(f"{workload.name}: {system.label}")
                run_dir = run_dir_of(work, workload, system)
                runner = run_ours if system.kind == "ours" else run_spark
                batches = runner(spark, system, workload, run_dir)
                store = run_dir / "checkpoints" / (JOB if system.kind == "ours" else "")
                entry["systems"][system.label] = {
                    "kind": system.kind, "settings": system.settings, "operators": list(system.operators),
                    "changelog": system.changelog, "batches": batches,
                    "summary": summarize(batches, workload.shares, workload.entries),
                    "hidden_bytes_final": hidden_bytes(store),
                }
            if args.restart and not args.quick:
                for system in order:
                    entry["systems"][system.label]["restart"] = repeated_restart(
                        system, workload, run_dir_of(work, workload, system), args.restart_repeat)
            elif args.restart and k == 0:
                # --quick: one restart (of ours) while the other workloads run, so that the smoke test
                # stays short; its timings mean nothing anyway
                system = next(s for s in order if s.kind == "ours")
                background = [(system, start_restart(system, workload, run_dir_of(work, workload, system)))]
            entry["systems"] = {s.label: entry["systems"][s.label] for s in chosen}
            entry["speed_vs_spark"] = speed_vs_spark(entry["systems"])
        if args.profile:
            target = next((w for w in workloads if w.name == "fixed-10pct"), workloads[0])
            for system in [s for s in chosen if s.kind == "ours"][: 1 if args.quick else len(args.operator_sets)]:
                log(f"profile: {system.label} on {target.name}")
                results["profile"].append(profile_ours(
                    spark, system, target, work / "profile" / system.label.replace("/", "_"), args.profile_updates))
        first = results["workloads"][workloads[0].name]["systems"]
        for system, proc in background:
            first[system.label]["restart"] = finish_restart(system, proc)
    finally:
        spark.stop()
        for _, proc in background:
            if proc.poll() is None:
                proc.kill()
    return results


def parse_ours_settings(values: list[str]) -> list[tuple[str, dict[str, str]]]:
    """`LABEL:KEY=VALUE` options, grouped by label, after the built-in variants."""
    variants = [(label, dict(settings)) for label, settings in OURS_VARIANTS]
    for value in values:
        label, sep, rest_ = value.partition(":")
        key, eq, setting = rest_.partition("=")
        if not sep or not eq or not label or not key or "/" in label:
            raise ValueError(f"--ours-setting {value!r}: use LABEL:KEY=VALUE, e.g. changelog:incremental=true")
        found = next((s for name, s in variants if name == label), None)
        if found is None:
            variants.append((label, found := {}))
        found[key] = setting
    for label, settings in variants:
        try:
            resolve_settings(settings)
        except ValueError as e:
            raise ValueError(f"variant {label!r}: {e}") from e
    return variants


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--quick", action="store_true", help="smoke test: a few thousand users, 3 batches, < 2 min")
    p.add_argument("--out", type=Path, help="directory for the JSON and PNG (default benchmarks/results)")
    p.add_argument("--workloads", help="comma-separated subset of fixed-1pct, fixed-10pct, growing "
                                       "(default all three; with --quick fixed-10pct)")
    p.add_argument("--operator-sets", default=",".join(OPERATOR_SETS),
                   help=f"comma-separated operator sets of ours (default {','.join(OPERATOR_SETS)}); "
                        "user_totals alone is the one that does what Spark's query does")
    p.add_argument("--ours-setting", action="append", default=[], metavar="LABEL:KEY=VALUE",
                   help="add a variant of ours (repeatable; same LABEL = same variant), e.g. "
                        "changelog:state.backend.changelog.enabled=true")
    p.add_argument("--users", type=int, default=500_000, help="users of the fixed workloads (default 500000)")
    p.add_argument("--updates", type=int, default=12, help="update batches of the fixed workloads (default 12)")
    p.add_argument("--no-restart", dest="restart", action="store_false", help="skip the cold restarts")
    p.add_argument("--restart-repeat", type=int, default=3, help="cold restarts per system and workload (default 3)")
    p.add_argument("--no-profile", dest="profile", action="store_false", help="skip the profile of ours")
    p.add_argument("--profile-updates", type=int, default=4, help="profiled update batches (default 4)")
    p.add_argument("--keep", action="store_true", help="keep the temp directory (data, checkpoints)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--report-from", type=Path, metavar="JSON",
                   help="no run: summaries, tables and plot again from a results JSON (written to --out)")
    p.add_argument("--restart-child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.restart_child:
        return args
    args.out = args.out or RESULTS
    if args.report_from:
        return args
    chosen = args.workloads or (QUICK_WORKLOAD if args.quick else "fixed-1pct,fixed-10pct,growing")
    args.workloads = [w.strip() for w in chosen.split(",") if w.strip()]
    unknown = set(args.workloads) - {"fixed-1pct", "fixed-10pct", "growing"}
    if unknown or not args.workloads:
        p.error(f"--workloads: unknown {sorted(unknown)}; choose from fixed-1pct, fixed-10pct, growing")
    args.operator_sets = [o.strip() for o in args.operator_sets.split(",") if o.strip()]
    if set(args.operator_sets) - set(OPERATOR_SETS) or not args.operator_sets:
        p.error(f"--operator-sets: choose from {', '.join(OPERATOR_SETS)}")
    try:
        args.ours_variants = parse_ours_settings(args.ours_setting)
    except ValueError as e:
        p.error(str(e))
    args.items = 20_000
    args.growing = {"batches": 16, "events": 20_000, "users": 200_000, "items": 5_000}
    args.warmup = not args.quick
    if args.quick:
        args.users, args.items, args.updates, args.profile_updates = 3_000, 300, 2, 1
        args.growing = {"batches": 3, "events": 2_000, "users": 2_000, "items": 200}
    if args.users < 10 or args.updates < 1 or args.profile_updates < 1:
        p.error("--users must be at least 10, --updates and --profile-updates at least 1")
    return args


def keep_orphans_in_tree() -> None:
    """Make this process the reaper of its tree's orphans (Linux), so a process whose parent ended
    stays below it and its CPU is still counted; elsewhere a no-op."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    keep_orphans_in_tree()
    if args.restart_child:
        restart_child(json.loads(args.restart_child))
        return
    if args.report_from:  # summaries, tables and plot again from a run's raw per-batch figures
        results = json.loads(args.report_from.read_text())
        for w in results["workloads"].values():
            for system in w["systems"].values():
                system["summary"] = summarize(system["batches"], w["shares"], w["entries"])
            w["entry_shares"] = entry_shares(w["shares"], w["entries"])
            w["speed_vs_spark"] = speed_vs_spark(w["systems"])
        results["definitions"] = definitions()
        write(results, args.out, args.report_from.stem)
        return
    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="sparkpoint-vs-spark-"))
    try:
        results = run(args, work)
    finally:
        if args.keep:
            log(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    import pyspark
    import rocksdict

    results["runtime_s"] = time.perf_counter() - started
    results["definitions"] = definitions()
    results["config"] = {
        "quick": args.quick, "master": "local[2]", "parallelism": PARALLELISM, "num_retained": RETAINED,
        "ours_variants": [{"label": label, "settings": s} for label, s in args.ours_variants],
        "operator_sets": {k: [op.name for op in OPERATOR_SETS[k]] for k in args.operator_sets},
        "spark_conf": SPARK_CONF, "spark_variants": {label: {SPARK_CHANGELOG: on} for label, on in SPARK_VARIANTS},
        "fixed": {"users": args.users, "items": args.items, "updates": args.updates},
        "growing": args.growing, "seed": args.seed, "warmup": args.warmup,
    }
    results["machine"] = {"python": platform.python_version(), "cpus": os.cpu_count(),
                          "pyspark": pyspark.__version__, "rocksdict": getattr(rocksdict, "__version__", "unknown")}
    write(results, args.out, "vs_spark_quick" if args.quick else "vs_spark")


def definitions() -> dict[str, str]:
    return {"live_state": LIVE_STATE, "uploaded": UPLOADED, "amplification": AMPLIFICATION,
            "amplification_compact": AMPLIFICATION_COMPACT, "update_batches": "every batch after the first"}


def write(results: dict[str, Any], out: Path, stem: str) -> None:
    for w in results["workloads"].values():
        w["restore_vs_spark"] = restore_vs_spark(w["systems"])
    print(report(results))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1, default=float) + "\n")
    plot(results, out / f"{stem}.png")
    print(f"wrote {out / f'{stem}.json'} and {stem}.png")


if __name__ == "__main__":
    main()
