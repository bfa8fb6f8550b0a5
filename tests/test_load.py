"""Load: hundreds of checkpoints at retention 3 on the core API (no Spark), step by step.

At every checkpoint: storage holds exactly the files of the 3 retained checkpoints (so it stays
bounded: bytes and files are recorded), the coordinator's registry equals a recount rebuilt from
the retained `_metadata` files, and the driver's Python heap (tracemalloc) and RSS are recorded;
the last stretch of checkpoints must not use more memory than the first.
"""

from __future__ import annotations

import gc
import json
import os
import random
import statistics
import time
import tracemalloc
from pathlib import Path

import pytest

from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.registry import SharedStateRegistry
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.state.backend import take_checkpoint
from sparkpoint.state.codecs import JsonCodec
from sparkpoint.state.engine.changelog import ChangelogOptions
from sparkpoint.state.keygroups import subtask_for_key
from tests.support.backends import make_backend

RETAINED = 3
KEYS = 3000


def registry_counts(registry: SharedStateRegistry) -> dict[str, object]:
    """Per file: count, created-by, last-used, owned; and per checkpoint its files."""
    entries: dict[str, object] = {p: registry.entry(p) for p in registry.paths()}
    return entries | {f"chk-{c}": registry.paths_of(c) for c in registry.checkpoint_ids()}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def load(tmp_path: Path, checkpoints: int) -> list[dict[str, int]]:
    storage = CheckpointStorage(f"file://{tmp_path}/ckpt", "job")
    store = CompletedCheckpointStore(storage)
    coordinator = CheckpointCoordinator(storage, num_retained=RETAINED)
    backends = [make_backend(storage, tmp_path / "local", i, 2, operator="op",
                             changelog=ChangelogOptions(enabled=(i == 1)))  # one materializes every time
                for i in range(2)]
    for b in backends:
        b.restore(None)
    codec = JsonCodec()
    owner = {f"k{i}": subtask_for_key(f"k{i}", 128, 2) for i in range(KEYS)}
    rng = random.Random(8)
    log = open(tmp_path / "load.jsonl", "w", buffering=1)  # noqa: SIM115
    tracemalloc.start()
    try:
        for step in range(1, checkpoints + 1):
            for b in backends:  # ~5% of the keys change each checkpoint, a few go
                keys = [k for k in (f"k{rng.randrange(KEYS)}" for _ in range(KEYS // 10)) if owner[k] == b.subtask]
                state = b.value_state("v", codec)
                state.put_many((k, [step, rng.random()]) for k in keys[1:])
                state.delete(keys[0])
            done = take_checkpoint(coordinator, backends, source_offsets={"step": step})
            listing = store.load_all()
            referenced = {m.metadata_path for m in listing.checkpoints}
            for m in listing.checkpoints:
                referenced |= m.paths()
            files = storage.walk("shared") + [f for c in storage.checkpoint_dirs() for f in storage.walk(f"chk-{c}")]
            assert {f.path for f in files} == referenced, f"chk-{step}: storage holds exactly the retained files"
            assert [m.checkpoint_id for m in listing.checkpoints] == list(range(step, max(0, step - RETAINED), -1))
            assert registry_counts(coordinator.registry) == registry_counts(store.rebuild_registry(listing)), (
                f"chk-{step}: the registry equals a recount from _metadata"
            )
            bound = sum(m.stats.state_size for m in listing.checkpoints) + sum(
                storage.info(m.metadata_path).size for m in listing.checkpoints)
            assert sum(f.size for f in files) <= bound, "storage holds at most the retained checkpoints' bytes"
            gc.collect()
            # One line per checkpoint to a file: a list of rows would itself grow the heap measured.
            log.write(json.dumps({
                "checkpoint": done.checkpoint_id, "files": len(files), "bytes": sum(f.size for f in files),
                "state_bytes": done.metadata.stats.state_size, "deleted": done.files_deleted,
                "heap": tracemalloc.get_traced_memory()[0], "rss": rss_bytes(),
            }) + "\n")
    finally:
        tracemalloc.stop()
        log.close()
        for b in backends:
            b.close()
    return [json.loads(line) for line in (tmp_path / "load.jsonl").read_text().splitlines()]


def check_flat(rows: list[dict[str, int]], window: int) -> dict[str, float]:
    """Storage and memory of the last `window` checkpoints against the first `window`."""
    first, last = rows[:window], rows[-window:]

    def mean(part: list[dict[str, int]], key: str) -> float:
        return statistics.fmean(r[key] for r in part)

    figures = {
        "heap_first_kib": mean(first, "heap") / 1024, "heap_last_kib": mean(last, "heap") / 1024,
        "rss_first_mib": mean(first, "rss") / 2**20, "rss_last_mib": mean(last, "rss") / 2**20,
        "files_max": max(r["files"] for r in rows), "bytes_max": max(r["bytes"] for r in rows),
        "files_first_max": max(r["files"] for r in first), "files_last_max": max(r["files"] for r in last),
    }
    figures = {k: round(v, 1) for k, v in figures.items()}
    assert figures["heap_last_kib"] - figures["heap_first_kib"] < 256, f"driver heap grows: {figures}"
    assert figures["rss_last_mib"] - figures["rss_first_mib"] < 64, f"driver RSS grows: {figures}"
    assert figures["files_last_max"] <= 2 * figures["files_first_max"], f"files on storage grow: {figures}"
    return figures


def test_forty_checkpoints_at_retention_3_keep_storage_registry_and_memory_flat(tmp_path: Path):
    rows = load(tmp_path, 40)
    check_flat(rows, 12)
    assert sum(r["deleted"] for r in rows) > 0, "subsumption deleted files"


@pytest.mark.soak
def test_soak_500_checkpoints_at_retention_3(tmp_path: Path):
    checkpoints = int(os.environ.get("SPARKPOINT_SOAK_CHECKPOINTS", "500"))
    started = time.monotonic()
    rows = load(tmp_path, checkpoints)
    figures = check_flat(rows, 100)
    seconds = round(time.monotonic() - started, 1)
    out = Path("build/soak")
    out.mkdir(parents=True, exist_ok=True)
    (out / "load.json").write_text(json.dumps({"name": "load", "checkpoints": checkpoints, "retained": RETAINED,
                                               "seconds": seconds, "failures": 0, **figures, "steps": rows}))
    print(f"\nload: {checkpoints} checkpoints at retention {RETAINED} in {seconds}s, 0 failures")
    print(f"{'checkpoint':>10} {'files':>6} {'bytes':>10} {'state':>10} {'heap KiB':>9} {'RSS MiB':>8}")
    for r in rows[:: max(1, checkpoints // 20)] + [rows[-1]]:
        print(f"{r['checkpoint']:>10} {r['files']:>6} {r['bytes']:>10} {r['state_bytes']:>10} "
              f"{r['heap'] / 1024:>9.0f} {r['rss'] / 2**20:>8.1f}")
    print(" ".join(f"{k}={v:.1f}" for k, v in figures.items()))
