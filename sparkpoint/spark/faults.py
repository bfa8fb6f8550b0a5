"""Failure injection at named points of the checkpoint protocol, for demos and tests.

An orchestrator passes one of `INJECTION_POINTS` down to the seam (`sparkpoint.pipeline.attempt`);
the seam raises `InjectedFailure` exactly there and leaves everything as a crash would (no
cleanup), so what follows is the real recovery path.

- `before-upload`: inside the Spark job, in subtask 0 of the first operator, after it applied
  its rows and before it snapshots and uploads (the other subtasks may upload: orphans).
- `after-upload`: after the Spark half returned, every upload done and the pending attempt
  persisted, before the checkpoint is completed.
- `before-commit`: in the completing half, after every handle was acknowledged, right before
  `_metadata` is written.

Crash points (`CRASH_POINTS`, `crash_point`) stop the whole process instead, SIGKILL, at named
points of the protocol in the driver or in Spark's Python workers, when the environment asks for
it (`SPARKPOINT_CRASH_AT=<point>[:<n>]`, see `sparkpoint.checkpoint.crash`). `spark_session` arms them:
it records the driver's process group and passes the variables to executors.
"""

from __future__ import annotations

from sparkpoint.checkpoint.crash import CRASH_POINTS, crash_point
from sparkpoint.checkpoint.crash import arm as arm_crash_points
from sparkpoint.checkpoint.errors import SparkpointError

__all__ = [
    "CRASH_POINTS", "INJECTION_POINTS", "InjectedFailure", "arm_crash_points", "check_point", "crash_point", "fail_at",
]

INJECTION_POINTS = ("before-upload", "after-upload", "before-commit")


class InjectedFailure(SparkpointError):
    """A failure asked for on purpose (`sparkpoint/inject-failure`); recovery must heal it."""


def check_point(inject_failure: str | None) -> str | None:
    """Validate a requested injection point (None or '' means none)."""
    if not inject_failure:
        return None
    if inject_failure not in INJECTION_POINTS:
        raise ValueError(
            f"unknown failure injection point {inject_failure!r}; use one of {', '.join(INJECTION_POINTS)}"
        )
    return inject_failure


def fail_at(point: str, inject_failure: str | None, where: str) -> None:
    if inject_failure == point:
        raise InjectedFailure(f"injected failure {point}: {where}")

