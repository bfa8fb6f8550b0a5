"""Read-all against the shuffle (issue 36): the bytes each route reads, events/s on a standalone
cluster beside Spark's own groupBy, S3 requests per checkpoint, and the crossover `auto` uses.

Data: `generate()`'s skewed events (event_id, user_id, item_id, amount, ts) over `--users` users,
FILES_PER_BATCH files per batch. Ours runs the sample operator `user_totals` alone (it reads
user_id, amount and ts: the projected share of a file's bytes) with the exactly-once Parquet sink,
`files_per_checkpoint` = FILES_PER_BATCH, one job per (route, parallelism), its input files in
place before it starts. The systems compared at one parallelism run side by side in one Spark
session, interleaved batch by batch (batch i of each, the first rotating, before batch i+1 of
any), so that what other processes do to the machine meanwhile falls on each alike. A batch's
time is that step's: ours from resuming the pipeline to its report; Spark from its batch's files
landing to its commit. Events/s = the events of every batch but the first ÷ their time (the
first restores nothing and starts the Python workers and the query).

Sections (each in a process of its own with a Spark of its own; `--only` picks some):

* cluster: a Spark standalone cluster on 127.0.0.1 (`tests/support/cluster.py`: a master and `--workers`
  workers of 1 core each, executors of 512 MB). For each parallelism in PARALLELISMS: ours on
  read-all, ours on the shuffle, and Spark Structured Streaming on the same files: readStream
  parquet over a glob of batch directories, each renamed into place whole (so that a trigger
  sees a batch's files together; maxFilesPerTrigger = FILES_PER_BATCH: a Spark batch is one of
  ours), groupBy(user_id) with user_totals' aggregates, RocksDB state store with changelog
  checkpointing (its faster mode in bench_vs_spark), update mode, foreachBatch to Parquet,
  spark.sql.shuffle.partitions = the parallelism. A Spark batch ends when `commits/<id>` appears.
  Read amplification per checkpoint = bytes_read ÷ batch_bytes from its `_metadata`
  (`source_offsets.read`: what the tasks read through `read_parquet_counted`).
* s3: input, checkpoints and output in three buckets of a moto server (server mode, 127.0.0.1) in
  a process of its own, behind a WSGI layer that counts every request the server answers, by
  bucket and kind (GET object, LIST, HEAD, PUT object or part, POST multipart create/complete,
  DELETE object or DeleteObjects), with the body bytes in and out. The counters are read after
  each checkpoint's report, so a checkpoint's requests are everything from the previous report
  to its own (the driver's listing and footer checks included). On `local[2]`, one run after
  the other (the counts, not the times, are the point).
* crossover: `local[2]`, the two routes at each parallelism over batches that grow through
  `--sizes` (events per batch), `--repeat` times over after a first, unmeasured batch. Per
  (parallelism, size): the shuffle's time per batch minus read-all's (medians of the repeats).
  SHUFFLE_ABOVE_BYTES is fitted as the threshold on (parallelism - 1) x batch bytes (what
  `choose_route` compares) that loses the least time against always taking the faster route;
  a linear model of the difference is fitted beside it.

Load: the machine is shared. A sampler reads /proc every 2 s and records the CPU (in cores) used by
processes outside this benchmark's process tree; each section records it with the load average.

Run (the machine has 2 cores: the cluster shows bytes and relative cost, not scale-out):

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.bench_routing                  # ~25 min on a busy machine
    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.bench_routing --only cluster   # ~11 min
    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.bench_routing --only crossover # ~8 min (s3: ~4)
    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.bench_routing --quick --out /tmp/r  # ~5 min

It prints tables and writes benchmarks/results/routing.json (routing_quick.json with --quick). With
`--only`, the sections not run are kept from the existing file (each section records its commit
and when it ran).
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
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
MB = 1 << 20
SECTIONS = ("cluster", "s3", "crossover")
ROUTES = ("read-all", "shuffle")
PARALLELISMS = (2, 4, 8, 16)
FILES_PER_BATCH = 4
S3_KEYS = {"key": "testing", "secret": "testing"}
SPARK_PROVIDER = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
SPARK_SCHEMA = "event_id long, user_id string, item_id string, amount double, ts timestamp"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- load: what other processes use while we measure -------------------------------------------------


class LoadMeter:
    """Samples /proc every `interval` s: the CPU (in cores) used by processes outside this
    process's tree (the lead's and other helpers' work), and the load average."""

    def __init__(self, interval: float = 2.0):
        self.interval, self.samples, self._stop = interval, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> LoadMeter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        tick, cpus = os.sysconf("SC_CLK_TCK"), os.cpu_count() or 1
        busy, ticks = _cpu_ticks()
        while not self._stop.wait(self.interval):
            busy_now, ticks_now = _cpu_ticks()
            # ours: what each process of our tree used since the last sample (a process that ended
            # in between loses its last interval to "others": a Python worker or JVM rarely ends)
            ours = sum(t - ticks.get(pid, 0) for pid, t in ticks_now.items())
            others = (busy_now - busy - ours) / tick / self.interval
            self.samples.append({"others_cores": round(min(cpus, max(0.0, others)), 2), "load1": os.getloadavg()[0]})
            busy, ticks = busy_now, ticks_now

    def summary(self) -> dict[str, Any]:
        """Mean and max of the others' cores, mean load average."""
        others = [s["others_cores"] for s in self.samples] or [0.0]
        return {"others_cores_mean": round(statistics.mean(others), 2), "others_cores_max": round(max(others), 2),
                "load1_mean": round(statistics.mean(s["load1"] for s in self.samples), 2) if self.samples else None,
                "samples": len(self.samples)}

    def since(self, start: int) -> float:
        """Others' mean cores over the samples from index `start` on."""
        window = [s["others_cores"] for s in self.samples[start:]]
        return round(statistics.mean(window), 2) if window else float("nan")


def _cpu_ticks() -> tuple[int, dict[int, int]]:
    """(busy ticks of the machine, ticks used by each living process of this process's tree)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    busy = sum(fields) - fields[3] - fields[4]  # less idle and iowait
    parents, ticks = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry)] = int(stat[1])
        ticks[int(entry)] = int(stat[11]) + int(stat[12])  # utime + stime
    me, ours = os.getpid(), {}
    for pid, t in ticks.items():
        p = pid
        while p > 1 and p != me:
            p = parents.get(p, 0)
        if p == me:
            ours[pid] = t
    return busy, ours


# --- data -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Batches:
    """Input files, FILES_PER_BATCH per batch, in processing order."""

    files: list[Path]
    events: list[int]  # per batch

    def batch_bytes(self, index: int) -> int:
        return sum(f.stat().st_size for f in self.files[index * FILES_PER_BATCH:(index + 1) * FILES_PER_BATCH])


def make_batches(root: Path, sizes: list[int], users: int, seed: int) -> Batches:
    """One batch per entry of `sizes` (events), each FILES_PER_BATCH files of generate()'s events."""
    from sparkpoint.spark.generate import generate

    files = []
    for index, events in enumerate(sizes):
        per_file = max(1, events // FILES_PER_BATCH)
        urls = generate(str(root), batches=FILES_PER_BATCH, events_per_batch=per_file, users=users, items=20_000,
                        seed=seed, first=index * FILES_PER_BATCH)
        files += [Path(u.removeprefix("file://")) for u in urls]
    return Batches(files, [max(1, e // FILES_PER_BATCH) * FILES_PER_BATCH for e in sizes])


def link_all(files: list[Path], directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for f in files:
        os.link(f, directory / f.name)


# --- the systems --------------------------------------------------------------------------------------


def ours_batches(spark: Any, data: Batches, run_dir: Path, route: str, parallelism: int, *,
                 input_url: str | None = None, urls: dict[str, str] | None = None,
                 options: dict[str, Any] | None = None,
                 on_batch: Callable[[int], dict[str, Any]] | None = None) -> Iterator[dict[str, Any]]:
    """Ours over the batches of `data` on `route`, one batch per step: its time (from this step's
    resumption to the pipeline's report), events and read figures (`on_batch(index)` adds its
    own). Local files unless `input_url`/`urls` name others."""
    from sparkpoint.pipeline.driver import StatefulPipeline
    from sparkpoint.pipeline.runtime import PipelineConfig
    from sparkpoint.state.sample import user_totals

    if input_url is None:
        link_all(data.files, run_dir / "in")
    urls = urls or {"checkpoints": f"file://{run_dir / 'checkpoints'}", "out": f"file://{run_dir / 'out'}"}
    config = PipelineConfig(
        input_url=input_url or f"file://{run_dir / 'in'}", checkpoints_url=urls["checkpoints"],
        output_url=urls["out"], job_id=f"{route}-p{parallelism}", parallelism=parallelism, routing=route,
        files_per_checkpoint=FILES_PER_BATCH, local_dir=str(run_dir / "local"),
        storage_options=options or {}, input_options=options or {}, max_batches=len(data.events),
    )
    reports = StatefulPipeline(spark, config, (user_totals,)).batches()
    for index in range(len(data.events)):
        started = time.perf_counter()
        report = next(reports, None)
        wall = time.perf_counter() - started
        if report is None or report.rows != data.events[index]:
            raise RuntimeError(f"ours/{route} p={parallelism} batch {index}: {report}, expected "
                               f"{data.events[index]} rows")
        read = report.read or {}
        log(f"  {route} p={parallelism} #{index}: {wall:.2f} s, {report.rows:,} events, "
            f"read {report.read_amplification}x of {read.get('batch_bytes', 0) / MB:.1f} MB")
        yield {"batch": index, "events": report.rows, "wall_s": wall, "routing": read.get("routing"),
               "bytes_read": read.get("bytes_read"), "batch_bytes": read.get("batch_bytes"),
               "read_amplification": report.read_amplification, "load1": os.getloadavg()[0],
               **(on_batch(index) if on_batch else {})}


def spark_batches(spark: Any, data: Batches, run_dir: Path, parallelism: int) -> Iterator[dict[str, Any]]:
    """Spark Structured Streaming's groupBy over the same batches (see the module docstring), one
    batch per step: the batch's files land together (a directory renamed into the input, read
    through a glob) and the step ends when `commits/<id>` appears."""
    from pyspark.sql import functions as F

    for key, value in {"spark.sql.streaming.stateStore.providerClass": SPARK_PROVIDER,
                       "spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled": "true",
                       "spark.sql.shuffle.partitions": str(parallelism)}.items():
        spark.conf.set(key, value)
    staging, landed, ckpt, out = run_dir / "staging", run_dir / "in", run_dir / "checkpoints", str(run_dir / "out")
    landed.mkdir(parents=True)

    def land(index: int) -> None:
        batch = staging / f"b{index:06d}"
        link_all(data.files[index * FILES_PER_BATCH:(index + 1) * FILES_PER_BATCH], batch)
        os.rename(batch, landed / batch.name)

    def write(batch: Any, batch_id: int) -> None:
        batch.write.mode("overwrite").parquet(f"{out}/batch={batch_id}")

    started = time.perf_counter()
    land(0)  # before the query starts: its glob then matches from the start
    events = spark.readStream.schema(SPARK_SCHEMA).option("maxFilesPerTrigger", FILES_PER_BATCH).parquet(
        str(landed / "*"))
    totals = events.groupBy("user_id").agg(
        F.count("*").alias("count"), F.sum("amount").alias("amount_sum"), F.min("amount").alias("amount_min"),
        F.max("amount").alias("amount_max"), F.max("ts").alias("last_ts"),
    )
    query = (totals.writeStream.outputMode("update").foreachBatch(write)
             .option("checkpointLocation", str(ckpt)).start())
    try:
        expected = 0
        for index in range(len(data.events)):
            if index:
                started = time.perf_counter()
                land(index)
            # done once Spark's progress reports count every row landed so far: a batch id can
            # commit without rows (it happened here, once), so the commit of id `index` is no sign
            expected += data.events[index]
            while (seen := spark_rows(query)) < expected:
                if query.exception() is not None or not query.isActive:
                    raise RuntimeError(f"Spark's query stopped: {query.exception()}")
                time.sleep(0.01)
            wall = time.perf_counter() - started
            if seen != expected:
                raise RuntimeError(f"Spark read {seen} rows, {expected} landed")
            log(f"  spark p={parallelism} #{index}: {wall:.2f} s")
            yield {"batch": index, "events": data.events[index], "wall_s": wall, "load1": os.getloadavg()[0],
                   "spark_batches": len(query.recentProgress)}
    finally:
        query.stop()


def spark_rows(query: Any) -> int:
    """The rows a streaming query has read so far, by its progress reports (it keeps the last 100)."""
    return sum(int(json.loads(p.json() if callable(p.json) else p.json)["numInputRows"])
               for p in query.recentProgress)


def interleaved(steps: dict[str, Iterator[dict[str, Any]]], batches: int) -> dict[str, list[dict[str, Any]]]:
    """Batch i of every system before batch i+1 of any, the first system rotating with i: what
    other processes do to the machine meanwhile falls on every system alike."""
    labels = list(steps)
    out: dict[str, list[dict[str, Any]]] = {label: [] for label in labels}
    try:
        for i in range(batches):
            for label in labels[i % len(labels):] + labels[:i % len(labels)]:
                out[label].append(next(steps[label]))
    finally:
        for gen in steps.values():
            gen.close()  # type: ignore[attr-defined]
    return out


def summarize(batches: list[dict[str, Any]]) -> dict[str, Any]:
    """Events/s of every batch but the first; read amplification over all of them."""
    later = batches[1:] or batches
    out: dict[str, Any] = {"events_per_s": sum(b["events"] for b in later) / sum(b["wall_s"] for b in later),
                           "seconds_per_batch": statistics.median(b["wall_s"] for b in later)}
    amps = [b["read_amplification"] for b in batches if b.get("read_amplification") is not None]
    if amps:
        out |= {"read_amplification_mean": statistics.mean(amps), "read_amplification_max": max(amps),
                "batch_mb": statistics.mean(b["batch_bytes"] for b in batches) / MB}
    return out


# --- section: the standalone cluster -------------------------------------------------------------------


def section_cluster(args: argparse.Namespace, work: Path, meter: LoadMeter) -> dict[str, Any]:
    from sparkpoint.spark.session import spark_session
    from tests.support.cluster import standalone_cluster

    sizes = [args.cluster_events] * args.cluster_batches
    log(f"cluster: generating {len(sizes)} batches of {args.cluster_events:,} events")
    data = make_batches(work / "data", sizes, args.users, args.seed)
    runs: dict[str, Any] = {}
    with standalone_cluster(work / "cluster", workers=args.workers) as cluster:
        os.environ.update(cluster.env())
        spark = spark_session(cluster.master_url, app_name="bench_routing")
        try:
            for parallelism in args.parallelisms:
                log(f"cluster: p={parallelism}, read-all, shuffle and Spark interleaved batch by batch")
                mark = len(meter.samples)
                dirs = {system: work / "runs" / f"{system}-p{parallelism}" for system in (*ROUTES, "spark")}
                steps = {system: ours_batches(spark, data, dirs[system], system, parallelism)
                         for system in ROUTES} | {"spark": spark_batches(spark, data, dirs["spark"], parallelism)}
                for system, batches in interleaved(steps, len(sizes)).items():
                    runs[f"{system}/p{parallelism}"] = {"system": system, "parallelism": parallelism,
                                                        "batches": batches, "others_cores": meter.since(mark),
                                                        **summarize(batches)}
                for d in dirs.values():
                    shutil.rmtree(d, ignore_errors=True)
        finally:
            spark.stop()
    return {"workers": args.workers, "events_per_batch": args.cluster_events, "batches": args.cluster_batches,
            "files_per_batch": FILES_PER_BATCH, "users": args.users, "runs": runs}


# --- section: S3, requests counted by the server ---------------------------------------------------------


def classify(method: str, path: str, query: str) -> tuple[str, str]:
    """(bucket, kind) of an S3 request in path style: kind is GET, LIST, HEAD, PUT, POST, DELETE
    or OTHER (bucket-level calls that are none of those)."""
    bucket, _, key = path.lstrip("/").partition("/")
    params = {p.split("=", 1)[0] for p in query.split("&") if p}
    if method == "POST":
        return bucket, "DELETE" if "delete" in params else "POST"
    if key:
        return bucket, {"GET": "GET", "HEAD": "HEAD", "PUT": "PUT", "DELETE": "DELETE"}.get(method, "OTHER")
    if method == "GET" and (not params or params & {"list-type", "prefix", "delimiter", "uploads", "marker"}):
        return bucket, "LIST"
    return bucket, "HEAD" if method == "HEAD" else "OTHER"


class CountingApp:
    """WSGI middleware in front of moto's app: counts requests and body bytes by (bucket, kind);
    GET /_counts answers them as JSON."""

    def __init__(self, app: Any):
        self.app, self.lock = app, threading.Lock()
        self.counts: Counter[str] = Counter()

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        if environ["PATH_INFO"] == "/_counts":
            with self.lock:
                body = json.dumps(dict(self.counts)).encode()
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        bucket, kind = classify(environ["REQUEST_METHOD"], environ["PATH_INFO"], environ.get("QUERY_STRING", ""))
        with self.lock:
            self.counts[f"{bucket}|{kind}|requests"] += 1
            self.counts[f"{bucket}|{kind}|bytes_in"] += int(environ.get("CONTENT_LENGTH") or 0)
        body = self.app(environ, start_response)

        def counted() -> Iterator[bytes]:
            n = 0
            try:
                for chunk in body:
                    n += len(chunk)
                    yield chunk
            finally:
                with self.lock:
                    self.counts[f"{bucket}|{kind}|bytes_out"] += n
                if hasattr(body, "close"):
                    body.close()

        return counted()


def serve_counting_moto(port_file: Path) -> None:
    """The counting moto server, in this process until killed; its port goes to `port_file`."""
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    server = make_server("127.0.0.1", 0, CountingApp(DomainDispatcherApplication(create_backend_app)), True,
                         request_handler=MotoRequestHandler)
    port_file.write_text(str(server.server_address[1]))
    server.serve_forever()


@contextmanager
def counting_moto(work: Path) -> Iterator[str]:
    """A counting moto server in a process of its own; yields its endpoint."""
    port_file = work / "moto.port"
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.bench_routing", "--s3-server", str(port_file)],
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL,
                            stderr=open(work / "moto.log", "wb"))  # noqa: SIM115  (the process owns it)
    try:
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text()):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the moto server did not start: {(work / 'moto.log').read_text()[-2000:]}")
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port_file.read_text()}"
    finally:
        proc.kill()
        proc.wait()


def server_counts(endpoint: str) -> Counter[str]:
    with urllib.request.urlopen(f"{endpoint}/_counts", timeout=30) as r:
        return Counter(json.loads(r.read()))


def section_s3(args: argparse.Namespace, work: Path, meter: LoadMeter) -> dict[str, Any]:
    import fsspec

    from sparkpoint.spark.session import spark_session

    sizes = [args.s3_events] * args.s3_batches
    log(f"s3: generating {len(sizes)} batches of {args.s3_events:,} events")
    data = make_batches(work / "data", sizes, args.users, args.seed)
    runs: dict[str, Any] = {}
    with counting_moto(work) as endpoint:
        options = {**S3_KEYS, "client_kwargs": {"endpoint_url": endpoint}}
        fs = fsspec.filesystem("s3", **options)
        for bucket in ("input", "ckpt", "output"):
            fs.mkdir(bucket)
        fs.put([str(f) for f in data.files], [f"input/data/{f.name}" for f in data.files])
        spark = spark_session("local[2]", app_name="bench_routing_s3")
        try:
            for parallelism in args.s3_parallelisms:
                for route in ROUTES:
                    label = f"{route}/p{parallelism}"
                    log(f"s3: {label}")
                    before = server_counts(endpoint)

                    def requests(index: int) -> dict[str, Any]:
                        nonlocal before
                        now = server_counts(endpoint)
                        delta = {k: now[k] - before[k] for k in now if now[k] != before[k]}
                        before = now  # (/_counts itself is not counted)
                        return {"requests": delta}

                    mark = len(meter.samples)
                    prefix = f"{route}-p{parallelism}"
                    batches = list(ours_batches(spark, data, work / "runs" / prefix, route, parallelism,
                                       input_url="s3://input/data",
                                       urls={"checkpoints": f"s3://ckpt/{prefix}", "out": f"s3://output/{prefix}"},
                                       options=options, on_batch=requests))
                    runs[label] = {"system": route, "parallelism": parallelism, "batches": batches,
                                   "others_cores": meter.since(mark), **summarize(batches),
                                   "per_checkpoint": per_checkpoint_requests(batches)}
        finally:
            spark.stop()
    return {"events_per_batch": args.s3_events, "batches": args.s3_batches, "files_per_batch": FILES_PER_BATCH,
            "users": args.users, "runs": runs}


def per_checkpoint_requests(batches: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Mean per checkpoint over every batch but the first, by bucket and kind: requests and bytes."""
    later = batches[1:] or batches
    total: Counter[str] = Counter()
    for b in later:
        total.update(b["requests"])
    out: dict[str, dict[str, float]] = {}
    for key, n in total.items():
        bucket, kind, what = key.split("|")
        out.setdefault(f"{bucket}|{kind}", {})[what] = n / len(later)
    return dict(sorted(out.items()))


# --- section: the crossover on local[2] ------------------------------------------------------------------


def section_crossover(args: argparse.Namespace, work: Path, meter: LoadMeter) -> dict[str, Any]:
    from sparkpoint.spark.routing import SHUFFLE_ABOVE_BYTES
    from sparkpoint.spark.session import spark_session

    sizes = [args.sizes[0]] + list(args.sizes) * args.repeat  # a first, unmeasured batch; then the sizes, repeated
    log(f"crossover: generating {len(sizes)} batches ({', '.join(f'{s:,}' for s in args.sizes)} events)")
    data = make_batches(work / "data", sizes, args.users, args.seed)
    runs: dict[str, Any] = {}
    spark = spark_session("local[2]", app_name="bench_routing_crossover")
    try:
        for parallelism in args.parallelisms:
            log(f"crossover: p={parallelism}, both routes interleaved batch by batch")
            mark = len(meter.samples)
            dirs = {route: work / "runs" / f"{route}-p{parallelism}" for route in ROUTES}
            steps = {route: ours_batches(spark, data, dirs[route], route, parallelism) for route in ROUTES}
            for route, batches in interleaved(steps, len(sizes)).items():
                runs[f"{route}/p{parallelism}"] = {"system": route, "parallelism": parallelism, "batches": batches,
                                                   "others_cores": meter.since(mark)}
            for d in dirs.values():
                shutil.rmtree(d, ignore_errors=True)
    finally:
        spark.stop()
    points = crossover_points(runs, args.parallelisms, args.sizes)
    return {"sizes_events": list(args.sizes), "repeat": args.repeat, "users": args.users,
            "files_per_batch": FILES_PER_BATCH, "runs": runs, "points": points,
            "fit": fit_threshold(points), "model": fit_model(points), "shuffle_above_bytes_now": SHUFFLE_ABOVE_BYTES}


def crossover_points(runs: dict[str, Any], parallelisms: list[int], sizes: list[int]) -> list[dict[str, Any]]:
    """Per (parallelism, size): each route's median seconds per batch and the batch's bytes."""
    points = []
    for p in parallelisms:
        for size in sizes:
            point: dict[str, Any] = {"parallelism": p, "events": size}
            for route in ROUTES:
                mine = [b for b in runs[f"{route}/p{p}"]["batches"][1:] if b["events"] == size]
                point[route] = statistics.median(b["wall_s"] for b in mine)
                point[f"{route}_amplification"] = statistics.mean(b["read_amplification"] for b in mine)
                point["batch_bytes"] = statistics.mean(b["batch_bytes"] for b in mine)
            point["extra_bytes"] = (p - 1) * point["batch_bytes"]
            point["shuffle_minus_read_all_s"] = point["shuffle"] - point["read-all"]
            points.append(point)
    return points


def fit_threshold(points: list[dict[str, Any]]) -> dict[str, Any]:
    """The threshold T on (parallelism - 1) x batch bytes ("shuffle when at least T") that loses
    the least time against taking the faster route at every point: the range of T that does, and
    its geometric middle."""
    xs = sorted({pt["extra_bytes"] for pt in points})
    # cut i (0 < i < n) lies between xs[i-1] and xs[i]; cut 0 below every point, cut n above all
    cuts = [0.0, *((a * b) ** 0.5 for a, b in zip(xs, xs[1:])), 2 * xs[-1]]

    def lost(t: float) -> float:
        return sum(max(0.0, pt["shuffle_minus_read_all_s"]) if pt["extra_bytes"] >= t
                   else max(0.0, -pt["shuffle_minus_read_all_s"]) for pt in points)

    losses = [lost(t) for t in cuts]
    good = [i for i, loss in enumerate(losses) if loss <= min(losses) + 1e-9]
    best = cuts[good[len(good) // 2]]
    misrouted = sum(1 for pt in points if (pt["extra_bytes"] >= best) != (pt["shuffle_minus_read_all_s"] < 0))
    return {"threshold_bytes": best, "lost_s": min(losses), "misrouted_points": misrouted,
            "range_bytes": [xs[good[0] - 1] if good[0] else 0.0, xs[good[-1]] if good[-1] < len(xs) else None],
            "lost_s_at_now": lost(_now())}


def _now() -> float:
    from sparkpoint.spark.routing import SHUFFLE_ABOVE_BYTES

    return float(SHUFFLE_ABOVE_BYTES)


def fit_model(points: list[dict[str, Any]]) -> dict[str, float]:
    """Least squares: shuffle - read-all = fixed + per_mb x batch MB - reread_per_mb x (p-1) x batch MB.
    The shuffle pays when (p-1) x reread_per_mb > per_mb, from a batch of fixed ÷ that difference."""
    import numpy as np

    a = np.array([[1.0, pt["batch_bytes"] / MB, -pt["extra_bytes"] / MB] for pt in points])
    y = np.array([pt["shuffle_minus_read_all_s"] for pt in points])
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    fitted = a @ coef
    ss = float(((y - y.mean()) ** 2).sum()) or 1.0
    return {"fixed_s": float(coef[0]), "per_mb_s": float(coef[1]), "reread_per_mb_s": float(coef[2]),
            "r2": 1 - float(((y - fitted) ** 2).sum()) / ss}


# --- tables ---------------------------------------------------------------------------------------------------


def table(title: str, header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)] if rows else [len(h) for h in header]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([title, line.format(*header), *(line.format(*map(str, r)) for r in rows), ""])


def report(results: dict[str, Any]) -> str:
    out = [f"machine: {results['machine']['cpus']} cores (shared: other processes' CPU is in each row)"]
    sections = results["sections"]
    if c := sections.get("cluster"):
        by_p: dict[int, dict[str, Any]] = {}
        for r in c["runs"].values():
            by_p.setdefault(r["parallelism"], {})[r["system"]] = r
        rows = []
        for p, systems in sorted(by_p.items()):
            ra, sh, sp = systems.get("read-all"), systems.get("shuffle"), systems.get("spark")
            rows.append([p, f"{ra['read_amplification_mean']:.2f}" if ra else "-",
                         f"{sh['read_amplification_mean']:.2f} (max {sh['read_amplification_max']:.2f})" if sh else "-",
                         f"{ra['events_per_s']:,.0f}" if ra else "-", f"{sh['events_per_s']:,.0f}" if sh else "-",
                         f"{sp['events_per_s']:,.0f}" if sp else "-",
                         f"{sh['events_per_s'] / sp['events_per_s']:.2f}" if sh and sp else "-",
                         f"{(ra or sh or sp)['others_cores']:.1f}"])
        out.append(table(
            f"Standalone cluster, {c['workers']} workers x 1 core on a 2-core machine: {c['batches']} batches of "
            f"{c['events_per_batch']:,} events ({c['files_per_batch']} files, ~{_batch_mb(c):.1f} MB); events/s over "
            "all batches but the first",
            ["p", "read ÷ batch, read-all", "read ÷ batch, shuffle", "ev/s read-all", "ev/s shuffle", "ev/s Spark",
             "shuffle ÷ Spark", "others' cores"], rows))
    if s := sections.get("s3"):
        rows = []
        for label, r in s["runs"].items():
            for key, v in r["per_checkpoint"].items():
                bucket, kind = key.split("|")
                rows.append([label, bucket, kind, f"{v.get('requests', 0):.1f}",
                             f"{v.get('bytes_out', 0) / MB:.2f}", f"{v.get('bytes_in', 0) / MB:.2f}"])
        out.append(table(f"S3 (moto server, counted by the server): requests per checkpoint, mean over batches "
                         f"2..{s['batches']} of {s['events_per_batch']:,} events", ["run", "bucket", "kind", "requests",
                                                                                     "MB out", "MB in"], rows))
        rows = [[label, f"{r['read_amplification_mean']:.2f}",
                 f"{r['per_checkpoint'].get('input|GET', {}).get('bytes_out', 0) / MB / r['batch_mb']:.2f}",
                 f"{r['seconds_per_batch']:.2f}"] for label, r in s["runs"].items()]
        out.append(table("S3: input bytes per checkpoint ÷ batch bytes", ["run", "counted by the tasks (_metadata)",
                                                                           "served by S3 (GET on the input bucket)",
                                                                           "s per batch"], rows))
    if x := sections.get("crossover"):
        rows = [[pt["parallelism"], f"{pt['events']:,}", f"{pt['batch_bytes'] / MB:.1f}",
                 f"{pt['extra_bytes'] / MB:.0f}", f"{pt['read-all']:.2f}", f"{pt['shuffle']:.2f}",
                 f"{pt['shuffle_minus_read_all_s']:+.2f}", f"{pt['read-all_amplification']:.2f}"]
                for pt in x["points"]]
        out.append(table("Crossover on local[2]: median s per batch", ["p", "events", "batch MB", "(p-1) x MB",
                                                                       "read-all s", "shuffle s", "shuffle - ra",
                                                                       "read ÷ batch (ra)"], rows))
        f, m = x["fit"], x["model"]
        hi = f"{f['range_bytes'][1] / MB:.0f}" if f["range_bytes"][1] else "∞"
        out.append(f"fitted SHUFFLE_ABOVE_BYTES: {f['threshold_bytes'] / MB:.0f} MB (any in "
                   f"{f['range_bytes'][0] / MB:.0f}..{hi} MB loses the least: {f['lost_s']:.2f} s over all points; "
                   f"the current "
                   f"{x['shuffle_above_bytes_now'] / MB:.0f} MB loses {f['lost_s_at_now']:.2f} s)")
        out.append(f"model: shuffle - read-all = {m['fixed_s']:+.2f} s {m['per_mb_s']:+.3f} s/MB x batch "
                   f"- {m['reread_per_mb_s']:.3f} s/MB x (p-1) x batch  (R² {m['r2']:.2f})\n")
    for name, sec in sections.items():
        out.append(f"{name}: {sec['measured_at']} at {sec['commit']}, {sec['runtime_s']:.0f} s; other processes "
                   f"used {sec['load']['others_cores_mean']} cores on average (max {sec['load']['others_cores_max']}), "
                   f"load average {sec['load']['load1_mean']}")
    return "\n".join(out)


def _batch_mb(section: dict[str, Any]) -> float:
    mbs = [r["batch_mb"] for r in section["runs"].values() if "batch_mb" in r]
    return statistics.mean(mbs) if mbs else 0.0


# --- main ------------------------------------------------------------------------------------------------------


def run_section(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One section, in this process (the child's side)."""
    work = Path(tempfile.mkdtemp(prefix=f"sparkpoint-routing-{name}-"))
    started = time.perf_counter()
    try:
        with LoadMeter() as meter:
            result = {"cluster": section_cluster, "s3": section_s3, "crossover": section_crossover}[name](
                args, work, meter)
        result["load"] = meter.summary()
    finally:
        if args.keep:
            log(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return result | {"runtime_s": time.perf_counter() - started, "measured_at": time.strftime("%Y-%m-%d %H:%M"),
                     "commit": commit.stdout.strip(), "quick": args.quick}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--quick", action="store_true", help="smoke test: small batches, p 2 and 4, ~5 min")
    p.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {', '.join(SECTIONS)}")
    p.add_argument("--out", type=Path, help="directory for the JSON (default benchmarks/results)")
    p.add_argument("--users", type=int, default=200_000)
    p.add_argument("--workers", type=int, default=4, help="cluster workers (1 core each)")
    p.add_argument("--cluster-events", type=int, default=1_500_000, help="events per batch on the cluster")
    p.add_argument("--cluster-batches", type=int, default=3)
    p.add_argument("--s3-events", type=int, default=1_500_000)
    p.add_argument("--s3-batches", type=int, default=4)
    p.add_argument("--sizes", default="100000,400000,1600000", help="crossover: events per batch")
    p.add_argument("--repeat", type=int, default=3, help="crossover: measured batches per size")
    p.add_argument("--parallelisms", help=f"comma-separated (default {','.join(map(str, PARALLELISMS))}; --quick 2,4)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--keep", action="store_true", help="keep the temp directories")
    p.add_argument("--section", help=argparse.SUPPRESS)  # the child's side: run one section, JSON to --section-out
    p.add_argument("--section-out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--s3-server", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.only = [s.strip() for s in args.only.split(",") if s.strip()]
    if unknown := set(args.only) - set(SECTIONS):
        p.error(f"--only: unknown {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    given = args.parallelisms
    args.parallelisms = [int(x) for x in (given or ",".join(map(str, PARALLELISMS))).split(",")]
    args.sizes = [int(x) for x in args.sizes.split(",")]
    args.s3_parallelisms = [4, 16]
    if args.quick:
        args.users, args.workers, args.s3_parallelisms = 20_000, 2, [4]
        args.parallelisms = args.parallelisms if given else [2, 4]
        args.cluster_events, args.cluster_batches, args.s3_events, args.s3_batches = 100_000, 3, 40_000, 2
        args.sizes, args.repeat = [20_000, 100_000], 1
    args.out = args.out or RESULTS
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.s3_server:
        serve_counting_moto(args.s3_server)
        return
    if args.section:
        args.section_out.write_text(json.dumps(run_section(args.section, args), default=float))
        return
    stem = "routing_quick" if args.quick else "routing"
    path = args.out / f"{stem}.json"
    results: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {"sections": {}}
    passed = argv if argv is not None else sys.argv[1:]
    pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    failed = []
    for name in args.only:
        log(f"section {name}")
        with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
            proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_routing", *passed, "--section", name,
                                   "--section-out", tmp.name], cwd=REPO, env={**os.environ, "PYTHONPATH": pythonpath})
            if proc.returncode != 0:
                log(f"section {name} failed ({proc.returncode}); the others go on")
                failed.append(name)
                continue
            results["sections"][name] = json.loads(Path(tmp.name).read_text())
        save(results, path)  # after each section: a later one failing loses nothing
    save(results, path)
    print(report(results))
    print(f"wrote {path}")
    if failed:
        raise SystemExit(f"sections failed: {', '.join(failed)}")


def save(results: dict[str, Any], path: Path) -> None:
    import pyspark

    results["sections"] = {k: results["sections"][k] for k in SECTIONS if k in results["sections"]}
    results["machine"] = {"python": platform.python_version(), "cpus": os.cpu_count(), "pyspark": pyspark.__version__}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1, default=float) + "\n")


if __name__ == "__main__":
    main()
