"""When the retention sensor prunes: a pure function of plain facts (`retention_decision`), then
the tick that gathers them from the Dagster instance.

After new checkpoints, it prunes each job they were written to, with the resource config of the
run that wrote it (a run launched for another job id is pruned there), when the checkpoint said
something is due (`prune_due`: a lowered retention, attempts that can never complete) or the
orphan sweep's grace period has passed since that job's last prune. Otherwise nothing: no run
after every checkpoint. One prune per distinct job configuration per tick. A checkpoint whose own
run pruned after committing it (the checkpoint job does, when a prune is due: tagged
`sparkpoint/pruned`) needs no prune run: the sensor launches one only for checkpoints no
checkpoint run pruned after (the follow job's, a recovery's), so a prune run never sits between
a landed file and its checkpoint run.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import dagster as dg

from sparkpoint.pipeline.maintenance import prune_reason
from sparkpoint.resources.scope import PRUNED_TAG, PipelineScope
from sparkpoint.sensors.recovery import resources_config

PRUNE_BECAUSE_TAG = "sparkpoint/prune-because"


@dataclass(frozen=True)
class CheckpointSeen:
    """A materialization of the checkpoint asset, as the decision needs it."""

    storage_id: int
    config: Mapping[str, Any]  # the resources' config of the run that wrote it (as the prune job takes it)
    prune_due: tuple[str, ...] = ()  # what its step said is due ("prune_due" in its metadata)
    pruned_in_run: bool = False  # its run pruned the job after committing it (`PRUNED_TAG`)

    @property
    def job(self) -> str:
        """Which job directory it was written to, as a key: its resources' config."""
        return json.dumps(dict(self.config), sort_keys=True)


@dataclass(frozen=True)
class RetentionCursor:
    """The newest materialization looked at, and when each job (by `CheckpointSeen.job`) was last pruned."""

    storage_id: int | None = None
    pruned: Mapping[str, float] = field(default_factory=dict)

    def to_cursor(self) -> str:
        return json.dumps({"storage_id": self.storage_id, "pruned": dict(self.pruned)})

    @classmethod
    def from_cursor(cls, cursor: str | None) -> RetentionCursor:
        raw = json.loads(cursor) if cursor else {}
        if not isinstance(raw, dict):  # an earlier version's cursor: the storage id alone
            return cls(int(raw))
        return cls(raw.get("storage_id"), dict(raw.get("pruned", {})))


@dataclass(frozen=True)
class Prune:
    """A prune run to request."""

    run_key: str
    config: Mapping[str, Any]
    because: str


def retention_decision(new: Sequence[CheckpointSeen], pruned: Mapping[str, float], now: float,
                       orphan_grace_seconds: float) -> tuple[list[Prune], dict[str, float]]:
    """The prunes to request for the checkpoints `new` (newest first), at most one per job, and
    when each job was last pruned after them."""
    pruned, prunes, requested = dict(pruned), [], set()
    # A checkpoint run that pruned after its commit is the job's last prune, whichever of the new
    # checkpoints it made: the ones after it ask for a prune run only for what they say is due.
    pruned.update({seen.job: now for seen in new if seen.pruned_in_run})
    for seen in new:
        if seen.job in requested:
            continue
        if seen.pruned_in_run:  # its run pruned after it: nothing left of the older ones
            requested.add(seen.job)
            continue
        because = prune_reason(seen.prune_due, pruned.get(seen.job), now, orphan_grace_seconds)
        if because is not None:
            pruned[seen.job] = now
            requested.add(seen.job)
            prunes.append(Prune(f"prune-after-{seen.storage_id}", seen.config, because))
    return prunes, pruned


# --- the tick ------------------------------------------------------------------------------------


def retention_tick(scope: PipelineScope, context: dg.SensorEvaluationContext, prune_job: dg.JobDefinition,
                   orphan_grace_seconds: float) -> list[dg.RunRequest] | dg.SkipReason:
    """The retention sensor's tick: look at the checkpoints since the cursor, unless a run of the
    pipeline is in flight (the cursor stays: the next tick looks at them again)."""
    cursor = RetentionCursor.from_cursor(context.cursor)
    records = context.instance.fetch_materializations(scope.checkpoint_key, limit=100, ascending=False).records
    new = [r for r in records if cursor.storage_id is None or r.storage_id > cursor.storage_id]
    if not new:
        return dg.SkipReason("no new checkpoint since the last look" if records else "no checkpoint yet")
    busy = scope.runs_in_flight(context.instance)
    if busy:
        return dg.SkipReason(f"{len(new)} new checkpoint{'s' if len(new) > 1 else ''} to look at; "
                             f"{scope.waiting_for(busy)}")
    seen = []
    for record in new:
        run = context.instance.get_run_by_id(record.run_id)
        seen.append(CheckpointSeen(record.storage_id, resources_config(run, prune_job) if run is not None else {},
                                   _prune_due(record.asset_materialization),
                                   pruned_in_run=run is not None and PRUNED_TAG in run.tags))
    prunes, pruned = retention_decision(seen, cursor.pruned, time.time(), orphan_grace_seconds)
    context.update_cursor(RetentionCursor(records[0].storage_id, pruned).to_cursor())
    if not prunes:
        return dg.SkipReason("nothing to prune: retention kept up in the checkpoint step, orphan sweep not due")
    return [dg.RunRequest(run_key=p.run_key, run_config={"resources": dict(p.config)} if p.config else {},
                          tags={PRUNE_BECAUSE_TAG: p.because}) for p in prunes]


def _prune_due(materialization: dg.AssetMaterialization | None) -> tuple[str, ...]:
    entry = materialization.metadata.get("prune_due") if materialization is not None else None
    return tuple(entry.value) if entry is not None and isinstance(entry.value, list) else ()
