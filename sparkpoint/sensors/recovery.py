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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import dagster as dg

from sparkpoint.resources.scope import FAILED_RUN_TAG, PipelineScope

LOOKBACK_SECONDS = 3600.0
FETCH_LIMIT = 100  # failure events read per tick; the rest on the next tick
_ENDED = {dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED}
WILL_RETRY_TAG = "dagster/will_retry"
FOLLOWS_AFTER_TAG = "sparkpoint/follows-after"  # a follow run launched again after the recovery of this failed one
NOT_RECOVERED_TAG = "sparkpoint/not-recovered"
# Failures of the configuration or the input itself, before any upload: a recovery with the
# same config would fail the same way.
CONFIG_ERRORS = frozenset({"ResourceConfigError", "DagsterInvalidConfigError", "SourceError", "SourceSchemaError",
                           "BadInputFile", "PipelineError", "EventTimeError", "OperatorStateMismatch",
                           "StateSchemaIncompatible"})


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


# --- which failed runs to recover ----------------------------------------------------------------


def recovery_decision(
    scope: PipelineScope, job_name: str, tags: Mapping[str, str], started_steps: Iterable[str],
    failures: Iterable[str] = (),
) -> str | None:
    """None: recover this failed run; otherwise why not. `failures` are the class names of the
    errors its pipeline steps failed with (their causes included)."""
    if tags.get("sparkpoint/job") == "recover" or job_name == scope.name("recover"):
        return f"run of a recover job ({job_name}) itself"
    if tags.get(WILL_RETRY_TAG, "").lower() == "true":
        return "Dagster will retry this run"
    if not scope.steps & set(started_steps):
        return f"it ran none of pipeline {scope.pipeline.name!r}'s steps"
    failed = set(failures)
    if "BadInputFile" in failed and failed <= CONFIG_ERRORS:
        return (f"a bad input file failed its checks before any upload (on_bad_file=\"fail\"): a recovery would fail "
                f"the same way. Land a fixed copy, skip the file with the {scope.name('skip_file')} job, or set "
                "on_bad_file=\"skip\"")
    if failed and failed <= CONFIG_ERRORS:
        return f"it failed on its configuration or input ({', '.join(sorted(failed))}) before any upload: fix it " \
               "and rerun"
    return None


def not_recovered_note(scope: PipelineScope, job_name: str, tags: Mapping[str, str]) -> str | None:
    """What a failed run of this pipeline's own recover job is tagged with (None for any other run)."""
    if job_name != scope.name("recover"):
        return None
    healed = tags.get(FAILED_RUN_TAG)
    what = f"the recovery of run {healed}" if healed else "this recovery"
    return (f"{what} failed and is not recovered again: fix the cause, then launch {scope.name('recover')}"
            + (f" with failed_run_id {healed}" if healed else ""))


def resources_config(run: dg.DagsterRun, job: dg.JobDefinition) -> dict[str, Any]:
    """The run's resource config for the resources `job` uses (a run launched from the launchpad
    for another job id carries it; the defaults fill in the rest)."""
    config: dict[str, Any] = dict((run.run_config or {}).get("resources") or {})  # type: ignore[call-overload]
    return {key: value for key, value in config.items() if key in job.required_resource_keys}


def _failure_classes(instance: dg.DagsterInstance, run_id: str, steps: frozenset[str]) -> set[str]:
    """Class names of the errors the run's pipeline steps failed with, and of their causes."""
    names: set[str] = set()
    for entry in instance.all_logs(run_id, of_type=dg.DagsterEventType.STEP_FAILURE):
        event = entry.dagster_event
        if event is None or event.step_key not in steps:
            continue
        error = event.step_failure_data.error
        while error is not None:
            names.add(error.cls_name or "")
            error = error.cause
    names.discard("DagsterExecutionStepExecutionError")  # the wrapper around the user code's error
    return names


def why_not_recover(scope: PipelineScope, instance: dg.DagsterInstance, run_id: str) -> str | None:
    """None: recover failed run `run_id`; otherwise why not (a failed recover run is tagged
    with what to do, on the run itself, where the UI shows it)."""
    run = instance.get_run_by_id(run_id)
    if run is None:
        return "deleted"
    note = not_recovered_note(scope, run.job_name, run.tags)
    if note:
        instance.add_run_tags(run.run_id, {NOT_RECOVERED_TAG: note})
        return note
    started = {e.step_key for e in instance.all_logs(run.run_id, of_type=dg.DagsterEventType.STEP_START)
               if e.step_key}
    return recovery_decision(scope, run.job_name, run.tags, started,
                             _failure_classes(instance, run.run_id, scope.steps))


def recovery_of(instance: dg.DagsterInstance, run_id: str, recover_job: str) -> bool:
    return bool(instance.get_run_ids(dg.RunsFilter(tags={FAILED_RUN_TAG: run_id}, job_name=recover_job), limit=1))


# --- the tick ------------------------------------------------------------------------------------


def recovery_tick(scope: PipelineScope, context: dg.SensorEvaluationContext, recover_job: dg.JobDefinition,
                  follow_job: dg.JobDefinition) -> dg.RunRequest | dg.SkipReason:
    """The recovery sensor's tick: the failures since the cursor, those of them to recover kept in
    it until a recovery run of each exists; one recovery launched at a time, none while a run of
    the pipeline is in flight; the follow job again after the recovery of a failed follow run."""
    instance = context.instance
    cursor = RecoveryCursor.from_cursor(context.cursor)
    failed, after = new_failures(instance, cursor.after)
    waiting, said, following = list(cursor.waiting), [], list(cursor.follow_again)
    for run_id in failed:
        why_not = why_not_recover(scope, instance, run_id)
        if why_not:
            said.append(f"run {run_id}: {why_not}")
        elif run_id not in waiting:
            waiting.append(run_id)
            run = instance.get_run_by_id(run_id)
            if run is not None and scope.is_follow_run(run) and run_id not in following:
                following.append(run_id)
    # Each stays until a recovery run of it exists (launched by an earlier tick, or by hand).
    waiting = [r for r in waiting if not recovery_of(instance, r, recover_job.name)]
    again = follow_again(instance, tuple(following), recover_job.name, follow_job.name, FAILED_RUN_TAG)
    said += again.notes
    context.update_cursor(RecoveryCursor(after, tuple(waiting),
                                         tuple(r for r in following if r == again.due or r in again.still)
                                         ).to_cursor())
    if not waiting and again.due is None:
        return dg.SkipReason("; ".join(said) or f"no failed run of pipeline {scope.pipeline.name!r} to recover")
    busy = scope.runs_in_flight(instance)
    if busy:
        then = (f"recovering failed run{'s' if len(waiting) > 1 else ''} {', '.join(waiting)}" if waiting
                else f"launching {follow_job.name} again after the recovery of {again.due}")
        return dg.SkipReason(f"{scope.waiting_for(busy)}; then {then}")
    if not waiting and again.due is not None:
        return follow_request(instance, again.due, follow_job)
    run = instance.get_run_by_id(waiting[0])
    if run is None:  # deleted since: nothing left to recover it with
        context.update_cursor(RecoveryCursor(after, tuple(waiting[1:]), tuple(following)).to_cursor())
        return dg.SkipReason(f"failed run {waiting[0]} was deleted: not recovered")
    return dg.RunRequest(  # one recovery at a time: the others wait for it in the next ticks
        run_key=run.run_id, tags={FAILED_RUN_TAG: run.run_id}, job_name=recover_job.name,
        run_config={"ops": {scope.name("recover_op"): {"config": {"failed_run_id": run.run_id}}},
                    "resources": resources_config(run, recover_job)},
    )

def follow_request(instance: dg.DagsterInstance, failed_id: str, follow_job: dg.JobDefinition
                   ) -> dg.RunRequest | dg.SkipReason:
    """The follow job again, with the failed follow run's own config (its interval, its stop
    condition, its resources)."""
    run = instance.get_run_by_id(failed_id)
    if run is None:
        return dg.SkipReason(f"failed follow run {failed_id} was deleted: {follow_job.name} is not launched again")
    return dg.RunRequest(run_key=f"follow-after-{failed_id}", job_name=follow_job.name,
                         tags={FOLLOWS_AFTER_TAG: failed_id}, run_config=dict(run.run_config or {}))
