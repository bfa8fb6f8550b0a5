"""Bad input files in Dagster (issue 34, item 2), on the smart-meters pipeline: under "fail" the
checkpoint run fails before any upload and the recovery sensor launches no recovery for it, nor the
input sensor a run; the `meters_skip_file` job consumes the file (no Spark) with a WARN on
`meters/input`; under "skip" (the input resource's `on_bad_file`) a run consumes a bad file and the
`skipped_files` check on `meters/input` warns, naming it."""

from __future__ import annotations

import os
import time
from pathlib import Path

import dagster as dg
import pytest

from sparkpoint.factory import pipeline_defs
from tests.support.meters_pipeline import bad, good, meters, state_of, totals

pytestmark = pytest.mark.spark


def settled(path: Path) -> None:
    os.utime(path, (time.time() - 60, time.time() - 60))


def check_evaluations(result: dg.ExecuteInProcessResult) -> dict[str, dg.AssetCheckEvaluation]:
    return {e.event_specific_data.check_name: e.event_specific_data for e in result.all_events
            if e.event_type_value == "ASSET_CHECK_EVALUATION"}


def test_a_bad_file_fails_its_run_unrecovered_until_the_skip_job_consumes_it_then_skip_warns(tmp_path: Path):
    pipeline = meters(tmp_path)
    parts = pipeline_defs(pipeline, landing_sensor=False)
    defs = parts.definitions()
    instance = dg.DagsterInstance.ephemeral()
    checkpoint_job = defs.resolve_job_def("meters_checkpoint")
    bad(tmp_path, "r-000.parquet", "null keys")
    goods = [good(tmp_path, "r-001.parquet")]
    for name in ("r-000.parquet", "r-001.parquet"):
        settled(tmp_path / "in" / name)

    failed = checkpoint_job.execute_in_process(instance=instance, raise_on_error=False)
    assert not failed.success
    failure = next(e for e in failed.all_events if e.event_type_value == "STEP_FAILURE")
    assert failure.step_key == "meters_sstables"
    error = failure.event_specific_data.error
    classes = set()
    while error is not None:
        classes.add(error.cls_name)
        if error.cls_name == "BadInputFile":
            assert "r-000.parquet" in error.message and "check 'null_keys'" in error.message
            assert "launch the meters_skip_file job with config file: 'r-000.parquet'" in error.message
            assert f"its input resource reading file://{tmp_path}/in as this run's did" in error.message
            assert "MODULE:ATTR naming pipeline 'meters'" in error.message
        error = error.cause
    assert "BadInputFile" in classes
    assert not (tmp_path / "ckpt" / "meters").exists() or not list((tmp_path / "ckpt" / "meters").rglob("*.sst"))

    decision = parts.sensor("recovery_sensor")(dg.build_sensor_context(instance=instance))
    assert isinstance(decision, dg.SkipReason), "no recovery: it would fail the same way"
    assert "bad input file" in decision.skip_message and "meters_skip_file" in decision.skip_message

    input_sensor = parts.sensor("input_sensor")
    needed = {k: v for k, v in parts.resources.items() if k in input_sensor.required_resource_keys}

    def input_tick() -> dg.RunRequest | dg.SkipReason:
        with dg.build_sensor_context(instance=instance, resources=needed) as context:
            return input_sensor(context)  # type: ignore[return-value]

    # A fresh sensor (no record of the failed run) still launches no run for the bad file.
    tick = input_tick()
    assert isinstance(tick, dg.SkipReason), tick
    assert "not launching a run for r-000.parquet" in tick.skip_message and "null_keys" in tick.skip_message

    skip_job = defs.resolve_job_def("meters_skip_file")
    skipped = skip_job.execute_in_process(
        instance=instance, run_config={"ops": {"meters_skip_file_op": {"config": {
            "file": "r-000.parquet", "reason": "the gateway sent null meter ids"}}}})
    assert skipped.success
    warning = check_evaluations(skipped)["skipped_files"]
    assert not warning.passed and warning.severity == dg.AssetCheckSeverity.WARN
    assert warning.asset_key == dg.AssetKey(["meters", "input"])
    assert "r-000.parquet (manual: the gateway sent null meter ids)" in (warning.description or "")
    [materialization] = skipped.get_asset_materialization_events()
    assert materialization.materialization.asset_key == dg.AssetKey(["meters", "checkpoint"])
    assert [s["file"] for s in materialization.materialization.metadata["skipped_files"].value] == ["r-000.parquet"]

    tick = input_tick()
    assert isinstance(tick, dg.RunRequest) and tick.run_key == "landed-r-001.parquet", \
        "the skipped file is consumed: the sensor goes on with the next one"
    done = checkpoint_job.execute_in_process(instance=instance)
    assert done.success and check_evaluations(done)["skipped_files"].passed

    # on_bad_file="skip", set on the input resource for this run: a bad file is consumed, and warned of.
    bad(tmp_path, "r-002.parquet", "missing column")
    goods.append(good(tmp_path, "r-003.parquet", 7))
    source_key = "meters_source"
    run_config = {"resources": {source_key: {"config": {"on_bad_file": "skip", "files_per_checkpoint": 2}}}}
    run = checkpoint_job.execute_in_process(instance=instance, run_config=run_config)
    assert run.success
    warning = check_evaluations(run)["skipped_files"]
    assert not warning.passed and warning.severity == dg.AssetCheckSeverity.WARN
    assert "r-002.parquet (columns: input file" in (warning.description or "")
    assert [s["file"] for s in warning.metadata["skipped_files"].value] == ["r-002.parquet"]
    assert state_of(pipeline) == pytest.approx(totals(goods))
