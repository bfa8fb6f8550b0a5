"""How does the checkpoint bookkeeping scale with the number of files?

No RocksDB here: a synthetic job (one operator, P subtasks, each holding F shared "SST" files)
takes checkpoints through the real `CheckpointCoordinator`, exactly as the state backend would:
every checkpoint replaces a fraction of each subtask's files with new uploads (tiny real files),
re-references the rest, and uploads three private files per subtask. Everything the coordinator
writes (`_metadata`, registry, subsumption, deletes) is the real thing. Three measurements:

a. registry rebuild (what every start does): a new `CheckpointCoordinator` over 100 retained
   checkpoints of 1,000 shared files each -- list the checkpoints, read and validate every
   `_metadata`, count the references. Target < 1 s. "parse alone" times `CheckpointMetadata.loads`
   of the same bytes, to show how much of the rebuild is the `_metadata` parser.
b. complete + subsume of a 10,000-file checkpoint with `num_retained=1`: commit `_metadata`,
   register, subsume the previous checkpoint and delete its files. Target < 100 ms of our own
   code. Our own time is measured on `memory://` (storage is a dict in this process) as the
   wall time minus the time spent inside the filesystem's methods (a proxy around `storage.fs`
   adds up the time of every call; one storage worker thread, so calls never overlap our code).
   That still charges our own code for fsspec's in-memory bookkeeping of open files, so it is an
   upper bound; "own CPU" is the process's CPU time minus that of the filesystem calls, which a
   busy machine inflates less than wall time. "_metadata dumps" times `CheckpointMetadata.dumps`
   of the same checkpoint alone (the serializer in metadata.py); "own - dumps" is the coordinator,
   registry and storage code. The same run on `file://` shows what real I/O adds.
c. orphan sweep over 100,000 files on `file://`: the retained checkpoints reference most of
   them, the rest are orphans of failed attempts (older than the grace) that get deleted.
   Target < 10 s.

d. `--ladder N,N,...` (instead of a-c): a job directory of N shared files per point (10 retained
   checkpoints of 32 subtasks, half of the files replaced per checkpoint, N/10 orphans), built
   through the real coordinator on `file://`; a registry rebuild (a new coordinator) and an
   orphan sweep, each in a new process, timed with their peak RSS. `--s3-ladder N,...` builds the
   same on S3 (moto on 127.0.0.1) and counts the S3 requests of each. The points are fitted with
   a power law (exponent 1 = linear). Results in bookkeeping_ladder.json (or --out).

Every figure is the median of `--repeat` runs. Run:

    .venv/bin/python -m benchmarks.bench_bookkeeping            # full scale, ~2 min
    .venv/bin/python -m benchmarks.bench_bookkeeping --quick    # 1/10 scale, seconds
    .venv/bin/python -m benchmarks.bench_bookkeeping --ladder 10000,100000,1000000 --repeat 3   # ~20 min
    .venv/bin/python -m benchmarks.bench_bookkeeping --ladder 1000 --s3-ladder 1000,10000 --repeat 1 \
        --out benchmarks/results/bookkeeping_ladder_s3.json                                      # ~5 min

It prints tables and writes JSON to benchmarks/results/bookkeeping.json
(bookkeeping_quick.json with --quick). `--profile` prints the top functions of each measurement.
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import gc
import io
import json
import logging
import math
import os
import platform
import pstats
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import fsspec
from fsspec.implementations.local import LocalFileSystem

from benchmarks.bench_state_backend import RequestCounter, moto_s3
from sparkpoint.checkpoint.coordinator import CheckpointCoordinator, CompletedCheckpoint
from sparkpoint.checkpoint.metadata import CheckpointMetadata, FileHandle, SubtaskStateHandle
from sparkpoint.checkpoint.paths import private_dir, shared_dir
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.checkpoint.sweep import sweep_orphans
from sparkpoint.state.keygroups import key_group_range

RESULTS = Path(__file__).parent / "results"
REPO = Path(__file__).resolve().parents[1]
OPERATOR = "bench"
MAX_PARALLELISM = 128
PRIVATE = ("CURRENT", "MANIFEST-000005", "OPTIONS-000007")
TARGETS = {"rebuild_s": 1.0, "complete_own_s": 0.1, "sweep_s": 10.0}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- a synthetic job -------------------------------------------------------------------------


def write_files(storage: CheckpointStorage, files: dict[str, bytes], *, local: bool) -> None:
    """Create small real files (relative path -> content); direct writes on a local disk."""
    if local:
        made: set[str] = set()
        for rel, data in files.items():
            path = f"{storage.root}/{rel}"
            parent = os.path.dirname(path)
            if parent not in made:
                os.makedirs(parent, exist_ok=True)
                made.add(parent)
            with open(path, "wb") as f:
                f.write(data)
    else:
        storage.fs.pipe({storage.abspath(rel): data for rel, data in files.items()})


def handle_for(rel: str, local_name: str, created_by: int) -> tuple[FileHandle, bytes]:
    data = f"{rel}\n".encode() * 2  # ~120 bytes: the content does not matter, its size and CRC32 do
    return FileHandle(local_name, rel, len(data), zlib.crc32(data), created_by), data


class SyntheticJob:
    """One operator with `subtasks` subtasks of `files` shared files each, checkpointed through
    the real coordinator; each checkpoint replaces `churn` of every subtask's files."""

    def __init__(
        self, storage: CheckpointStorage, *, subtasks: int, files: int, churn: float, num_retained: int, seed: int = 1
    ):
        self.storage = storage
        self.local = isinstance(storage.fs, LocalFileSystem)
        self.subtasks = subtasks
        self.files = files
        self.churn = churn
        self.rng = random.Random(seed)
        self.coordinator = CheckpointCoordinator(storage, num_retained=num_retained)
        self.base: list[list[FileHandle]] = [[] for _ in range(subtasks)]  # confirmed shared files
        self.numbers = [0] * subtasks

    def snapshot(self, checkpoint_id: int, subtask: int) -> tuple[SubtaskStateHandle, dict[str, bytes]]:
        """The handle a subtask would acknowledge, and the files it uploaded."""
        kept = list(self.base[subtask])
        replaced = self.files if not kept else max(1, round(self.churn * self.files))
        for victim in sorted(self.rng.sample(range(len(kept)), min(replaced, len(kept))), reverse=True):
            del kept[victim]
        uploads: dict[str, bytes] = {}
        new = []
        for _ in range(self.files - len(kept)):
            self.numbers[subtask] += 1
            rel = f"{shared_dir(OPERATOR, subtask)}/{uuid.uuid4().hex}.sst"
            handle, data = handle_for(rel, f"{self.numbers[subtask]:06d}.sst", checkpoint_id)
            new.append(handle)
            uploads[rel] = data
        attempt = uuid.uuid4().hex[:12]
        private = []
        for name in PRIVATE:
            rel = f"{private_dir(checkpoint_id, OPERATOR, subtask)}/{attempt}/{name}"
            handle, data = handle_for(rel, name, checkpoint_id)
            private.append(handle)
            uploads[rel] = data
        shared = sorted(kept + new, key=lambda f: f.local_name)
        handle = SubtaskStateHandle(
            operator=OPERATOR,
            subtask=subtask,
            checkpoint_id=checkpoint_id,
            key_group_range=key_group_range(MAX_PARALLELISM, self.subtasks, subtask),
            max_parallelism=MAX_PARALLELISM,
            shared=tuple(shared),
            private=tuple(private),
        )
        return handle, uploads

    def acknowledge_all(self) -> int:
        """Trigger a checkpoint, upload and acknowledge every subtask's files; returns its id."""
        pending = self.coordinator.trigger(expected={OPERATOR: self.subtasks})
        cid = pending.checkpoint_id
        uploads: dict[str, bytes] = {}
        for s in range(self.subtasks):
            handle, files = self.snapshot(cid, s)
            uploads.update(files)
            self.coordinator.acknowledge(cid, handle)
        write_files(self.storage, uploads, local=self.local)
        return cid

    def complete(self, checkpoint_id: int) -> CompletedCheckpoint:
        done = self.coordinator.complete(checkpoint_id)
        for handle in done.metadata.subtask_handles():  # confirm: the next checkpoint's base
            self.base[handle.subtask] = list(handle.shared)
        return done

    def checkpoint(self) -> CompletedCheckpoint:
        return self.complete(self.acknowledge_all())


# --- measuring -------------------------------------------------------------------------------


class TimedFS:
    """Forwards to a filesystem and adds up the wall time spent inside its methods."""

    def __init__(self, fs: Any):
        self._fs = fs
        self._lock = threading.Lock()
        self.seconds = 0.0
        self.cpu_seconds = 0.0  # CPU time of the calling threads inside the filesystem
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._fs, name)
        if not callable(attr):
            return attr

        def timed(*args: Any, **kwargs: Any) -> Any:
            started, cpu = time.perf_counter(), time.thread_time()
            try:
                return attr(*args, **kwargs)
            finally:
                with self._lock:
                    self.seconds += time.perf_counter() - started
                    self.cpu_seconds += time.thread_time() - cpu
                    self.calls += 1

        return timed


class Phases:
    """Wall time spent in chosen methods (not re-entrant: each phase runs on one thread)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        self.seconds.setdefault(name, 0.0)

        def call(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - started

        return call

    def wrap(self, obj: Any, name: str) -> None:
        setattr(obj, name, self.timed(name, getattr(obj, name)))


def median(values: list[float]) -> float:
    return statistics.median(values)


def profiled(fn: Callable[[], Any], enabled: bool, title: str) -> Any:
    if not enabled:
        return fn()
    profile = cProfile.Profile()
    result = profile.runcall(fn)
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(25)
    print(f"--- profile: {title}\n{out.getvalue()}", file=sys.stderr)
    return result


def storage_at(url: str, job: str, *, max_workers: int = 8) -> CheckpointStorage:
    return CheckpointStorage(url, job, max_workers=max_workers)


def new_coordinator(url: str, job: str, num_retained: int) -> CheckpointCoordinator:
    """What a start does: a coordinator on a fresh storage object rebuilds its registry."""
    return CheckpointCoordinator(storage_at(url, job), num_retained=num_retained)


def job_url(kind: str, work: Path) -> str:
    return f"file://{work}/checkpoints" if kind == "file" else f"memory://bookkeeping-{uuid.uuid4().hex[:8]}"


def drop(storage: CheckpointStorage) -> None:
    if storage.fs.exists(storage.root):
        storage.fs.rm(storage.root, recursive=True)


# --- a. registry rebuild -----------------------------------------------------------------------


def bench_rebuild(args: argparse.Namespace, work: Path, kind: str) -> dict[str, Any]:
    storage = storage_at(job_url(kind, work), f"rebuild-{uuid.uuid4().hex[:6]}")
    job = SyntheticJob(
        storage, subtasks=args.rebuild_subtasks, files=args.rebuild_files // args.rebuild_subtasks,
        churn=args.churn, num_retained=args.rebuild_checkpoints,
    )
    started = time.perf_counter()
    for _ in range(args.rebuild_checkpoints):
        job.checkpoint()
    log(f"rebuild ({kind}): {args.rebuild_checkpoints} checkpoints built in {time.perf_counter() - started:.1f} s")
    keys = ("list_s", "load_s", "count_s", "coordinator_s", "coordinator_cpu_s", "parse_s")
    runs: dict[str, list[float]] = {k: [] for k in keys}
    for n in range(args.repeat):
        fresh = storage_at(storage.url, storage.job_id)
        store = CompletedCheckpointStore(fresh)
        t0 = time.perf_counter()
        ids = store.checkpoint_ids()
        t1 = time.perf_counter()
        listing = store.load_all()
        t2 = time.perf_counter()
        registry = store.rebuild_registry(listing)
        t3 = time.perf_counter()
        runs["list_s"].append(t1 - t0)
        runs["load_s"].append(t2 - t1)
        runs["count_s"].append(t3 - t2)
        t3, cpu = time.perf_counter(), time.process_time()
        coordinator = profiled(
            lambda: new_coordinator(storage.url, storage.job_id, args.rebuild_checkpoints),
            args.profile and n == 0, f"registry rebuild on {kind}",
        )
        runs["coordinator_s"].append(time.perf_counter() - t3)
        runs["coordinator_cpu_s"].append(time.process_time() - cpu)
        raw = [fresh.read_bytes(m.metadata_path) for m in listing.checkpoints]
        started = time.perf_counter()
        for data in raw:  # the parse and validation of `_metadata` (metadata.py) alone
            CheckpointMetadata.loads(data)
        runs["parse_s"].append(time.perf_counter() - started)
        assert len(ids) == args.rebuild_checkpoints and not listing.unreadable
        assert coordinator.registry.paths() == registry.paths()
    meta = listing.checkpoints[0]
    result = {
        "storage": kind,
        "checkpoints": len(ids),
        "files_per_checkpoint": len(meta.paths()),
        "references": sum(len(m.paths()) + 1 for m in listing.checkpoints),
        "distinct_files": len(registry.paths()),
        "metadata_bytes": storage.info(meta.metadata_path).size,
        **{k: median(v) for k, v in runs.items()},
    }
    log(f"rebuild ({kind}): {result['coordinator_s']:.3f} s for {result['references']:,} references")
    drop(storage)
    return result


# --- b. complete + subsume -------------------------------------------------------------------


def bench_complete(args: argparse.Namespace, work: Path, kind: str) -> dict[str, Any]:
    # One worker thread: filesystem calls never overlap our own code, so the two times add up.
    storage = storage_at(job_url(kind, work), f"complete-{uuid.uuid4().hex[:6]}", max_workers=1)
    job = SyntheticJob(
        storage, subtasks=args.complete_subtasks, files=args.complete_files // args.complete_subtasks,
        churn=args.churn, num_retained=1,
    )
    job.checkpoint()
    job.checkpoint()
    timed = TimedFS(storage.fs)
    storage.fs = timed
    rows = []
    for n in range(args.repeat):
        cid = job.acknowledge_all()
        timed.seconds, timed.cpu_seconds, timed.calls = 0.0, 0.0, 0
        started, cpu = time.perf_counter(), time.process_time()
        done = profiled(lambda c=cid: job.complete(c), args.profile and n == 0, f"complete + subsume on {kind}")
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu
        assert done.subsumed == (cid - 1,) and done.deletion_blocked is None
        started = time.perf_counter()
        done.metadata.dumps()  # what `complete` spends serializing `_metadata` (metadata.py), timed alone
        dumps = time.perf_counter() - started
        rows.append({
            "wall_s": wall, "storage_s": timed.seconds, "own_s": wall - timed.seconds, "storage_calls": timed.calls,
            "metadata_dumps_s": dumps, "own_without_dumps_s": wall - timed.seconds - dumps,
            "own_cpu_s": cpu - timed.cpu_seconds,
            "files": len(done.metadata.paths()), "files_new": done.files_new, "files_deleted": done.files_deleted,
        })
    storage.fs = timed._fs
    result = {"storage": kind, **{k: median([r[k] for r in rows]) for k in rows[0]}}
    log(f"complete ({kind}): {result['wall_s'] * 1000:.0f} ms wall, {result['own_s'] * 1000:.0f} ms own, "
        f"{result['files']:,} files, {result['files_deleted']:,} deleted")
    drop(storage)
    return result


# --- c. orphan sweep -------------------------------------------------------------------------


def bench_sweep(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    runs = []
    for n in range(args.repeat):
        storage = storage_at(job_url("file", work), f"sweep-{uuid.uuid4().hex[:6]}")
        job = SyntheticJob(
            storage, subtasks=args.sweep_subtasks, files=args.sweep_files_per_subtask, churn=args.sweep_churn,
            num_retained=args.sweep_retained,
        )
        for _ in range(args.sweep_retained):
            job.checkpoint()
        referenced = len(job.coordinator.registry.paths())
        orphans = write_orphans(storage, job, max(0, args.sweep_total - referenced))
        listed = referenced + orphans
        phases = Phases()
        for name in ("walk", "delete", "remove_empty_dirs"):
            phases.wrap(storage, name)
        started, cpu = time.perf_counter(), time.process_time()
        with mock.patch.object(CompletedCheckpointStore, "load_all", phases.timed("load_all",
                                                                                CompletedCheckpointStore.load_all)):
            report = profiled(
                lambda s=storage: sweep_orphans(s, grace_seconds=3600, now=time.time() + 7200),
                args.profile and n == 0, "orphan sweep",
            )
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu
        assert len(report.orphans) == orphans, (len(report.orphans), orphans)
        runs.append({"files": listed, "referenced": referenced, "orphans": orphans, "wall_s": wall, "cpu_s": cpu,
                     **{f"{k}_s": v for k, v in phases.seconds.items()}})
        log(f"sweep: {listed:,} files, {orphans:,} orphans deleted in {wall:.2f} s "
            f"({', '.join(f'{k} {v:.2f} s' for k, v in phases.seconds.items())})")
        drop(storage)
    return {"storage": "file", **{k: median([r[k] for r in runs]) for k in runs[0]}}


def write_orphans(storage: CheckpointStorage, job: SyntheticJob, count: int) -> int:
    """Uploads of failed attempts: nine in ten shared SSTs, the rest the private files (three per
    attempt directory) of checkpoints that never completed (no `_metadata` in their `chk-N`)."""
    files: dict[str, bytes] = {}
    failed = job.coordinator.next_checkpoint_id()
    private = count // 10
    for i in range(count - private):
        rel = f"{shared_dir(OPERATOR, i % job.subtasks)}/{uuid.uuid4().hex}.sst"
        files[rel] = handle_for(rel, "x", 1)[1]
    for i in range(0, private, len(PRIVATE)):
        attempt = f"{private_dir(failed + i // 3000, OPERATOR, (i // 3) % job.subtasks)}/{uuid.uuid4().hex[:12]}"
        for name in PRIVATE[: private - i]:
            files[f"{attempt}/{name}"] = handle_for(f"{attempt}/{name}", name, 1)[1]
    write_files(storage, files, local=job.local)
    return len(files)


# --- d. the ladder: 10^4, 10^5, 10^6 shared files ----------------------------------------------
#
# One synthetic job directory per size N (distinct shared files): `retained` checkpoints of
# `subtasks` subtasks, each checkpoint replacing `churn` of the files, so that the checkpoints list
# F = N / (1 + (retained - 1) x churn) files each, plus N x `orphans` files of failed attempts.
# Each measurement runs in a process of its own (`--measure`), as a start does: its peak RSS
# (VmHWM, reset after the imports) is the rebuild's or the sweep's, and what the process still
# holds after it (the coordinator's registry) is "retained".


def per_checkpoint_files(files: int, retained: int, churn: float) -> int:
    return round(files / (1 + (retained - 1) * churn))


def s3_options(endpoint: str) -> dict[str, Any]:
    return {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": endpoint}}


def rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def build_ladder_job(args: argparse.Namespace, url: str, options: dict[str, Any], files: int) -> dict[str, Any]:
    """The job directory of one ladder point, built through the real coordinator."""
    storage = CheckpointStorage(url, f"ladder-{files}-{uuid.uuid4().hex[:6]}", options)
    per_checkpoint = per_checkpoint_files(files, args.ladder_retained, args.ladder_churn)
    job = SyntheticJob(storage, subtasks=args.ladder_subtasks, files=max(1, per_checkpoint // args.ladder_subtasks),
                       churn=args.ladder_churn, num_retained=args.ladder_retained)
    started = time.perf_counter()
    metadata_bytes = []
    for _ in range(args.ladder_retained):
        done = job.checkpoint()
        metadata_bytes.append(storage.info(done.metadata.metadata_path).size)
    shared = len([p for p in job.coordinator.registry.paths() if p.startswith("shared/")])
    references = sum(len(job.coordinator.registry.paths_of(c)) for c in job.coordinator.registry.checkpoint_ids())
    built = time.perf_counter() - started
    log(f"ladder {files:,} ({url.split(':')[0]}): {args.ladder_retained} checkpoints of "
        f"{job.files * job.subtasks:,} shared files, {shared:,} distinct, in {built:.0f} s")
    return {"job_id": storage.job_id, "storage": storage, "job": job, "shared_files": shared,
            "files_per_checkpoint": job.files * job.subtasks, "references": references,
            "metadata_bytes_max": max(metadata_bytes), "metadata_bytes_total": sum(metadata_bytes), "build_s": built}


def measure_in_child(args: argparse.Namespace, what: str, url: str, job_id: str,
                     endpoint: str | None) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.bench_bookkeeping", "--measure", what, "--url", url, "--job", job_id,
           "--ladder-retained", str(args.ladder_retained)] + (["--endpoint", endpoint] if endpoint else [])
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)
    if done.returncode != 0:
        raise RuntimeError(f"--measure {what} failed ({done.returncode}): {done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """One rebuild or one sweep of an existing job directory, in this (fresh) process."""
    options = s3_options(args.endpoint) if args.endpoint else {}
    storage = CheckpointStorage(args.url, args.job, options)
    counter = RequestCounter(storage.fs) if args.endpoint else None
    gc.collect()
    baseline = rss_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the current RSS
    started, cpu = time.perf_counter(), time.process_time()
    if args.measure == "rebuild":
        coordinator = CheckpointCoordinator(storage, num_retained=args.ladder_retained)
        facts = {"registry_entries": len(coordinator.registry.paths()),
                 "checkpoints": len(coordinator.registry.checkpoint_ids())}
    else:
        report = sweep_orphans(storage, grace_seconds=3600, now=time.time() + 7200)
        facts = {"orphans": len(report.orphans), "referenced": report.referenced}
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    peak = rss_kib("VmHWM")
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what the process holds, not the heap it grew to
    return {"wall_s": wall, "cpu_s": cpu, "baseline_mb": baseline / 1024, "peak_mb": peak / 1024,
            "peak_over_baseline_mb": (peak - baseline) / 1024, "retained_mb": (rss_kib("VmRSS") - baseline) / 1024,
            "requests": counter.take() if counter else None, **facts}


def ladder_point(args: argparse.Namespace, work: Path, files: int, kind: str, endpoint: str | None) -> dict[str, Any]:
    url = f"s3://{args.bucket}/checkpoints" if kind == "s3" else f"file://{work}/checkpoints"
    options = s3_options(endpoint) if endpoint else {}
    built = build_ladder_job(args, url, options, files)
    storage, job = built.pop("storage"), built.pop("job")
    repeat = 1 if kind == "s3" else args.repeat
    rebuilds = [measure_in_child(args, "rebuild", url, storage.job_id, endpoint) for _ in range(repeat)]
    sweeps = []
    for _ in range(repeat):
        orphans = write_orphans(storage, job, round(files * args.ladder_orphans))
        sweeps.append(measure_in_child(args, "sweep", url, storage.job_id, endpoint))
        assert sweeps[-1]["orphans"] == orphans, (sweeps[-1]["orphans"], orphans)
    row = {"files": files, "storage": kind, **built, "orphans": sweeps[0]["orphans"],
           "rebuild": median_row(rebuilds), "sweep": median_row(sweeps)}
    log(f"ladder {files:,} ({kind}): rebuild {row['rebuild']['wall_s']:.2f} s, "
        f"peak +{row['rebuild']['peak_over_baseline_mb']:.0f} MB"
        f" (retained {row['rebuild']['retained_mb']:.0f} MB); sweep of {row['orphans']:,} orphans "
        f"{row['sweep']['wall_s']:.2f} s, peak +{row['sweep']['peak_over_baseline_mb']:.0f} MB"
        + (f"; requests {row['rebuild']['requests']} / {row['sweep']['requests']}" if kind == "s3" else ""))
    if kind == "file":
        shutil.rmtree(storage.root, ignore_errors=True)
    return row


def median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out = dict(rows[0])
    for k, v in rows[0].items():
        if isinstance(v, float):
            out[k] = median([r[k] for r in rows])
    out["runs_s"] = [r["wall_s"] for r in rows]
    return out


def fit(xs: list[float], ys: list[float]) -> dict[str, float]:
    """Power law y = a x^b through the points (least squares in log-log), and the linear
    y = c x + d: b near 1 is linear, n log n shows as b ~ 1.1 over two decades."""
    lx, ly = [math.log(x) for x in xs], [math.log(max(y, 1e-9)) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    b = sum((x - mx) * (y - my) for x, y in zip(lx, ly)) / sum((x - mx) ** 2 for x in lx)
    slope, intercept = statistics.linear_regression(xs, ys) if len(xs) > 1 else (ys[0] / xs[0], 0.0)
    return {"exponent": b, "per_million": slope * 1e6, "intercept": intercept}


def run_ladder(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    rows = [ladder_point(args, work, n, "file", None) for n in args.ladder]
    if args.s3_ladder:
        with moto_s3(work) as (s3_url, options):
            args.bucket = s3_url.split("/")[2]
            rows += [ladder_point(args, work, n, "s3", options["client_kwargs"]["endpoint_url"])
                     for n in args.s3_ladder]
    fits: dict[str, Any] = {}
    file_rows = [r for r in rows if r["storage"] == "file"]
    if len(file_rows) > 1:
        xs = [float(r["shared_files"]) for r in file_rows]
        for what in ("rebuild", "sweep"):
            for metric in ("wall_s", "peak_over_baseline_mb", "retained_mb"):
                fits[f"{what}.{metric}"] = fit(xs, [max(r[what][metric], 1e-3) for r in file_rows])
    return {"rows": rows, "fits": fits}


def ladder_report(r: dict[str, Any]) -> str:
    rows = r["rows"]
    out = [table(
        "d. The ladder: rebuild and sweep of a job directory of N shared files, each in a new process (median)",
        ["storage", "shared files", "files/ckpt", "references", "_metadata MB (max)", "rebuild s", "peak +MB",
         "retained MB", "orphans", "sweep s", "peak +MB", "requests rebuild / sweep"],
        [[x["storage"], f"{x['shared_files']:,}", f"{x['files_per_checkpoint']:,}", f"{x['references']:,}",
          f"{x['metadata_bytes_max'] / 2**20:.1f}", f"{x['rebuild']['wall_s']:.2f}",
          f"{x['rebuild']['peak_over_baseline_mb']:.0f}", f"{x['rebuild']['retained_mb']:.0f}", f"{x['orphans']:,}",
          f"{x['sweep']['wall_s']:.2f}", f"{x['sweep']['peak_over_baseline_mb']:.0f}",
          f"{sum((x['rebuild']['requests'] or {}).values())} / {sum((x['sweep']['requests'] or {}).values())}"]
         for x in rows],
    )]
    if r["fits"]:
        out.append(table("Fits over the file:// points: y = a N^b (b = 1: linear) and the slope per 10^6 files",
                         ["measure", "exponent b", "per 10^6 files"],
                         [[k, f"{v['exponent']:.2f}", f"{v['per_million']:,.2f}"] for k, v in r["fits"].items()]))
    return "\n".join(out)


# --- report ----------------------------------------------------------------------------------


def table(title: str, header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    rule = "  ".join("-" * w for w in widths)
    return "\n".join([title, fmt.format(*header), rule, *(fmt.format(*r) for r in rows), ""])


def ms(seconds: float) -> str:
    return f"{seconds * 1000:,.1f}"


def verdict(value: float, target: float) -> str:
    return "met" if value < target else "MISSED"


def report(r: dict[str, Any]) -> str:
    out = [
        table(
            "a. Registry rebuild (a new coordinator over the retained checkpoints; ms, median)",
            ["storage", "ckpts", "files/ckpt", "references", "distinct", "_metadata KB", "list", "read+validate",
             "(parse alone)", "count", "coordinator", "(its CPU)", f"target {ms(TARGETS['rebuild_s'])}"],
            [[x["storage"], str(x["checkpoints"]), f"{x['files_per_checkpoint']:,}", f"{x['references']:,}",
              f"{x['distinct_files']:,}", f"{x['metadata_bytes'] / 1024:,.0f}", ms(x["list_s"]), ms(x["load_s"]),
              ms(x["parse_s"]), ms(x["count_s"]), ms(x["coordinator_s"]), ms(x["coordinator_cpu_s"]),
              verdict(x["coordinator_s"], TARGETS["rebuild_s"])]
             for x in r["rebuild"]],
        ),
        table(
            "b. complete + subsume (num_retained=1; ms, median; own = wall - time inside the filesystem)",
            ["storage", "files", "new", "deleted", "fs calls", "wall", "in fs", "own", "(own CPU)",
             "(_metadata dumps)", "(own - dumps)", f"target {ms(TARGETS['complete_own_s'])}"],
            [[x["storage"], f"{x['files']:,}", f"{x['files_new']:,}", f"{x['files_deleted']:,}",
              f"{x['storage_calls']:,}", ms(x["wall_s"]), ms(x["storage_s"]), ms(x["own_s"]), ms(x["own_cpu_s"]),
              ms(x["metadata_dumps_s"]), ms(x["own_without_dumps_s"]),
              verdict(x["own_s"], TARGETS["complete_own_s"]) if x["storage"] == "memory" else "(I/O incl.)"]
             for x in r["complete"]],
        ),
        table(
            "c. Orphan sweep (s, median)",
            ["storage", "files", "referenced", "orphans", "read _metadata", "list", "delete", "rmdir", "CPU s",
             "wall s", f"target {TARGETS['sweep_s']:.0f} s"],
            [[x["storage"], f"{x['files']:,}", f"{x['referenced']:,}", f"{x['orphans']:,}", f"{x['load_all_s']:.2f}",
              f"{x['walk_s']:.2f}", f"{x['delete_s']:.2f}", f"{x['remove_empty_dirs_s']:.2f}", f"{x['cpu_s']:.2f}",
              f"{x['wall_s']:.2f}",
              verdict(x["wall_s"], TARGETS["sweep_s"])] for x in [r["sweep"]]],
        ),
        f"total runtime {r['runtime_s']:.0f} s",
    ]
    return "\n".join(out)


# --- main ------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--quick", action="store_true", help="smoke test at 1/10 of the scale, 1 repetition")
    p.add_argument("--repeat", type=int, default=5, help="repetitions per measurement (median; default 5)")
    p.add_argument("--churn", type=float, default=0.02, help="files replaced per checkpoint (default 0.02)")
    p.add_argument("--rebuild-checkpoints", type=int, default=100)
    p.add_argument("--rebuild-files", type=int, default=1000, help="shared files per checkpoint (default 1000)")
    p.add_argument("--rebuild-subtasks", type=int, default=4)
    p.add_argument("--complete-files", type=int, default=10_000, help="shared files per checkpoint (default 10000)")
    p.add_argument("--complete-subtasks", type=int, default=20)
    p.add_argument("--sweep-total", type=int, default=100_000, help="files in storage (default 100000)")
    p.add_argument("--sweep-subtasks", type=int, default=50)
    p.add_argument("--sweep-files-per-subtask", type=int, default=800)
    p.add_argument("--sweep-retained", type=int, default=3)
    p.add_argument("--sweep-churn", type=float, default=0.125)
    p.add_argument("--only", choices=["rebuild", "complete", "sweep"], help="run one measurement (no JSON written)")
    p.add_argument("--ladder", type=sizes, metavar="N,N,...",
                   help="d. only: rebuild and sweep of job directories of N shared files on file:// (e.g. "
                        "10000,100000,1000000); writes bookkeeping_ladder.json")
    p.add_argument("--s3-ladder", type=sizes, default=[], metavar="N,N,...",
                   help="with --ladder: the same on S3 (moto on 127.0.0.1), once each, with request counts")
    p.add_argument("--ladder-retained", type=int, default=10, help="retained checkpoints (default 10)")
    p.add_argument("--ladder-churn", type=float, default=0.5, help="files replaced per checkpoint (default 0.5)")
    p.add_argument("--ladder-subtasks", type=int, default=32)
    p.add_argument("--ladder-orphans", type=float, default=0.1, help="orphans, as a fraction of N (default 0.1)")
    p.add_argument("--measure", choices=["rebuild", "sweep"], help=argparse.SUPPRESS)  # the ladder's child process
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--job", help=argparse.SUPPRESS)
    p.add_argument("--endpoint", help=argparse.SUPPRESS)
    p.add_argument("--profile", action="store_true", help="print a cProfile summary of each measurement")
    p.add_argument("--out", type=Path, help="JSON output (default benchmarks/results/bookkeeping[_quick].json)")
    args = p.parse_args(argv)
    if args.quick:
        args.repeat = 1
        args.rebuild_checkpoints //= 10
        args.complete_files //= 10
        args.sweep_total //= 10
        args.sweep_files_per_subtask //= 10
    if args.repeat < 1 or args.rebuild_checkpoints < 1 or not 0 < args.churn <= 1:
        p.error("--repeat and --rebuild-checkpoints must be positive, --churn in (0, 1]")
    default = "bookkeeping_ladder" if args.ladder else "bookkeeping"
    args.out = args.out or RESULTS / (f"{default}_quick.json" if args.quick else f"{default}.json")
    return args


def sizes(text: str) -> list[int]:
    return [int(float(n)) for n in text.split(",") if n]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    if args.measure:
        print(json.dumps(measure(args)))
        return
    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="sparkpoint-bookkeeping-"))
    try:
        if args.ladder:
            ladder = run_ladder(args, work)
            ladder["runtime_s"] = time.perf_counter() - started
            ladder["config"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                                if k.startswith(("ladder", "s3_ladder", "repeat"))}
            ladder["machine"] = {"python": platform.python_version(), "cpus": os.cpu_count(),
                                 "fsspec": fsspec.__version__}
            print(ladder_report(ladder))
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(ladder, indent=2) + "\n")
            print(f"wrote {args.out}")
            return
        if args.only:
            one = {"rebuild": lambda: bench_rebuild(args, work, "file"),
                   "complete": lambda: bench_complete(args, work, "memory"), "sweep": lambda: bench_sweep(args, work)}
            one[args.only]()
            return
        results: dict[str, Any] = {
            "rebuild": [bench_rebuild(args, work, kind) for kind in ("file", "memory")],
            "complete": [bench_complete(args, work, kind) for kind in ("memory", "file")],
            "sweep": bench_sweep(args, work),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results["runtime_s"] = time.perf_counter() - started
    rebuild_file = next(x for x in results["rebuild"] if x["storage"] == "file")
    complete_mem = next(x for x in results["complete"] if x["storage"] == "memory")
    results["targets"] = {
        "rebuild_s": {"target": TARGETS["rebuild_s"], "measured": rebuild_file["coordinator_s"]},
        "complete_own_s": {"target": TARGETS["complete_own_s"], "measured": complete_mem["own_s"]},
        "sweep_s": {"target": TARGETS["sweep_s"], "measured": results["sweep"]["wall_s"]},
    }
    for t in results["targets"].values():
        t["met"] = t["measured"] < t["target"]
    results["config"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    results["machine"] = {"python": platform.python_version(), "cpus": os.cpu_count(), "fsspec": fsspec.__version__}
    print(report(results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
