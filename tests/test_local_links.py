"""Links planted in a task's local directory are never followed for a write (DESIGN rule 11):
the marker, the fingerprints and the subtask lock are written without touching a link's target."""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path

import pytest

from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.errors import StateBackendError
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.spark.tasks import _exclusive
from sparkpoint.state.backend import restore_with_fallback, take_checkpoint
from sparkpoint.state.codecs import StructCodec
from tests.support.backends import make_backend

COUNTS = StructCodec[tuple[int]]("<q")
PLANTED = ("working.json.tmp", "fingerprints.json.tmp")


backend = partial(make_backend, operator="counts", max_parallelism=32)


def plant_links(local: Path, sentinel: Path) -> int:
    planted = 0
    for directory in [local, *[p for p in local.rglob("*") if p.is_dir() and not p.is_symlink()]]:
        for name in PLANTED:
            if not (directory / name).exists():
                (directory / name).symlink_to(sentinel)
                planted += 1
    return planted


def test_marker_and_fingerprint_writes_never_follow_a_planted_link(local_storage: CheckpointStorage, tmp_path: Path):
    sentinel = tmp_path / "sentinel.txt"
    sentinel.write_bytes(b"precious")
    local = tmp_path / "local"
    coord = CheckpointCoordinator(local_storage, num_retained=2)
    with backend(local_storage, local) as b:
        b.restore(None)
        b.value_state("count", COUNTS).put_many((f"k{i}", (i,)) for i in range(500))
        take_checkpoint(coord, [b])
        assert plant_links(local, sentinel) >= 4
        for n in range(2):
            b.value_state("count", COUNTS).put_many((f"k{i}", (i + n,)) for i in range(0, 500, 7))
            take_checkpoint(coord, [b])
    plant_links(local, sentinel)
    latest = CompletedCheckpointStore(local_storage).latest()
    assert latest is not None
    with backend(local_storage, local) as again:  # a restore checks the task-local copy, records fingerprints
        restore_with_fallback([again], [latest])
        assert again.value_state("count", COUNTS).get("k7") == (8,)
    assert sentinel.read_bytes() == b"precious"
    assert all(p.is_symlink() for p in local.rglob("*.tmp")), "planted links are left as they are"


def test_the_subtask_lock_refuses_a_planted_link(tmp_path: Path):
    sentinel = tmp_path / "sentinel.txt"
    sentinel.write_bytes(b"precious")
    directory = tmp_path / "local" / "slot-0"
    directory.mkdir(parents=True)
    (directory / ".lock").symlink_to(sentinel)
    with pytest.raises(StateBackendError, match="symbolic link"), _exclusive(directory):
        pass
    assert sentinel.read_bytes() == b"precious"
    os.unlink(directory / ".lock")
    with _exclusive(directory):  # a plain lock file works as before
        assert (directory / ".lock").is_file()
