"""The snapshot strategy on its own: a `Snapshotter` over a local state of plain files, no RocksDB.

The backend gives its snapshotter the local state explicitly (`SnapshotSource`), so the rules of
incremental uploads (1: fresh names; 2: reuse only what was confirmed) are checked here against
a directory standing in for the working database and real checkpoint storage.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from sparkpoint.checkpoint.errors import CheckpointDeclined
from sparkpoint.checkpoint.metadata import KeyGroupRange, SubtaskStateHandle
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.state.engine.rocksdb import RocksDBOptions
from sparkpoint.state.engine.snapshotting import Snapshotter


class FakeLocalState:
    """A subtask's local state as the snapshotter sees it: `db/` holds the working database's
    files, a native checkpoint hard-links them, the marker is remembered."""

    operator = "totals"
    subtask = 0
    key_group_range = KeyGroupRange(0, 127)
    max_parallelism = 128
    options = RocksDBOptions()
    log = None

    def __init__(self, directory: Path):
        self.dir = directory
        (directory / "db").mkdir(parents=True)
        self.marker: tuple[int, SubtaskStateHandle] | None = None
        self._switched = False

    def write(self, name: str, data: bytes) -> None:
        (self.dir / "db" / name).write_bytes(data)

    def remove(self, name: str) -> None:
        (self.dir / "db" / name).unlink()

    def open_db(self) -> None:
        raise AssertionError("a snapshot of files only never opens the database")

    def flush(self) -> list[str]:
        return []

    def native_checkpoint(self, target: Path) -> None:
        target.mkdir(parents=True)
        for f in (self.dir / "db").iterdir():
            os.link(f, target / f.name)

    def live_bytes(self) -> int:
        return sum(f.stat().st_size for f in (self.dir / "db").iterdir() if f.suffix == ".sst")

    def copy_dir(self, checkpoint_id: int | None) -> Path:
        return self.dir / f"chk-{checkpoint_id}"

    def write_marker(self, checkpoint_id: int, handle: SubtaskStateHandle, job_url: str) -> None:
        self.marker = (checkpoint_id, handle)

    def drop_local_checkpoints(self, *, keep: set[int]) -> None:
        for entry in self.dir.glob("chk-*"):
            if int(entry.name[4:]) not in keep:
                shutil.rmtree(entry)

    @property
    def switched(self) -> bool:
        return self._switched

    def mark_switched(self, checkpoint_id: int) -> None:
        self._switched = True

    def unmark_switched(self) -> None:
        self._switched = False


@pytest.fixture
def local(tmp_path: Path) -> FakeLocalState:
    state = FakeLocalState(tmp_path / "local")
    state.write("000007.sst", b"a" * 100)
    state.write("000008.sst", b"b" * 200)
    state.write("MANIFEST-000005", b"manifest")
    state.write("CURRENT", b"MANIFEST-000005\n")
    return state


def shared_by_name(handle: SubtaskStateHandle) -> dict[str, str]:
    return {f.local_name: f.path for f in handle.shared}


def test_a_snapshot_after_a_confirmed_one_uploads_only_the_files_the_base_lacks(local: FakeLocalState,
                                                                                 local_storage: CheckpointStorage):
    snapshotter = Snapshotter(local, local_storage)
    first = snapshotter.snapshot(1)
    assert sorted(shared_by_name(first)) == ["000007.sst", "000008.sst"]
    assert sorted(f.local_name.rsplit("/", 1)[-1] for f in first.private) == ["CURRENT", "MANIFEST-000005"]
    snapshotter.confirm(1)
    local.remove("000007.sst")  # compacted away
    local.write("000009.sst", b"c" * 300)
    second = snapshotter.snapshot(2)
    assert shared_by_name(second)["000008.sst"] == shared_by_name(first)["000008.sst"], "reused, not uploaded"
    assert shared_by_name(second)["000009.sst"] not in shared_by_name(first).values()
    assert "000007.sst" not in shared_by_name(second)
    assert local_storage.exists(shared_by_name(second)["000009.sst"])
    assert local.marker is not None and local.marker[0] == 2


def test_a_pending_snapshot_is_no_base_for_the_next_one(local: FakeLocalState, local_storage: CheckpointStorage):
    snapshotter = Snapshotter(local, local_storage)
    first = snapshotter.snapshot(1)  # never confirmed: another attempt may still delete its uploads
    second = snapshotter.snapshot(2)
    assert not set(shared_by_name(first).values()) & set(shared_by_name(second).values())
    assert snapshotter.base_id is None
    with pytest.raises(CheckpointDeclined):
        snapshotter.confirm(7)


def test_confirm_keeps_the_task_local_copy_of_the_confirmed_checkpoint_only(local: FakeLocalState,
                                                                          local_storage: CheckpointStorage):
    snapshotter = Snapshotter(local, local_storage)
    snapshotter.snapshot(1)
    second = snapshotter.snapshot(2)
    snapshotter.abort(1)
    assert not local.copy_dir(1).exists()
    snapshotter.confirm(2)
    assert sorted(p.name for p in local.dir.glob("chk-*")) == ["chk-2"]
    assert snapshotter.base_id == 2
    snapshotter.forget_base()
    third = snapshotter.snapshot(3)
    assert not {f.path for f in third.shared} & {f.path for f in second.shared}, "a forgotten base is uploaded again"
