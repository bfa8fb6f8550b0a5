"""What does a checkpoint's table commit cost? The Delta and Iceberg sinks against writing the
same rows with the format's own Python writer, per checkpoint, as the table's history grows.

No Spark: the sink objects are driven as a run drives them. Per checkpoint, "stage" is the tasks'
part (`for_tasks` on the driver, then `stage` of every subtask's rows: one Parquet file per
subtask and partition value, written into the table's location, unseen) and "commit" the
completer's (`commit`: read what the table records for the job, then one table transaction
naming the staged files). "direct" writes the same rows, concatenated, in one call of the
library: `deltalake.write_deltalake(mode="append")` / pyiceberg `Table.append`, which writes the
data files and commits them (no exactly-once record, no fencing).

Storage is S3: a moto server in a process of its own behind the counting WSGI layer of
bench_routing, which counts every request it answers (delta-rs' requests come from Rust, out of
reach of an fsspec wrapper), by bucket and kind, with the body bytes in and out. Each writer has a
bucket of its own. The Iceberg catalog is pyiceberg's SQL catalog on a local SQLite file (the
embedded default), not counted. Seconds include moto's own time per request (a local server:
roughly a real S3's request count at a fraction of its latency).

Figures per checkpoint at the first checkpoint (which creates the table) and at the last
(`--checkpoints`, default 100: the mean of the last five, i.e. with ~100 versions of history),
plus the files each checkpoint adds (subtasks × partition values) and, for Delta, what 100
checkpoints of small files cost a reader and what `DeltaTable.optimize.compact()` makes of it.

Run:

    .venv/bin/python -m benchmarks.bench_table_commit            # 100 checkpoints, ~10 min
    .venv/bin/python -m benchmarks.bench_table_commit --quick    # 3 checkpoints, seconds

It prints tables and writes JSON to benchmarks/results/table_commit.json
(table_commit_quick.json with --quick), or into the directory `--out DIR`.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from benchmarks.bench_routing import S3_KEYS, counting_moto, server_counts, table
from sparkpoint.tables.delta import DeltaSink
from sparkpoint.tables.delta_parts import delta_options
from sparkpoint.tables.iceberg import IcebergSink
from sparkpoint.tables.spec import DeltaTable, IcebergTable

RESULTS = Path(__file__).parent / "results"
JOB = "bench-job"
OPERATOR = ("order_totals", "order-totals-v1")  # (name, uid): a user's operator, not the sample's
REGIONS = ("emea", "amer", "apac")
KB = 1024


def log(msg: str) -> None:
    print(f"[bench_table_commit] {msg}", flush=True)


# --- the rows ---------------------------------------------------------------------------------------------


def subtask_rows(checkpoint: int, subtask: int, n: int, regions: int) -> pd.DataFrame:
    """One subtask's changed rows of checkpoint N: order totals by customer, partitioned by region."""
    rng = np.random.default_rng(checkpoint * 1000 + subtask)
    start = (checkpoint * 100 + subtask) * n
    return pd.DataFrame({
        "customer": [f"c{i:09d}" for i in range(start, start + n)],
        "region": [REGIONS[i % regions] for i in range(n)],
        "orders": rng.integers(1, 50, n, dtype=np.int64),
        "total": rng.random(n) * 1000,
    })


def direct_rows(checkpoint: int, args: argparse.Namespace) -> pa.Table:
    frames = [subtask_rows(checkpoint, s, args.rows, args.regions) for s in range(args.subtasks)]
    frame = pd.concat(frames, ignore_index=True).assign(checkpoint_id=np.int64(checkpoint))
    return pa.Table.from_pandas(frame, preserve_index=False)


# --- counting ---------------------------------------------------------------------------------------------


class Meter:
    """Seconds, requests and bytes (in + out) of one bucket, per phase of a checkpoint."""

    def __init__(self, endpoint: str, bucket: str):
        self.endpoint, self.bucket = endpoint, bucket

    def _bucket(self) -> tuple[int, int]:
        counts = server_counts(self.endpoint)
        mine = {k.split("|", 1)[1]: v for k, v in counts.items() if k.startswith(f"{self.bucket}|")}
        requests = sum(v for k, v in mine.items() if k.endswith("|requests"))
        return requests, sum(v for k, v in mine.items() if k.endswith(("|bytes_in", "|bytes_out")))

    def kinds(self) -> dict[str, int]:
        counts = server_counts(self.endpoint)
        return {k.split("|")[1]: v for k, v in counts.items() if k.startswith(f"{self.bucket}|") and
                k.endswith("|requests")}

    def measure(self, work: Callable[[], Any]) -> dict[str, float]:
        requests, size = self._bucket()
        start = time.perf_counter()
        work()
        seconds = time.perf_counter() - start
        requests_after, size_after = self._bucket()
        return {"seconds": seconds, "requests": requests_after - requests, "bytes": size_after - size}


# --- the four writers -------------------------------------------------------------------------------------


def checkpoints_into(sink: DeltaSink | IcebergSink, args: argparse.Namespace, meter: Meter) -> list[dict[str, Any]]:
    """Every checkpoint as a run takes it: the tasks stage their rows (with the driver's `for_tasks`
    spec), then the completer commits the staged files."""
    points = []
    for cid in range(1, args.checkpoints + 1):
        staged: list[str] = []

        def stage(cid: int = cid, staged: list[str] = staged) -> None:
            tasks = sink.for_tasks()
            for s in range(args.subtasks):
                staged.extend(tasks.stage(cid, OPERATOR[0], s, subtask_rows(cid, s, args.rows, args.regions)))

        point: dict[str, Any] = {"checkpoint": cid, "stage": meter.measure(stage)}
        point["commit"] = meter.measure(lambda cid=cid, staged=staged: sink.commit(cid, staged))
        point["files"] = len(staged)
        points.append(point)
    return points


def run_delta_sink(args: argparse.Namespace, endpoint: str, bucket: str) -> list[dict[str, Any]]:
    options = {**S3_KEYS, "client_kwargs": {"endpoint_url": endpoint}}
    sink = DeltaSink.at(DeltaTable(f"s3://{bucket}/orders", partition_by=["region"]), JOB,
                        storage_options=options, operators=[OPERATOR])
    return checkpoints_into(sink, args, Meter(endpoint, bucket))


def run_delta_direct(args: argparse.Namespace, endpoint: str, bucket: str) -> list[dict[str, Any]]:
    from deltalake import write_deltalake

    uri = f"s3://{bucket}/orders"
    options = delta_options(uri, {**S3_KEYS, "client_kwargs": {"endpoint_url": endpoint}})
    meter = Meter(endpoint, bucket)
    points = []
    for cid in range(1, args.checkpoints + 1):
        rows = direct_rows(cid, args)
        point = {"checkpoint": cid, "write": meter.measure(lambda rows=rows: write_deltalake(
            uri, rows, mode="append", partition_by=["region"], storage_options=options))}
        points.append(point)
    return points


def iceberg_catalog(work: Path, endpoint: str) -> dict[str, str]:
    return {"name": "bench", "type": "sql", "uri": f"sqlite:///{work}/catalog.db",
            "s3.endpoint": endpoint, "s3.access-key-id": "testing", "s3.secret-access-key": "testing",
            "s3.region": "us-east-1"}


def create_iceberg_table(props: dict[str, str], identifier: str, location: str) -> Any:
    """An Iceberg table of the rows' columns, partitioned by region (identity)."""
    from pyiceberg.catalog import load_catalog

    props = dict(props)
    catalog = load_catalog(props.pop("name"), **props)
    catalog.create_namespace_if_not_exists(identifier.split(".")[0])
    schema = direct_rows(0, argparse.Namespace(subtasks=1, rows=1, regions=1)).schema
    created = catalog.create_table(identifier, schema=schema, location=location)
    with created.update_spec() as spec:
        spec.add_identity("region")
    return catalog.load_table(identifier)


def run_iceberg_sink(args: argparse.Namespace, endpoint: str, bucket: str, work: Path) -> list[dict[str, Any]]:
    props = iceberg_catalog(work, endpoint)
    create_iceberg_table(props, "bench.sink_orders", f"s3://{bucket}/orders")
    options = {**S3_KEYS, "client_kwargs": {"endpoint_url": endpoint}}
    sink = IcebergSink.at(IcebergTable("bench.sink_orders", catalog=props), JOB, [OPERATOR], options)
    return checkpoints_into(sink, args, Meter(endpoint, bucket))


def run_iceberg_direct(args: argparse.Namespace, endpoint: str, bucket: str, work: Path) -> list[dict[str, Any]]:
    props = iceberg_catalog(work, endpoint)
    ice = create_iceberg_table(props, "bench.direct_orders", f"s3://{bucket}/orders")
    meter = Meter(endpoint, bucket)
    points = []
    for cid in range(1, args.checkpoints + 1):
        rows = direct_rows(cid, args)
        points.append({"checkpoint": cid, "write": meter.measure(lambda rows=rows: ice.append(rows))})
    return points


def delta_readers(args: argparse.Namespace, endpoint: str, bucket: str) -> dict[str, Any]:
    """What the sink's table costs a reader after all checkpoints, and after `optimize.compact()`."""
    from deltalake import DeltaTable as Table

    uri = f"s3://{bucket}/orders"
    options = delta_options(uri, {**S3_KEYS, "client_kwargs": {"endpoint_url": endpoint}})
    meter = Meter(endpoint, bucket)

    def read() -> dict[str, Any]:
        got: dict[str, Any] = {}
        got["read"] = meter.measure(lambda: got.update(rows=Table(uri, storage_options=options).to_pyarrow_table()
                                                        .num_rows))
        got["files"] = len(Table(uri, storage_options=options).file_uris())
        return got

    before = read()
    compact = meter.measure(lambda: Table(uri, storage_options=options).optimize.compact())
    after = read()
    return {"before": before, "compact": compact, "after": after}


# --- the report -------------------------------------------------------------------------------------------


def phase_at(points: list[dict[str, Any]], phase: str, first: bool) -> dict[str, float]:
    """A phase's figures at the first checkpoint, or the mean of the last five."""
    chosen = points[:1] if first else points[-min(5, len(points)):]
    return {k: statistics.fmean(p[phase][k] for p in chosen) for k in ("seconds", "requests", "bytes")}


def summarize(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    rows = []
    for name, points in runs.items():
        phases = ["stage", "commit"] if "commit" in points[0] else ["write"]
        for first in (True, False):
            at = points[0]["checkpoint"] if first else points[-1]["checkpoint"]
            for phase in phases:
                rows.append({"writer": name, "phase": phase, "at_checkpoint": at, **phase_at(points, phase, first)})
    return rows


def report(result: dict[str, Any]) -> str:
    a = result["args"]
    out = [table(f"Cost per checkpoint: {a['subtasks']} subtasks x {a['rows']:,} rows, {a['regions']} partition "
                 f"values (S3 on a local moto server, counted by the server; at the last checkpoint: mean of "
                 f"the last five)",
                 ["writer", "phase", "at checkpoint", "seconds", "requests", "KiB"],
                 [[r["writer"], r["phase"], str(r["at_checkpoint"]), f"{r['seconds']:.3f}", f"{r['requests']:.1f}",
                   f"{r['bytes'] / KB:,.0f}"] for r in result["summary"]])]
    out.append(f"Files each checkpoint adds to the table: {result['files_per_checkpoint']} "
               f"(= {a['subtasks']} subtasks x {a['regions']} partition values), for either sink.")
    readers = result["delta_readers"]
    out.append(table(f"A reader of the Delta sink's table after {a['checkpoints']} checkpoints "
                     "(to_pyarrow_table), before and after DeltaTable.optimize.compact()",
                     ["table", "files", "rows", "read s", "read requests"],
                     [[k, str(readers[k]["files"]), f"{readers[k]['rows']:,}", f"{readers[k]['read']['seconds']:.3f}",
                       str(readers[k]["read"]["requests"])] for k in ("before", "after")]))
    c = readers["compact"]
    out.append(f"optimize.compact(): {c['seconds']:.2f} s, {c['requests']} requests, {c['bytes'] / KB:,.0f} KiB")
    out.append(f"Requests by kind over the whole run: {json.dumps(result['kinds'])}")
    return "\n".join(out)


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="bench_table_commit_"))
    try:
        with counting_moto(work) as endpoint:
            import fsspec

            fs = fsspec.filesystem("s3", **S3_KEYS, client_kwargs={"endpoint_url": endpoint})
            buckets = {"delta sink": "delta-sink", "delta write_deltalake": "delta-direct",
                       "iceberg sink": "iceberg-sink", "iceberg append": "iceberg-direct"}
            for bucket in buckets.values():
                fs.mkdir(bucket)
            writers: dict[str, Callable[[], list[dict[str, Any]]]] = {
                "delta sink": lambda: run_delta_sink(args, endpoint, buckets["delta sink"]),
                "delta write_deltalake": lambda: run_delta_direct(args, endpoint, buckets["delta write_deltalake"]),
                "iceberg sink": lambda: run_iceberg_sink(args, endpoint, buckets["iceberg sink"], work),
                "iceberg append": lambda: run_iceberg_direct(args, endpoint, buckets["iceberg append"], work),
            }
            runs = {}
            for name, writer in writers.items():
                log(f"{name}: {args.checkpoints} checkpoints")
                runs[name] = writer()
            readers = delta_readers(args, endpoint, buckets["delta sink"])
            kinds = {name: Meter(endpoint, bucket).kinds() for name, bucket in buckets.items()}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    files = {p["files"] for name in ("delta sink", "iceberg sink") for p in runs[name]}
    return {"args": {k: v for k, v in vars(args).items() if k != "out"}, "machine": machine(),
            "summary": summarize(runs), "files_per_checkpoint": max(files), "delta_readers": readers,
            "kinds": kinds, "points": runs}


def machine() -> dict[str, Any]:
    import os

    return {"date": datetime.now(UTC).strftime("%Y-%m-%d"), "python": platform.python_version(),
            "platform": platform.platform(), "cpus": os.cpu_count()}


@contextmanager
def quiet() -> Iterator[None]:
    logging.basicConfig(level=logging.ERROR)
    yield


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--quick", action="store_true", help="smoke test: 3 checkpoints of fewer rows")
    p.add_argument("--checkpoints", type=int, default=100, help="checkpoints per writer (default 100)")
    p.add_argument("--subtasks", type=int, default=4, help="subtasks staging rows per checkpoint (default 4)")
    p.add_argument("--rows", type=int, default=2000, help="rows per subtask per checkpoint (default 2000)")
    p.add_argument("--regions", type=int, default=3, choices=range(1, len(REGIONS) + 1),
                   help="partition values among the rows (default 3)")
    p.add_argument("--out", type=Path, default=RESULTS, metavar="DIR",
                   help="where table_commit[_quick].json goes (default benchmarks/results)")
    args = p.parse_args(argv)
    if args.quick:
        args.checkpoints, args.rows = 3, 200
    if args.checkpoints < 2 or args.subtasks < 1 or args.rows < 1:
        p.error("--checkpoints must be at least 2, --subtasks and --rows positive")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with quiet():
        result = run(args)
    print(report(result))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / ("table_commit_quick.json" if args.quick else "table_commit.json")
    path.write_text(json.dumps(result, indent=2) + "\n")
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
