"""A driver without Spark, for crash-point tests: the same protocol as `sparkpoint run` on the
core API alone (restore the latest checkpoint, apply seeded batches, one checkpoint each), so a
test can kill and resume it dozens of times in the time one JVM takes to start.

    python -m tests.support.crash_driver ROOT --seed S --batches B

State: one operator `totals`, parallelism 2, the changelog on with short chains (so both native
checkpoints and changelog checkpoints happen), task-local recovery on, 2 retained checkpoints.
"""

from __future__ import annotations

import argparse
import random

from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.state.backend import restore_with_fallback, take_checkpoint
from sparkpoint.state.codecs import JsonCodec
from sparkpoint.state.engine.changelog import ChangelogOptions
from sparkpoint.state.keygroups import subtask_for_key
from tests.support.backends import make_backends

OPERATOR, PARALLELISM, RETAINED = "totals", 2, 2
CODEC = JsonCodec()


def batch(seed: int, index: int) -> list[tuple[str, int]]:
    """Batch `index` of the seeded stream: (key, increment) rows."""
    rng = random.Random(seed * 100_003 + index)
    return [(f"k{rng.randrange(300)}", rng.randrange(1, 1000)) for _ in range(400)]


def expected_totals(seed: int, batches: int) -> dict[str, int]:
    totals: dict[str, int] = {}
    for i in range(batches):
        for key, inc in batch(seed, i):
            totals[key] = totals.get(key, 0) + inc
    return totals


def storage_of(root: str) -> CheckpointStorage:
    return CheckpointStorage(f"file://{root}/ckpt", "job")


def run(root: str, seed: int, batches: int) -> None:
    storage = storage_of(root)
    backends = make_backends(storage, f"{root}/local", PARALLELISM, operator=OPERATOR,
                             changelog=ChangelogOptions(enabled=True, max_chain=3, slice_min_bytes=1))
    coordinator = CheckpointCoordinator(storage, num_retained=RETAINED)
    retained = CompletedCheckpointStore(storage).load_all().checkpoints
    results = restore_with_fallback(backends, retained)
    latest = next((m for m in retained if m.checkpoint_id == results[0].checkpoint_id), None)
    start = int(latest.source_offsets["next_batch"]) if latest else 0
    print(f"restored {results[0].checkpoint_id} via {','.join(r.source for r in results)}", flush=True)
    for index in range(start, batches):
        rows: list[list[tuple[str, int]]] = [[] for _ in backends]
        for key, inc in batch(seed, index):
            rows[subtask_for_key(key, 128, PARALLELISM)].append((key, inc))
        for backend, part in zip(backends, rows):
            incs: dict[str, int] = {}
            for key, inc in part:
                incs[key] = incs.get(key, 0) + inc
            state = backend.value_state("total", CODEC)
            old = state.get_many(sorted(incs))
            state.put_many((k, (v or 0) + incs[k]) for k, v in zip(sorted(incs), old))
        done = take_checkpoint(coordinator, backends, source_offsets={"next_batch": index + 1})
        print(f"chk-{done.checkpoint_id} batch={index}", flush=True)
    for b in backends:
        b.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--batches", type=int, required=True)
    args = parser.parse_args()
    run(args.root, args.seed, args.batches)


if __name__ == "__main__":
    main()
