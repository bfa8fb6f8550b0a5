"""The pipeline with the changelog on (Flink's key `state.backend.changelog.enabled`): exact state
and exactly-once output through changelog checkpoints, materializations, a new machine, a rescale
and a corrupt changelog file."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest

from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.cli import main
from sparkpoint.pipeline.driver import StatefulPipeline
from sparkpoint.pipeline.settings import resolve_settings
from sparkpoint.state.engine import changelog as cl
from sparkpoint.state.sample import SAMPLE_OPERATORS
from tests.support import oracle
from tests.test_pipeline import config, export, make_input

pytestmark = pytest.mark.spark

# materialize by the chain's length alone (a share of 100 never calls for one): the schedule the tests expect
SETTINGS = {"state.backend.changelog.enabled": "true", "changelog-max-chain": "2", "changelog_materialize_share": "100"}


def kinds(storage: CheckpointStorage, checkpoint_id: int) -> set[str]:
    """What checkpoint N uploaded for its subtasks: 'log' (a changelog file) or 'files' (RocksDB's)."""
    meta = CompletedCheckpointStore(storage).load(checkpoint_id)
    out = set()
    for op in meta.operators.values():
        for h in op.subtasks:
            new = [f for f in h.files() if f.created_by == checkpoint_id]
            out.add("log" if new and all(cl.is_changelog(f.local_name) for f in new) else "files")
    return out


def run(spark, config, storage: CheckpointStorage) -> tuple[list, list[set[str]]]:
    seen: list[set[str]] = []
    reports = StatefulPipeline(spark, config, SAMPLE_OPERATORS).run(
        lambda r: seen.append(kinds(storage, r.checkpoint_id)))
    return reports, seen


def switched(storage: CheckpointStorage, checkpoint_id: int) -> bool:
    """Checkpoint N switched to a materialization in steps: new RocksDB files beside an older chain."""
    meta = CompletedCheckpointStore(storage).load(checkpoint_id)
    return any(
        any(f.created_by == checkpoint_id and not cl.is_changelog(f.local_name) for f in h.files())
        and any(cl.is_changelog(f.local_name) and f.created_by < checkpoint_id for f in h.files())
        for h in meta.subtask_handles()
    )


def test_changelog_pipeline_is_exact_through_materializations_a_new_machine_and_a_rescale(spark, tmp_path: Path):
    input_dir = make_input(tmp_path, batches=7)
    storage = CheckpointStorage(f"file://{tmp_path}/ckpt", "job")
    on = replace(config(tmp_path, max_batches=4),
                 **resolve_settings({**SETTINGS, "changelog_materialize_in_steps": "false"}))
    reports, seen = run(spark, on, storage)
    assert seen == [{"files"}, {"log"}, {"log"}, {"files"}]
    assert all(r.checkpointed_size < r.state_size / 2 for r in reports[1:3])

    # A new machine (no working database, no task-local copy) at a changelog checkpoint...
    reports = StatefulPipeline(spark, replace(on, max_batches=1, local_dir=str(tmp_path / "m2")),
                               SAMPLE_OPERATORS).run()
    assert set(reports[0].restored) == {"primary"} and kinds(storage, 5) == {"log"}
    # ... then a rescale from a chain of one changelog file, and the chain goes on after it.
    reports, seen = run(spark, replace(on, max_batches=None, parallelism=2), storage)
    assert set(reports[0].restored) == {"rescale"}
    assert seen == [{"files"}, {"log"}]

    events = pd.concat(oracle.read_batches(input_dir), ignore_index=True)
    oracle.assert_totals_equal(export(tmp_path, "user_totals"), oracle.user_totals(events))
    oracle.assert_reach_equal(export(tmp_path, "item_reach"), oracle.item_reach(events))
    output = pd.read_parquet(tmp_path / "out")
    expected = oracle.sink_rows(oracle.read_batches(input_dir))
    assert sorted(output["checkpoint_id"].unique()) == list(range(1, 8))
    for cid, rows in zip(range(1, 8), expected):
        oracle.assert_totals_equal(output[output["checkpoint_id"] == cid], rows)
    assert main(["verify", "--checkpoints", f"file://{tmp_path}/ckpt", "--job-id", "job"]) == 0
    assert main(["gc", "--checkpoints", f"file://{tmp_path}/ckpt", "--job-id", "job", "--grace", "0"]) == 0


def test_a_corrupt_changelog_file_falls_back_and_replays_exactly_once(spark, tmp_path: Path):
    input_dir = make_input(tmp_path, batches=4)
    storage = CheckpointStorage(f"file://{tmp_path}/ckpt", "job")
    on = replace(config(tmp_path, max_batches=3), **resolve_settings(SETTINGS))
    StatefulPipeline(spark, on, SAMPLE_OPERATORS).run()
    victim = next(f for f in CompletedCheckpointStore(storage).load(3).files()
                  if f.created_by == 3 and cl.is_changelog(f.local_name))
    data = bytearray(storage.read_bytes(victim.path))
    data[len(data) // 2] ^= 0xFF
    storage.fs.pipe_file(storage.abspath(victim.path), bytes(data))
    reports = StatefulPipeline(spark, replace(on, max_batches=None, local_dir=str(tmp_path / "new-machine")),
                               SAMPLE_OPERATORS).run()
    assert [r.files for r in reports] == [("batch-000002.parquet",), ("batch-000003.parquet",)]
    events = pd.concat(oracle.read_batches(input_dir), ignore_index=True)
    oracle.assert_totals_equal(export(tmp_path, "user_totals"), oracle.user_totals(events))
    output = pd.read_parquet(tmp_path / "out")
    assert len(output) == sum(len(e) for e in oracle.sink_rows(oracle.read_batches(input_dir)))



def test_a_materialization_in_steps_runs_in_the_spark_tasks(spark, tmp_path: Path):
    """The default: the chain calls for a materialization and a later checkpoint switches to it
    (slices written and ingested in the tasks); exact through a new machine and a rescale."""
    input_dir = make_input(tmp_path, batches=9)
    storage = CheckpointStorage(f"file://{tmp_path}/ckpt", "job")
    by_files = {**SETTINGS, "changelog-max-chain": "3", "changelog_materialize_share": "100"}
    on = replace(config(tmp_path, max_batches=7), **resolve_settings(by_files))
    seen: list[tuple[set[str], bool]] = []  # read as each checkpoint completes: retention drops the older ones
    StatefulPipeline(spark, on, SAMPLE_OPERATORS).run(
        lambda r: seen.append((kinds(storage, r.checkpoint_id), switched(storage, r.checkpoint_id))))
    assert {"files"} not in [k for k, _ in seen[1:]]  # never materialized at once
    assert any(s for _, s in seen), seen
    reports = StatefulPipeline(spark, replace(on, max_batches=1, local_dir=str(tmp_path / "m2")),
                               SAMPLE_OPERATORS).run()
    assert set(reports[0].restored) == {"primary"}
    reports, _ = run(spark, replace(on, max_batches=None, parallelism=2), storage)
    assert set(reports[0].restored) == {"rescale"}
    events = pd.concat(oracle.read_batches(input_dir), ignore_index=True)
    oracle.assert_totals_equal(export(tmp_path, "user_totals"), oracle.user_totals(events))
    oracle.assert_reach_equal(export(tmp_path, "item_reach"), oracle.item_reach(events))
