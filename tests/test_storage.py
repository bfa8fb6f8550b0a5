"""One storage suite for every backend: file://, memory:// and S3 (a local moto server)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sparkpoint.checkpoint.errors import CheckpointAlreadyExists, PathEscapesJobDirectory, StorageError
from sparkpoint.checkpoint.storage import CheckpointStorage, crc32_of_file

HOSTILE = ["../other-job/shared/x.sst", "/etc/passwd", "s3://elsewhere/x", "shared/../../x", "", "a//b",
           "./chk-1/_metadata", "chk-1/..", "C:/x", "shared\\x"]


def test_upload_and_download_keep_size_and_crc(any_storage: CheckpointStorage, tmp_path: Path):
    files = []
    for i in range(5):
        p = tmp_path / f"{i:06d}.sst"
        p.write_bytes(bytes([i]) * (1000 + i))
        files.append((str(p), f"shared/op/0/{i}.sst"))
    handles = any_storage.upload(files, checkpoint_id=3)
    assert [h.size for h in handles] == [1000 + i for i in range(5)]
    assert all(h.created_by == 3 for h in handles)
    any_storage.get_files([(h.path, str(tmp_path / "back" / h.local_name)) for h in handles])
    for h in handles:
        back = tmp_path / "back" / h.local_name
        assert back.stat().st_size == h.size and crc32_of_file(str(back)) == h.crc32


def test_exclusive_commit_has_one_winner(any_storage: CheckpointStorage):
    any_storage.commit_exclusive("chk-1/_metadata", b"first")
    with pytest.raises(CheckpointAlreadyExists):
        any_storage.commit_exclusive("chk-1/_metadata", b"second")
    assert any_storage.read_bytes("chk-1/_metadata") == b"first"


def test_listing_completed_checkpoints_and_dirs(any_storage: CheckpointStorage, tmp_path: Path):
    for cid in (1, 2, 10):
        any_storage.commit_exclusive(f"chk-{cid}/_metadata", b"{}")
    p = tmp_path / "x"
    p.write_bytes(b"x")
    any_storage.put_files([(str(p), "chk-11/op/0/MANIFEST")])
    assert any_storage.completed_checkpoint_ids() == [1, 2, 10]
    assert any_storage.checkpoint_dirs() == [1, 2, 10, 11]
    walked = {f.path for f in any_storage.walk("chk-11")}
    assert walked == {"chk-11/op/0/MANIFEST"}


def test_delete_is_parallel_and_tolerates_missing(any_storage: CheckpointStorage, tmp_path: Path):
    p = tmp_path / "x"
    p.write_bytes(b"x")
    any_storage.put_files([(str(p), f"shared/op/0/{i}.sst") for i in range(20)])
    any_storage.delete([f"shared/op/0/{i}.sst" for i in range(25)])
    assert any_storage.walk("shared") == []


@pytest.mark.parametrize("path", HOSTILE)
def test_paths_outside_the_job_directory_are_refused(storage: CheckpointStorage, path: str):
    with pytest.raises(PathEscapesJobDirectory):
        storage.delete([path])
    with pytest.raises(PathEscapesJobDirectory):
        storage.commit_exclusive(path, b"x")


def test_hostile_path_deletes_nothing_outside(tmp_path: Path):
    victim = tmp_path / "checkpoints" / "other-job" / "keep.sst"
    victim.parent.mkdir(parents=True)
    victim.write_bytes(b"precious")
    storage = CheckpointStorage(f"file://{tmp_path}/checkpoints", "job")
    with pytest.raises(PathEscapesJobDirectory):
        storage.delete(["../other-job/keep.sst"])
    assert victim.read_bytes() == b"precious"


def test_bad_url_and_job_id_are_clear_errors():
    with pytest.raises(StorageError, match="fsspec URL"):
        CheckpointStorage("nosuchproto://x", "job")
    with pytest.raises(StorageError, match="job id"):
        CheckpointStorage("memory://x", "../evil")


def test_local_commit_leaves_no_temporary_file(local_storage: CheckpointStorage):
    local_storage.commit_exclusive("chk-1/_metadata", b"x")
    assert [f.path for f in local_storage.walk("chk-1")] == ["chk-1/_metadata"]
