"""A job's life: what a checkpoint costs at 10^2 .. 10^5 consumed input files (issue 46).

A job consumes `FILES_PER_CHECKPOINT` (100) tiny input files per checkpoint, 10^3 checkpoints,
10^5 files, through the real `ParquetDirectorySource` (its listing, its offsets) and the real
`CheckpointCoordinator` (trigger, `_metadata` committed, registry, retention of 2). No Spark and
no state: a checkpoint here is its bookkeeping, what grows with history if anything does.

Per checkpoint, at histories 10^2, 10^3, 10^4, 10^5 (files consumed before it):

* `_metadata` bytes, as committed;
* planning time: read the latest `_metadata` (what every run's start does), list the input,
  pick the batch and advance the offsets (wall time, this process; the least of 3 runs, the
  machine being shared);
* listing requests: file://, the directories listed; S3, the `ListObjectsV2` requests the moto
  server answered (counted by the server, a WSGI wrapper around moto on 127.0.0.1);
* peak memory: tracemalloc's peak over planning and the commit (Python allocations only).

Two ways, at the same directory states: "bounded", this version (a floor and at most
`RECENT_NAMES` names, listings from the floor on), and "today", the version-1 behaviour it
replaces (every consumed name in `_metadata`, the whole directory listed: `rescan` and a floor
that never rises). A power law y = a x^b is fitted per metric: b <= 0.1 is flat, 1 linear.

Measured and modelled:

* file://: the whole life is run (10^5 files landed, 10^3 checkpoints). Files land in date
  partitions of 10^4 files (`date=YYYY-MM-DD/`), as a landing zone that keeps files for years
  would; "today" is measured at each point on the same directory with offsets of every name.
* S3 (moto): files are put into moto's store in-process (landing is not what is measured);
  every listing is a real HTTP request to the server. Moto answers a `StartAfter` listing by
  scanning the whole bucket (real S3 does not), so planning time on moto grows with the bucket
  where S3's would not: the flat figures there are `_metadata` bytes and requests. The life
  runs to `--s3-history` files (default 10^4: moto's scans make 10^5 take an hour on one core);
  above, the points are modelled: the same bytes and requests (the offsets hold at most
  `RECENT_NAMES` names and a listing from the floor asks one request per 1,000 new names,
  whatever lies below), planning and memory not given.

Run:

    .venv/bin/python -m benchmarks.bench_history                 # ~5 min: file:// to 10^5, S3 to 10^4
    .venv/bin/python -m benchmarks.bench_history --quick         # 10^2..10^3, seconds
    .venv/bin/python -m benchmarks.bench_history --plot-only     # tables and picture again from the JSON

Results: benchmarks/results/history.json, and the curves in docs/img/pipeline-life.png.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import tempfile
import threading
import time
import tracemalloc
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import fsspec
import pandas as pd

from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.metadata import KeyGroupRange, SubtaskStateHandle
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.pipeline.runtime import offsets_of
from sparkpoint.spark import offsets as offsets_module
from sparkpoint.spark.offsets import SourceOffsets
from sparkpoint.spark.source import ParquetDirectorySource

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "history.json"
PICTURE = ROOT / "docs" / "img" / "pipeline-life.png"
HISTORY = (100, 1_000, 10_000, 100_000)
FILES_PER_CHECKPOINT = 100
FILES_PER_PARTITION = 1_000  # a day of files at one every 1.5 minutes
TINY = pd.DataFrame({"k": ["a"], "v": [1]}).to_parquet()
MAX_PARALLELISM = 128
REPEAT = 3  # planning is timed this many times (it changes nothing), the least kept
METRICS = ("metadata_bytes", "planning_ms", "listing_requests", "peak_kb")


def name_of(i: int) -> str:
    """Input file i's name: in a date partition per `FILES_PER_PARTITION` files, in landing order."""
    day = i // FILES_PER_PARTITION
    return f"date=2026-{1 + day // 28:02d}-{1 + day % 28:02d}/events-{i:07d}.parquet"


class Lander:
    """Lands files on a backend, counting its listing requests."""

    url: str
    options: dict[str, Any]

    def land(self, first: int, end: int) -> None:
        raise NotImplementedError

    def requests(self, source: ParquetDirectorySource) -> int:
        raise NotImplementedError


class LocalLander(Lander):
    def __init__(self, root: Path):
        self.root, self.url, self.options = root, str(root), {}

    def land(self, first: int, end: int) -> None:
        for i in range(first, end):
            path = self.root / name_of(i)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(TINY)

    def requests(self, source: ParquetDirectorySource) -> int:
        return source.lister.requests  # directories listed (one scandir each)


class S3Lander(Lander):
    def __init__(self, endpoint: str, counts: Counter[str]):
        self.options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": endpoint}}
        self.bucket = "life-" + uuid.uuid4().hex[:8]
        fsspec.filesystem("s3", **self.options).mkdir(self.bucket)
        self.url, self.counts = f"s3://{self.bucket}/input", counts
        from moto.s3.models import s3_backends

        self._backend = s3_backends["123456789012"]["global"]

    def land(self, first: int, end: int) -> None:
        for i in range(first, end):  # into moto's store: landing is not what is measured
            self._backend.put_object(self.bucket, f"input/{name_of(i)}", TINY)

    def requests(self, source: ParquetDirectorySource) -> int:
        return self.counts["ListObjectsV2"]


@contextmanager
def counting_moto() -> Iterator[tuple[str, Counter[str]]]:
    """A moto S3 server on 127.0.0.1 in this process (landing puts into its store directly)
    that counts the requests it answers, by operation."""
    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    app = DomainDispatcherApplication(create_backend_app)
    counts: Counter[str] = Counter()

    def counted(environ: dict[str, Any], start_response: Any) -> Any:
        query = environ.get("QUERY_STRING", "")
        counts["ListObjectsV2" if "list-type=2" in query else environ["REQUEST_METHOD"]] += 1
        return app(environ, start_response)

    server = make_server("127.0.0.1", 0, counted, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", counts
    finally:
        server.shutdown()


def checkpoint(storage: CheckpointStorage, coordinator: CheckpointCoordinator, source: ParquetDirectorySource,
               lander: Lander, trace: bool) -> dict[str, float]:
    """One checkpoint of the life: plan (read the latest `_metadata`, list, advance), commit.
    With `trace` (a measured point), the planning is timed `REPEAT` times, then done once more
    under tracemalloc (its requests are the first's), whose peak with the commit's is the
    checkpoint's peak memory."""
    requests = lander.requests(source)
    began = time.perf_counter()
    after, files = plan(storage, source)
    planning = time.perf_counter() - began
    listed = lander.requests(source) - requests
    if trace:  # planning changes nothing: timed again, the least kept (the machine is shared)
        planning = min([planning, *(timed(lambda: plan(storage, source)) for _ in range(REPEAT - 1))])
        tracemalloc.start()
        after, files = plan(storage, source)
    done = commit(coordinator, after)
    peak = tracemalloc.get_traced_memory()[1] if trace else 0
    if trace:
        tracemalloc.stop()
    size = storage.info(f"chk-{done.checkpoint_id}/_metadata").size
    return {"files": files, "metadata_bytes": size, "planning_ms": planning * 1000, "listing_requests": listed,
            "peak_kb": peak / 1024}


def timed(fn: Callable[[], Any]) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def commit(coordinator: CheckpointCoordinator, offsets: SourceOffsets) -> Any:
    """A checkpoint of one subtask holding no state (no files: the bookkeeping alone) and `offsets`."""
    cid = coordinator.trigger(expected={"life": 1}, names={"life": "life"}).checkpoint_id
    coordinator.acknowledge(cid, SubtaskStateHandle("life", 0, cid, KeyGroupRange(0, MAX_PARALLELISM - 1),
                                                    MAX_PARALLELISM, (), ()))
    return coordinator.complete(cid, source_offsets={"source": offsets.to_json(), "sink": []})


def plan(storage: CheckpointStorage, source: ParquetDirectorySource) -> tuple[SourceOffsets, int]:
    """What a run does before its batch: read the latest `_metadata`, list, take the batch."""
    latest = CompletedCheckpointStore(storage).latest()
    offsets = offsets_of(latest) if latest is not None else SourceOffsets(())
    batch = source.pending(offsets)[:FILES_PER_CHECKPOINT]
    return source.advance(offsets, batch), len(batch)


def life(lander: Lander, work: Path, history: int, points: tuple[int, ...], kind: str,
         say: Callable[[str], None]) -> list[dict[str, Any]]:
    """The whole life to `history` files; at each of `points` the bounded checkpoint and today's
    (version-1 offsets of every name, the whole directory listed) on the same directory."""
    storage = CheckpointStorage(f"file://{work}/{kind}-bounded", "life")
    coordinator = CheckpointCoordinator(storage, num_retained=2)
    lander.land(0, FILES_PER_CHECKPOINT)  # an input directory to open (S3: a prefix holding a key)
    source = ParquetDirectorySource(lander.url, lander.options)
    rows = []
    started = time.perf_counter()
    for consumed in range(0, history, FILES_PER_CHECKPOINT):
        if consumed:
            lander.land(consumed, consumed + FILES_PER_CHECKPOINT)
        if consumed in points:
            bounded = checkpoint(storage, coordinator, source, lander, trace=True)
            today = today_checkpoint(lander, work, kind, consumed)
            rows.append({"history": consumed, "bounded": bounded, "today": today})
            say(f"{kind} history {consumed:>7,}: bounded {fmt(bounded)} | today {fmt(today)} "
                f"({time.perf_counter() - started:,.0f} s)")
        else:
            checkpoint(storage, coordinator, source, lander, trace=False)
    return rows


def today_checkpoint(lander: Lander, work: Path, kind: str, consumed: int) -> dict[str, float]:
    """The version-1 checkpoint at `consumed` files: offsets of every name, the whole directory listed."""
    storage = CheckpointStorage(f"file://{work}/{kind}-today-{consumed}", "life")
    coordinator = CheckpointCoordinator(storage, num_retained=2)
    commit(coordinator, SourceOffsets(tuple(name_of(i) for i in range(consumed))))
    saved = offsets_module.RECENT_NAMES
    offsets_module.RECENT_NAMES = 1 << 60  # the floor never rises: version 1, as before
    try:
        return checkpoint(storage, coordinator, ParquetDirectorySource(lander.url, lander.options, rescan=True),
                          lander, trace=True)
    finally:
        offsets_module.RECENT_NAMES = saved


def fmt(row: dict[str, float]) -> str:
    return (f"{row['metadata_bytes']:>9,} B {row['planning_ms']:>8.1f} ms {row['listing_requests']:>4} req "
            f"{row['peak_kb']:>9,.0f} KB")


def fit(xs: list[float], ys: list[float]) -> float:
    """The exponent b of y = a x^b (least squares in log-log): <= 0.1 flat, 1 linear."""
    lx, ly = [math.log(x) for x in xs], [math.log(max(y, 1e-9)) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    return sum((x - mx) * (y - my) for x, y in zip(lx, ly)) / sum((x - mx) ** 2 for x in lx)


def exponents(rows: list[dict[str, Any]], way: str, since: int = 0) -> dict[str, float]:
    """Per metric the fitted exponent over the measured points of `way` from history `since` on."""
    measured = [r for r in rows if r.get(way) and not r.get("modelled") and r["history"] >= since]
    xs = [float(r["history"]) for r in measured]
    return {m: round(fit(xs, [float(r[way][m]) for r in measured]), 3) for m in METRICS} if len(xs) > 1 else {}


def fitted(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """The exponents of both ways over every measured point, and the bounded way's once a date
    partition is full (a local listing reads the floor's partition whole: a young job's is smaller)."""
    return {"bounded": exponents(rows, "bounded"), "today": exponents(rows, "today"),
            "bounded, full partitions": exponents(rows, "bounded", FILES_PER_PARTITION)}


def modelled(rows: list[dict[str, Any]], points: tuple[int, ...]) -> list[dict[str, Any]]:
    """S3 points above the measured life: the bounded offsets and listing do not depend on the
    history, so the last measured bytes and requests stand; planning and memory not given."""
    last = rows[-1]["bounded"]
    done = {r["history"] for r in rows}
    return [{"history": n, "modelled": True, "bounded": {"metadata_bytes": last["metadata_bytes"],
                                                          "listing_requests": last["listing_requests"]}}
            for n in points if n not in done]


def table(kind: str, rows: list[dict[str, Any]], fitted: dict[str, dict[str, float]]) -> str:
    lines = [f"{kind}: per checkpoint ({FILES_PER_CHECKPOINT} files each) at each history",
             f"{'history':>8}  {'way':<8} {'_metadata B':>12} {'planning ms':>12} {'list req':>9} {'peak KB':>10}"]
    for r in rows:
        for way in ("bounded", "today"):
            v = r.get(way)
            if not v:
                continue
            cells = [f"{v['metadata_bytes']:>12,}", f"{v['planning_ms']:>12.1f}" if "planning_ms" in v else
                     f"{'-':>12}", f"{v['listing_requests']:>9}", f"{v['peak_kb']:>10,.0f}" if "peak_kb" in v else
                     f"{'-':>10}"]
            mark = " (modelled)" if r.get("modelled") else ""
            lines.append(f"{r['history']:>8,}  {way:<8} " + " ".join(cells) + mark)
    for way, fx in fitted.items():
        if fx:
            lines.append(f"exponent ({way}): " + ", ".join(f"{m} {fx[m]:.2f}" for m in METRICS))
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = {"metadata_bytes": "_metadata bytes", "planning_ms": "planning ms", "listing_requests":
              "listing requests", "peak_kb": "peak memory KB (file://)"}
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8))
    for ax, metric in zip(axes, METRICS):
        for kind, style in (("file", "-"), ("s3", "--")):
            if kind == "s3" and metric == "peak_kb":
                continue  # the S3 client's own ~10 MB, seen when it allocates anew: not the checkpoint's
            rows = results.get(kind, {}).get("rows", [])
            for way, color in (("bounded", "tab:green"), ("today", "tab:red")):
                pts = [(r["history"], r[way][metric]) for r in rows
                       if r.get(way) and metric in r[way] and r[way][metric] > 0]
                if pts:
                    ax.plot(*zip(*pts), style, marker="o", color=color, label=f"{kind} {way}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(titles[metric])
        ax.set_xlabel("input files consumed before the checkpoint")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("A pipeline's life: one checkpoint's cost by history (bounded offsets vs version 1)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="histories 10^2 and 10^3 only")
    parser.add_argument("--s3-history", type=int, default=10_000, help="files the S3 life runs to (then modelled)")
    parser.add_argument("--no-s3", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--picture", type=Path, default=PICTURE)
    parser.add_argument("--plot-only", action="store_true", help="the tables and the picture from --out's JSON")
    args = parser.parse_args()
    if args.plot_only:
        report(json.loads(args.out.read_text()), args.out, args.picture)
        return
    points = HISTORY[:2] if args.quick else HISTORY
    history = points[-1] + FILES_PER_CHECKPOINT
    results: dict[str, Any] = {"files_per_checkpoint": FILES_PER_CHECKPOINT, "files_per_partition":
                               FILES_PER_PARTITION, "recent_names": offsets_module.RECENT_NAMES, "points": list(points)}
    with tempfile.TemporaryDirectory(prefix="bench-history-") as tmp:
        work = Path(tmp)
        results["file"] = {"rows": life(LocalLander(work / "input"), work, history, points, "file", print)}
        if not args.no_s3:
            s3_points = tuple(p for p in points if p <= args.s3_history)
            with counting_moto() as (endpoint, counts):
                s3_rows = life(S3Lander(endpoint, counts), work, s3_points[-1] + FILES_PER_CHECKPOINT, s3_points,
                               "s3", print)
            results["s3"] = {"rows": s3_rows + modelled(s3_rows, points), "measured_to": s3_points[-1]}
    report(results, args.out, args.picture)


def report(results: dict[str, Any], out: Path, picture: Path) -> None:
    """Fit, print the tables, write the JSON and draw the picture."""
    for kind, title in (("file", "file://"), ("s3", "S3 (moto, requests counted by the server)")):
        if kind in results:
            results[kind]["exponents"] = fitted(results[kind]["rows"])
            print(table(title, results[kind]["rows"], results[kind]["exponents"]))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    plot(results, picture)
    print(f"wrote {out} and {picture}")


if __name__ == "__main__":
    main()
