"""Real RocksDB state backends for the tests that need state but no Spark: the one way they are built."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.state.backend import RocksDBStateBackend
from sparkpoint.state.keygroups import key_group_for


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
