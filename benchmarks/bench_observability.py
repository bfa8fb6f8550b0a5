"""What observing a checkpoint costs: the request ledger and the metrics, as a share of the
checkpoint's own time (goal: at most 2%).

One job of two subtasks (real RocksDB, `keys` keys, a `churn` share of them updated before each
checkpoint) takes `checkpoints` checkpoints per variant, on file:// and on S3 (moto on 127.0.0.1,
unless `--no-s3`). The variants, in `VARIANTS` (one entry each; add yours there):

* `baseline`: nothing observed: the ledger's botocore hooks removed and its seam counting off;
* `ledger`: every request counted (hooks on S3, the seam elsewhere), drained and recorded in
  `_metadata` with its cost, as a run does;
* `ledger+metrics`: and the metrics of each checkpoint taken and rendered in Prometheus' text
  format (and pushed, with `--pushgateway URL`).

Variants take turns checkpoint by checkpoint (the machine's drift hits them alike). Two figures:
the median seconds per checkpoint and its overhead against the baseline (whole checkpoints: on a
shared machine their noise is larger than the ledger); and the time spent observing, measured
directly: draining and recording the ledger, the metrics, and each counted request times what
counting one costs (`per_request_seconds`: the botocore hooks of a request on S3, a seam count
elsewhere), as a share of the baseline's median checkpoint.

Run: .venv/bin/python -m benchmarks.bench_observability [--checkpoints 30] [--keys 50000] [--quick]
Prints a table, writes benchmarks/results/observability.json (observability_quick.json with --quick).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparkpoint.checkpoint import ledger
from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.ledger import Prices
from sparkpoint.checkpoint.metadata import CheckpointMetadata
from sparkpoint.checkpoint.metrics import PipelineMetrics
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.state.backend import RocksDBStateBackend
from sparkpoint.state.codecs import StructCodec
from sparkpoint.state.keygroups import key_group_for

RESULTS = Path(__file__).parent / "results"
COUNT = StructCodec[tuple[int]]("<q")


@dataclass
class Variant:
    """One way of observing a checkpoint: whether the ledger counts, and what runs after the
    commit (`after`: given the committed `_metadata`)."""

    name: str
    ledger: bool
    after: Callable[[CheckpointMetadata], None] | None = None
    seconds: list[float] = field(default_factory=list)
    observing: list[float] = field(default_factory=list)  # seconds spent observing, measured directly


def variants(pushgateway: str | None) -> list[Variant]:
    metrics = PipelineMetrics("bench")

    def observe_metrics(meta: CheckpointMetadata) -> None:
        metrics.checkpoint_completed(meta)
        metrics.text()
        if pushgateway:
            metrics.push(pushgateway)

    return [Variant("baseline", ledger=False), Variant("ledger", ledger=True),
            Variant("ledger+metrics", ledger=True, after=observe_metrics)]


VARIANTS = variants  # the list a benchmark run takes: extend `variants` with a new way of observing


@contextmanager
def ledger_switched(storage: CheckpointStorage, on: bool) -> Iterator[None]:
    """The ledger as a run has it (`on`), or removed: no botocore hooks, no seam counting."""
    events = getattr(getattr(getattr(storage.fs, "_s3", None), "meta", None), "events", None)
    seam = storage._seam_counts
    if not on:
        storage._seam_counts = False
        if events is not None:
            for event, suffix in (("request-created.s3", "created"), ("before-send.s3", "send"),
                                  ("response-received.s3", "received")):
                events.unregister(event, unique_id=f"sparkpoint-ledger-{suffix}")
    try:
        yield
    finally:
        storage._seam_counts = seam
        if not on and events is not None:
            storage.fs._sparkpoint_ledger = False
            ledger.watch(storage.fs)
        ledger.drain()


def per_request_seconds(storage: CheckpointStorage, n: int = 20_000) -> float:
    """What counting one request costs: on S3 the botocore hooks of one request and its response,
    elsewhere one count at the seam."""
    if storage._seam_counts:
        t = time.perf_counter()
        for _ in range(n):
            ledger.count("PUT", up=100)
        took = (time.perf_counter() - t) / n
    else:
        class Request:
            method, url, body = "PUT", f"http://127.0.0.1:1/{storage.root}/chk-1/x", b"x"
            headers = {"Content-Length": "1"}
            context: dict[str, Any] = {}

        request = Request()
        response = {"headers": {"Content-Length": "100"}}
        t = time.perf_counter()
        for _ in range(n):
            ledger._created(request)
            ledger._sent(request)
            ledger._received(response_dict=response, context=request.context)
        took = (time.perf_counter() - t) / n
    ledger.drain()
    return took


class Job:
    """Two subtasks of one operator and their coordinator on `storage`."""

    def __init__(self, storage: CheckpointStorage, local: Path, keys: int, seed: int):
        self.storage = storage
        self.coordinator = CheckpointCoordinator(storage, num_retained=2)
        self.backends = [RocksDBStateBackend(storage, "counts", i, parallelism=2, local_dir=local, max_parallelism=32)
                         for i in range(2)]
        for b in self.backends:
            b.restore(None)
        self.per_request = per_request_seconds(storage)
        self.rng = random.Random(seed)
        self.keys = [f"k{i:08d}" for i in range(keys)]
        self._update(1.0)

    def _update(self, share: float) -> None:
        chosen = self.rng.sample(self.keys, max(1, int(len(self.keys) * share)))
        for b in self.backends:
            mine = [k for k in chosen if key_group_for(k, 32) in b.key_group_range]
            b.value_state("count", COUNT).put_many((k, (self.rng.randrange(1 << 30),)) for k in mine)

    def checkpoint(self, variant: Variant, churn: float) -> float:
        """One checkpoint after updating `churn` of the keys; its seconds (the update not counted)."""
        self._update(churn)
        started = time.perf_counter()
        with ledger_switched(self.storage, variant.ledger):
            pending = self.coordinator.trigger(expected={"counts": 2})
            for b in self.backends:
                self.coordinator.acknowledge(pending.checkpoint_id, b.snapshot(pending.checkpoint_id))
            spent = 0.0

            def observe(stats: Any) -> Any:
                nonlocal spent
                t = time.perf_counter()
                counted = ledger.drain()
                out = stats.observed(counted, Prices(), duration_seconds=0.0)
                requests = counted.total + sum(counted.input_requests.values())
                spent += time.perf_counter() - t + requests * self.per_request
                return out

            done = self.coordinator.complete(pending.checkpoint_id, observe=observe if variant.ledger else None)
            for b in self.backends:
                b.confirm(pending.checkpoint_id)
            if variant.after is not None:
                t = time.perf_counter()
                variant.after(done.metadata)
                spent += time.perf_counter() - t
        variant.observing.append(spent)
        return time.perf_counter() - started

    def close(self) -> None:
        for b in self.backends:
            b.close()


def run(where: str, storage_options: dict[str, Any], args: argparse.Namespace, work: Path) -> dict[str, Any]:
    chosen = VARIANTS(args.pushgateway)
    jobs = {v.name: Job(CheckpointStorage(f"{where}/{v.name}", "bench", storage_options), work / v.name, args.keys,
                        seed=7) for v in chosen}
    try:
        for _ in range(args.checkpoints):
            for v in chosen:
                v.seconds.append(jobs[v.name].checkpoint(v, args.churn))
    finally:
        for job in jobs.values():
            job.close()
    base = statistics.median(chosen[0].seconds)
    return {v.name: {"median_seconds": round(statistics.median(v.seconds), 5),
                     "overhead_pct": round(100 * (statistics.median(v.seconds) - base) / base, 2),
                     "observing_ms": round(1000 * statistics.median(v.observing), 3),
                     "observing_pct": round(100 * statistics.median(v.observing) / base, 3),
                     "seconds": [round(s, 5) for s in v.seconds]} for v in chosen}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoints", type=int, default=30)
    parser.add_argument("--keys", type=int, default=50_000)
    parser.add_argument("--churn", type=float, default=0.05)
    parser.add_argument("--no-s3", action="store_true", help="file:// only")
    parser.add_argument("--pushgateway", metavar="URL", help="push the metrics there after every checkpoint")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 3 checkpoints of 2,000 keys")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.quick:
        args.checkpoints, args.keys = 3, 2000
    results: dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if k != "out"}, "storages": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        results["storages"]["file"] = run(f"file://{work}/ckpt", {}, args, work / "file")
        if not args.no_s3:
            import fsspec
            from moto.server import ThreadedMotoServer

            logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's server logs every request
            server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
            server.start()
            try:
                host, port = server.get_host_and_port()
                options = {"key": "bench", "secret": "bench", "client_kwargs": {"endpoint_url": f"http://{host}:{port}"}}
                bucket = "bench-" + uuid.uuid4().hex[:8]
                fsspec.filesystem("s3", **options).mkdir(bucket)
                results["storages"]["s3"] = run(f"s3://{bucket}/ckpt", options, args, work / "s3")
            finally:
                server.stop()
    _print(results)
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"observability{'_quick' if args.quick else ''}.json"
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")
    return results


def _print(results: dict[str, Any]) -> None:
    print(f"Observing a checkpoint: median seconds per checkpoint ({results['args']['checkpoints']} checkpoints, "
          f"{results['args']['keys']} keys, {results['args']['churn']:.0%} updated each)")
    print("'overhead' compares whole checkpoints (the machine's noise included); 'observing' is the time spent "
          "observing, measured directly (counting each request, draining, recording, the metrics)")
    print(f"{'storage':8} {'variant':18} {'median s':>10} {'overhead':>9} {'observing ms':>13} {'observing':>10}")
    for storage, rows in results["storages"].items():
        for name, row in rows.items():
            print(f"{storage:8} {name:18} {row['median_seconds']:>10.4f} {row['overhead_pct']:>8.2f}% "
                  f"{row['observing_ms']:>13.3f} {row['observing_pct']:>9.3f}%")


if __name__ == "__main__":
    main()
