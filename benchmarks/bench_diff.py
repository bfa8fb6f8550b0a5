"""`sparkpoint diff` between two checkpoints of one job against exporting both and comparing them in
pandas: 500k keys, a checkpoint, then a fraction of the keys updated, some deleted, some added, a
second checkpoint. Bytes are what each way reads: downloaded from checkpoint storage, and read
whole to find the keys that may differ; "changed bytes" are the SSTs and changelog files one
checkpoint lists and the other does not.

Run: .venv/bin/python -m benchmarks.bench_diff [--keys 500000] [--churn 0.01,0.1]
Prints a table, writes benchmarks/results/diff.json.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
from pathlib import Path

import pandas as pd

from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.state.backend import RocksDBStateBackend, take_checkpoint
from sparkpoint.state.codecs import StructCodec
from sparkpoint.state.diff import diff_snapshots, locate
from sparkpoint.state.extract import state_table
from sparkpoint.state.operators import KeyedOperator

TOTALS = StructCodec[tuple[int, float]]("<qd")


def _export(state: RocksDBStateBackend) -> pd.DataFrame:
    rows = [(k.decode(), n, s) for k, (n, s) in state.value_state("totals", TOTALS).items()]
    return pd.DataFrame(rows, columns=["user", "count", "sum"])


OP = KeyedOperator("totals", "user", lambda batch, state: None, _export)


def _pandas_compare(old: pd.DataFrame, new: pd.DataFrame) -> pd.DataFrame:
    merged = old.merge(new, on="user", how="outer", suffixes=("_old", ""), indicator=True)
    differs = (merged["count"] != merged["count_old"]) | (merged["sum"] != merged["sum_old"])
    return merged[(merged["_merge"] != "both") | differs]


def run(keys: int, churn: float, root: Path) -> dict[str, object]:
    storage = CheckpointStorage(f"file://{root}/checkpoints", "bench")
    local = root / "local"
    coordinator = CheckpointCoordinator(storage, num_retained=10)
    rng = random.Random(1)
    with RocksDBStateBackend(storage, "totals", 0, parallelism=1, local_dir=local) as backend:
        backend.restore(None)
        state = backend.value_state("totals", TOTALS)
        for start in range(0, keys, 100_000):
            state.put_many((f"user-{i:08d}", (i, i * 0.5)) for i in range(start, min(keys, start + 100_000)))
        before = take_checkpoint(coordinator, [backend]).checkpoint_id
        changed = rng.sample(range(keys), int(keys * churn))
        state.put_many((f"user-{i:08d}", (i + 1, 1.0)) for i in changed[: len(changed) * 8 // 10])
        for i in changed[len(changed) * 8 // 10 : len(changed) * 9 // 10]:
            state.delete(f"user-{i:08d}")
        state.put_many((f"new-{i:08d}", (i, 0.0)) for i in range(len(changed) // 10))
        after = take_checkpoint(coordinator, [backend]).checkpoint_id

    started = time.perf_counter()
    _, old = state_table(storage, OP, before)
    _, new = state_table(storage, OP, after)
    expected = _pandas_compare(old, new)
    export_seconds = time.perf_counter() - started
    meta = [locate(c, storage).meta.operators["totals"] for c in (before, after)]
    export_bytes = sum(f.size for op in meta for h in op.subtasks for f in h.files())

    results = {}
    for name, local_dir in (("diff, task-local copy", local), ("diff, no local copy", None)):
        started = time.perf_counter()
        result = diff_snapshots(locate(before, storage), locate(after, storage), OP, local_dir=local_dir)
        seconds = time.perf_counter() - started
        assert len(result.table) == len(expected), (len(result.table), len(expected))
        results[name] = {"seconds": round(seconds, 3), "bytes_read": result.bytes_read,
                         "bytes_scanned": result.bytes_scanned, "bytes_local": result.bytes_local,
                         "method": result.method, "changed_bytes": result.changed_bytes,
                         "shared_bytes": result.shared_bytes, "rows": len(result.table)}
    return {"keys": keys, "churn": churn, "rows_differing": len(expected),
            "export_and_compare": {"seconds": round(export_seconds, 3), "bytes_read": export_bytes}, **results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=500_000)
    parser.add_argument("--churn", default="0.01,0.1")
    parser.add_argument("--out", default="benchmarks/results/diff.json")
    args = parser.parse_args()
    rows = []
    for churn in (float(c) for c in args.churn.split(",")):
        root = Path(tempfile.mkdtemp(prefix="sparkpoint-bench-diff-"))
        try:
            rows.append(run(args.keys, churn, root))
        finally:
            shutil.rmtree(root, ignore_errors=True)
    mb = 1 << 20
    print(f"{'churn':>6} {'way':<24} {'seconds':>8} {'read MB':>8} {'scanned MB':>10} {'changed MB':>10} "
          f"{'read+scanned / changed':>22} {'speed-up':>8}")
    for row in rows:
        base = row["export_and_compare"]
        print(f"{row['churn']:>6.0%} {'export both + pandas':<24} {base['seconds']:>8.2f} "
              f"{base['bytes_read'] / mb:>8.1f}")
        for way in ("diff, task-local copy", "diff, no local copy"):
            r = row[way]
            ratio = (r["bytes_read"] + r["bytes_scanned"]) / max(1, r["changed_bytes"])
            print(f"{'':>6} {way:<24} {r['seconds']:>8.2f} {r['bytes_read'] / mb:>8.1f} "
                  f"{r['bytes_scanned'] / mb:>10.1f} {r['changed_bytes'] / mb:>10.1f} "
                  f"{ratio:>22.2f} {base['seconds'] / r['seconds']:>7.1f}x")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
