"""The orphan sweep deletes only unreferenced, old-enough files, and never when in doubt."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import pytest

from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.errors import DeletionBlocked, PathEscapesJobDirectory
from sparkpoint.checkpoint.metadata import metadata_path
from sparkpoint.checkpoint.storage import CheckpointStorage, StoredFile
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.checkpoint.sweep import select_orphans, sweep_orphans
from sparkpoint.cli import main
from sparkpoint.resources import CheckpointRegistryResource, CheckpointStorageResource, ResourceConfigError
from sparkpoint.state.engine.verify import verify_checkpoint
from tests.support.backends import write_checkpoints
from tests.support.dagster_setup import init_resource
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


def test_sweep_verify_and_retention_never_follow_a_link_out_of_the_job_directory(tmp_path: Path, capsys):
    url = f"file://{tmp_path}/ck"
    storage = CheckpointStorage(url, "job")
    write_checkpoints(storage, tmp_path / "local", 2)
    outside = tmp_path / "precious"
    (outside / "counts" / "0").mkdir(parents=True)
    (outside / "counts" / "0" / "data.bin").write_bytes(b"keep me")
    (outside / "old.sst").write_bytes(b"keep me too")
    old = 1_000_000_000
    for p in outside.rglob("*"):
        os.utime(p, (old, old))
    job = tmp_path / "ck" / "job"
    os.symlink(outside, job / "chk-9")  # a chk-N that is a link
    os.symlink(outside / "old.sst", job / "shared" / "counts" / "0" / "linked.sst")  # a file link

    report = sweep_orphans(storage, grace_seconds=0, dry_run=True)
    assert sorted(f.path for f in report.symlinks) == ["chk-9", "shared/counts/0/linked.sst"]
    assert not [f for f in report.orphans if f.symlink]
    # chk-9 counts as an unreadable checkpoint: deletion stops until someone looks
    with pytest.raises(DeletionBlocked, match="chk-9"):
        sweep_orphans(storage, grace_seconds=0)
    assert main(["gc", "--checkpoints", url, "--job-id", "job", "--grace", "0"]) == 2
    assert "symbolic link" in capsys.readouterr().err
    assert (outside / "counts" / "0" / "data.bin").read_bytes() == b"keep me"
    assert (outside / "old.sst").read_bytes() == b"keep me too"

    # a link in place of a file a checkpoint lists: verify reports it, never reads through it
    os.unlink(job / "chk-9")
    meta = CompletedCheckpointStore(storage).load(2)
    victim = next(f for f in meta.files() if f.path.startswith("shared/"))
    (job / victim.path).unlink()
    os.symlink(outside / "old.sst", job / victim.path)
    problems = verify_checkpoint(storage, meta)
    assert [p.path for p in problems] == [victim.path] and "symbolic link" in problems[0].problem
    with pytest.raises(PathEscapesJobDirectory):
        storage.read_bytes(victim.path)
    # retention of the checkpoint listing it does not delete through the link either
    write_checkpoints(CheckpointStorage(url, "job"), tmp_path / "local", 1, retained=1)
    assert (outside / "old.sst").read_bytes() == b"keep me too"


@pytest.mark.parametrize("grace", [math.nan, math.inf, -1.0])
def test_an_orphan_grace_that_is_not_a_finite_number_of_seconds_is_refused(tmp_path: Path, grace: float):
    storage = CheckpointStorageResource(checkpoints_url=f"file://{tmp_path}/ckpt")
    with pytest.raises(ResourceConfigError, match="orphan_grace_seconds must be a finite number"):
        init_resource(CheckpointRegistryResource(storage=storage, orphan_grace_seconds=grace))
    with pytest.raises(ValueError, match="finite number of seconds"):
        sweep_orphans(CheckpointStorage(f"file://{tmp_path}/ckpt", "job"), grace_seconds=grace)
    with pytest.raises(SystemExit):
        main(["gc", "--checkpoints", f"file://{tmp_path}/ckpt", "--job-id", "job", "--grace", str(grace)])
