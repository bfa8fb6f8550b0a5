"""One batch in two halves that may run in separate processes: the seam orchestrators drive.

Four rooms: `record` (the pending attempt's wire format), `store` (its records in checkpoint
storage), `protocol` (the Spark half, complete, abort) and `steps` (what an orchestrator's step
functions call). The names below are the package's public face.

1. `run_spark_half`: trigger checkpoint N, run the Spark job (every subtask restores, applies its
   rows, stages its sink rows, snapshots and uploads) and return a `PendingAttempt`: the
   checkpoint id, the subtask state handles, staged sink files, the next source offsets.
2. `complete_attempt`: needs no Spark. A coordinator rebuilt from storage triggers exactly N,
   acknowledges every handle, writes `_metadata` (exclusive create: the fence against a second
   writer), applies retention and commits the sink.
3. `abort_attempt`: an attempt that will never complete: delete its uploads (those no retained
   checkpoint references) and its sink staging.

`StatefulPipeline`'s loop (the CLI) calls 1 then 2 in one process with one coordinator.
An orchestrator running them as two steps persists the attempt in between with `save_attempt`:
versioned JSON at `<job>/_pending/chk-<N>-<attempt id>.json` in checkpoint storage (never pickle).
Storage rather than the orchestrator's IO layer, because recovery needs to find the attempts of
runs that died, from any process, with nothing but the checkpoint URL; the orphan sweep only
looks at `shared/` and `chk-*/`, so these files are managed here: deleted on completion or
abort, and by `recover`/`prune` once their checkpoint is completed or abandoned. The attempt id
(a Dagster run id, say) names which step wrote it, so two overlapping runs never read each
other's attempt.

Completing and aborting the same persisted attempt exclude each other on storage, never by a
check made before acting (DESIGN rule 9): whichever side first creates the attempt's claim file
`<job>/_pending/chk-<N>-<attempt id>.claim` (exclusive create, `sparkpoint.pipeline.claims`)
decides. A completer claims before it writes `_metadata`; an abort claims before it deletes
anything. A completer that finds the abort's claim gives up without writing; an abort that finds
the completer's claim deletes nothing (the completer may be alive and about to commit) until a
checkpoint at or above N exists that is not the attempt's, which it reads from chk-N *after* the
listing that showed it. An abort that wins the claim looks at chk-N once more: a completer that
committed and forgot its claim just before leaves nothing to undo. An abort's claim stays behind
as a tombstone until a checkpoint at or above N completes, so a completer that wakes up late
still finds it. A retry of a completing step whose first try died after its claim (the claim
names its holder) completes the attempt itself when that holder is known dead, and otherwise says
who holds it.

The committed `_metadata` records the attempt id beside the source offsets and the staged sink
files (`committed_offsets`; older files lack it). So a writer whose commit another writer's
checkpoint took can say whose: `finish_step_or_overtaken` returns `Overtaken` ("overtaken by chk-N
of attempt X; nothing committed") instead of raising, once a checkpoint at or above N that is not
the attempt's exists, and aborts the attempt itself.

`tests/support/interleavings.py` runs these actors against each other at every interleaving of their
storage steps that its bound allows.
"""


from sparkpoint.pipeline.attempt.protocol import (
    LOST_RACE,
    AbortOutcome,
    AttemptAborted,
    AttemptInProgress,
    abort_attempt,
    complete_attempt,
    run_spark_half,
)
from sparkpoint.pipeline.attempt.record import (
    ATTEMPT_KEY,
    AttemptError,
    PendingAttempt,
    SubtaskRun,
    attempt_path,
    committed_offsets,
    recorded_offsets,
    snapshot_summary,
    watermark_of,
    written_by,
)
from sparkpoint.pipeline.attempt.steps import (
    AttemptIdReused,
    Overtaken,
    finish_step,
    finish_step_or_overtaken,
    overtaken_by,
    spark_half_with_fallback,
    start_step,
    start_steps,
)
from sparkpoint.pipeline.attempt.store import (
    AttemptListing,
    forget_tombstones,
    list_attempts,
    load_attempt,
    pending_attempts,
    pending_paths,
    save_attempt,
    set_aside_unreadable,
)

__all__ = [
    "ATTEMPT_KEY", "LOST_RACE", "AbortOutcome", "AttemptAborted", "AttemptError", "AttemptIdReused",
    "AttemptInProgress", "AttemptListing", "Overtaken", "PendingAttempt", "SubtaskRun", "abort_attempt",
    "attempt_path", "committed_offsets", "complete_attempt", "finish_step",
    "finish_step_or_overtaken", "forget_tombstones", "list_attempts", "load_attempt", "overtaken_by",
    "pending_attempts", "pending_paths", "recorded_offsets", "run_spark_half", "save_attempt", "set_aside_unreadable",
    "snapshot_summary", "spark_half_with_fallback", "start_step", "start_steps", "watermark_of", "written_by",
]
