"""What an append to list state costs as the list grows: the same per-append time at 10, 1,000 and
100,000 elements (one seek for the key's last sequence number and one put, never a read of the
list), against the read-and-rewrite a value state holding the list as one value needs.

Run: .venv/bin/python -m benchmarks.bench_list_append [--appends 2000] [--sizes 10,1000,100000]
Prints a table, writes benchmarks/results/list_append.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.state.backend import RocksDBStateBackend
from sparkpoint.state.codecs import JsonCodec, StructCodec

EVENT = StructCodec[tuple[int, float]]("<qd")


def per_append_us(state, key: str, appends: int) -> float:  # type: ignore[no-untyped-def]
    started = time.perf_counter()
    for i in range(appends):
        state.add(key, (i, 1.0))
    return (time.perf_counter() - started) / appends * 1e6


def per_rewrite_us(state, key: str, appends: int) -> float:  # type: ignore[no-untyped-def]
    started = time.perf_counter()
    for i in range(appends):
        values = state.get(key)
        values.append([i, 1.0])
        state.put(key, values)
    return (time.perf_counter() - started) / appends * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--appends", type=int, default=2000)
    parser.add_argument("--sizes", default="10,1000,100000")
    parser.add_argument("--out", default="benchmarks/results/list_append.json")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        storage = CheckpointStorage(f"file://{tmp}/ckpt", "bench")
        with RocksDBStateBackend(storage, "lists", 0, parallelism=1, local_dir=f"{tmp}/local") as b:
            b.restore(None)
            lists = b.list_state("events", EVENT)
            whole = b.value_state("events_as_one_value", JsonCodec())
            for size in [int(s) for s in args.sizes.split(",")]:
                key = f"hot-{size}"
                lists.add_many((key, (i, 0.0)) for i in range(size))
                append = per_append_us(lists, key, args.appends)
                rewrite = None
                if size <= 10_000:  # at 10^5 one rewrite copies ~3 MB: minutes for the whole run
                    whole.put(key, [[i, 0.0] for i in range(size)])
                    rewrite = per_rewrite_us(whole, key, max(1, args.appends // 10))
                rows.append({"elements": size, "list_append_us": round(append, 2),
                             "value_rewrite_us": None if rewrite is None else round(rewrite, 1)})
    print(f"{'elements':>10} {'list append (µs)':>18} {'rewrite as one value (µs)':>27}")
    for r in rows:
        rewrite = "-" if r["value_rewrite_us"] is None else f"{r['value_rewrite_us']:.1f}"
        print(f"{r['elements']:>10,} {r['list_append_us']:>18.2f} {rewrite:>27}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"appends": args.appends, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
