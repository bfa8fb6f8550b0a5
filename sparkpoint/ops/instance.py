"""The Dagster instance settings sparkpoint relies on, and a helper to write them.

Overlapping runs (a schedule tick and a UI click at once) are serialized by the `sparkpoint`
concurrency *pool*: every sparkpoint asset and op declares `pool="sparkpoint"`, and the instance
gives that pool one slot with `granularity: run`, so the run queue starts a run that uses the
pool only when no other such run is in progress. A pool rather than a run-tag limit because a
pool is attached to the assets themselves: it covers runs of the UI's Materialize button (the
implicit `__ASSET_JOB`, which carries no tag of ours), schedules and sensors alike. Whatever
gets through anyway (another instance, the CLI) is fenced by the exclusive create of
`_metadata`: only one writer commits checkpoint N, the loser deletes its uploads.

The run queue looks for runs to start every second instead of Dagster's default five: a run an
input sensor requests when a file lands starts up to four seconds sooner (the sensor daemon's own
loop, five seconds, is fixed).
"""

from __future__ import annotations

from pathlib import Path

INSTANCE_YAML = """\
# Written by sparkpoint (sparkpoint/ops/instance.py): one sparkpoint run at a time.
concurrency:
  pools:
    granularity: run
    default_limit: 1
run_queue:
  dequeue_interval_seconds: 1
telemetry:
  enabled: false
"""


def prepare_dagster_home(home: str | Path) -> Path:
    """Create DAGSTER_HOME with sparkpoint's dagster.yaml unless one is there already."""
    path = Path(home).resolve()
    path.mkdir(parents=True, exist_ok=True)
    config = path / "dagster.yaml"
    if not config.exists():
        config.write_text(INSTANCE_YAML)
    return path
