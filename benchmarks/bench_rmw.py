"""Read-modify-write throughput of keyed state against rocksdict's own batched writes.

The state API adds a key-group prefix, a versioned value codec and (for `update_many`) a
multi-get before the write. This measures what that costs, on one core, per key:

* rocksdict raw: `WriteBatch.put` of pre-encoded bytes, one batch of `--batch` keys (the floor);
* `ValueState.put_many`: the same keys through the state API (prefix + codec);
* `ValueState.update_many`: multi-get + merge function + one WriteBatch (the operators' path);
* `ValueState.get_many`: multi-get alone.

Run: .venv/bin/python -m benchmarks.bench_rmw [--keys 1000000] [--batch 100000]
Prints a table, writes benchmarks/results/rmw.json.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from rocksdict import Options, Rdict, WriteBatch, WriteOptions

from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.state.backend import RocksDBStateBackend
from sparkpoint.state.codecs import StructCodec

TOTALS = StructCodec[tuple[int, float, float, float, int]]("<qdddq")


def rate(n: int, seconds: float) -> float:
    return n / seconds if seconds > 0 else float("inf")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=100_000)
    parser.add_argument("--out", default="benchmarks/results/rmw.json")
    args = parser.parse_args()
    rng = random.Random(1)
    keys = [f"user-{rng.randrange(10**12):012d}" for _ in range(args.keys)]
    value = (1, 2.0, 1.0, 3.0, 1_700_000_000_000_000)
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        opts = Options(raw_mode=True)
        opts.create_if_missing(True)
        raw = Rdict(f"{tmp}/raw", options=opts)
        write = WriteOptions()
        write.disable_wal = True  # type: ignore[method-assign, assignment]
        raw.set_write_options(write)
        encoded = [(k.encode(), TOTALS.encode(value)) for k in keys]
        started = time.perf_counter()
        for i in range(0, len(encoded), args.batch):
            wb = WriteBatch(raw_mode=True)
            for k, v in encoded[i : i + args.batch]:
                wb.put(k, v)
            raw.write(wb)
        results["rocksdict raw WriteBatch.put"] = rate(len(keys), time.perf_counter() - started)
        raw.close()

        storage = CheckpointStorage(f"file://{tmp}/ckpt", "bench")
        backend = RocksDBStateBackend(storage, "op", 0, parallelism=1, local_dir=Path(tmp) / "local")
        backend.restore(None)
        state = backend.value_state("totals", TOTALS)
        started = time.perf_counter()
        for i in range(0, len(keys), args.batch):
            state.put_many((k, value) for k in keys[i : i + args.batch])
        results["ValueState.put_many"] = rate(len(keys), time.perf_counter() - started)

        Totals = tuple[int, float, float, float, int]

        def merge(_key: object, old: Totals | None) -> Totals:
            if old is None:
                return value
            return (old[0] + 1, old[1] + 2.0, min(old[2], 1.0), max(old[3], 3.0), max(old[4], value[4]))

        shuffled = keys[:]
        rng.shuffle(shuffled)
        started = time.perf_counter()
        for i in range(0, len(shuffled), args.batch):
            state.update_many(shuffled[i : i + args.batch], merge)
        results["ValueState.update_many (get+merge+put)"] = rate(len(keys), time.perf_counter() - started)

        started = time.perf_counter()
        for i in range(0, len(shuffled), args.batch):
            state.get_many(shuffled[i : i + args.batch])
        results["ValueState.get_many"] = rate(len(keys), time.perf_counter() - started)
        backend.dispose()

    floor = results["rocksdict raw WriteBatch.put"]
    print(f"{args.keys:,} keys, batches of {args.batch:,}, one core")
    print(f"{'path':<40} {'keys/s':>12} {'vs raw put':>10}")
    for name, r in results.items():
        print(f"{name:<40} {r:>12,.0f} {r / floor:>10.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"keys": args.keys, "batch": args.batch, "keys_per_s": results}, indent=1))


if __name__ == "__main__":
    main()
