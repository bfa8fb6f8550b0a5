"""Real RocksDB state backends for the tests that need state but no Spark: the one way they are built."""

from __future__ import annotations

import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.state.backend import RocksDBStateBackend, take_checkpoint
from sparkpoint.state.codecs import StructCodec
from sparkpoint.state.keygroups import key_group_for

COUNT = StructCodec[tuple[int]]("<q")


def make_backend(storage: CheckpointStorage, local_dir: Path | str, subtask: int = 0, parallelism: int = 1, *,
                 operator: str = "counts", **options: Any) -> RocksDBStateBackend:
    """Subtask `subtask` of `parallelism` of `operator`'s keyed state, its local files under `local_dir`.

    `options` are the backend's own (`max_parallelism`, `changelog`, `local_recovery`, `states`, ...);
    a test module binds the ones it always uses with `functools.partial`."""
    return RocksDBStateBackend(storage, operator, subtask, parallelism=parallelism, local_dir=local_dir, **options)


def make_backends(storage: CheckpointStorage, local_dir: Path | str, parallelism: int = 2, *,
                  operator: str = "counts", **options: Any) -> list[RocksDBStateBackend]:
    """Every subtask of `operator` at `parallelism`, sharing one local directory (as one machine's)."""
    return [make_backend(storage, local_dir, i, parallelism, operator=operator, **options) for i in range(parallelism)]


def owned(backend: RocksDBStateBackend, keys: Iterable[str]) -> list[str]:
    """The `keys` whose key group `backend`'s subtask owns, in their order."""
    return [k for k in keys if key_group_for(k, backend.max_parallelism) in backend.key_group_range]


def write_checkpoints(storage: CheckpointStorage, local: Path, rounds: int, *, retained: int = 2) -> dict[str, int]:
    """`rounds` checkpoints of counts (`COUNT` in the value state "count" of operator "counts", two
    subtasks, 16 key groups); returns the content they hold."""
    coord = CheckpointCoordinator(storage, num_retained=retained)
    backends = make_backends(storage, local, max_parallelism=16)
    model: dict[str, int] = {}
    rng = random.Random(7)
    for b in backends:
        b.restore(None)
    for _ in range(rounds):
        keys = sorted({f"k{rng.randrange(400):04d}" for _ in range(150)})
        for k in keys:
            model[k] = model.get(k, 0) + 1
        for b in backends:
            b.value_state("count", COUNT).put_many((k, (model[k],)) for k in owned(b, keys))
        take_checkpoint(coord, backends)
    for b in backends:
        b.close()
    return model
