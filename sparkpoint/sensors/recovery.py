"""What the recovery sensor remembers between ticks: which run failures it has looked at, and
the failed runs it decided to recover but has not launched a recovery for yet.

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

import dagster as dg

LOOKBACK_SECONDS = 3600.0
FETCH_LIMIT = 100  # failure events read per tick; the rest on the next tick


@dataclass(frozen=True)
class RecoveryCursor:
    after: int | None  # storage id of the last run-failure event looked at (None: none yet)
    waiting: tuple[str, ...] = ()  # failed runs to recover, in the order they failed

    def to_cursor(self) -> str:
        return json.dumps({"after": self.after, "waiting": list(self.waiting)})

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
        waiting = raw.get("waiting")
        return cls(after if isinstance(after, int) else None,
                   tuple(w for w in waiting if isinstance(w, str)) if isinstance(waiting, list) else ())


def new_failures(instance: dg.DagsterInstance, after: int | None) -> tuple[list[str], int | None]:
    """(ids of the runs that failed since the event `after`, oldest first; the new `after`)."""
    kind = dg.DagsterEventType.RUN_FAILURE
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
