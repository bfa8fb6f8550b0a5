"""One task of `bench_scale`, run as a process of its own, as a Spark task's Python worker is:
restore the latest checkpoint of a state that `bench_state_backend` left on storage, read and
write one batch of random keys (the reads fill the block cache, the writes the memtables), take an
incremental checkpoint, and report the process's peak memory (VmHWM).

`bench_scale` runs it twice on the same local directory: first empty (the restore downloads from
primary storage), then again in a new process, which restores what the first one left locally
(a retried task on the same executor). The batch is the same size at every state size, so a
peak that grows with the state is RocksDB's, not the batch's.

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.scale_task --storage URL --job-id ID --keys N \
        --batch-keys 100000 --local DIR

It prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_state_backend import CODEC, OPERATOR, STATE, key, write_keys
from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.state.backend import RocksDBStateBackend, take_checkpoint

MB = 1024 * 1024


def rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the current RSS


def one_task(storage: CheckpointStorage, local: Path, keys: int, batch: int, version: int,
             rng: random.Random) -> dict[str, Any]:
    coordinator = CheckpointCoordinator(storage, num_retained=2)
    latest = coordinator.store.load_all().checkpoints[0]
    backend = RocksDBStateBackend(storage, OPERATOR, 0, parallelism=1,
                                  max_parallelism=latest.operators[OPERATOR].max_parallelism, local_dir=local)
    before = rss_kib("VmRSS")
    try:
        started = time.perf_counter()
        restored = backend.restore(latest)
        restore_s = time.perf_counter() - started
        after_restore = rss_kib("VmHWM")
        # Read-modify-write, as an operator does: the reads fill the block cache, the writes the memtables.
        ids = sorted(rng.sample(range(keys), batch))
        state = backend.value_state(STATE, CODEC)
        started = time.perf_counter()
        found = state.get_many([key(i) for i in ids])
        if any(v is None for v in found):
            raise RuntimeError(f"the restored state lost {sum(v is None for v in found)} of {batch} keys")
        del found
        read_s = time.perf_counter() - started
        cache_after_reads = backend.db.property_int_value("rocksdb.block-cache-usage") if backend.db else 0
        write_keys(state, ids, version)
        batch_s = time.perf_counter() - started
        started = time.perf_counter()
        done = take_checkpoint(coordinator, [backend])
        checkpoint_s = time.perf_counter() - started
        assert backend.db is not None
        cache = {name: backend.db.property_int_value(f"rocksdb.{name}") for name in
                 ("block-cache-usage", "block-cache-pinned-usage", "cur-size-all-mem-tables",
                  "estimate-table-readers-mem")}
    finally:
        backend.close()
    return {
        "restored_from": restored.source,
        "restore_s": restore_s,
        "batch_s": batch_s,
        "read_s": read_s,
        "block_cache_after_reads_mb": (cache_after_reads or 0) / MB,
        "checkpoint_s": checkpoint_s,
        "uploaded_bytes": done.metadata.stats.checkpointed_size,
        "rss_before_mb": before / 1024,
        "peak_after_restore_mb": after_restore / 1024,
        "peak_mb": rss_kib("VmHWM") / 1024,
        "rocksdb_at_end_mb": {name: (v or 0) / MB for name, v in cache.items()},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--storage", required=True)
    p.add_argument("--job-id", required=True)
    p.add_argument("--keys", type=int, required=True, help="the keys the state holds (ids 0..keys-1)")
    p.add_argument("--batch-keys", type=int, default=100_000)
    p.add_argument("--local", type=Path, required=True)
    # Not the bench's own random sequence: a task reading the keys its churn last wrote would read
    # a few small recent files instead of the whole state.
    p.add_argument("--seed", type=int, default=7, help="picks the batch's keys; also the version written")
    args = p.parse_args()
    storage = CheckpointStorage(args.storage, args.job_id)
    batch = min(args.batch_keys, args.keys)
    reset_peak()
    out = {"batch_keys": batch, "baseline_mb": rss_kib("VmRSS") / 1024,
           **one_task(storage, args.local, args.keys, batch, args.seed, random.Random(f"task-{args.seed}"))}
    out["max_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(out))

if __name__ == "__main__":
    main()
