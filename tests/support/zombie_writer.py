"""One writer of the zombie-writer test (tests/test_zombie_writers.py), run as its own process.

It processes batches 1..N of a deterministic input into two RocksDB subtasks and, for each batch,
races the other writer for checkpoint id N: both wait at a barrier, then trigger exactly N (every
third id, one of them by turns starts 0.2 s late, so each writer wins some on any machine). The
winner commits its sink output for N (a file created exclusively, naming the writer); the loser
aborts. One JSON line per id on stdout says what happened.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.errors import CheckpointAlreadyExists, SparkpointError
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.state.backend import take_checkpoint
from tests.support.backends import make_backends
from tests.support.reliability import count_round
from tests.support.waiting import wait_for


def batch(n: int) -> list[str]:
    rng = random.Random(n)
    return sorted({f"k{rng.randrange(300):04d}" for _ in range(40)})


def model_at(n: int) -> dict[str, int]:
    model: dict[str, int] = {}
    for i in range(1, n + 1):
        for k in batch(i):
            model[k] = model.get(k, 0) + 1
    return model


def barrier(directory: Path, n: int, name: str, writers: int) -> None:
    (directory / f"{n}.{name}").touch()
    wait_for(lambda: len(list(directory.glob(f"{n}.*"))) >= writers, 60, 0.001, f"the other writer at checkpoint {n}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoints", required=True)
    p.add_argument("--job-id", default="job")
    p.add_argument("--storage-options", default="{}")
    p.add_argument("--local", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--batches", type=int, required=True)
    p.add_argument("--barrier", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(f"{args.seed}-{args.name}")
    storage = CheckpointStorage(args.checkpoints, args.job_id, json.loads(args.storage_options))
    coord = CheckpointCoordinator(storage, num_retained=2)
    subtasks = make_backends(storage, args.local, max_parallelism=16)
    for b in subtasks:
        b.restore(None)
    model: dict[str, int] = {}
    for n in range(1, args.batches + 1):
        keys = batch(n)
        count_round(subtasks, model, keys)
        barrier(Path(args.barrier), n, args.name, 2)
        if n % 3 == 0:
            # Every third id, the writers take turns starting late, so each wins some whatever
            # the machine's timing favours; the late one still races and loses the create.
            late = ("live", "zombie")[(n // 3) % 2]
            time.sleep(0.2 if args.name == late else 0.0)
        else:
            time.sleep(rng.random() * 0.01)  # a free race: who gets there first varies
        try:
            take_checkpoint(coord, subtasks, source_offsets={"batch": n, "writer": args.name}, checkpoint_id=n)
        except CheckpointAlreadyExists as e:
            print(json.dumps({"id": n, "outcome": "lost", "why": str(e)[:200]}), flush=True)
            continue
        except SparkpointError as e:  # declined: e.g. the other writer committed a newer one first
            print(json.dumps({"id": n, "outcome": type(e).__name__, "why": str(e)[:300]}), flush=True)
            continue
        # The sink commits only after our _metadata is in place: exactly one writer gets here per id.
        with open(Path(args.out) / f"batch-{n}.json", "x") as f:
            json.dump({"writer": args.name, "rows": {k: model[k] for k in keys}}, f)
        print(json.dumps({"id": n, "outcome": "won"}), flush=True)
    for b in subtasks:
        b.close()


if __name__ == "__main__":
    main()
