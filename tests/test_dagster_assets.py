"""The SSTable and checkpoint assets on local Spark: metadata as on storage, checks, no-op runs."""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import pytest

from sparkpoint.assets import registry_matches, verifies
from sparkpoint.assets.metadata import readable_size
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from tests.support.dagster_setup import (
    CHECKPOINT_KEY,
    JOB,
    OUTPUT_KEY,
    SCOPE,
    SSTABLE_KEYS,
    make_input,
    materialize,
    storage_of,
)

pytestmark = pytest.mark.spark


@pytest.mark.parametrize(("size", "shown"), [
    (0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (12_345_678, "11.8 MiB"), (3 * 1024**3, "3.0 GiB"),
    (5 * 1024**5, "5120.0 TiB"),
])
def test_a_size_reads_in_binary_units(size: int, shown: str):
    assert readable_size(size) == shown


def values(event: dg.AssetMaterialization) -> dict[str, object]:
    return {k: v.value for k, v in event.metadata.items()}


def test_materializing_twice_makes_two_checkpoints_whose_metadata_matches_storage(spark, tmp_path: Path):
    make_input(tmp_path, batches=3)
    instance = dg.DagsterInstance.ephemeral()
    for expected_id in (1, 2):
        result = materialize(tmp_path, instance)
        assert storage_of(tmp_path).completed_checkpoint_ids()[-1] == expected_id
        by_key = {e.materialization.asset_key: e.materialization for e in result.get_asset_materialization_events()}
        assert set(by_key) == {CHECKPOINT_KEY, OUTPUT_KEY, *SSTABLE_KEYS.values()}
        assert all(c.passed for c in result.get_asset_check_evaluations())
        assert len(result.get_asset_check_evaluations()) == 2

    storage = storage_of(tmp_path)
    meta = CompletedCheckpointStore(storage).load(2)
    got = values(by_key[CHECKPOINT_KEY])
    assert got["checkpoint_id"] == 2
    assert got["path"] == f"{tmp_path}/ckpt/{JOB}/chk-2/_metadata"  # a path value
    assert isinstance(by_key[CHECKPOINT_KEY].metadata["path"], dg.PathMetadataValue)
    assert got["state_size_bytes"] == meta.stats.state_size
    assert got["checkpointed_size_bytes"] == meta.stats.checkpointed_size
    # beside each byte count, the same size as a person reads it
    assert got["state_size"] == readable_size(meta.stats.state_size) and got["state_size"].endswith(" KiB")
    assert got["checkpointed_size"] == readable_size(meta.stats.checkpointed_size)
    assert got["summary"].startswith("chk-2: uploaded ") and " KiB" in got["summary"]
    assert 0 < got["incremental_ratio"] < 1, "the second checkpoint reuses files of the first"
    assert got["incremental_ratio"] == round(meta.stats.checkpointed_size / meta.stats.state_size, 4)
    assert got["files_new"] == sum(1 for f in meta.files() if f.created_by == 2)
    assert got["files_reused"] == len(meta.paths()) - got["files_new"] > 0
    assert got["files_deleted"] == 0
    assert got["retained"] == [2, 1]
    one = CompletedCheckpointStore(storage).load(1)
    assert got["registry_files"] == len(meta.paths() | one.paths()) + 2  # + both _metadata
    assert got["duration_seconds"] > 0
    # what `sparkpoint history` shows beside it: no subtask restored (they went on from their databases)
    assert got["restored_subtasks"] == 0 and 0 < got["phase_upload_seconds"] <= got["phase_snapshot_seconds"]
    assert got["dagster/row_count"] == 1500
    assert got["batch"] == ["batch-000001.parquet"]
    assert got["prune_due"] == []
    assert by_key[CHECKPOINT_KEY].tags["dagster/data_version"] == "2"
    # how the batch reached its subtasks (a small batch: read-all, each of the 2 subtasks read it whole)
    assert got["routing"] == "read-all" == meta.source_offsets["read"]["routing"]
    assert got["batch_size_bytes"] == (tmp_path / "in" / "batch-000001.parquet").stat().st_size
    assert got["input_read_bytes"] == meta.source_offsets["read"]["bytes_read"] == 2 * got["batch_size_bytes"]
    assert got["read_amplification"] == 2.0 and got["input_read"] == readable_size(got["input_read_bytes"])
    # the request ledger: what `_metadata` counted up to the commit, and what the commit made after it
    assert meta.stats.ledger is not None and got["requests_total"] == sum(got["requests"].values())
    assert all(got["requests"][op] >= n for op, n in meta.stats.ledger.requests.items())
    assert got["requests"]["PUT"] > got["files_new"]  # each new file, and `_metadata`
    assert got["input_requests"]["GET"] >= 2 and got["input_bytes"] > 0 and got["estimated_cost_usd"] > 0

    sst = values(by_key[SSTABLE_KEYS["user_totals"]])
    handles = meta.operators["user_totals"].subtasks
    assert sst["checkpoint_id"] == 2 and sst["subtasks"] == 2
    assert sst["sst_files_new"] == sum(1 for h in handles for f in h.shared if f.created_by == 2)
    assert sst["sst_files_reused"] == sum(1 for h in handles for f in h.shared if f.created_by != 2) > 0
    assert sst["uploaded_bytes"] == sum(f.size for h in handles for f in h.new_files())
    assert sst["uploaded"] == readable_size(sst["uploaded_bytes"])
    assert sst["dagster/row_count"] > 0
    assert sst["restore"] == {"0": "working", "1": "working"}
    assert not list((tmp_path / "ckpt" / JOB).glob("_pending/*")), "completion forgets the attempt"

    out = values(by_key[OUTPUT_KEY])
    assert out["checkpoint_id"] == 2 and out["files"] == 2  # one part file per subtask of user_totals
    import pandas as pd

    written = pd.read_parquet(tmp_path / "out")
    assert out["dagster/row_count"] == int((written["checkpoint_id"] == 2).sum()) > 0
    assert [c.name for c in out["dagster/column_schema"].columns] == list(written.columns)


def test_a_run_without_unconsumed_batch_creates_no_checkpoint(spark, tmp_path: Path):
    make_input(tmp_path, batches=1)
    instance = dg.DagsterInstance.ephemeral()
    materialize(tmp_path, instance)
    before = sorted(p.relative_to(tmp_path) for p in (tmp_path / "ckpt").rglob("*"))
    result = materialize(tmp_path, instance)
    assert result.success
    assert result.get_asset_materialization_events() == []
    assert storage_of(tmp_path).completed_checkpoint_ids() == [1]
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "ckpt").rglob("*")) == before
    skipped = [e.step_key for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_SKIPPED]
    assert "sparkpoint_complete" in skipped


def test_verify_check_fails_on_a_corrupted_file_and_registry_check_passes(spark, tmp_path: Path):
    make_input(tmp_path, batches=1)
    materialize(tmp_path, dg.DagsterInstance.ephemeral())
    assert verifies(SCOPE, storage_of(tmp_path)).passed
    meta = CompletedCheckpointStore(storage_of(tmp_path)).load(1)
    victim = next(f for f in meta.files() if f.path.endswith(".sst"))
    path = tmp_path / "ckpt" / JOB / victim.path
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    result = verifies(SCOPE, storage_of(tmp_path))
    assert not result.passed
    assert victim.path in json.dumps(result.metadata["problems"].value)
    assert registry_matches(SCOPE, storage_of(tmp_path)).passed


def test_the_savepoint_job_writes_a_self_contained_savepoint_the_pipeline_resumes_from(spark, tmp_path: Path):
    from tests.support.dagster_setup import JOBS, resources

    make_input(tmp_path, batches=2)
    instance = dg.DagsterInstance.ephemeral()
    materialize(tmp_path, instance)
    result = JOBS.savepoint.execute_in_process(instance=instance, resources=resources(tmp_path))
    assert result.success
    (event,) = [e for e in result.all_events if e.event_type_value == "STEP_OUTPUT"]
    got = {k: v.value for k, v in event.event_specific_data.metadata.items()}  # type: ignore[union-attr]
    sp = CompletedCheckpointStore(storage_of(tmp_path)).load(got["savepoint_id"])
    assert sp.kind == "savepoint" and got["from_checkpoint"] == 1 and got["savepoint_id"] == 2
    assert sp.paths() and all(p.startswith("chk-2/") for p in sp.paths()), "nothing referenced in shared/"
    assert got["path"] == f"{tmp_path}/ckpt/{JOB}/chk-2/_metadata"
    assert got["state_size_bytes"] == sp.stats.state_size and got["state_size"] == readable_size(sp.stats.state_size)
    materialize(tmp_path, instance)  # the next batch resumes from the savepoint
    latest = CompletedCheckpointStore(storage_of(tmp_path)).load(3)
    assert latest.source_offsets != sp.source_offsets
    assert 2 in CompletedCheckpointStore(storage_of(tmp_path)).checkpoint_ids(), "retention keeps the savepoint"
