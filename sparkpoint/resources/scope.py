"""The names one pipeline's Dagster definitions take, so that two pipelines merge into one code
location without a clash: asset keys under `<key_prefix>/` (default: the pipeline's name), job,
sensor, schedule, op and resource names starting with `<name>_`, its own concurrency pool; and
which runs of the instance are the pipeline's (what its sensors and schedule wait for)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import dagster as dg

from sparkpoint.pipeline.runtime import PipelineError
from sparkpoint.pipeline.spec import Pipeline
from sparkpoint.resources import (
    CheckpointRegistryResource,
    CheckpointStorageResource,
    InputResource,
    PipelineResources,
    SparkResource,
    StateBackendResource,
)
from sparkpoint.resources.options import PipelineDefsOptions

ROLES = ("storage", "registry", "spark", "state_backend", "source")
_DAGSTER_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
INJECT_TAG = "sparkpoint/inject-failure"
FAILED_RUN_TAG = "sparkpoint/recovers"
RECOVERED_BY_TAG = "sparkpoint/recovered-by"
PIPELINE_TAG = "sparkpoint/pipeline"
OVERTAKEN_TAG = "sparkpoint/overtaken"
PRUNED_TAG = "sparkpoint/pruned"  # the pipeline's name: this checkpoint run pruned its job after committing
FOLLOW_JOB = "follow"  # `<name>_follow`: one step that checkpoints the input as it lands
TICK_TAG = "sparkpoint/tick"  # "true": with no unconsumed batch, a checkpoint of no input (time passes)
# A run in one of these may still start or finish a checkpoint of its pipeline.
IN_FLIGHT = (dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING,
             dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.CANCELING)


@dataclass(frozen=True)
class PipelineScope:
    """One pipeline's names in Dagster, and the options its definitions are built with."""

    pipeline: Pipeline
    options: PipelineDefsOptions = field(default_factory=PipelineDefsOptions)

    @classmethod
    def of(cls, pipeline: Pipeline, options: PipelineDefsOptions | None = None) -> PipelineScope:
        scope = cls(pipeline, options or PipelineDefsOptions())
        if not _DAGSTER_NAME.fullmatch(pipeline.name):
            raise PipelineError(
                f"pipeline name {pipeline.name!r} cannot prefix Dagster job, sensor and resource names "
                "(letters, digits and _ only, not starting with a digit): rename the pipeline "
                "(its job id can stay: job_id=...)"
            )
        if not _DAGSTER_NAME.fullmatch(scope.group_name):
            raise PipelineError(f"group_name {scope.group_name!r} must be letters, digits and _ only")
        return scope

    @property
    def prefix(self) -> str:
        return self.pipeline.name

    @property
    def key_prefix(self) -> tuple[str, ...]:
        given = self.options.key_prefix
        return (self.pipeline.name,) if given is None else (given,) if isinstance(given, str) else tuple(given)

    @property
    def group_name(self) -> str:
        return self.options.group_name or self.pipeline.name

    @property
    def owners(self) -> list[str]:
        return list(self.options.owners)

    @property
    def tags(self) -> dict[str, str]:
        return dict(self.options.tags or {})

    # --- names -------------------------------------------------------------------------------

    def name(self, suffix: str) -> str:
        return f"{self.prefix}_{suffix}"

    def key(self, name: str) -> dg.AssetKey:
        return dg.AssetKey([*self.key_prefix, name])

    @property
    def sstable_keys(self) -> dict[str, dg.AssetKey]:
        return {op.name: self.key(op.name) for op in self.pipeline.operators}

    @property
    def checkpoint_key(self) -> dg.AssetKey:
        return self.key("checkpoint")

    @property
    def input_key(self) -> dg.AssetKey:
        return self.key("input")

    @property
    def output_key(self) -> dg.AssetKey:
        return self.key("output")

    @property
    def pool(self) -> str:
        """One run of this pipeline at a time (the instance gives every pool one slot)."""
        return self.prefix

    @property
    def steps(self) -> frozenset[str]:
        """The op names of its pipeline steps: the checkpoint job's two and the follow job's one
        (what a failed run must have started to need recovery)."""
        return frozenset({self.name("sstables"), self.name("complete"), self.name("follow_op")})

    # --- its runs ----------------------------------------------------------------------------

    def owns_run(self, run: dg.DagsterRun) -> bool:
        """Whether `run` is one of this pipeline's: tagged with its name (its jobs, so its
        sensors' and schedule's runs), or selecting its assets or running its steps (the UI's
        Materialize button runs the implicit `__ASSET_JOB`, which carries no tag of ours)."""
        if run.tags.get(PIPELINE_TAG) == self.pipeline.name:
            return True
        keys = {*self.sstable_keys.values(), self.checkpoint_key, self.output_key}
        if run.asset_selection and keys & set(run.asset_selection):
            return True
        return bool(run.step_keys_to_execute and self.steps & set(run.step_keys_to_execute))

    def runs_in_flight(self, instance: dg.DagsterInstance) -> list[dg.DagsterRun]:
        """This pipeline's runs that are queued or in progress, oldest first: asked of the
        instance, so it holds whatever the instance's concurrency config says."""
        runs = instance.get_runs(dg.RunsFilter(statuses=list(IN_FLIGHT)), limit=500)
        return [r for r in reversed(runs) if self.owns_run(r)]

    def is_follow_run(self, run: dg.DagsterRun) -> bool:
        """Whether `run` is a run of this pipeline's follow job."""
        return run.job_name == self.name(FOLLOW_JOB)

    def waiting_for(self, runs: list[dg.DagsterRun]) -> str:
        """What a sensor or the schedule says while it waits for `runs` (`runs_in_flight`)."""
        shown = ", ".join(f"{r.run_id} ({r.status.value})" for r in runs[:3])
        more = f" and {len(runs) - 3} more" if len(runs) > 3 else ""
        return (f"waiting for run{'s' if len(runs) > 1 else ''} {shown}{more} of pipeline {self.pipeline.name!r} "
                "to finish: one run of a pipeline at a time")

    # --- resources ---------------------------------------------------------------------------

    def resource_key(self, role: str) -> str:
        return self.name(role)

    def resource_keys(self, *roles: str) -> set[str]:
        return {self.resource_key(r) for r in roles}

    def keyed(self, by_role: Mapping[str, Any]) -> dict[str, Any]:
        """Resources (or their run config) by role -> by this pipeline's resource keys."""
        return {self.resource_key(role): value for role, value in by_role.items()}

    def storage(self, context: Any) -> CheckpointStorageResource:
        resource: CheckpointStorageResource = getattr(context.resources, self.resource_key("storage"))
        return resource

    def registry(self, context: Any) -> CheckpointRegistryResource:
        resource: CheckpointRegistryResource = getattr(context.resources, self.resource_key("registry"))
        return resource

    def spark(self, context: Any) -> SparkResource:
        resource: SparkResource = getattr(context.resources, self.resource_key("spark"))
        return resource

    def source(self, context: Any) -> InputResource:
        resource: InputResource = getattr(context.resources, self.resource_key("source"))
        return resource

    def resources(self, context: Any) -> PipelineResources:
        backend: StateBackendResource = getattr(context.resources, self.resource_key("state_backend"))
        return PipelineResources(self.storage(context), self.registry(context), backend, self.source(context))
