"""One pipeline's sensors: recovery after its failed runs, retention when something is to prune,
and a run when new input lands.

The recovery sensor reads every run failure of the instance, the UI's Materialize button
(`__ASSET_JOB`) included: a sensor with `monitored_jobs` would not see those. It decides from
the failed run alone (which of *this pipeline's* steps it started, how they failed, its tags)
and launches the pipeline's recover job once per failed run (run key = the failed run's id) with
the failed run's own resource config, so a run launched for another job id, input or checkpoint
location is healed there, not in the defaults, and another pipeline's failure is never touched.
A failed recover run is not recovered again (it could fail the same way for ever): the sensor
tags it `sparkpoint/not-recovered` with what to do, and says so in its skip reason. A failed run
of the follow job is recovered the same way; once its recovery succeeded, the sensor launches the
follow job again with the failed run's config (run key `follow-after-<failed run>`, tag
`sparkpoint/follows-after`), unless a follow run was started since.

While a follow run of the pipeline is in progress, the input sensor launches no batch run: the
follow run checkpoints each file as it lands (its skip reason names the run).

None of the pipeline's sensors (nor its schedule) starts a run while another run of the pipeline
is queued or in progress (`PipelineScope.runs_in_flight`, asked of the instance): they skip,
naming the runs they wait for. So one run of a pipeline at a time holds even on an instance that
gives the pipeline's pool no limit. The recovery sensor keeps the failed runs it waits to recover
in its cursor (`sparkpoint.sensors.recovery`) and launches one recovery at a time.

The input sensor's decisions (when a file has settled, when a file a run did not consume is
offered again, when it observes the input asset, a failure injection armed in its cursor) are in
`sparkpoint.sensors.landing`. Before it launches a run it checks the batch's files from their
footers: under `on_bad_file="fail"` a bad file launches no run (its skip reason names the file, the
check and the `<name>_skip_file` job); a file consumed as skipped is never pending again.
"""


import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

import dagster as dg

from sparkpoint.assets import skip_job_how
from sparkpoint.assets.metadata import input_observation
from sparkpoint.checkpoint.errors import SparkpointError
from sparkpoint.ops import PipelineJobs
from sparkpoint.pipeline.badfiles import bad_file_message
from sparkpoint.resources.scope import FAILED_RUN_TAG, INJECT_TAG, PipelineScope
from sparkpoint.sensors import landing
from sparkpoint.sensors.recovery import RecoveryCursor, follow_again, new_failures
from sparkpoint.spark.settling import SETTLE_SECONDS, settle
from sparkpoint.spark.source import BadInputFile

WILL_RETRY_TAG = "dagster/will_retry"
FOLLOWS_AFTER_TAG = "sparkpoint/follows-after"  # a follow run launched again after the recovery of this failed one
NOT_RECOVERED_TAG = "sparkpoint/not-recovered"
# Failures of the configuration or the input itself, before any upload: a recovery with the
# same config would fail the same way.
CONFIG_ERRORS = frozenset({"ResourceConfigError", "DagsterInvalidConfigError", "SourceError", "SourceSchemaError",
                           "BadInputFile", "PipelineError", "EventTimeError", "OperatorStateMismatch",
                           "StateSchemaIncompatible"})


def recovery_decision(
    scope: PipelineScope, job_name: str, tags: Mapping[str, str], started_steps: Iterable[str],
    failures: Iterable[str] = (),
) -> str | None:
    """None: recover this failed run; otherwise why not. `failures` are the class names of the
    errors its pipeline steps failed with (their causes included)."""
    if tags.get("sparkpoint/job") == "recover" or job_name == scope.name("recover"):
        return f"run of a recover job ({job_name}) itself"
    if tags.get(WILL_RETRY_TAG, "").lower() == "true":
        return "Dagster will retry this run"
    if not scope.steps & set(started_steps):
        return f"it ran none of pipeline {scope.pipeline.name!r}'s steps"
    failed = set(failures)
    if "BadInputFile" in failed and failed <= CONFIG_ERRORS:
        return (f"a bad input file failed its checks before any upload (on_bad_file=\"fail\"): a recovery would fail "
                f"the same way. Land a fixed copy, skip the file with the {scope.name('skip_file')} job, or set "
                "on_bad_file=\"skip\"")
    if failed and failed <= CONFIG_ERRORS:
        return f"it failed on its configuration or input ({', '.join(sorted(failed))}) before any upload: fix it " \
               "and rerun"
    return None


def not_recovered_note(scope: PipelineScope, job_name: str, tags: Mapping[str, str]) -> str | None:
    """What a failed run of this pipeline's own recover job is tagged with (None for any other run)."""
    if job_name != scope.name("recover"):
        return None
    healed = tags.get(FAILED_RUN_TAG)
    what = f"the recovery of run {healed}" if healed else "this recovery"
    return (f"{what} failed and is not recovered again: fix the cause, then launch {scope.name('recover')}"
            + (f" with failed_run_id {healed}" if healed else ""))


def resources_config(run: dg.DagsterRun, job: dg.JobDefinition) -> dict[str, Any]:
    """The run's resource config for the resources `job` uses (a run launched from the launchpad
    for another job id carries it; the defaults fill in the rest)."""
    config: dict[str, Any] = dict((run.run_config or {}).get("resources") or {})  # type: ignore[call-overload]
    return {key: value for key, value in config.items() if key in job.required_resource_keys}


def _failure_classes(instance: dg.DagsterInstance, run_id: str, steps: frozenset[str]) -> set[str]:
    """Class names of the errors the run's pipeline steps failed with, and of their causes."""
    names: set[str] = set()
    for entry in instance.all_logs(run_id, of_type=dg.DagsterEventType.STEP_FAILURE):
        event = entry.dagster_event
        if event is None or event.step_key not in steps:
            continue
        error = event.step_failure_data.error
        while error is not None:
            names.add(error.cls_name or "")
            error = error.cause
    names.discard("DagsterExecutionStepExecutionError")  # the wrapper around the user code's error
    return names


def _why_not_recover(scope: PipelineScope, instance: dg.DagsterInstance, run_id: str) -> str | None:
    """None: recover failed run `run_id`; otherwise why not (a failed recover run is tagged
    with what to do, on the run itself, where the UI shows it)."""
    run = instance.get_run_by_id(run_id)
    if run is None:
        return "deleted"
    note = not_recovered_note(scope, run.job_name, run.tags)
    if note:
        instance.add_run_tags(run.run_id, {NOT_RECOVERED_TAG: note})
        return note
    started = {e.step_key for e in instance.all_logs(run.run_id, of_type=dg.DagsterEventType.STEP_START)
               if e.step_key}
    return recovery_decision(scope, run.job_name, run.tags, started,
                             _failure_classes(instance, run.run_id, scope.steps))


def _recovery_of(instance: dg.DagsterInstance, run_id: str, recover_job: str) -> bool:
    return bool(instance.get_run_ids(dg.RunsFilter(tags={FAILED_RUN_TAG: run_id}, job_name=recover_job), limit=1))


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


def build_sensors(scope: PipelineScope, jobs: PipelineJobs, *, landing_sensor: bool = True,
                  orphan_grace_seconds: float = 3600.0, settle_seconds: float = SETTLE_SECONDS,
                  retry_seconds: float = landing.RETRY_SECONDS) -> list[dg.SensorDefinition]:
    """Recovery and retention (running), and the input-landing sensor (running when
    `landing_sensor`; `settle_seconds` and `retry_seconds` as in `sparkpoint.sensors.landing`)."""
    recover_job, prune_job, follow_job = jobs.recover, jobs.prune, jobs.follow

    @dg.sensor(name=scope.name("recovery_sensor"), jobs=[recover_job, follow_job], minimum_interval_seconds=10,
               default_status=dg.DefaultSensorStatus.RUNNING,
               description=f"Launches `{recover_job.name}` for each failed run of `{scope.pipeline.name}`, once "
                           f"none of its runs is in flight; after the recovery of a failed `{follow_job.name}` run, "
                           "launches that job again")
    def recovery_sensor(context: dg.SensorEvaluationContext) -> dg.RunRequest | dg.SkipReason:
        instance = context.instance
        cursor = RecoveryCursor.from_cursor(context.cursor)
        failed, after = new_failures(instance, cursor.after)
        waiting, said, following = list(cursor.waiting), [], list(cursor.follow_again)
        for run_id in failed:
            why_not = _why_not_recover(scope, instance, run_id)
            if why_not:
                said.append(f"run {run_id}: {why_not}")
            elif run_id not in waiting:
                waiting.append(run_id)
                run = instance.get_run_by_id(run_id)
                if run is not None and scope.is_follow_run(run) and run_id not in following:
                    following.append(run_id)
        # Each stays until a recovery run of it exists (launched by an earlier tick, or by hand).
        waiting = [r for r in waiting if not _recovery_of(instance, r, recover_job.name)]
        again = follow_again(instance, tuple(following), recover_job.name, follow_job.name, FAILED_RUN_TAG)
        said += again.notes
        context.update_cursor(RecoveryCursor(after, tuple(waiting),
                                             tuple(r for r in following if r == again.due or r in again.still)
                                             ).to_cursor())
        if not waiting and again.due is None:
            return dg.SkipReason("; ".join(said) or f"no failed run of pipeline {scope.pipeline.name!r} to recover")
        busy = scope.runs_in_flight(instance)
        if busy:
            then = (f"recovering failed run{'s' if len(waiting) > 1 else ''} {', '.join(waiting)}" if waiting
                    else f"launching {follow_job.name} again after the recovery of {again.due}")
            return dg.SkipReason(f"{scope.waiting_for(busy)}; then {then}")
        if not waiting and again.due is not None:
            return follow_request(instance, again.due)
        run = instance.get_run_by_id(waiting[0])
        if run is None:  # deleted since: nothing left to recover it with
            context.update_cursor(RecoveryCursor(after, tuple(waiting[1:]), tuple(following)).to_cursor())
            return dg.SkipReason(f"failed run {waiting[0]} was deleted: not recovered")
        return dg.RunRequest(  # one recovery at a time: the others wait for it in the next ticks
            run_key=run.run_id, tags={FAILED_RUN_TAG: run.run_id}, job_name=recover_job.name,
            run_config={"ops": {scope.name("recover_op"): {"config": {"failed_run_id": run.run_id}}},
                        "resources": resources_config(run, recover_job)},
        )

    def follow_request(instance: dg.DagsterInstance, failed_id: str) -> dg.RunRequest | dg.SkipReason:
        """The follow job again, with the failed follow run's own config (its interval, its stop
        condition, its resources)."""
        run = instance.get_run_by_id(failed_id)
        if run is None:
            return dg.SkipReason(f"failed follow run {failed_id} was deleted: {follow_job.name} is not launched again")
        return dg.RunRequest(run_key=f"follow-after-{failed_id}", job_name=follow_job.name,
                             tags={FOLLOWS_AFTER_TAG: failed_id}, run_config=dict(run.run_config or {}))

    @dg.sensor(name=scope.name("retention_sensor"), target=prune_job, minimum_interval_seconds=60,
               default_status=dg.DefaultSensorStatus.RUNNING)
    def retention_sensor(context: dg.SensorEvaluationContext) -> list[dg.RunRequest] | dg.SkipReason:
        """After new checkpoints, prune each job they were written to, with the resource config of
        the run that wrote it, when the checkpoint said something is due (a lowered retention,
        attempts that can never complete) or the orphan sweep's grace period has passed since
        that job's last prune. Otherwise nothing: no run after every checkpoint."""
        cursor = json.loads(context.cursor) if context.cursor else {}
        if not isinstance(cursor, dict):  # an earlier version's cursor: the storage id alone
            cursor = {"storage_id": int(cursor)}
        seen, pruned = cursor.get("storage_id"), dict(cursor.get("pruned", {}))
        records = context.instance.fetch_materializations(scope.checkpoint_key, limit=100, ascending=False).records
        new = [r for r in records if seen is None or r.storage_id > seen]
        if not new:
            return dg.SkipReason("no new checkpoint since the last look" if records else "no checkpoint yet")
        busy = scope.runs_in_flight(context.instance)
        if busy:  # the cursor stays: the next tick looks at these checkpoints again
            return dg.SkipReason(f"{len(new)} new checkpoint{'s' if len(new) > 1 else ''} to look at; "
                                 f"{scope.waiting_for(busy)}")
        now, requests = time.time(), {}
        for record in new:  # newest first: one prune per distinct job configuration
            run = context.instance.get_run_by_id(record.run_id)
            config = resources_config(run, prune_job) if run is not None else {}
            key = json.dumps(config, sort_keys=True)
            if key in requests:
                continue
            materialization = record.asset_materialization
            due_entry = materialization.metadata.get("prune_due") if materialization is not None else None
            due = list(due_entry.value) if due_entry is not None and isinstance(due_entry.value, list) else []
            if due or now - pruned.get(key, 0.0) >= orphan_grace_seconds:
                pruned[key] = now
                requests[key] = dg.RunRequest(run_key=f"prune-after-{record.storage_id}",
                                              run_config={"resources": config} if config else {},
                                              tags={"sparkpoint/prune-because": "; ".join(due) or "orphan sweep due"})
        context.update_cursor(json.dumps({"storage_id": records[0].storage_id, "pruned": pruned}))
        if not requests:
            return dg.SkipReason("nothing to prune: retention kept up in the checkpoint step, orphan sweep not due")
        return list(requests.values())

    @dg.sensor(name=scope.name("input_sensor"), target=jobs.checkpoint, minimum_interval_seconds=1,
               default_status=dg.DefaultSensorStatus.RUNNING if landing_sensor else dg.DefaultSensorStatus.STOPPED,
               required_resource_keys=scope.resource_keys("storage", "registry", "state_backend", "source"),
               description=f"Materializes `{scope.pipeline.name}` when a batch file lands that no checkpoint consumed")
    def input_sensor(context: dg.SensorEvaluationContext, **resources: Any) -> dg.RunRequest | dg.SkipReason:
        # (Dagster passes the required resources as keyword arguments too; context.resources has them.)
        # One run per batch file: while it runs, the same first file is pending and the sensor
        # waits for it; a file its run did not consume is offered again under a new run key.
        cursor = landing.InputCursor.from_cursor(context.cursor, scope.name("input_sensor"))
        if cursor.problem:  # a cursor a user set: it stays as it is until they fix or delete it
            return dg.SkipReason(cursor.problem)

        def skip(reason: str) -> dg.SkipReason:
            context.update_cursor(cursor.to_cursor())
            return dg.SkipReason(cursor.say(reason))

        try:
            driver = scope.resources(context).driver(scope.pipeline)
            pending = driver.pending_files()
            cursor, due = cursor.observe(pending, time.time())
            if due:
                report_observation(context, input_observation(scope.input_key, pending, driver.consumed_files,
                                                              driver.config.input_url,
                                                              f"seen by {scope.name('input_sensor')}"))
            if not pending:
                return skip("no batch file waiting")
            following = [r for r in scope.runs_in_flight(context.instance) if scope.is_follow_run(r)]
            if following:
                return skip(f"follow run {following[0].run_id} ({following[0].status.value}) of pipeline "
                            f"{scope.pipeline.name!r} checkpoints each file as it lands: no batch run is "
                            "launched while it is in progress")
            name, now = pending[0], time.time()
            stat = driver.source.stat(name)
            seen, unsettled = settle(cursor.seen, name, stat, now, settle_seconds)
            cursor = replace(cursor, seen=seen)
            if unsettled:
                return skip(unsettled)
            runs = landing.landed_runs(context.instance, scope.name("input_sensor"), name)
            decision = landing.landing_decision(name, stat, runs, landing.active_recoveries(context.instance, runs),
                                                now, retry_seconds)
            # The runs ended after the listing above: had one consumed the file, a new listing shows it.
            if decision.again and name not in driver.pending_files():
                return skip(f"{name} was consumed while the sensor looked")
        except SparkpointError as e:
            return skip(f"input not readable: {e}")
        if decision.run_key is None:
            return skip(decision.reason)
        busy = scope.runs_in_flight(context.instance)
        if busy:
            return skip(f"{decision.reason}; {scope.waiting_for(busy)}")
        try:  # the batch's checks from its footers: a run would fail on a bad file (on_bad_file="fail")
            driver.check_batch(driver.ready_files(pending[: driver.config.files_per_checkpoint]))
        except BadInputFile as e:
            said = bad_file_message(e.file, e.check, e.reason,
                                    skip_how=skip_job_how(scope, e.file, driver.config.input_url))
            return skip(f"not launching a run for {name}: {said}")
        except SparkpointError as e:
            return skip(f"input not readable: {e}")
        tags = dict(decision.tags)
        if cursor.inject_failure:  # armed for this run only: the cursor forgets it with this request
            tags[INJECT_TAG] = cursor.inject_failure
            context.log.info(f"{decision.reason}; injecting failure {cursor.inject_failure} (armed in the cursor)")
            cursor = replace(cursor, inject_failure=None)
        else:
            context.log.info(decision.reason)
        context.update_cursor(cursor.to_cursor())
        return dg.RunRequest(run_key=decision.run_key, tags=tags)

    return [recovery_sensor, retention_sensor, input_sensor]
