"""Sensors: recovery after a failed pipeline run, retention after new checkpoints.

The recovery sensor monitors every run of this code location, the UI's Materialize button
(`__ASSET_JOB`) included: a sensor with `monitored_jobs` would not see those. It decides from
the failed run alone (which steps it started, its tags) and launches the `recover` job once per
failed run (run key = the failed run's id); the recovery run does the work.
"""


from collections.abc import Iterable, Mapping

import dagster as dg

from sparkpoint.assets import CHECKPOINT_KEY, checkpoint, sstables
from sparkpoint.ops import FAILED_RUN_TAG, prune_job, recover_job

PIPELINE_STEPS = frozenset({sstables.op.name, checkpoint.op.name})
WILL_RETRY_TAG = "dagster/will_retry"


def recovery_decision(job_name: str, tags: Mapping[str, str], started_steps: Iterable[str]) -> str | None:
    """None: recover this failed run; otherwise why not."""
    if job_name == recover_job.name:
        return f"run of the {recover_job.name} job itself"
    if tags.get(WILL_RETRY_TAG, "").lower() == "true":
        return "Dagster will retry this run"
    if not PIPELINE_STEPS & set(started_steps):
        return "it ran neither the SSTable nor the checkpoint step"
    return None


@dg.run_failure_sensor(name="recovery_sensor", request_job=recover_job, default_status=dg.DefaultSensorStatus.RUNNING,
                       minimum_interval_seconds=10)
def recovery_sensor(context: dg.RunFailureSensorContext) -> dg.RunRequest | dg.SkipReason:
    run = context.dagster_run
    started = {e.step_key for e in context.instance.all_logs(run.run_id, of_type=dg.DagsterEventType.STEP_START)
               if e.step_key}
    why_not = recovery_decision(run.job_name, run.tags, started)
    if why_not:
        return dg.SkipReason(f"run {run.run_id}: {why_not}")
    if context.instance.get_run_ids(dg.RunsFilter(tags={FAILED_RUN_TAG: run.run_id}), limit=1):
        return dg.SkipReason(f"run {run.run_id} already has a recovery run")
    return dg.RunRequest(
        run_key=run.run_id, tags={FAILED_RUN_TAG: run.run_id},
        run_config={"ops": {"recover_op": {"config": {"failed_run_id": run.run_id}}}},
    )


@dg.sensor(name="retention_sensor", target=prune_job, minimum_interval_seconds=60,
           default_status=dg.DefaultSensorStatus.RUNNING)
def retention_sensor(context: dg.SensorEvaluationContext) -> dg.RunRequest | dg.SkipReason:
    """After each new checkpoint materialization, prune (subsume, stale attempts, orphan sweep)."""
    records = context.instance.fetch_materializations(CHECKPOINT_KEY, limit=1, ascending=False).records
    if not records:
        return dg.SkipReason("no checkpoint materialized yet")
    latest = records[0].storage_id
    if context.cursor and int(context.cursor) >= latest:
        return dg.SkipReason("no new checkpoint since the last prune")
    context.update_cursor(str(latest))
    return dg.RunRequest(run_key=f"prune-after-{latest}")


SENSORS = [recovery_sensor, retention_sensor]
