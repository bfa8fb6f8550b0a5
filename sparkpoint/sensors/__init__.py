"""Sensors: recovery after a failed pipeline run, retention after new checkpoints.

The recovery sensor monitors every run of this code location, the UI's Materialize button
(`__ASSET_JOB`) included: a sensor with `monitored_jobs` would not see those. It decides from
the failed run alone (which steps it started, how they failed, its tags) and launches the
`recover` job once per failed run (run key = the failed run's id) with the failed run's own
resource config, so a run launched for another job id, input or checkpoint location is healed
there, not in the defaults; the recovery run does the work. The retention sensor likewise prunes
the job each new checkpoint materialization was written to.
"""


import json
from collections.abc import Iterable, Mapping
from typing import Any

import dagster as dg

from sparkpoint.assets import CHECKPOINT_KEY, checkpoint, sstables
from sparkpoint.ops import FAILED_RUN_TAG, prune_job, recover_job

PIPELINE_STEPS = frozenset({sstables.op.name, checkpoint.op.name})
WILL_RETRY_TAG = "dagster/will_retry"
# Failures of the configuration itself: nothing was uploaded, and a recovery with the same
# config would fail the same way.
CONFIG_ERRORS = frozenset({"ResourceConfigError", "DagsterInvalidConfigError", "SourceError"})


def recovery_decision(
    job_name: str, tags: Mapping[str, str], started_steps: Iterable[str], failures: Iterable[str] = ()
) -> str | None:
    """None: recover this failed run; otherwise why not. `failures` are the class names of the
    errors its pipeline steps failed with (their causes included)."""
    if job_name == recover_job.name:
        return f"run of the {recover_job.name} job itself"
    if tags.get(WILL_RETRY_TAG, "").lower() == "true":
        return "Dagster will retry this run"
    if not PIPELINE_STEPS & set(started_steps):
        return "it ran neither the SSTable nor the checkpoint step"
    failed = set(failures)
    if failed and failed <= CONFIG_ERRORS:
        return f"it failed on its configuration ({', '.join(sorted(failed))}) before any upload: fix it and rerun"
    return None


def resources_config(run: dg.DagsterRun, job: dg.JobDefinition) -> dict[str, Any]:
    """The run's resource config for the resources `job` uses (a run launched from the launchpad
    for another job id carries it; the defaults fill in the rest)."""
    config = (run.run_config or {}).get("resources") or {}
    return {key: value for key, value in config.items() if key in job.required_resource_keys}


def _failure_classes(instance: dg.DagsterInstance, run_id: str) -> set[str]:
    """Class names of the errors the run's pipeline steps failed with, and of their causes."""
    names: set[str] = set()
    for entry in instance.all_logs(run_id, of_type=dg.DagsterEventType.STEP_FAILURE):
        event = entry.dagster_event
        if event is None or event.step_key not in PIPELINE_STEPS:
            continue
        error = event.step_failure_data.error
        while error is not None:
            names.add(error.cls_name or "")
            error = error.cause
    names.discard("DagsterExecutionStepExecutionError")  # the wrapper around the user code's error
    return names


@dg.run_failure_sensor(name="recovery_sensor", request_job=recover_job, default_status=dg.DefaultSensorStatus.RUNNING,
                       minimum_interval_seconds=10)
def recovery_sensor(context: dg.RunFailureSensorContext) -> dg.RunRequest | dg.SkipReason:
    run = context.dagster_run
    started = {e.step_key for e in context.instance.all_logs(run.run_id, of_type=dg.DagsterEventType.STEP_START)
               if e.step_key}
    why_not = recovery_decision(run.job_name, run.tags, started, _failure_classes(context.instance, run.run_id))
    if why_not:
        return dg.SkipReason(f"run {run.run_id}: {why_not}")
    if context.instance.get_run_ids(dg.RunsFilter(tags={FAILED_RUN_TAG: run.run_id}), limit=1):
        return dg.SkipReason(f"run {run.run_id} already has a recovery run")
    return dg.RunRequest(
        run_key=run.run_id, tags={FAILED_RUN_TAG: run.run_id},
        run_config={"ops": {"recover_op": {"config": {"failed_run_id": run.run_id}}},
                    "resources": resources_config(run, recover_job)},
    )


@dg.sensor(name="retention_sensor", target=prune_job, minimum_interval_seconds=60,
           default_status=dg.DefaultSensorStatus.RUNNING)
def retention_sensor(context: dg.SensorEvaluationContext) -> list[dg.RunRequest] | dg.SkipReason:
    """After new checkpoint materializations, prune (subsume, stale attempts, orphan sweep) each
    job they were written to, with the resource config of the run that wrote it."""
    cursor = int(context.cursor) if context.cursor else None
    records = context.instance.fetch_materializations(CHECKPOINT_KEY, limit=100, ascending=False).records
    new = [r for r in records if cursor is None or r.storage_id > cursor]
    if not records or not new:
        return dg.SkipReason("no new checkpoint since the last prune" if records else "no checkpoint materialized yet")
    context.update_cursor(str(records[0].storage_id))
    requests: dict[str, dg.RunRequest] = {}
    for record in new:  # newest first: one prune per distinct job configuration
        run = context.instance.get_run_by_id(record.run_id)
        config = resources_config(run, prune_job) if run is not None else {}
        key = json.dumps(config, sort_keys=True)
        requests.setdefault(key, dg.RunRequest(run_key=f"prune-after-{record.storage_id}",
                                               run_config={"resources": config} if config else {}))
    return list(requests.values())


SENSORS = [recovery_sensor, retention_sensor]
