"""When the input sensor offers a landed batch file: pure functions of plain facts, then the two
look-ups in the Dagster instance they need.

A run key is spent by the run it launched, whatever that run's outcome: Dagster never launches a
second run for a key a sensor used (DESIGN rule 12). So the key of a file's run counts the runs
of it before (`landed-<file>`, then `landed-<file>-1`, ...). While a run of the file, or the
recovery of one that failed, is queued or in progress, the sensor waits for it. Once every run of
the file ended and the file is still not consumed (the run failed, was cancelled, failed in
resource setup before any step, or succeeded on another batch), the file is offered again: at
once if it changed since that run (its size or modification time: the cause may be gone),
otherwise after a delay that doubles with each run, so a file that fails the same way every time
is not run every few seconds, and a failed run's recovery sensor has time to launch its recovery.

A file is offered only once it has settled (`sparkpoint.spark.settling`, the rule every batch
applies too): its size and modification time unchanged for `settle_seconds`, seen from its
modification time or across two ticks (the cursor keeps what the last tick saw, for filesystems
whose clock runs ahead or that give no time). A file still being
copied (a local `cp`, NFS, a FUSE mount) is not read half-written. A writer that may pause for
longer writes under a name starting with `_` or `.` and renames the file when it is complete:
the source skips those names.

Every skip says what the sensor waits for.

The sensor's cursor (`InputCursor`) keeps, besides the first pending file as the last tick saw it,
what its last observation of the input asset reported: each tick reports an observation of
`<name>/input` (files pending, the next and the newest file) when that changed, and otherwise once
every `OBSERVE_EVERY_SECONDS`, so the asset shows when the sensor last looked without an event
every few seconds. And it carries a failure injection a user arms for the sensor's next run, in
one step: set the cursor to `{"inject_failure": "after-upload"}` (the sensor page's "Set cursor
value", or `dagster sensor cursor <name>_input_sensor --set ...`). The next run the sensor requests
gets the tag `sparkpoint/inject-failure` and the cursor forgets it: exactly one run fails there.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import dagster as dg

from sparkpoint.resources.options import RETRY_SECONDS
from sparkpoint.resources.scope import FAILED_RUN_TAG, INJECT_TAG
from sparkpoint.spark.faults import INJECTION_POINTS
from sparkpoint.spark.settling import FileSeen
from sparkpoint.spark.source import BatchStat

LANDED_TAG = "sparkpoint/landed"
SIZE_TAG, MODIFIED_TAG = "sparkpoint/landed-size", "sparkpoint/landed-modified"
RETRY_MAX_SECONDS = 1800.0  # the re-offer of an unchanged file: RETRY_SECONDS, doubling with each run, up to this
OBSERVE_EVERY_SECONDS = 300.0  # an unchanged input is observed again after this (the UI shows when)
_FINISHED = {dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED}


def arm_hint(sensor_name: str) -> str:
    points = " | ".join(INJECTION_POINTS)
    return (f"set the cursor of {sensor_name} to {{\"inject_failure\": \"{INJECTION_POINTS[1]}\"}} ({points}), "
            f"or delete it (dagster sensor cursor {sensor_name} --delete)")


@dataclass(frozen=True)
class InputCursor:
    """What the input sensor keeps between ticks: the first pending file as last seen, what its
    last observation of the input reported and when, and a failure injection armed by a user for
    the next run it requests (`problem`: why a cursor a user set cannot be followed)."""

    seen: FileSeen | None = None
    observed: str | None = None
    observed_at: float = 0.0
    inject_failure: str | None = None
    problem: str | None = None

    def to_cursor(self) -> str:
        raw: dict[str, Any] = json.loads(self.seen.to_cursor()) if self.seen else {}
        if self.observed is not None:
            raw.update(observed=self.observed, observed_at=self.observed_at)
        if self.inject_failure is not None:
            raw["inject_failure"] = self.inject_failure
        return json.dumps(raw)

    @classmethod
    def from_cursor(cls, cursor: str | None, sensor_name: str) -> InputCursor:
        """The cursor the sensor wrote, or one a user set (earlier versions' cursors are read too)."""
        if not cursor or not cursor.strip():
            return cls()
        try:
            raw = json.loads(cursor)
        except ValueError:
            raw = None
        if not isinstance(raw, dict):
            return cls(problem=f"the cursor {cursor[:200]!r} is not a JSON object: {arm_hint(sensor_name)}")
        observed, observed_at = raw.get("observed"), raw.get("observed_at")
        inject = raw.get("inject_failure")
        problem = None
        if inject is not None and inject not in INJECTION_POINTS:
            problem = f"the cursor arms an unknown failure injection point {inject!r}: {arm_hint(sensor_name)}"
        return cls(FileSeen.from_cursor(cursor), observed if isinstance(observed, str) else None,
                   float(observed_at) if isinstance(observed_at, (int, float)) else 0.0,
                   inject if isinstance(inject, str) and inject else None, problem)

    def observe(self, pending: Sequence[str], now: float,
                every_seconds: float = OBSERVE_EVERY_SECONDS) -> tuple[InputCursor, bool]:
        """(the cursor after this tick, whether this tick reports an observation of the input)."""
        what = json.dumps([len(pending), pending[0] if pending else None, pending[-1] if pending else None])
        if what == self.observed and now - self.observed_at < every_seconds:
            return self, False
        return replace(self, observed=what, observed_at=now), True

    def say(self, reason: str) -> str:
        """A skip reason, saying what is armed for the next run."""
        if self.inject_failure is None:
            return reason
        return f"{reason} (armed: the next run gets {INJECT_TAG}={self.inject_failure})"


@dataclass(frozen=True)
class LandedRun:
    """A run the input sensor requested for a file, as the decision needs it."""

    run_id: str
    status: str  # Dagster's run status, e.g. FAILURE
    run_key: str | None
    ended_at: float | None  # None while it is queued or in progress
    size: int | None = None  # the file as it was when the run was requested (its tags)
    modified: float | None = None

    @property
    def active(self) -> bool:
        return self.ended_at is None


@dataclass(frozen=True)
class Landing:
    """The decision: a run key to request (with its tags), or None and what the sensor waits for."""

    run_key: str | None
    reason: str
    tags: Mapping[str, str]
    again: bool = False  # a re-offer of a file that earlier runs did not consume


def run_key(name: str, attempt: int) -> str:
    return f"landed-{name}" if attempt == 0 else f"landed-{name}-{attempt}"


def retry_delay(ended_runs: int, retry_seconds: float = RETRY_SECONDS) -> float:
    """How long after the last run of an unchanged file it is offered again."""
    return float(min(retry_seconds * 2 ** max(ended_runs - 1, 0), RETRY_MAX_SECONDS))


def landing_decision(
    name: str, stat: BatchStat, runs: Sequence[LandedRun], recoveries: Mapping[str, str], now: float,
    retry_seconds: float = RETRY_SECONDS,
) -> Landing:
    """Whether to request a run for the settled first pending file `name`. `runs`: the sensor's
    earlier runs of it, any order; `recoveries`: failed run id -> its recovery run still queued
    or in progress."""
    tags = {LANDED_TAG: name, SIZE_TAG: str(stat.size), MODIFIED_TAG: repr(stat.modified)}
    for run in runs:
        if run.active:
            return Landing(None, f"waiting for run {run.run_id} of {name} ({run.status})", tags)
        if run.run_id in recoveries:
            return Landing(None, f"waiting for recovery run {recoveries[run.run_id]} of run {run.run_id}, "
                                 f"which failed on {name}", tags)
    if not runs:
        return Landing(run_key(name, 0), f"{name} landed", tags)
    used = {run.run_key for run in runs}
    attempt = len(runs)
    while run_key(name, attempt) in used:  # a deleted run freed a lower number
        attempt += 1
    last = max(runs, key=lambda r: r.ended_at or 0.0)
    if (last.size, last.modified) != (stat.size, stat.modified) and last.size is not None:
        return Landing(run_key(name, attempt), f"{name} changed since run {last.run_id} ({last.status})", tags,
                       again=True)
    due = (last.ended_at or 0.0) + retry_delay(len(runs), retry_seconds)
    ran = f"{len(runs)} run{'s' if len(runs) > 1 else ''} of {name} ended without consuming it"
    if now < due:
        return Landing(None, f"{ran}, the last {last.run_id} with {last.status}: offering it again in "
                             f"{due - now:.0f} s, or once it changes", tags)
    return Landing(run_key(name, attempt), f"{ran}: offering it again", tags, again=True)


# --- the look-ups ---------------------------------------------------------------------------------


def landed_runs(instance: dg.DagsterInstance, sensor_name: str, name: str) -> list[LandedRun]:
    """The runs `sensor_name` requested for file `name` (Dagster tags each with the sensor's name)."""
    records = instance.get_run_records(dg.RunsFilter(tags={LANDED_TAG: name, "dagster/sensor_name": sensor_name}))
    return [_landed(r) for r in records]


def active_recoveries(instance: dg.DagsterInstance, runs: Sequence[LandedRun]) -> dict[str, str]:
    """Failed run id -> the id of its recovery run that is queued or in progress."""
    found = {}
    for run in runs:
        if run.status != dg.DagsterRunStatus.FAILURE.value:
            continue
        for record in instance.get_run_records(dg.RunsFilter(tags={FAILED_RUN_TAG: run.run_id})):
            if record.dagster_run.status not in _FINISHED:
                found[run.run_id] = record.dagster_run.run_id
    return found


def _landed(record: dg.RunRecord) -> LandedRun:
    run = record.dagster_run
    ended = None
    if run.status in _FINISHED:
        ended = record.end_time or record.update_timestamp.timestamp()
    size, modified = _number(run.tags.get(SIZE_TAG)), _number(run.tags.get(MODIFIED_TAG))
    return LandedRun(run.run_id, run.status.value, run.tags.get("dagster/run_key"), ended,
                     int(size) if size is not None else None, modified)


def _number(text: str | None) -> float | None:
    """A number a tag holds (None for no tag, "None", or an earlier version's run without one)."""
    try:
        return float(text) if text not in (None, "None") else None
    except ValueError:
        return None
