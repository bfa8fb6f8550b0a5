"""Injected failures at each protocol point, healed by the recovery sensor's run: exactly-once."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pandas as pd
import pytest

from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.checkpoint.sweep import sweep_orphans
from sparkpoint.resources.scope import FAILED_RUN_TAG, INJECT_TAG, RECOVERED_BY_TAG
from sparkpoint.state.engine.verify import verify_checkpoint
from sparkpoint.state.extract import operator_states
from sparkpoint.state.sample import item_reach, user_totals
from tests.support import oracle
from tests.support.dagster_setup import (
    CHECKPOINT_KEY,
    JOB,
    OUTPUT_KEY,
    SSTABLE_KEYS,
    make_input,
    materialize,
    recover_job,
    recovery_sensor,
    resources,
    storage_of,
)

pytestmark = pytest.mark.spark


def heal(tmp_path: Path, instance: dg.DagsterInstance, failed: dg.ExecuteInProcessResult) -> dg.ExecuteInProcessResult:
    """What the daemon does: evaluate the sensor on the failure, launch what it requests."""
    context = dg.build_sensor_context(instance=instance)
    request = recovery_sensor(context)
    assert isinstance(request, dg.RunRequest), request
    assert request.run_key == failed.run_id
    run = recover_job.execute_in_process(
        run_config=request.run_config, tags=request.tags, instance=instance, resources=resources(tmp_path)
    )
    assert isinstance(recovery_sensor(dg.build_sensor_context(instance=instance, cursor=context.cursor)),
                      dg.SkipReason), "one recovery per failed run"
    return run


def test_injected_failures_heal_to_the_uninterrupted_state_and_exactly_once_output(spark, tmp_path: Path):
    input_dir = make_input(tmp_path, batches=4)
    instance = dg.DagsterInstance.ephemeral()
    materialize(tmp_path, instance)
    storage = storage_of(tmp_path)
    for point, completed_before in (("before-upload", [1]), ("after-upload", [1, 2]), ("before-commit", [2, 3])):
        failed = materialize(tmp_path, instance, tags={INJECT_TAG: point}, raise_on_error=False)
        assert not failed.success
        assert f"injected failure {point}" in str(failed.all_events), point
        assert storage.completed_checkpoint_ids() == completed_before, point
        healed = heal(tmp_path, instance, failed)
        assert healed.success
        done = {e.materialization.asset_key: e.materialization for e in healed.get_asset_materialization_events()}
        assert set(done) == {CHECKPOINT_KEY, *SSTABLE_KEYS.values(), OUTPUT_KEY}, "the graph is current after healing"
        assert done[CHECKPOINT_KEY].metadata["checkpoint_id"].value == max(completed_before) + 1
        # The output the failed run left failed is materialized by the rows recovery committed.
        assert done[OUTPUT_KEY].metadata["checkpoint_id"].value == max(completed_before) + 1
        assert done[OUTPUT_KEY].tags["dagster/data_version"] == str(max(completed_before) + 1)
        assert done[CHECKPOINT_KEY].metadata["recovered_run"].value == failed.run_id
        checks = [e.event_specific_data for e in healed.all_events if e.event_type_value == "ASSET_CHECK_EVALUATION"]
        assert sorted(c.check_name for c in checks) == ["checkpoint_verifies", "registry_matches_metadata"]
        assert all(c.passed for c in checks)
        assert instance.get_run_by_id(failed.run_id).tags[RECOVERED_BY_TAG] == healed.run_id

    store = CompletedCheckpointStore(storage)
    latest = store.latest()
    assert latest is not None and latest.checkpoint_id == 4
    assert latest.source_offsets["source"]["consumed"] == [f"batch-{i:06d}.parquet" for i in range(4)]
    pending = tmp_path / "ckpt" / JOB / "_pending"
    assert not pending.exists() or not any(pending.iterdir()), "no attempt is left pending"
    assert sweep_orphans(storage, grace_seconds=0, dry_run=True).orphans == (), "recovery left no upload behind"
    for meta in store.load_all().checkpoints:
        assert verify_checkpoint(storage, meta) == []

    batches = oracle.read_batches(input_dir)
    events = pd.concat(batches, ignore_index=True)
    with operator_states(storage, latest, user_totals.name) as backends:
        oracle.assert_totals_equal(pd.concat([user_totals.export(b) for b in backends]), oracle.user_totals(events))
    with operator_states(storage, latest, item_reach.name) as backends:
        oracle.assert_reach_equal(pd.concat([item_reach.export(b) for b in backends]), oracle.item_reach(events))

    output = pd.read_parquet(tmp_path / "out")
    assert sorted(output["checkpoint_id"].unique()) == [1, 2, 3, 4]
    for cid, expected in zip([1, 2, 3, 4], oracle.sink_rows(batches)):
        oracle.assert_totals_equal(output[output["checkpoint_id"] == cid].drop(columns="checkpoint_id"), expected)
    assert instance.get_run_ids(dg.RunsFilter(tags={FAILED_RUN_TAG: failed.run_id})) != []
