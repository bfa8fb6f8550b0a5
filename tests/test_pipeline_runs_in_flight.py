"""One run of a pipeline at a time without relying on the instance's config (issue 37): the
pipeline's input, recovery and retention sensors and its schedule start nothing while one of its
runs is queued or in progress, asked of the instance (its tag, or the assets and steps an
`__ASSET_JOB` run selects), and say which run they wait for; the recovery sensor keeps a failure
it waits to recover and launches its recovery once the run in flight ended. And the code location
says once, at load, when the instance gives the pipeline's pool no limit.

Real Dagster instances; a run "in flight" is a run record in the instance, as the daemon sees it."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import uuid
from pathlib import Path

import dagster as dg
import pytest

from sparkpoint.ops import instance as instance_config
from sparkpoint.ops.instance import INSTANCE_YAML, POOL_YAML, pool_problem, warn_if_pool_unlimited
from sparkpoint.resources.scope import FAILED_RUN_TAG, PIPELINE_TAG
from tests.support.orders_pipeline import land, orders

REPO = Path(__file__).resolve().parent.parent


def in_flight(instance: dg.DagsterInstance, *, tags: dict[str, str] | None = None,
              assets: set[dg.AssetKey] | None = None, status: dg.DagsterRunStatus = dg.DagsterRunStatus.STARTED,
              job: str = "__ASSET_JOB") -> dg.DagsterRun:
    run = dg.DagsterRun(job_name=job, run_id=str(uuid.uuid4()), status=status, tags=tags or {},
                        asset_selection=frozenset(assets) if assets is not None else None)
    instance.add_run(run)
    return run


def skip_text(result: object) -> str:
    assert isinstance(result, dg.SkipReason), result
    return result.skip_message or ""


def waits_for(run: dg.DagsterRun, pipeline: str = "orders") -> str:
    return (f"waiting for run {run.run_id} ({run.status.value}) of pipeline {pipeline!r} to finish: one run of a "
            "pipeline at a time")


def test_the_input_sensor_waits_for_any_run_of_its_pipeline_in_flight(tmp_path: Path):
    parts = orders(tmp_path)
    other = orders(tmp_path, "refunds")
    instance = dg.DagsterInstance.ephemeral()
    land(tmp_path, "o0.parquet")
    sensor = parts.sensor("input_sensor")

    def tick() -> object:
        needed = {k: v for k, v in parts.resources.items() if k in sensor.required_resource_keys}
        with dg.build_sensor_context(instance=instance, resources=needed) as context:
            return sensor(context)

    # A Materialize click (the implicit asset job, no tag of ours) selecting the pipeline's checkpoint.
    click = in_flight(instance, assets={parts.scope.checkpoint_key}, status=dg.DagsterRunStatus.NOT_STARTED)
    assert skip_text(tick()) == f"o0.parquet landed; {waits_for(click)}"
    instance.report_run_canceled(click)
    # A run of one of the pipeline's own jobs (its tag), and another pipeline's run beside it.
    recover = in_flight(instance, tags={PIPELINE_TAG: "orders"}, job="orders_recover")
    in_flight(instance, tags={PIPELINE_TAG: "refunds"}, assets={other.scope.checkpoint_key}, job="refunds_checkpoint")
    assert skip_text(tick()) == f"o0.parquet landed; {waits_for(recover)}"
    instance.report_run_canceled(recover)
    request = tick()
    assert isinstance(request, dg.RunRequest) and request.run_key == "landed-o0.parquet", request


def test_the_recovery_sensor_waits_for_runs_in_flight_and_keeps_the_failure(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch):
    import sparkpoint.assets.steps

    parts = orders(tmp_path)
    instance = dg.DagsterInstance.ephemeral()

    def storage_fails(*args: object, **kwargs: object) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(sparkpoint.assets.steps, "finish_step_or_overtaken", storage_fails)
    failed = dg.materialize(parts.assets, selection=[parts.scope.checkpoint_key], resources=parts.resources,
                            instance=instance, raise_on_error=False)
    assert not failed.success
    sensor = parts.sensor("recovery_sensor")
    busy = in_flight(instance, tags={PIPELINE_TAG: "orders"}, job="orders_checkpoint")

    context = dg.build_sensor_context(instance=instance)
    skip = skip_text(sensor(context))
    assert skip == f"{waits_for(busy)}; then recovering failed run {failed.run_id}", skip
    assert not instance.get_run_ids(dg.RunsFilter(tags={FAILED_RUN_TAG: failed.run_id}))
    context = dg.build_sensor_context(instance=instance, cursor=context.cursor)
    assert skip_text(sensor(context)) == skip, "the next tick still waits, and still knows the failure"

    instance.report_run_canceled(busy)
    context = dg.build_sensor_context(instance=instance, cursor=context.cursor)
    request = sensor(context)
    assert isinstance(request, dg.RunRequest), request
    assert request.run_key == failed.run_id and request.tags == {FAILED_RUN_TAG: failed.run_id}

    # Its recovery run, once launched, is what the next tick waits for; then nothing is left to do.
    recovery = in_flight(instance, tags={PIPELINE_TAG: "orders", FAILED_RUN_TAG: failed.run_id}, job="orders_recover")
    context = dg.build_sensor_context(instance=instance, cursor=context.cursor)
    assert skip_text(sensor(context)) == "no failed run of pipeline 'orders' to recover"
    instance.report_run_canceled(recovery)


def test_two_failures_are_recovered_one_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import sparkpoint.assets.steps

    parts = orders(tmp_path)
    instance = dg.DagsterInstance.ephemeral()
    monkeypatch.setattr(sparkpoint.assets.steps, "finish_step_or_overtaken",
                        lambda *a, **k: (_ for _ in ()).throw(OSError(5, "Input/output error")))
    first, second = (dg.materialize(parts.assets, selection=[parts.scope.checkpoint_key], resources=parts.resources,
                                    instance=instance, raise_on_error=False) for _ in range(2))
    sensor = parts.sensor("recovery_sensor")
    context = dg.build_sensor_context(instance=instance)
    request = sensor(context)
    assert isinstance(request, dg.RunRequest) and request.run_key == first.run_id
    recovery = in_flight(instance, tags={PIPELINE_TAG: "orders", FAILED_RUN_TAG: first.run_id}, job="orders_recover")
    context = dg.build_sensor_context(instance=instance, cursor=context.cursor)
    assert skip_text(sensor(context)) == f"{waits_for(recovery)}; then recovering failed run {second.run_id}"
    instance.report_run_canceled(recovery)
    context = dg.build_sensor_context(instance=instance, cursor=context.cursor)
    request = sensor(context)
    assert isinstance(request, dg.RunRequest) and request.run_key == second.run_id


def test_the_retention_sensor_and_the_schedule_wait_for_runs_in_flight(tmp_path: Path):
    parts = orders(tmp_path, schedule="*/5 * * * *")
    retention, schedule = parts.sensor("retention_sensor"), parts.jobs.schedule
    assert schedule is not None
    with dg.instance_for_test() as instance:  # a schedule's context reads the instance through its ref
        instance.report_runless_asset_event(dg.AssetMaterialization(parts.scope.checkpoint_key,
                                                                    metadata={"prune_due": ["1 attempt"]}))
        busy = in_flight(instance, assets={parts.scope.sstable_keys["spend_per_customer"]})
        context = dg.build_sensor_context(instance=instance)
        assert skip_text(retention(context)) == f"1 new checkpoint to look at; {waits_for(busy)}"
        assert skip_text(schedule(dg.build_schedule_context(instance=instance))) == waits_for(busy)

        instance.report_run_canceled(busy)
        assert isinstance(schedule(dg.build_schedule_context(instance=instance)), dg.RunRequest)
        context = dg.build_sensor_context(instance=instance, cursor=context.cursor)
        requests = retention(context)
        assert isinstance(requests, list) and len(requests) == 1, "the checkpoint the skipped tick saw is pruned"


# --- the instance's pool config, said at load ------------------------------------------------------

@pytest.mark.parametrize(
    "granularity, default_limit, limits, problem",
    [
        ("run", 1, {}, None),
        (None, None, {}, "gives pool 'orders' no limit"),
        ("run", None, {"orders": 1}, None),  # set per pool (`dagster instance concurrency set orders 1`)
        ("run", None, {"other": 1}, "gives pool 'orders' no limit"),
        ("run", 3, {}, "lets 3 runs of pool 'orders' run at once"),
        (None, 1, {}, "limits pool 'orders' per op (granularity op, Dagster's default): another run can take the "
                      "slot between a run's two steps"),
    ],
)
def test_pool_problem_table(granularity, default_limit, limits, problem):
    assert pool_problem("orders", granularity=granularity, default_limit=default_limit, limits=limits) == problem


def home_with(tmp_path: Path, yaml: str | None) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    if yaml is not None:
        (home / "dagster.yaml").write_text(yaml)
    return home


def said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == instance_config.__name__]


def test_loading_on_an_instance_without_the_pool_config_warns_once_naming_the_lines(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture):
    home = home_with(tmp_path, "telemetry:\n  enabled: false\n")
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    caplog.set_level(logging.WARNING)
    orders(tmp_path)
    orders(tmp_path)  # a reload of the location
    messages = said(caplog)
    assert len(messages) == 1, messages
    assert f"the Dagster instance in {home} gives pool 'orders' no limit" in messages[0]
    assert messages[0].endswith(f"add to {home}/dagster.yaml:\n{POOL_YAML}")
    assert POOL_YAML in INSTANCE_YAML


@pytest.mark.parametrize("case", ["sparkpoint's config", "a limit set for the pool", "no DAGSTER_HOME",
                                  "an unreadable dagster.yaml", "a DAGSTER_HOME that does not exist"])
def test_loading_says_nothing_with_the_config_or_without_a_readable_instance(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, case: str):
    if case == "no DAGSTER_HOME":
        monkeypatch.delenv("DAGSTER_HOME", raising=False)
    elif case == "a DAGSTER_HOME that does not exist":
        monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "nowhere"))
    else:
        yaml = {"sparkpoint's config": INSTANCE_YAML, "a limit set for the pool": "concurrency:\n  pools:\n"
                "    granularity: run\n", "an unreadable dagster.yaml": "concurrency: [: not yaml"}[case]
        home = home_with(tmp_path, yaml)
        monkeypatch.setenv("DAGSTER_HOME", str(home))
        if case == "a limit set for the pool":
            with dg.DagsterInstance.get() as instance:
                instance.event_log_storage.set_concurrency_slots("orders", 1)
    caplog.set_level(logging.WARNING)
    assert warn_if_pool_unlimited("orders", "orders") is None
    orders(tmp_path)
    assert said(caplog) == []


def test_definitions_validate_loads_on_a_fresh_instance_and_warns_once(tmp_path: Path):
    home = home_with(tmp_path, "telemetry:\n  enabled: false\n")
    env = {**os.environ, "DAGSTER_HOME": str(home)}
    done = subprocess.run([str(Path(sys.executable).parent / "dagster"), "definitions", "validate", "-w",
                           "workspace.yaml"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("gives pool 'sparkpoint' no limit") == 1, done.stderr
