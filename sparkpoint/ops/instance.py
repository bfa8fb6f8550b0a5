"""The Dagster instance settings sparkpoint relies on, and a helper to write them.

Overlapping runs of one pipeline (a schedule tick and a UI click at once) are serialized by that
pipeline's concurrency *pool*: every asset and op `build_pipeline_defs` makes for pipeline
`clicks` declares `pool="clicks"` (`PipelineScope.pool`: the pipeline's name; the sample's is
`sparkpoint`), and the instance gives every pool one slot with `granularity: run`, so the run
queue starts a run of a pipeline only when no other run of the same pipeline is in progress.
Runs of different pipelines have different pools and run side by side; the factory refuses two
pipelines that would write one job directory (same checkpoints location and job id), which
their pools would not keep apart. A pool rather than a run-tag limit because a pool is attached
to the assets themselves: it covers runs of the UI's Materialize button (the implicit
`__ASSET_JOB`, which carries no tag of ours), schedules and sensors alike. Whatever gets through
anyway (another instance, the CLI) is fenced by the exclusive create of `_metadata`: only one
writer commits checkpoint N, the loser deletes its uploads.

`default_limit: 1` is the limit of every pool of the instance that has none of its own, other
code's pools included; give those their own limit in `dagster.yaml` if they need more.

The run queue looks for runs to start every second instead of Dagster's default five: a run an
input sensor requests when a file lands starts up to four seconds sooner (the sensor daemon's own
loop, five seconds, is fixed).
"""

from __future__ import annotations

from pathlib import Path

INSTANCE_YAML = """\
# Written by sparkpoint (sparkpoint/ops/instance.py): one run of each pipeline at a time.
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
