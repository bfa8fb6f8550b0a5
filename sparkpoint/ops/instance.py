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

Without these lines (most existing instances, Dagster+ by default) the pipeline's own sensors and
schedule still wait for its runs in flight (see `sparkpoint.sensors`), but a Materialize click or
another launcher may start a run beside one of them; the run that loses the checkpoint then ends
"overtaken by chk-N of run X; nothing committed". `warn_if_pool_unlimited` says so once, when
the code location loads on such an instance.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

POOL_YAML = """\
concurrency:
  pools:
    granularity: run
    default_limit: 1
"""

INSTANCE_YAML = f"""\
# Written by sparkpoint (sparkpoint/ops/instance.py): one run of each pipeline at a time.
{POOL_YAML}run_queue:
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


def pool_problem(pool: str, *, granularity: str | None, default_limit: int | None,
                 limits: dict[str, int]) -> str | None:
    """What is wrong with how an instance limits `pool` (None: one run at a time). `limits`:
    the limits set for single pools (`dagster instance concurrency set`)."""
    limit = limits.get(pool, default_limit)
    if limit is None:
        return f"gives pool {pool!r} no limit"
    if limit > 1:
        return f"lets {limit} runs of pool {pool!r} run at once"
    if (granularity or "op") != "run":
        said = granularity or "op, Dagster's default"
        return (f"limits pool {pool!r} per op (granularity {said}): another run can take the slot between a run's "
                "two steps")
    return None


def instance_pool_problem(pool: str) -> tuple[str, str] | None:
    """(DAGSTER_HOME, what is wrong) for the instance this process would use; None when it
    limits `pool` to one run at a time, or when there is no instance to read, or it cannot be read."""
    home = os.environ.get("DAGSTER_HOME")
    if not home or not os.path.isdir(home):
        return None
    try:
        import yaml

        path = Path(home) / "dagster.yaml"
        config = (yaml.safe_load(path.read_text()) if path.exists() else None) or {}
        pools = (config.get("concurrency") or {}).get("pools") or {}
        if pool_problem(pool, granularity=pools.get("granularity"), default_limit=pools.get("default_limit"),
                        limits={}) is None:
            return None  # said by dagster.yaml: no need to open the instance's storage
        problem = _problem_in_instance(pool)
    except Exception:  # an instance that cannot be read says nothing here; Dagster reports it itself
        return None
    return (home, problem) if problem else None


def _problem_in_instance(pool: str) -> str | None:
    """The same, asked of the instance (limits set per pool live in its storage)."""
    import dagster as dg

    instance: Any = dg.DagsterInstance.get()
    try:
        config = instance.get_concurrency_config().pool_config
        limits = {p.name: p.limit for p in instance.event_log_storage.get_pool_limits()}
        granularity = config.pool_granularity.value if config.pool_granularity else None
        return pool_problem(pool, granularity=granularity, default_limit=config.default_pool_limit, limits=limits)
    finally:
        instance.dispose()


_SAID: set[tuple[str, str]] = set()


def warn_if_pool_unlimited(pipeline: str, pool: str) -> None:
    """Warn once per process, when the code location loads, if the instance lets runs of
    `pipeline` overlap, naming the `dagster.yaml` lines to add. Silent in a run's own process
    (Dagster's run worker loads the code location again) and where no instance can be read."""
    if multiprocessing.parent_process() is not None or any(a.startswith("execute_") for a in sys.argv[1:3]):
        return
    if (os.environ.get("DAGSTER_HOME", ""), pool) in _SAID:
        return
    found = instance_pool_problem(pool)
    if found is None:
        return
    home, problem = found
    _SAID.add((home, pool))
    log.warning(
        f"sparkpoint: the Dagster instance in {home} {problem}, so runs of pipeline {pipeline!r} may overlap: its "
        "sensors and schedule wait for its runs in flight, but a Materialize click or another launcher does not, "
        "and the run that loses a checkpoint to another ends 'overtaken by chk-N of run X; nothing committed'. "
        f"For one run of a pipeline at a time, add to {home}/dagster.yaml:\n{POOL_YAML}"
    )
