"""The input sensor's tick: observe the input, and request a run of the checkpoint job for the
first pending batch file once it has settled and `sparkpoint.sensors.landing` decides it is due;
none while a run of the pipeline is in flight, none for a batch whose files fail their checks
from their footers (under `on_bad_file="fail"`: the skip reason names the file, the check and the
`<name>_skip_file` job). Every skip says what the sensor waits for."""

from __future__ import annotations

import time
from dataclasses import replace

import dagster as dg

from sparkpoint.assets.build import step_driver
from sparkpoint.assets.metadata import input_observation
from sparkpoint.assets.steps import skip_job_how
from sparkpoint.checkpoint.errors import SparkpointError
from sparkpoint.pipeline.badfiles import bad_file_message
from sparkpoint.pipeline.driver import StatefulPipeline
from sparkpoint.resources.scope import INJECT_TAG, PipelineScope
from sparkpoint.sensors import landing
from sparkpoint.spark.settling import settle
from sparkpoint.spark.source import BadInputFile


def report_observation(context: dg.SensorEvaluationContext, observation: dg.AssetObservation) -> None:
    """Record a sensor's observation in the instance at once (what the daemon does with a
    `SensorResult`'s asset events), so the sensor still returns a plain run request or skip
    reason. A context built without an instance (`build_sensor_context()` in a test) has nowhere
    to record it."""
    try:
        instance = context.instance
    except dg.DagsterInvariantViolationError:
        return
    instance.report_runless_asset_event(observation)


def input_tick(scope: PipelineScope, context: dg.SensorEvaluationContext) -> dg.RunRequest | dg.SkipReason:
    """The input sensor's tick. One run per batch file: while it runs, the same first file is
    pending and the sensor waits for it; a file its run did not consume is offered again under a
    new run key (`sparkpoint.sensors.landing`)."""
    cursor = landing.InputCursor.from_cursor(context.cursor, scope.name("input_sensor"))
    if cursor.problem:  # a cursor a user set: it stays as it is until they fix or delete it
        return dg.SkipReason(cursor.problem)
    try:
        driver = step_driver(scope, context)
        cursor, decision, batch = _decide(scope, context, driver, cursor)
        if decision.run_key is not None:
            decision = _launchable(scope, context, driver, decision, batch)
    except SparkpointError as e:
        decision = landing.Landing(None, f"input not readable: {e}", {})
    if decision.run_key is None:
        context.update_cursor(cursor.to_cursor())
        return dg.SkipReason(cursor.say(decision.reason))
    tags = dict(decision.tags)
    if cursor.inject_failure:  # armed for this run only: the cursor forgets it with this request
        tags[INJECT_TAG] = cursor.inject_failure
        context.log.info(f"{decision.reason}; injecting failure {cursor.inject_failure} (armed in the cursor)")
        cursor = replace(cursor, inject_failure=None)
    else:
        context.log.info(decision.reason)
    context.update_cursor(cursor.to_cursor())
    return dg.RunRequest(run_key=decision.run_key, tags=tags)


def _decide(scope: PipelineScope, context: dg.SensorEvaluationContext, driver: StatefulPipeline,
            cursor: landing.InputCursor) -> tuple[landing.InputCursor, landing.Landing, list[str]]:
    """Observe the input (when due) and decide about its first pending file: (the cursor after it,
    the decision, the pending files)."""
    pending = driver.pending_files()
    cursor, due = cursor.observe(pending, time.time())
    if due:
        report_observation(context, input_observation(scope.input_key, driver, f"seen by {scope.name('input_sensor')}",
                                                      pending))
    if not pending:
        return cursor, landing.Landing(None, "no batch file waiting", {}), pending
    following = [r for r in scope.runs_in_flight(context.instance) if scope.is_follow_run(r)]
    if following:
        return cursor, landing.Landing(
            None, f"follow run {following[0].run_id} ({following[0].status.value}) of pipeline "
                  f"{scope.pipeline.name!r} checkpoints each file as it lands: no batch run is launched while it is "
                  "in progress", {}), pending
    name, now = pending[0], time.time()
    stat = driver.source.stat(name)
    seen, unsettled = settle(cursor.seen, name, stat, now, driver.config.settle_seconds)
    cursor = replace(cursor, seen=seen)
    if unsettled:
        return cursor, landing.Landing(None, unsettled, {}), pending
    runs = landing.landed_runs(context.instance, scope.name("input_sensor"), name)
    decision = landing.landing_decision(name, stat, runs, landing.active_recoveries(context.instance, runs), now,
                                        scope.options.landing_retry_seconds)
    # The runs ended after the listing above: had one consumed the file, a new listing shows it.
    if decision.again and name not in driver.pending_files():
        return cursor, landing.Landing(None, f"{name} was consumed while the sensor looked", {}), pending
    return cursor, decision, pending


def _launchable(scope: PipelineScope, context: dg.SensorEvaluationContext, driver: StatefulPipeline,
                decision: landing.Landing, pending: list[str]) -> landing.Landing:
    """`decision`, or why its run is not launched now: a run of the pipeline in flight, or a bad
    file in the batch, from its footers (a run would fail on it under on_bad_file="fail")."""
    busy = scope.runs_in_flight(context.instance)
    if busy:
        return replace(decision, run_key=None, reason=f"{decision.reason}; {scope.waiting_for(busy)}")
    try:
        driver.check_batch(driver.ready_files(pending[: driver.config.files_per_checkpoint]))
    except BadInputFile as e:
        said = bad_file_message(e.file, e.check, e.reason,
                                skip_how=skip_job_how(scope, e.file, driver.config.input_url))
        return replace(decision, run_key=None, reason=f"not launching a run for {pending[0]}: {said}")
    return decision
