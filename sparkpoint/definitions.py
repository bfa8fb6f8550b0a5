"""The sparkpoint Dagster code location: `dagster dev -w workspace.yaml` or `dg dev` loads `defs`."""

from __future__ import annotations

import dagster as dg

from sparkpoint.assets import ASSET_CHECKS, ASSETS
from sparkpoint.ops import JOBS, checkpoint_schedule
from sparkpoint.resources import default_resources
from sparkpoint.sensors import SENSORS

defs = dg.Definitions(
    assets=ASSETS,
    asset_checks=ASSET_CHECKS,
    jobs=JOBS,
    schedules=[checkpoint_schedule],
    sensors=SENSORS,
    resources=default_resources(),
)
