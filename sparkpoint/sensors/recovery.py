"""What the recovery sensor remembers between ticks: which run failures it has looked at, the
failed runs it decided to recover but has not launched a recovery for yet, and the failed runs of
the follow job, whose job it launches again once their recovery succeeded.

A recovery waits while a run of its pipeline is queued or in progress (one run of a pipeline at a
time, whatever the instance's concurrency config), so a failure cannot always be acted on in the
tick that sees it. Dagster's run-failure sensors see each failure once and move on; this sensor
reads the instance's run-failure events itself and keeps the failed runs still to recover in its
cursor until a recovery run of each exists (DESIGN rule 12: a failure is never dropped while the
sensor waits). A sensor without a cursor (its first tick) looks back `LOOKBACK_SECONDS`, so a
failure just before a deploy is not missed; one with the cursor of the run-failure sensor of
earlier versions goes on from where that one stopped.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Literal

import dagster as dg

LOOKBACK_SECONDS = 3600.0
FETCH_LIMIT = 100  # failure events read per tick; the rest on the next tick


@dataclass(frozen=True)
class RecoveryCursor:
    after: int | None  # storage id of the last run-failure event looked at (None: none yet)
    waiting: tuple[str, ...] = ()  # failed runs to recover, in the order they failed
    follow_again: tuple[str, ...] = ()  # failed follow runs: the follow job is launched again once recovered

    def to_cursor(self) -> str:
        return json.dumps({"after": self.after, "waiting": list(self.waiting), "follow_again": list(self.follow_again)})

    @classmethod
    def from_cursor(cls, cursor: str | None) -> RecoveryCursor:
        try:
            raw = json.loads(cursor or "null")
        except ValueError:
            return cls(None)
        if not isinstance(raw, dict):
            return cls(None)
        if "record_id" in raw:  # the cursor of this sensor as a Dagster run-failure sensor
            return cls(int(raw["record_id"]) if isinstance(raw["record_id"], int) else None)
        after = raw.get("after")
        return cls(after if isinstance(after, int) else None, _ids(raw.get("waiting")), _ids(raw.get("follow_again")))


def _ids(value: object) -> tuple[str, ...]:
    return tuple(w for w in value if isinstance(w, str)) if isinstance(value, list) else ()


def new_failures(instance: dg.DagsterInstance, after: int | None) -> tuple[list[str], int | None]:
    """(ids of the runs that failed since the event `after`, oldest first; the new `after`)."""
    kind: Literal[dg.DagsterEventType.RUN_FAILURE] = dg.DagsterEventType.RUN_FAILURE
    if after is None:
        flt = dg.RunStatusChangeRecordsFilter(kind, after_timestamp=time.time() - LOOKBACK_SECONDS)
    else:
        flt = dg.RunStatusChangeRecordsFilter(kind, after_storage_id=after)
    records = instance.fetch_run_status_changes(flt, limit=FETCH_LIMIT, ascending=True).records
    if records:
        return list(dict.fromkeys(r.event_log_entry.run_id for r in records)), records[-1].storage_id
    if after is None:  # nothing in the look-back: go on from the newest failure event, if any
        newest = instance.fetch_run_status_changes(kind, limit=1).records
        return [], newest[0].storage_id if newest else 0
    return [], after


@dataclass(frozen=True)
class FollowAgain:
    """What to do about the failed follow runs the sensor keeps: the one to launch the follow job
    again for (its recovery succeeded), those still waiting for their recovery, and notes on
    those it lets go."""

    due: str | None
    still: tuple[str, ...]
    notes: tuple[str, ...]


def follow_again(instance: dg.DagsterInstance, failed_follow_runs: tuple[str, ...], recover_job: str,
                 follow_job: str, failed_tag: str) -> FollowAgain:
    """Per failed follow run: its recovery run (tagged `failed_tag`) still to come or in flight:
    kept; succeeded: due, unless a follow run was started since it failed; failed or cancelled:
    let go (a failed recovery is not recovered again, nor followed after)."""
    due, still, notes = None, [], []
    for run_id in failed_follow_runs:
        records = instance.get_run_records(dg.RunsFilter(tags={failed_tag: run_id}, job_name=recover_job),
                                           order_by="create_timestamp", ascending=True)
        if not records or records[-1].dagster_run.status not in _ENDED:
            still.append(run_id)
            continue
        recovery = records[-1].dagster_run
        if recovery.status != dg.DagsterRunStatus.SUCCESS:
            notes.append(f"recovery run {recovery.run_id} of follow run {run_id} {recovery.status.value.lower()}: "
                         f"{follow_job} is not launched again; launch it once the cause is fixed")
            continue
        since = instance.get_run_records(dg.RunsFilter(job_name=follow_job, created_after=records[-1].create_timestamp),
                                         limit=1)
        if since:
            notes.append(f"follow run {since[0].dagster_run.run_id} started after the recovery of {run_id}")
        elif due is None:
            due = run_id
        else:
            still.append(run_id)
    return FollowAgain(due, tuple(still), tuple(notes))


_ENDED = {dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED}
