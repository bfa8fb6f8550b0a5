"""`build_pipeline_defs`: a user's `Pipeline` as Dagster definitions.

    import dagster as dg
    from sparkpoint import build_pipeline_defs
    from my_project.pipelines import clicks, sessions

    defs = dg.Definitions.merge(build_pipeline_defs(clicks), build_pipeline_defs(sessions))

Everything is scoped to the pipeline (see `sparkpoint.resources.scope`): asset keys
`<name>/<operator>`, `<name>/checkpoint`, `<name>/input`, `<name>/output`; jobs, sensors,
schedule and resources named `<name>_...`; its own concurrency pool. The resources carry the
pipeline's own settings; the launchpad or `EnvVar`s override any field, and recovery and
retention act on the resource config of the run they follow.

Because each pipeline has its own pool, two pipelines that write one job directory (the same
checkpoints location and job id) would run at once against it: the factory refuses the second
pipeline built in one process for a job directory (`Definitions.merge` of the two, two
components), naming both. Building the same pipeline again (a reload) is not refused.

On an instance that does not limit the pipeline's pool to one run at a time, building it logs a
warning once per process, naming the `dagster.yaml` lines to add (`sparkpoint.ops.instance`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import dagster as dg

from sparkpoint.assets import build_assets, build_checks
from sparkpoint.checkpoint.storage import storage_url
from sparkpoint.ops import PipelineJobs, build_jobs
from sparkpoint.ops.instance import warn_if_pool_unlimited
from sparkpoint.pipeline.runtime import PipelineError
from sparkpoint.pipeline.spec import Pipeline
from sparkpoint.resources import resources_for
from sparkpoint.resources.options import RETRY_SECONDS, PipelineDefsOptions
from sparkpoint.resources.scope import ROLES, PipelineScope
from sparkpoint.sensors import build_sensors

# (checkpoints URL, job id) -> the name of the pipeline whose definitions this process built for
# it. For the process's life: how long definitions live says nothing (Dagster's own caches keep
# some alive after the code location dropped them).
_JOB_DIRS: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class PipelineDefs:
    """The parts `build_pipeline_defs` puts together, for code that needs one of them."""

    scope: PipelineScope
    assets: list[Any]
    checks: list[dg.AssetChecksDefinition]
    jobs: PipelineJobs
    sensors: list[dg.SensorDefinition]
    resources: dict[str, Any]  # by this pipeline's resource keys

    def definitions(self) -> dg.Definitions:
        return dg.Definitions(
            assets=self.assets, asset_checks=self.checks, jobs=self.jobs.all(),
            schedules=[self.jobs.schedule] if self.jobs.schedule else [],
            sensors=self.sensors, resources=self.resources,
        )

    def sensor(self, suffix: str) -> dg.SensorDefinition:
        name = self.scope.name(suffix)
        return next(s for s in self.sensors if s.name == name)


def pipeline_defs(pipeline: Pipeline, options: PipelineDefsOptions | None = None, **keywords: Any) -> PipelineDefs:
    """The parts of `build_pipeline_defs`: `options`, with `keywords` (its keywords) on top."""
    options = (options or PipelineDefsOptions()).with_(**keywords)
    if options.landing_settle_seconds is not None:  # the sensor's wait and the runs' are one setting
        pipeline = pipeline.with_(settle_seconds=options.landing_settle_seconds)
    scope = PipelineScope.of(pipeline, options)
    by_role: dict[str, Any] = resources_for(pipeline)
    unknown = set(options.resources or {}) - set(ROLES)
    if unknown:
        raise ValueError(f"resources: unknown role(s) {sorted(unknown)}; the roles are {', '.join(ROLES)}")
    by_role.update(options.resources or {})
    claim_job_dir(pipeline, by_role["storage"])
    warn_if_pool_unlimited(pipeline.name, scope.pool)
    jobs = build_jobs(scope)
    return PipelineDefs(
        scope=scope, assets=build_assets(scope), checks=build_checks(scope), jobs=jobs,
        sensors=build_sensors(scope, jobs, orphan_grace_seconds=by_role["registry"].orphan_grace_seconds),
        resources=scope.keyed(by_role),
    )


def claim_job_dir(pipeline: Pipeline, storage: Any) -> None:
    """Refuse `pipeline` when this process built another pipeline's definitions for the job
    directory its `storage` resource writes: each pipeline has its own pool, so their runs would
    overlap on one directory. A location set through `EnvVar` is known only at launch and is not
    checked. A notebook that renames a pipeline restarts its kernel to build it again."""
    url, job_id = getattr(storage, "checkpoints_url", None), getattr(storage, "job_id", None)
    if not all(isinstance(v, str) and not isinstance(v, dg.EnvVar) for v in (url, job_id)):
        return
    key = (storage_url(str(url)), str(job_id))
    other = _JOB_DIRS.setdefault(key, pipeline.name)
    if other != pipeline.name:
        raise PipelineError(
            f"pipelines {other!r} and {pipeline.name!r} both write job {job_id!r} under {key[0]}: each runs in "
            "its own pool, so their runs would overlap on one job directory; give one of them another job_id "
            "or checkpoints_url"
        )


def build_pipeline_defs(
    pipeline: Pipeline,
    *,
    key_prefix: str | Sequence[str] | None = None,
    group_name: str | None = None,
    owners: Sequence[str] = (),
    tags: Mapping[str, str] | None = None,
    schedule: str | None = None,
    schedule_status: dg.DefaultScheduleStatus = dg.DefaultScheduleStatus.RUNNING,
    landing_sensor: bool = True,
    resources: Mapping[str, dg.ConfigurableResource] | None = None,  # type: ignore[type-arg]
    landing_settle_seconds: float | None = None,
    landing_retry_seconds: float = RETRY_SECONDS,
    tick: bool = False,
) -> dg.Definitions:
    """Dagster definitions for `pipeline`: its assets, checks, jobs, sensors, schedule and resources.

    SSTable assets (one per operator), the checkpoint asset and its checks, the input (observable)
    and output assets; jobs `<name>_checkpoint`, `_follow` (one step that checkpoints each batch as it
    lands, as `sparkpoint run --follow`), `_recover`, `_prune`, `_verify`, `_rebuild_registry`,
    `_savepoint`, `_skip_file`; sensors `<name>_recovery_sensor` (after a failed follow run, the
    follow job again once recovered), `_retention_sensor`, `_input_sensor` (runs the checkpoint job
    when a batch lands, none while a follow run is in progress); a schedule
    `<name>_checkpoint_schedule` when `schedule` (cron) is given; resources `<name>_storage`,
    `_registry`, `_spark`, `_state_backend`, `_source`. Every name carries the pipeline's, so any
    number of pipelines share one code location. Guide: [Dagster](../dagster.md).

    Example:
        ```python
        import dagster as dg
        from sparkpoint import build_pipeline_defs
        from my_project.pipelines import clicks, sessions

        defs = dg.Definitions.merge(build_pipeline_defs(clicks, owners=["team:web"]),
                                    build_pipeline_defs(sessions, schedule="*/10 * * * *"))
        ```

    Args:
        pipeline: the `sparkpoint.Pipeline`.
        key_prefix: prefix of the asset keys (default: the name).
        group_name: the assets' group (default: the name).
        owners: owners of every asset (`"team:web"`, an e-mail).
        tags: tags of every asset.
        schedule: a cron for the checkpoint job's schedule; None: no schedule.
        schedule_status: whether that schedule starts running.
        landing_sensor: the input sensor (a run per batch file that lands); False: none. It observes
            `<name>/input` on its ticks (files pending, next and newest file), and a failure injection
            armed in its cursor (`{"inject_failure": "after-upload"}`, set in the UI or with
            `dagster sensor cursor`) goes to its next run only.
        resources: replaces resources by role (`storage`, `registry`, `spark`, `state_backend`,
            `source`), e.g. `{"spark": SparkResource(remote="sc://spark:15002")}` or with `EnvVar` fields.
        landing_settle_seconds: the input sensor offers a file once it has been unchanged this long (a
            file still being copied is not read), and its runs judge a failing file only then: the
            pipeline's `settle_seconds` setting (default 2), which this replaces when given.
        landing_retry_seconds: a file earlier runs did not consume is offered again this long after the
            last (doubling with each run), at once if it changed.
        tick: a scheduled run that finds no unconsumed batch makes a checkpoint of no input, so
            processing time passes without data (due timers fire, TTL state expires); any run of the
            checkpoint job does so with the run tag `sparkpoint/tick=true`.

    Returns:
        A `dagster.Definitions`.

    Raises:
        PipelineError: another pipeline's definitions in this process write the same job
            directory (checkpoints location and job id); the message names both.
        ValueError: an unknown resource role.
    """
    keywords = {name: value for name, value in locals().items() if name != "pipeline"}  # the options' fields
    return pipeline_defs(pipeline, PipelineDefsOptions(**keywords)).definitions()
