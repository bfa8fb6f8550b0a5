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

from typing import Any

import dagster as dg

from sparkpoint.ops.jobs import PipelineJobs
from sparkpoint.resources.scope import PipelineScope
from sparkpoint.sensors.input import input_tick
from sparkpoint.sensors.recovery import recovery_tick
from sparkpoint.sensors.retention import retention_tick


def build_sensors(scope: PipelineScope, jobs: PipelineJobs, *, orphan_grace_seconds: float = 3600.0
                  ) -> list[dg.SensorDefinition]:
    """Recovery and retention (running), and the input-landing sensor (running when the options'
    `landing_sensor`). `orphan_grace_seconds`: the registry's, how often a prune sweeps orphans."""
    recover_job, prune_job, follow_job = jobs.recover, jobs.prune, jobs.follow
    name = scope.pipeline.name

    @dg.sensor(name=scope.name("recovery_sensor"), jobs=[recover_job, follow_job], minimum_interval_seconds=10,
               default_status=dg.DefaultSensorStatus.RUNNING,
               description=f"Launches `{recover_job.name}` for each failed run of `{name}`, once none of its runs "
                           f"is in flight; after the recovery of a failed `{follow_job.name}` run, launches that job "
                           "again")
    def recovery_sensor(context: dg.SensorEvaluationContext) -> dg.RunRequest | dg.SkipReason:
        return recovery_tick(scope, context, recover_job, follow_job)

    @dg.sensor(name=scope.name("retention_sensor"), target=prune_job, minimum_interval_seconds=60,
               default_status=dg.DefaultSensorStatus.RUNNING)
    def retention_sensor(context: dg.SensorEvaluationContext) -> list[dg.RunRequest] | dg.SkipReason:
        """After new checkpoints, prune each job they were written to, with the resource config of
        the run that wrote it, when the checkpoint said something is due (a lowered retention,
        attempts that can never complete) or the orphan sweep's grace period has passed since
        that job's last prune. Otherwise nothing: no run after every checkpoint."""
        return retention_tick(scope, context, prune_job, orphan_grace_seconds)

    running = dg.DefaultSensorStatus.RUNNING if scope.options.landing_sensor else dg.DefaultSensorStatus.STOPPED

    @dg.sensor(name=scope.name("input_sensor"), target=jobs.checkpoint, minimum_interval_seconds=1,
               default_status=running,
               required_resource_keys=scope.resource_keys("storage", "registry", "state_backend", "source"),
               description=f"Materializes `{name}` when a batch file lands that no checkpoint consumed")
    def input_sensor(context: dg.SensorEvaluationContext, **resources: Any) -> dg.RunRequest | dg.SkipReason:
        # (Dagster passes the required resources as keyword arguments too; context.resources has them.)
        return input_tick(scope, context)

    return [recovery_sensor, retention_sensor, input_sensor]
