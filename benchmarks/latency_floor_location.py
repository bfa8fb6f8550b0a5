"""Dagster's own floor for `bench_latency --only floor`: the least a landed file can cost through a
sensor and a run on the instance and `dagster dev` that serve sparkpoint's pipeline beside it.

An asset that does nothing (`landed`, key `latency_floor/landed`), a job of it alone on the
in-process executor (as sparkpoint's pipeline jobs), and a sensor on the directory the bench names
(`SPARKPOINT_LATENCY_FLOOR_DIR`) with the interval of sparkpoint's input sensor
(`SPARKPOINT_LATENCY_FLOOR_INTERVAL`, which the bench reads from sparkpoint's definitions): each
tick lists the directory and requests one run per file it has not seen (run key and tag
`latency_floor/landed` = the file's name; the cursor is the last name requested). It imports
Dagster alone, so a run's process costs what any Dagster run's does."""

from __future__ import annotations

import os

import dagster as dg

DIR_ENV, INTERVAL_ENV = "SPARKPOINT_LATENCY_FLOOR_DIR", "SPARKPOINT_LATENCY_FLOOR_INTERVAL"
PREFIX, TAG = "latency_floor", "latency_floor/landed"
JOB, SENSOR = "latency_floor_job", "latency_floor_sensor"


@dg.asset(key_prefix=PREFIX)
def landed() -> None:
    """Nothing: its materialization event is the floor's end."""


floor_job = dg.define_asset_job(JOB, selection=[landed], executor_def=dg.in_process_executor)


def new_files(directory: str, cursor: str | None) -> list[str]:
    """The files in `directory` after `cursor` (the last one requested), by name: the bench lands
    them in name order."""
    return sorted(n for n in os.listdir(directory) if n > (cursor or ""))


def floor_sensor(interval: int) -> dg.SensorDefinition:
    @dg.sensor(name=SENSOR, job=floor_job, minimum_interval_seconds=interval,
               default_status=dg.DefaultSensorStatus.RUNNING)
    def sensor(context: dg.SensorEvaluationContext) -> dg.SensorResult:
        files = new_files(os.environ[DIR_ENV], context.cursor)
        return dg.SensorResult(run_requests=[dg.RunRequest(run_key=n, tags={TAG: n}) for n in files],
                               cursor=files[-1] if files else context.cursor)

    return sensor


defs = (dg.Definitions(assets=[landed], jobs=[floor_job], sensors=[floor_sensor(int(os.environ[INTERVAL_ENV]))])
        if DIR_ENV in os.environ else dg.Definitions())
