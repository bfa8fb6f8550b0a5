"""How the factory builds one pipeline's Dagster definitions, as one frozen value: the keywords of
`build_pipeline_defs` (the component's attributes of the same names fill it too), which the
scope (`sparkpoint.resources.scope`) carries to every builder of assets, jobs and sensors.

The pipeline's own settings (`settle_seconds`, retention, ...) are not options: they come from
`sparkpoint.pipeline.settings.SETTINGS` through the pipeline and its resources.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import dagster as dg

RETRY_SECONDS = 30.0  # the input sensor's first re-offer of an unchanged file (`sparkpoint.sensors.landing`)

# (input URL, the files checkpoints consumed) -> the batch file it landed, or None: what a checkpoint
# step that finds no unconsumed batch calls first (the sample lands the next batch of its stream).
LandBatch = Callable[[str, Sequence[str]], str | None]


@dataclass(frozen=True, kw_only=True)
class PipelineDefsOptions:
    """The options of one pipeline's definitions; each field is the keyword of `build_pipeline_defs`
    of the same name, which documents it. `land_batch` is not a keyword of it: a code location
    of its own (the sample's) sets it."""

    key_prefix: str | Sequence[str] | None = None
    group_name: str | None = None
    owners: Sequence[str] = ()
    tags: Mapping[str, str] | None = None
    schedule: str | None = None
    schedule_status: dg.DefaultScheduleStatus = dg.DefaultScheduleStatus.RUNNING
    landing_sensor: bool = True
    resources: Mapping[str, dg.ConfigurableResource] | None = None  # type: ignore[type-arg]
    landing_settle_seconds: float | None = None
    landing_retry_seconds: float = RETRY_SECONDS
    tick: bool = False
    land_batch: LandBatch | None = field(default=None, compare=False)

    def with_(self, **changes: Any) -> PipelineDefsOptions:
        """These options with `changes` (keywords of `build_pipeline_defs`); an unknown one is a TypeError."""
        return replace(self, **changes) if changes else self
