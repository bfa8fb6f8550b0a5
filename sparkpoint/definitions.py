"""The sparkpoint Dagster code location: `dg dev` (or `dagster dev -w workspace.yaml`) loads `defs`,
the sample pipeline built by the factory like any user's (`build_pipeline_defs`). With the sample's
own input, a materialization that finds no batch lands the next batch of the sample stream first,
so the input sensor is stopped and the schedule (cron from `SPARKPOINT_CHECKPOINT_CRON`) too.
"""

from __future__ import annotations

import os

import dagster as dg

from sparkpoint.factory import pipeline_defs
from sparkpoint.sample import pipeline

sample = pipeline_defs(
    pipeline, sample_stream=True, landing_sensor=False,
    schedule=os.environ.get("SPARKPOINT_CHECKPOINT_CRON", "*/10 * * * *"),
    schedule_status=dg.DefaultScheduleStatus.STOPPED,
)
defs = sample.definitions()
