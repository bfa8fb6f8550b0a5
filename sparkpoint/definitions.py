"""The sparkpoint Dagster code location: `dg dev` (or `dagster dev -w workspace.yaml`) loads `defs`,
the sample pipeline built by the factory like any user's (`pipeline_defs`). With the sample's own
input, a materialization that finds no batch lands the next batch of the sample stream first
(`sparkpoint.sample.land_sample_batch`), so the input sensor is stopped and the schedule (cron from
`SPARKPOINT_CHECKPOINT_CRON`) too.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import dagster as dg

from sparkpoint.checkpoint.storage import storage_url
from sparkpoint.factory import PipelineDefs, pipeline_defs
from sparkpoint.sample import land_sample_batch, pipeline


def sample_stream(input_url: str, consumed: Sequence[str]) -> str | None:
    """The next batch of the sample stream, when a run reads the sample's own input (a run whose
    resources point elsewhere reads only what lands there)."""
    if input_url != storage_url(pipeline.location("input")):
        return None
    return land_sample_batch(input_url, consumed)


def sample_defs(**keywords: Any) -> PipelineDefs:
    """The sample pipeline's definitions (`keywords`: the factory's, on top): its input directory
    made, and a checkpoint step that finds no batch in it lands the next one of the sample stream."""
    Path(pipeline.location("input")).mkdir(parents=True, exist_ok=True)
    return pipeline_defs(pipeline, land_batch=sample_stream, landing_sensor=False, **keywords)


sample = sample_defs(schedule=os.environ.get("SPARKPOINT_CHECKPOINT_CRON", "*/10 * * * *"),
                     schedule_status=dg.DefaultScheduleStatus.STOPPED)
defs = sample.definitions()
