"""How a batch's rows reach their subtasks: two routes, one result.

* **read-all** (`sparkpoint.spark.tasks.run_slots`): one stage, task i runs subtask i of every
  operator and reads every input file of the batch itself, keeping its key groups' rows. No
  shuffle and no second stage, but each file is read once per subtask index: the bytes read grow
  with the parallelism.
* **shuffle** (`shuffle_job`): the batch is read once, split by files and row groups across
  tasks (`read_units`); each reading task tags its rows with their subtask (by key group, as
  read-all keeps them) and Spark's own shuffle brings each subtask's rows to the task that runs
  it (`repartition` into `parallelism` partitions on a column whose Spark hash puts subtask s in
  partition s). The subtask then restores, processes and snapshots exactly as on the other route.

A subtask gets the same rows in the same order, with the same types, on either route: the parts
it receives are put back in batch order (file, then row group); both routes read through the same
reader (`read_parquet_counted`); and a file is cut between row groups only where pyarrow gives
its columns the same pandas types from some row groups as from the whole file
(`row_groups_read_alike`). So state, output and `_metadata` (but for its record of the route
itself) do not depend on the route, and a job may change route from one checkpoint to the next
(or rescale while it does).

`routing="auto"` (`choose_route`) takes the shuffle when what read-all would read beyond the
batch itself, (parallelism - 1) x the batch's bytes, reaches `SHUFFLE_ABOVE_BYTES`: below it a
second stage and a shuffle cost more than reading the batch again. Measured on `local[2]`
(`benchmarks/bench_routing.py`, crossover): the shuffle's fixed cost is about a second a batch,
and the threshold that routes every measured batch to its faster route lies between 57 and 78 MB
in three runs of four (78-122 MB in the fourth).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sparkpoint.lazy import lazy_module

if TYPE_CHECKING:
    import pandas as pd
else:
    pd = lazy_module("pandas")

ROUTINGS = ("auto", "read-all", "shuffle")
READ_ALL, SHUFFLE = "read-all", "shuffle"
UNIT_BYTES = 64 << 20  # a reading task's share of the batch: row groups of a file up to this size
SHUFFLE_ABOVE_BYTES = 64 << 20  # auto: the extra bytes read-all would read from which the shuffle pays (measured)

ROUTE_SCHEMA = "route int, subtask int, op int, unit int, late long, read_bytes long, rows binary"


def check_routing(routing: str) -> list[str]:
    """Problems with a `routing` setting (empty: none)."""
    if routing not in ROUTINGS:
        return [f"routing must be one of {', '.join(ROUTINGS)}, got {routing!r}"]
    return []


@dataclass(frozen=True)
class ReadUnit:
    """A piece of a batch that one task reads: a file, or some of its row groups."""

    url: str
    row_groups: tuple[int, ...] | None = None  # None: the whole file


@dataclass(frozen=True)
class FileLayout:
    """An input file as its footer describes it: its bytes and each row group's (compressed)."""

    url: str
    size: int = 0
    row_group_bytes: tuple[int, ...] = ()
    splittable: bool = False  # its row groups read apart give the types the whole file gives


def batch_bytes(layouts: Sequence[FileLayout]) -> int:
    """The batch's bytes on storage."""
    return sum(f.size for f in layouts)


def choose_route(routing: str, parallelism: int, layouts: Sequence[FileLayout]) -> str:
    """The route a batch takes: `routing` unless it is "auto"; then the shuffle when read-all
    would read at least `SHUFFLE_ABOVE_BYTES` more than the batch, else read-all. A batch with
    no files reads nothing: read-all (one stage, every subtask runs on no rows)."""
    if not layouts:
        return READ_ALL
    if routing != "auto":
        return routing
    return SHUFFLE if (parallelism - 1) * batch_bytes(layouts) >= SHUFFLE_ABOVE_BYTES else READ_ALL


def read_units(layouts: Sequence[FileLayout], unit_bytes: int | None = None) -> list[ReadUnit]:
    """The batch cut into pieces for the reading tasks, in batch order: a file whose row groups
    add up to more than `unit_bytes` (default `UNIT_BYTES`) is cut between row groups (never
    inside one), when it is `splittable`."""
    unit_bytes = unit_bytes or UNIT_BYTES
    units = []
    for f in layouts:
        groups = f.row_group_bytes
        if len(groups) <= 1 or sum(groups) <= unit_bytes or not f.splittable:
            units.append(ReadUnit(f.url))
            continue
        piece: list[int] = []
        size = 0
        for g, n in enumerate(groups):
            if piece and size + n > unit_bytes:
                units.append(ReadUnit(f.url, tuple(piece)))
                piece, size = [], 0
            piece.append(g)
            size += n
        units.append(ReadUnit(f.url, tuple(piece)))
    return units


def spark_hash_int(value: int, seed: int = 42) -> int:
    """Spark's `hash()` of an int column (Murmur3 x86 32-bit, seed 42, as `HashPartitioning`
    uses): a signed 32-bit int."""
    mask = 0xFFFFFFFF

    def rotl(x: int, r: int) -> int:
        return ((x << r) | (x >> (32 - r))) & mask

    k1 = rotl((value & mask) * 0xCC9E2D51 & mask, 15) * 0x1B873593 & mask
    h1 = (rotl(seed ^ k1, 13) * 5 + 0xE6546B64) & mask
    h1 ^= 4
    h1 ^= h1 >> 16
    h1 = h1 * 0x85EBCA6B & mask
    h1 ^= h1 >> 13
    h1 = h1 * 0xC2B2AE35 & mask
    h1 ^= h1 >> 16
    return h1 - (1 << 32) if h1 & 0x80000000 else h1


def partition_routes(parallelism: int) -> list[int]:
    """For each subtask s, the smallest int whose Spark hash puts it in partition s of
    `parallelism`: the value its rows are repartitioned by."""
    routes: dict[int, int] = {}
    value = 0
    while len(routes) < parallelism:
        routes.setdefault(spark_hash_int(value) % parallelism, value)
        value += 1
    return [routes[s] for s in range(parallelism)]


def reading_tasks(spark: Any, units: int, parallelism: int) -> int:
    """How many tasks read the batch: every core the session has (a classic session's default
    parallelism) or the subtasks, whichever is more, and never more than there are units."""
    cores = parallelism
    try:
        cores = max(cores, int(spark.sparkContext.defaultParallelism))
    except Exception:  # noqa: BLE001  Spark Connect has no SparkContext: the subtasks' count
        pass
    return max(1, min(units, cores))


def shuffle_job(spark: Any, spec: Any, units: list[ReadUnit], schema: str,
                route: Callable[..., Iterator[pd.DataFrame]],
                run: Callable[..., Iterator[pd.DataFrame]]) -> list[dict[str, Any]]:
    """The shuffle route's Spark job: `route(spec, units, routes, frames)` over the unit indexes
    (split across the reading tasks), repartitioned by subtask, then `run(spec, frames)` in each
    partition; the result rows, as dicts in `schema`'s columns. Classic and Spark Connect alike
    (DataFrame API only)."""
    routes = partition_routes(spec.parallelism)
    tasks = reading_tasks(spark, len(units), spec.parallelism)

    def read(frames):  # type: ignore[no-untyped-def]  # Spark infers UDF kinds from hints: keep none
        return route(spec, units, routes, frames)

    def process(frames):  # type: ignore[no-untyped-def]
        return run(spec, frames)

    routed = spark.range(0, len(units), 1, tasks).mapInPandas(read, ROUTE_SCHEMA)
    job = routed.repartition(spec.parallelism, "route").mapInPandas(process, schema)
    return [r.asDict() for r in job.collect()]
