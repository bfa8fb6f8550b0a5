"""Event time and ticks through Dagster: the checkpoint asset carries `watermark` and `late_rows`,
the SSTable assets what the state holds (entries, timers pending and fired, expired entries); a
run tagged `sparkpoint/tick=true`, and every run of a schedule built with `tick=True`, makes a
checkpoint of no input so that processing-time timers fire and TTL state expires.

Users' own operators (tests.test_event_time), not the sample's."""

from __future__ import annotations

import time
from pathlib import Path

import dagster as dg
import pandas as pd

from sparkpoint import Pipeline
from sparkpoint.factory import pipeline_defs
from sparkpoint.resources import SparkResource
from sparkpoint.resources.scope import TICK_TAG
from tests.test_event_time import BATCHES, LATENESS, REMIND_AFTER_S, REMINDERS, SILENCE_ALERTS, land, micros, oracle


def defs_of(tmp_path: Path, operator, name: str, **kw):
    pipeline = Pipeline(name, [operator], input_url=str(tmp_path / "in"), checkpoints_url=str(tmp_path / "ckpt"),
                        output_url=str(tmp_path / "out"), local_dir=str(tmp_path / "local"), parallelism=2,
                        max_parallelism=16, **kw)
    # The session fixture's JVM is shared by the whole test session: do not stop it.
    return pipeline_defs(pipeline, schedule="*/5 * * * *", tick=True,
                         resources={"spark": SparkResource(stop_on_teardown=False)})


def materializations(result: dg.ExecuteInProcessResult, key: dg.AssetKey) -> list[dict]:
    return [{k: v.value for k, v in e.materialization.metadata.items()}
            for e in result.get_asset_materialization_events() if e.materialization.asset_key == key]


def observations(result: dg.ExecuteInProcessResult, key: dg.AssetKey) -> list[dict]:
    seen = [e.asset_observation_data.asset_observation for e in result.get_asset_observation_events()]
    return [{k: v.value for k, v in o.metadata.items()} for o in seen if o.asset_key == key]


def run(defs, instance: dg.DagsterInstance, tags: dict[str, str] | None = None) -> dg.ExecuteInProcessResult:
    return dg.materialize([*defs.assets, *defs.checks], resources=defs.resources, instance=instance, tags=tags,
                          selection=dg.AssetSelection.assets(*defs.scope.sstable_keys.values(),
                                                             defs.scope.checkpoint_key).downstream())


def test_the_checkpoint_asset_carries_the_watermark_and_late_rows(spark, tmp_path: Path):
    land(tmp_path)
    defs = defs_of(tmp_path, SILENCE_ALERTS, "devices", event_time="reported_at", allowed_lateness=LATENESS)
    instance = dg.DagsterInstance.ephemeral()
    expected = oracle(BATCHES, LATENESS, "drop")
    expected_changes, last, watermark = [], {}, None  # per batch: devices first seen, devices whose last report moved
    for rows in BATCHES:
        kept = [(d, t) for d, t in rows if watermark is None or t >= watermark]
        newest = {d: max(t for e, t in kept if e == d) for d, _ in kept}
        expected_changes.append((sum(1 for d in newest if d not in last),
                                 sum(1 for d, t in newest.items() if d in last and t > last[d])))
        last.update({d: max(t, last.get(d, t)) for d, t in newest.items()})
        watermark = max([*(t for _, t in rows), (watermark or 0) + LATENESS]) - LATENESS
    for watermark, late, due in expected:
        result = run(defs, instance)
        checkpoint = materializations(result, defs.scope.checkpoint_key)[0]
        assert checkpoint["watermark"] == pd.Timestamp(micros(watermark), unit="us", tz="UTC").isoformat()
        assert checkpoint["late_rows"] == late
        sstables = materializations(result, defs.scope.sstable_keys["silence"])[0]
        assert sstables["timers_fired"] == len(due)
        if checkpoint["checkpoint_id"] > 1:  # the checkpoint before it, linked, and what changed since (cheap)
            added, changed = expected_changes[checkpoint["checkpoint_id"] - 1]
            assert checkpoint["previous_checkpoint_id"] == checkpoint["checkpoint_id"] - 1
            # reported after the materialization (which goes out at the commit): an observation
            (since,) = observations(result, defs.scope.checkpoint_key)
            assert (since["checkpoint_id"], since["previous_checkpoint_id"]) == (
                checkpoint["checkpoint_id"], checkpoint["checkpoint_id"] - 1)
            assert since["keys_added"] == {"silence": added}, since["keys_added"]
            assert (since["keys_changed"], since["keys_removed"]) == ({"silence": changed}, {"silence": 0})
    assert sstables["entries"] == 4 and sstables["timers_pending"] == 4 - sum(len(d) for _, _, d in expected)
    assert sstables["states"] == {"last_report": {"kind": "value", "ttl": None, "entries": 4}}


def test_a_tick_run_fires_processing_timers_and_expires_ttl_and_the_schedule_ticks(spark, tmp_path: Path):
    (tmp_path / "in").mkdir()
    pd.DataFrame({"user": ["ann", "bob"]}).to_parquet(tmp_path / "in" / "b00.parquet")
    defs = defs_of(tmp_path, REMINDERS, "reminders")
    instance = dg.DagsterInstance.ephemeral()
    run(defs, instance)
    assert materializations(run(defs, instance), defs.scope.checkpoint_key) == [], "no input, no tick: nothing"
    time.sleep(REMIND_AFTER_S + 0.5)
    ticked = run(defs, instance, tags={TICK_TAG: "true"})
    checkpoint = materializations(ticked, defs.scope.checkpoint_key)[0]
    assert checkpoint["checkpoint_id"] == 2 and checkpoint["dagster/row_count"] == 0
    sstables = materializations(ticked, defs.scope.sstable_keys["reminders"])[0]
    assert (sstables["timers_fired"], sstables["timers_pending"], sstables["expired_removed"]) == (2, 0, 2)
    out = pd.read_parquet(tmp_path / "out")
    assert sorted(out.user) == ["ann", "bob"] and set(out.checkpoint_id) == {2}

    with dg.instance_for_test() as scheduled:
        request = defs.jobs.schedule(dg.build_schedule_context(instance=scheduled))
    assert isinstance(request, dg.RunRequest) and request.tags.get(TICK_TAG) == "true"


def test_the_savepoint_job_diffs_against_a_savepoint_its_run_config_names(spark, tmp_path: Path):
    land(tmp_path, BATCHES[:2])
    defs = defs_of(tmp_path, SILENCE_ALERTS, "devices", event_time="reported_at", allowed_lateness=LATENESS)
    instance = dg.DagsterInstance.ephemeral()
    run(defs, instance)
    job = defs.definitions().get_job_def(defs.scope.name("savepoint"))
    saved = step_output(job.execute_in_process(instance=instance))
    url = str(tmp_path / "ckpt" / "devices" / f"chk-{saved['savepoint_id']}")
    run(defs, instance)  # batch 1: d4 new, d1 d2 d3 moved
    second = job.execute_in_process(instance=instance, run_config={
        "ops": {defs.scope.name("savepoint_op"): {"config": {"diff_against": url}}}})
    facts = step_output(second)
    assert facts["keys_added"] == {"silence": 1} and facts["keys_changed"] == {"silence": 3}
    assert facts["keys_removed"] == {"silence": 0}


def step_output(result: dg.ExecuteInProcessResult) -> dict:
    return {k: v.value for e in result.all_events if e.event_type_value == "STEP_OUTPUT"
            for k, v in e.step_output_data.metadata.items()}
