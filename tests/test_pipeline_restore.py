"""What a pipeline restores from: its output survives two fallbacks in a row and a fallback late
in a long run, RocksDB refusing a restored directory in a Spark task falls back too, a checkpoint
of other operators than the job's is refused unless allowed, a checkpoints directory with glob
characters resumes where it stopped, and a flipped letter in the latest `_metadata` stops the
resume instead of starting empty."""

from __future__ import annotations

import json
import shutil
import zlib
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest

from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.errors import OperatorStateMismatch
from sparkpoint.checkpoint.metadata import content_checksum
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.pipeline.driver import StatefulPipeline
from sparkpoint.state.backend import take_checkpoint
from sparkpoint.state.engine.changelog import is_changelog
from sparkpoint.state.sample import SAMPLE_OPERATORS, item_reach, user_totals
from tests.support import oracle
from tests.support.backends import make_backends
from tests.test_pipeline import config as base_config
from tests.test_pipeline import export, make_input

CKPT = "ckpt"


def config(tmp_path: Path, num_retained: int = 2, local_dir: str | None = None, **kw):
    c = replace(base_config(tmp_path, **kw), num_retained=num_retained)
    return replace(c, local_dir=local_dir) if local_dir else c


def storage_of(tmp_path: Path) -> CheckpointStorage:
    return CheckpointStorage(f"file://{tmp_path}/{CKPT}", "job")


def new_state_file(storage: CheckpointStorage, checkpoint_id: int) -> str:
    """A file of state that checkpoint N uploaded: an SST, or with the changelog on its changelog."""
    meta = CompletedCheckpointStore(storage).load(checkpoint_id)
    return next(
        f.path for f in meta.files()
        if f.created_by == checkpoint_id and (f.local_name.endswith(".sst") or is_changelog(f.local_name))
    )


def flip(storage: CheckpointStorage, path: str) -> None:
    data = bytearray(storage.read_bytes(path))
    data[len(data) // 2] ^= 0xFF
    storage.fs.pipe_file(storage.abspath(path), bytes(data))


def assert_exactly_once(tmp_path: Path, input_dir: str) -> None:
    events = pd.concat(oracle.read_batches(input_dir), ignore_index=True)
    oracle.assert_totals_equal(export(tmp_path, "user_totals"), oracle.user_totals(events))
    output = pd.read_parquet(tmp_path / "out")
    expected = oracle.sink_rows(oracle.read_batches(input_dir))
    assert len(output) == sum(len(e) for e in expected), "every batch's output exactly once"


@pytest.mark.spark
def test_output_survives_two_fallbacks_in_a_row(spark, tmp_path: Path):
    """N fails to restore (transiently), the run falls back to O and replays; later N would read
    again and a newer checkpoint is corrupt: the restart must not fall back to N, whose output
    was rolled back."""
    input_dir = make_input(tmp_path, batches=5)
    StatefulPipeline(spark, config(tmp_path, num_retained=3, max_batches=3), SAMPLE_OPERATORS).run()
    storage = storage_of(tmp_path)
    hidden = new_state_file(storage, 3)
    job_dir = tmp_path / CKPT / "job"
    (job_dir / hidden).rename(tmp_path / "hidden-file")  # a transient read error of checkpoint 3
    reports = StatefulPipeline(spark, config(tmp_path, num_retained=3, max_batches=1,
                                             local_dir=str(tmp_path / "machine-2")), SAMPLE_OPERATORS).run()
    assert [r.files for r in reports] == [("batch-000002.parquet",)]
    (tmp_path / "hidden-file").rename(job_dir / hidden)  # checkpoint 3 would read fine again
    assert 3 not in CompletedCheckpointStore(storage).checkpoint_ids(), "a rolled-back checkpoint is discarded"
    latest = CompletedCheckpointStore(storage).checkpoint_ids()[0]
    flip(storage, new_state_file(storage, latest))
    StatefulPipeline(spark, config(tmp_path, num_retained=3, local_dir=str(tmp_path / "machine-3")),
                     SAMPLE_OPERATORS).run()
    assert_exactly_once(tmp_path, input_dir)


@pytest.mark.spark
def test_fallback_late_in_a_run_finds_the_checkpoints_retained_since_it_began(spark, tmp_path: Path):
    input_dir = make_input(tmp_path, batches=5)
    StatefulPipeline(spark, config(tmp_path, num_retained=3, max_batches=2), SAMPLE_OPERATORS).run()
    storage = storage_of(tmp_path)
    local = tmp_path / "local"
    corrupted: list[int] = []

    def corrupt_once(report) -> None:  # the first checkpoint of this run goes bad on storage and locally
        if not corrupted:
            corrupted.append(report.checkpoint_id)
            flip(storage, new_state_file(storage, report.checkpoint_id))
            shutil.rmtree(local)

    reports = StatefulPipeline(spark, config(tmp_path, num_retained=3), SAMPLE_OPERATORS).run(
        on_checkpoint=corrupt_once)
    assert corrupted == [3]
    assert [r.files[0] for r in reports] == ["batch-000002.parquet", "batch-000002.parquet",
                                            "batch-000003.parquet", "batch-000004.parquet"]
    assert_exactly_once(tmp_path, input_dir)


@pytest.mark.spark
def test_rocksdb_refusing_a_restored_directory_in_a_task_falls_back(spark, tmp_path: Path):
    input_dir = make_input(tmp_path, batches=3)
    # RocksDB's own files only: a changelog checkpoint shares its MANIFEST with the one before it
    StatefulPipeline(spark, config(tmp_path, max_batches=2, changelog=False), SAMPLE_OPERATORS).run()
    storage = storage_of(tmp_path)
    meta_path = tmp_path / CKPT / "job" / "chk-2" / "_metadata"
    raw = json.loads(meta_path.read_bytes())
    garbage = b"not a MANIFEST at all" * 8
    for op in raw["operators"].values():
        for sub in op["subtasks"]:
            for f in sub["private"]:
                if f["local_name"].startswith("MANIFEST"):
                    storage.fs.pipe_file(storage.abspath(f["path"]), garbage)
                    f.update(size=len(garbage), crc32=zlib.crc32(garbage))
    raw["checksum"] = content_checksum(raw)
    meta_path.write_bytes(json.dumps(raw).encode())  # verifies, and RocksDB will not open it
    reports = StatefulPipeline(spark, config(tmp_path, local_dir=str(tmp_path / "new"), changelog=False),
                               SAMPLE_OPERATORS).run()
    assert [r.files[0] for r in reports] == ["batch-000001.parquet", "batch-000002.parquet"]
    assert_exactly_once(tmp_path, input_dir)


def _checkpoint_of(tmp_path: Path, operators: list[str]) -> None:
    storage = storage_of(tmp_path)
    coord = CheckpointCoordinator(storage)
    backends = [b for name in operators for b in make_backends(storage, tmp_path / "core", 3, operator=name)]
    for b in backends:
        b.restore(None)
    take_checkpoint(coord, backends, source_offsets={"source": {"version": 1, "consumed": []}, "sink": []})
    for b in backends:
        b.close()


def test_a_checkpoint_with_other_operators_than_the_job_is_refused_unless_allowed(tmp_path: Path):
    make_input(tmp_path, batches=1)
    _checkpoint_of(tmp_path, ["user_totals", "item_reach"])
    only_totals = StatefulPipeline(None, config(tmp_path), operators=(user_totals,))
    with pytest.raises(OperatorStateMismatch, match="item_reach.*--allow-non-restored-state"):
        only_totals.begin()
    StatefulPipeline(None, config(tmp_path, allow_non_restored_state=True), operators=(user_totals,)).begin()
    with pytest.raises(OperatorStateMismatch, match="--max-parallelism 128"):
        StatefulPipeline(None, config(tmp_path, max_parallelism=64), SAMPLE_OPERATORS).begin()

    shutil.rmtree(tmp_path / CKPT)
    _checkpoint_of(tmp_path, ["user_totals"])
    both = StatefulPipeline(None, config(tmp_path), operators=(user_totals, item_reach))
    with pytest.raises(OperatorStateMismatch, match="no state for item_reach.*--allow-new-operators"):
        both.begin()
    StatefulPipeline(None, config(tmp_path, allow_new_operators=True), operators=(user_totals, item_reach)).begin()


@pytest.mark.spark
def test_a_checkpoints_directory_with_glob_characters_resumes_where_it_stopped(spark, tmp_path: Path):
    input_dir = make_input(tmp_path, batches=3)
    bracketed = replace(config(tmp_path), checkpoints_url=f"file://{tmp_path}/ck[prod]")
    StatefulPipeline(spark, replace(bracketed, max_batches=2), SAMPLE_OPERATORS).run()
    reports = StatefulPipeline(spark, bracketed, SAMPLE_OPERATORS).run()
    assert [r.files for r in reports] == [("batch-000002.parquet",)], "resumed, not restarted from empty state"
    assert CompletedCheckpointStore(CheckpointStorage(f"file://{tmp_path}/ck[prod]", "job")).checkpoint_ids() == [3, 2]
    output = pd.read_parquet(tmp_path / "out")
    assert len(output) == sum(len(e) for e in oracle.sink_rows(oracle.read_batches(input_dir)))


def test_a_flipped_letter_in_the_latest_metadata_stops_the_resume_instead_of_starting_empty(tmp_path: Path):
    from sparkpoint.pipeline.runtime import PipelineError

    make_input(tmp_path, batches=1)
    _checkpoint_of(tmp_path, ["user_totals", "item_reach"])
    path = tmp_path / CKPT / "job" / "chk-1" / "_metadata"
    path.write_text(path.read_text().replace('"user_totals"', '"user_totalr"', 1))
    with pytest.raises(PipelineError, match=r"chk-1/_metadata cannot be read.*checksum"):
        StatefulPipeline(None, config(tmp_path), SAMPLE_OPERATORS).begin()
