"""One pipeline's resources: made from its settings (`resources_for`), and read back as its
config for the run at hand (`PipelineResources`)."""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dagster as dg
import pydantic

from sparkpoint.checkpoint.errors import SparkpointError
from sparkpoint.checkpoint.storage import storage_url
from sparkpoint.pipeline.driver import StatefulPipeline
from sparkpoint.pipeline.runtime import PipelineConfig, validate_config
from sparkpoint.pipeline.settings import of_role
from sparkpoint.pipeline.spec import Pipeline
from sparkpoint.resources.backend import InputResource, StateBackendResource
from sparkpoint.resources.fields import R, ResourceConfigError, json_object, pipeline_value, resource_value
from sparkpoint.resources.spark import SparkResource
from sparkpoint.resources.storage import CheckpointRegistryResource, CheckpointStorageResource
from sparkpoint.tables.spec import table_url


@dataclass(frozen=True)
class PipelineResources:
    """One pipeline's resources, configured for the run at hand."""

    storage: CheckpointStorageResource
    registry: CheckpointRegistryResource
    state_backend: StateBackendResource
    source: InputResource

    def driver(self, pipeline: Pipeline, spark: Any = None) -> StatefulPipeline:
        """`pipeline` with what these resources set on top of its own settings (`spark` None:
        the completing half)."""
        config = self.config(pipeline)
        try:
            return StatefulPipeline(spark, config, pipeline.operators)
        except SparkpointError as e:
            raise ResourceConfigError(str(e)) from e

    def settings(self, pipeline: Pipeline) -> dict[str, Any]:
        """What these resources set, by `PipelineConfig` field (a part of a composite setting such
        as `rocksdb` on top of `pipeline`'s own)."""
        values: dict[str, Any] = {}
        parts: dict[str, dict[str, Any]] = {}
        for role in ("storage", "registry", "state_backend", "source"):
            resource = getattr(self, role)
            for setting in of_role(role):
                field, _, part = (setting.target or setting.name).partition(".")
                if part:
                    parts.setdefault(field, {})[part] = resource_value(setting, resource)
                else:
                    values[field] = resource_value(setting, resource)
        for field, changes in parts.items():
            try:
                values[field] = dataclasses.replace(getattr(pipeline, field), **changes)
            except ValueError as e:
                raise ResourceConfigError(f"state backend: {e}") from e
        return values

    def config(self, pipeline: Pipeline) -> PipelineConfig:
        """`pipeline`'s settings with what these resources set on top (checked; nothing is opened)."""
        storage, backend, source = self.storage, self.state_backend, self.source
        try:
            config = pipeline.config(
                input_url=storage_url(source.input_url), input_options=json_object(source.input_options,
                                                                             "input: input_options"),
                output_url=table_url(source.output_url) if source.output_url else None,
                checkpoints_url=storage.url(), job_id=storage.job_id, storage_options=storage.options(),
                local_dir=str(Path(backend.local_dir).resolve()), **self.settings(pipeline),
            )
            validate_config(config)
            return config
        except SparkpointError as e:
            raise ResourceConfigError(str(e)) from e


def resources_for(pipeline: Pipeline) -> dict[str, dg.ConfigurableResource]:  # type: ignore[type-arg]
    """The resources of `pipeline`, by role; the launchpad (or `EnvVar`s) override any field.

    The pipeline's settings are the *defaults* of resource classes of its own, not values given
    to the shared classes: Dagster fills the fields a run config leaves out from the class's
    defaults, so a launch that sets only `job_id` would otherwise read and write the embedded
    defaults' locations (the sample's `.sparkpoint/checkpoints`), not the pipeline's."""
    storage = _own(CheckpointStorageResource, pipeline,
                   checkpoints_url=pipeline.location("checkpoints"), job_id=pipeline.effective_job_id,
                   storage_options=json.dumps(dict(pipeline.storage_options)))
    input_options = dict(pipeline.input_options if pipeline.input_options is not None else pipeline.storage_options)
    return {
        "storage": storage,
        "registry": _own(CheckpointRegistryResource, pipeline, storage=storage, **_settings_of(pipeline, "registry")),
        "spark": _own(SparkResource, pipeline, app_name=pipeline.name),
        "state_backend": _own(StateBackendResource, pipeline, local_dir=pipeline.location("local"),
                              **_settings_of(pipeline, "state_backend")),
        "source": _own(InputResource, pipeline,
                       input_url=pipeline.location("input"), input_options=json.dumps(input_options),
                       output_url=pipeline.config().output_url or "",
                       **_settings_of(pipeline, "source")),
    }


def _settings_of(pipeline: Pipeline, role: str) -> dict[str, Any]:
    """`pipeline`'s settings that are fields of the resource of `role`, by field name."""
    return {setting.resource_field or setting.name: pipeline_value(setting, pipeline) for setting in of_role(role)}


def _own(cls: type[R], pipeline: Pipeline, **defaults: Any) -> R:
    """An instance of a subclass of `cls` whose field defaults are `defaults` (a resource given as
    a field, like the registry's storage, is passed as a value)."""
    nested = {k: defaults.pop(k) for k in list(defaults) if isinstance(defaults[k], dg.ConfigurableResource)}
    name = re.sub(r"[^0-9A-Za-z_]", "_", pipeline.name)
    fields: dict[str, Any] = {k: (cls.model_fields[k].annotation, v) for k, v in defaults.items()}
    own = pydantic.create_model(f"{name}_{cls.__name__}", __base__=cls, __module__=cls.__module__, **fields)
    return own(**nested)
