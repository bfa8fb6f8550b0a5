"""Task-local recovery without reading the SSTs (issue 10: task-local restore >= 20x primary).

An SST of a task-local copy whose inode is unchanged since its content was checked against a
CRC32 is taken as it is; RocksDB's block checksums, checked on every read, catch what a
fingerprint cannot see (a rewrite that puts the old mtime back), and the task that meets such an
error discards its local state and runs again from stable storage."""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
from pathlib import Path

import pandas as pd
import pytest

from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.metadata import CheckpointMetadata
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.pipeline.driver import StatefulPipeline
from sparkpoint.spark.generate import generate
from sparkpoint.state.backend import take_checkpoint
from sparkpoint.state.engine import restore as restore_module
from sparkpoint.state.engine.restore import FINGERPRINTS
from sparkpoint.state.engine.rocksdb import RocksDBOptions, count_keys, flush_all, is_corruption, open_db
from sparkpoint.state.sample import SAMPLE_OPERATORS
from tests.support import oracle
from tests.support.waiting import wait_for
from tests.test_backend import COUNTS, backend, read_all, write_random
from tests.test_pipeline import config, export


def rewrite_in_place(path: Path, every: int | None = None) -> None:
    """Flip one bit every `every` bytes of `path` (None: one bit, a third of the way in, in a data
    block), same inode, and put its old mtime back."""
    st = path.stat()
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        for i in range(every // 2, len(data), every) if every else [len(data) // 3]:
            data[i] ^= 0x01
        f.seek(0)
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_ino == st.st_ino and path.stat().st_mtime_ns == st.st_mtime_ns


def two_checkpoints(storage: CheckpointStorage, local: Path) -> tuple[dict[str, int], CheckpointMetadata]:
    rng = random.Random(21)
    coord = CheckpointCoordinator(storage, num_retained=2)
    model: dict[str, int] = {}
    with backend(storage, local) as b:
        b.restore(None)
        write_random(b, model, rng, 3000, 20_000)
        take_checkpoint(coord, [b])
        write_random(b, model, rng, 3000, 20_000)
        take_checkpoint(coord, [b])
        b.value_state("count", COUNTS).put("dirty", (1,))  # db/ is no longer checkpoint 2
    return model, CompletedCheckpointStore(storage).load(2)


def rewritten_behind_rocksdbs_back(
    storage: CheckpointStorage, local: Path, every: int | None
) -> tuple[dict[str, int], CheckpointMetadata]:
    """Two checkpoints, then every SST of the task-local copy of the second rewritten in place."""
    model, meta = two_checkpoints(storage, local)
    for sst in local_copy(storage, local).glob("*.sst"):
        rewrite_in_place(sst, every)  # also db/'s files: the same inodes
    return model, meta


def wait_trash_deleted(subtask_dir: Path) -> None:
    """Up to 30 s for the background deletion to take every `trash-*` directory."""
    wait_for(lambda: not [p for p in subtask_dir.iterdir() if p.name.startswith("trash-")], 30, 0.05,
             "the background deletion of the trash-* directories",
             last=lambda: sorted(p.name for p in subtask_dir.iterdir()))


def local_copy(storage: CheckpointStorage, local: Path) -> Path:
    return local / storage.job_id / "counts" / "0" / "chk-2"


def test_an_unchanged_task_local_copy_is_restored_without_reading_its_ssts(
    local_storage: CheckpointStorage, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    model, meta = two_checkpoints(local_storage, tmp_path / "local")
    assert (local_copy(local_storage, tmp_path / "local") / FINGERPRINTS).is_file()
    read: list[str] = []
    real = restore_module.crc32_of_file
    monkeypatch.setattr(restore_module, "crc32_of_file", lambda p: read.append(p) or real(p))
    with backend(local_storage, tmp_path / "local") as b:
        assert b.restore(meta).source == "local"
        assert read_all(b) == model
    assert read and not [p for p in read if p.endswith(".sst")], "only MANIFEST, CURRENT, OPTIONS are checksummed"


def test_a_task_local_sst_changed_in_place_is_checksummed_and_replaced(
    local_storage: CheckpointStorage, tmp_path: Path
):
    model, meta = two_checkpoints(local_storage, tmp_path / "local")
    victim = sorted(local_copy(local_storage, tmp_path / "local").glob("*.sst"))[0]
    with open(victim, "r+b") as f:  # same inode, new mtime
        f.seek(victim.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    with backend(local_storage, tmp_path / "local") as b:
        result = b.restore(meta)
        assert result.source == "primary" and "CRC32" in result.problems[0] and victim.name in result.problems[0]
        assert read_all(b) == model


def test_a_rewrite_that_keeps_the_mtime_is_caught_by_rocksdb_and_healed_from_storage(
    local_storage: CheckpointStorage, tmp_path: Path
):
    model, meta = rewritten_behind_rocksdbs_back(local_storage, tmp_path / "local", every=None)
    with backend(local_storage, tmp_path / "local") as b:
        assert b.restore(meta).source == "local", "the fingerprints match: RocksDB opens the files"
        with pytest.raises(Exception) as err:
            read_all(b)  # a scan: without asking the iterator's status it would just end early
        assert is_corruption(err.value), err.value
        b.discard_local_state()
        assert not [p for p in b.dir.iterdir() if p.name.startswith("chk-") or p.name == "db"]
        assert b.restore(meta).source == "primary", "never the local files again"
        assert read_all(b) == model


def test_a_task_local_copy_rocksdb_refuses_to_open_is_replaced_from_storage(
    local_storage: CheckpointStorage, tmp_path: Path
):
    # Index and footer blocks too: RocksDB's open refuses the files.
    model, meta = rewritten_behind_rocksdbs_back(local_storage, tmp_path / "local", every=512)
    with backend(local_storage, tmp_path / "local") as b:
        result = b.restore(meta)
        assert result.source == "primary" and "RocksDB refuses" in result.problems[0]
        assert read_all(b) == model


def test_is_corruption_reads_rocksdb_status_text_through_the_chain():
    inner = Exception("Corruption: block checksum mismatch: stored = 1, computed = 2")
    try:
        try:
            raise inner
        except Exception as e:
            raise RuntimeError("while processing") from e
    except RuntimeError as outer:
        assert is_corruption(outer)
    assert not is_corruption(Exception("IO error: No space left on device"))
    assert not is_corruption(ValueError("Corruption: a user's own message"))


def test_blocks_cached_by_an_earlier_open_answer_with_the_checked_content_and_a_cold_read_catches_the_damage(
    local_storage: CheckpointStorage, tmp_path: Path
):
    # The block cache is the process's and outlives a database: a Spark worker that ran the last
    # batch still holds its blocks, and a restore keeps them (re-reading them cost a third of a
    # batch's reads). What the cache answers passed its checksum when it was read: the damage
    # done since never reaches an answer, and the first read that misses the cache catches it.
    model, meta = two_checkpoints(local_storage, tmp_path / "local")
    with backend(local_storage, tmp_path / "local") as b:
        assert b.restore(meta).source == "local"
        assert read_all(b) == model  # every block of the state is now in the cache
    for sst in local_copy(local_storage, tmp_path / "local").glob("*.sst"):
        rewrite_in_place(sst)
    with backend(local_storage, tmp_path / "local") as b:
        assert b.restore(meta).source == "working", "db/ is checkpoint 2, and RocksDB opens its files"
        assert read_all(b) == model, "the cached blocks are checkpoint 2's content, not the damaged bytes"
    cold = RocksDBOptions(block_cache_mb=RocksDBOptions().block_cache_mb - 1)  # another worker: a cache of its own
    with backend(local_storage, tmp_path / "local", options=cold) as b:
        assert b.restore(meta).source == "working"
        with pytest.raises(Exception) as err:
            read_all(b)
        assert is_corruption(err.value), err.value
        b.discard_local_state()
        assert b.restore(meta).source == "primary"
        assert read_all(b) == model


@pytest.mark.spark
def test_pipeline_heals_a_task_local_copy_rewritten_behind_rocksdbs_back(spark, tmp_path: Path):
    generate(str(tmp_path / "in"), batches=2, events_per_batch=2000, users=300, items=40, seed=12)
    cfg = config(tmp_path, parallelism=2)
    assert [r.checkpoint_id for r in StatefulPipeline(spark, cfg, SAMPLE_OPERATORS).run()] == [1, 2]
    subtask_dir = tmp_path / "local" / "job" / "user_totals" / "0"
    ssts = sorted(subtask_dir.glob("chk-2/*.sst"))
    assert ssts and (subtask_dir / "chk-2" / FINGERPRINTS).is_file()
    # db/ holds the same inodes, or, where a compaction has rewritten them since (the changelog
    # mode keeps the working database compact), files of its own: damage each inode once
    inodes = {sst.stat().st_ino: sst for sst in [*ssts, *sorted(subtask_dir.glob("db/*.sst"))]}
    for sst in inodes.values():
        rewrite_in_place(sst)

    generate(str(tmp_path / "in"), batches=1, events_per_batch=2000, users=300, items=40, seed=12, first=2)
    # Workers that hold none of the blocks (a cache of another size is another cache): a worker that
    # still held them would answer right from them (the test above), and never read the damage.
    cold = dataclasses.replace(cfg, rocksdb=RocksDBOptions(block_cache_mb=RocksDBOptions().block_cache_mb - 2))
    reports = StatefulPipeline(spark, cold, SAMPLE_OPERATORS).run()
    assert [r.checkpoint_id for r in reports] == [3]
    assert sorted(reports[0].restored) == ["primary", "working", "working", "working"], reports[0].restored
    events = pd.concat(oracle.read_batches(str(tmp_path / "in")), ignore_index=True)
    oracle.assert_totals_equal(export(tmp_path, "user_totals"), oracle.user_totals(events))
    oracle.assert_reach_equal(export(tmp_path, "item_reach"), oracle.item_reach(events))
    output = pd.read_parquet(tmp_path / "out")
    for cid, expected in zip([1, 2, 3], oracle.sink_rows(oracle.read_batches(str(tmp_path / "in")))):
        oracle.assert_totals_equal(output[output["checkpoint_id"] == cid], expected)


def test_counting_the_keys_of_a_damaged_database_raises_instead_of_coming_out_short(tmp_path: Path):
    db = open_db(str(tmp_path / "db"), ["s"], RocksDBOptions(), create=True)
    cf = db.get_column_family("s")
    for i in range(50_000):
        cf[b"k%08d" % i] = b"v%040d" % i
    assert count_keys(cf) == 50_000
    flush_all(db, ["s"])
    del cf
    db.close()
    for sst in (tmp_path / "db").glob("*.sst"):
        rewrite_in_place(sst)
    db = open_db(str(tmp_path / "db"), [], RocksDBOptions(), create=False, read_only=True)
    try:
        with pytest.raises(Exception) as err:
            count_keys(db.get_column_family("s"))
        assert is_corruption(err.value), err.value
    finally:
        db.close()


def test_the_old_working_database_is_deleted_off_the_restore_path(local_storage: CheckpointStorage, tmp_path: Path):
    model, meta = two_checkpoints(local_storage, tmp_path / "local")
    subtask_dir = local_copy(local_storage, tmp_path / "local").parent
    (subtask_dir / "db" / "ran-ahead.sst").write_bytes(b"x" * 1_000_000)  # db/ is no checkpoint: it goes
    (subtask_dir / "trash-0dead0de").mkdir()  # left by a process that died while deleting
    (subtask_dir / "trash-0dead0de" / "000001.sst").write_bytes(b"y")
    with backend(local_storage, tmp_path / "local") as b:
        assert b.restore(meta).source == "local"
        assert not (b.db_path / "ran-ahead.sst").exists() and read_all(b) == model
    wait_trash_deleted(subtask_dir)


def test_a_working_database_that_is_a_symlink_goes_without_what_it_points_to(
    local_storage: CheckpointStorage, tmp_path: Path
):
    model, meta = two_checkpoints(local_storage, tmp_path / "local")
    subtask_dir = local_copy(local_storage, tmp_path / "local").parent
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("keep me")
    shutil.rmtree(subtask_dir / "db")
    (subtask_dir / "db").symlink_to(outside, target_is_directory=True)
    with backend(local_storage, tmp_path / "local") as b:
        assert b.restore(meta).source == "local" and read_all(b) == model
    wait_trash_deleted(subtask_dir)
    assert (outside / "precious").read_text() == "keep me"


def test_a_task_local_sst_that_is_a_symlink_is_not_taken_even_with_the_right_content(
    local_storage: CheckpointStorage, tmp_path: Path
):
    model, meta = two_checkpoints(local_storage, tmp_path / "local")
    victim = sorted(local_copy(local_storage, tmp_path / "local").glob("*.sst"))[0]
    outside = tmp_path / "outside.sst"
    shutil.copyfile(victim, outside)  # the same bytes, outside the local directory
    victim.unlink()
    victim.symlink_to(outside)
    with backend(local_storage, tmp_path / "local") as b:
        result = b.restore(meta)
        assert result.source == "primary" and "not a regular file" in result.problems[0]
        assert read_all(b) == model
