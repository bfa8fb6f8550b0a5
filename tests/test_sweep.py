"""The orphan sweep deletes only unreferenced, old-enough files, and never when in doubt."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.errors import DeletionBlocked
from sparkpoint.checkpoint.metadata import metadata_path
from sparkpoint.checkpoint.storage import CheckpointStorage, StoredFile
from sparkpoint.checkpoint.sweep import select_orphans, sweep_orphans
from tests.support.helpers import FakeSubtask
from tests.test_coordinator import run_checkpoint


def leave_orphans(storage: CheckpointStorage, tmp_path: Path) -> tuple[FakeSubtask, list[str]]:
    coord = CheckpointCoordinator(storage, num_retained=1)
    sub = FakeSubtask(storage, tmp_path / "db")
    sub.write("a")
    sub.write("b")
    run_checkpoint(coord, sub, ["a"])
    # a killed task: uploads that never reached the coordinator
    killed = sub.snapshot(2, ["b"])
    return sub, [f.path for f in killed.files()]


def test_sweep_deletes_unreferenced_files_only(storage: CheckpointStorage, tmp_path: Path):
    sub, orphans = leave_orphans(storage, tmp_path)
    dry = sweep_orphans(storage, grace_seconds=0, dry_run=True)
    assert sorted(f.path for f in dry.orphans) == sorted(orphans)
    assert all(storage.exists(p) for p in orphans), "dry run deletes nothing"
    report = sweep_orphans(storage, grace_seconds=0)
    assert report.deleted and len(report.orphans) == len(orphans)
    assert not any(storage.exists(p) for p in orphans)
    assert storage.exists(sub.confirmed["a"].path) and storage.exists(metadata_path(1))


def test_grace_period_protects_fresh_files(storage: CheckpointStorage, tmp_path: Path):
    _, orphans = leave_orphans(storage, tmp_path)
    report = sweep_orphans(storage, grace_seconds=3600)
    assert report.orphans == ()
    assert all(storage.exists(p) for p in orphans)


def test_pending_checkpoint_files_are_kept(storage: CheckpointStorage, tmp_path: Path):
    _, orphans = leave_orphans(storage, tmp_path)
    report = sweep_orphans(storage, grace_seconds=0, pending_paths=orphans)
    assert report.orphans == ()


def test_unreadable_metadata_stops_the_sweep(storage: CheckpointStorage, tmp_path: Path):
    _, orphans = leave_orphans(storage, tmp_path)
    storage.fs.rm_file(storage.abspath(metadata_path(1)))
    storage.write_bytes(metadata_path(1), b"not json")
    with pytest.raises(DeletionBlocked, match="chk-1/_metadata"):
        sweep_orphans(storage, grace_seconds=0)
    assert all(storage.exists(p) for p in orphans)


def test_select_orphans_is_pure():
    now = time.time()
    files = [
        StoredFile("shared/op/0/old.sst", 1, now - 100),
        StoredFile("shared/op/0/young.sst", 1, now - 1),
        StoredFile("shared/op/0/unknown-age.sst", 1, 0.0),
        StoredFile("chk-3/op/0/MANIFEST", 1, now - 100),
        StoredFile("notes.txt", 1, now - 100),
        StoredFile("shared/op/0/kept.sst", 1, now - 100),
    ]
    picked = select_orphans(files, {"shared/op/0/kept.sst"}, grace_seconds=10, now=now)
    assert [f.path for f in picked] == ["chk-3/op/0/MANIFEST", "shared/op/0/old.sst"]
