"""Dagster resources: checkpoint storage, registry, Spark, state backend, input.

Every field is a plain string, number or boolean, so the launchpad and `EnvVar("...")` can set
it; options that are mappings are JSON text. The embedded defaults need nothing: checkpoints
under `.sparkpoint/checkpoints`, input `.sparkpoint/demo/input` (relative to the working
directory). Values are checked at setup, with a message that names the field.
"""

from sparkpoint.resources.backend import InputResource, StateBackendResource
from sparkpoint.resources.fields import (
    DEFAULT_CHECKPOINTS,
    DEFAULT_INPUT,
    DEFAULT_JOB_ID,
    DEFAULT_LOCAL_DIR,
    DEFAULT_OUTPUT,
    ResourceConfigError,
    with_settings,
)
from sparkpoint.resources.pipeline import PipelineResources, resources_for
from sparkpoint.resources.spark import SparkResource
from sparkpoint.resources.storage import CheckpointRegistryResource, CheckpointStorageResource

__all__ = ["DEFAULT_CHECKPOINTS", "DEFAULT_INPUT", "DEFAULT_JOB_ID", "DEFAULT_LOCAL_DIR", "DEFAULT_OUTPUT",
           "CheckpointRegistryResource", "CheckpointStorageResource", "InputResource", "PipelineResources",
           "ResourceConfigError", "SparkResource", "StateBackendResource", "resources_for", "with_settings"]
