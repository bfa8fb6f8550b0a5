"""Rolling a job back to one of its retained checkpoints, its output with it (`sparkpoint rollback`).

Restoring checkpoint N alone would leave the output of the checkpoints after it visible, and their
batches, replayed from N, would be written a second time. So one command does both, in the order
a fallback past a damaged checkpoint does (`StatefulPipeline.fall_back`):

1. refuse what cannot be rolled back to: an id that is not retained (the retained ones are named),
   another job's savepoint copied into the directory (its `_metadata` names that job), a job
   whose run is between its steps (a persisted attempt at or above the latest checkpoint); N
   already the latest is nothing to do;
2. retire the checkpoints after N through the coordinator (`retire_above`): their ids are noted as
   retired (`sparkpoint.checkpoint.retired`: no writer takes them again, so a table sink never
   takes a replay's commit for theirs), then their `_metadata`, then their files;
3. undo their output through the sink (`Sink.drop` of exactly the retired ids and the output listed
   above N before they went, not `rollback(after=N)`: a run that restored N once they were gone may
   have committed above them already; for an erased copy N, above the id of the original it stands
   for, `erase.output_id`, which is what the sink recorded): the Parquet
   directory deletes their part files, a table commits a version that removes exactly this job's
   files of them (rows other writers added since stay).

A crash between 2 and 3 leaves output above the latest checkpoint, which the next start's
`settle_sink` removes: a checkpoint whose output is gone is never restored. The next run restores
N and processes the batches after it again, as checkpoints above every retired id.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.metadata import CheckpointMetadata
from sparkpoint.checkpoint.retired import next_id_after
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore, StoreListing
from sparkpoint.pipeline.attempt import PendingAttempt, list_attempts, recorded_offsets
from sparkpoint.pipeline.claims import COMPLETE, current_holder
from sparkpoint.pipeline.erase import output_id
from sparkpoint.pipeline.runtime import PipelineConfig, PipelineError, open_output
from sparkpoint.state.operators import KeyedOperator
from sparkpoint.tables.sink import Sink

log = logging.getLogger(__name__)

OutputSink = Sink
SHOWN = 5  # names shown per checkpoint in a line


class RollbackRefused(PipelineError):
    """The job cannot be rolled back to that checkpoint now; the message says why and what to do."""


@dataclass(frozen=True)
class RollbackReport:
    """What a rollback to checkpoint `to` retired and undid (with `dry_run`: would retire and undo)."""

    job_url: str
    to: int
    retired: tuple[tuple[int, str], ...]  # (checkpoint id, kind), newest first
    output: dict[int, tuple[str, ...]]  # checkpoint id -> its visible output (files) undone
    replayed: tuple[str, ...]  # input files the next run processes again, in order
    next_checkpoint_id: int
    output_url: str | None = None
    dry_run: bool = False
    files_deleted: int = 0
    undone: tuple[int, ...] = field(default=())  # checkpoints whose output was undone

    @property
    def nothing_to_do(self) -> bool:
        return not self.retired

    @property
    def message(self) -> str:
        """One paragraph: what was (would be) retired and undone, and what the next run does."""
        if self.nothing_to_do:
            return f"chk-{self.to} is already the latest checkpoint of {self.job_url}: nothing to roll back"
        verb = "would retire" if self.dry_run else "retired"
        retired = ", ".join(f"chk-{cid}" + (f" ({kind})" if kind != "checkpoint" else "")
                            for cid, kind in self.retired)
        parts = [f"rollback of {self.job_url} to chk-{self.to}: {verb} {retired}"
                 + ("" if self.dry_run else f" ({self.files_deleted} files deleted)")]
        parts.append(self._output_line())
        if any(kind == "savepoint" for _, kind in self.retired):
            parts.append("a retired savepoint is gone with them: keep one first with `sparkpoint savepoint "
                         "--from-checkpoint ID --to URL`" if self.dry_run else "retired savepoints are gone")
        parts.append(f"the next run restores chk-{self.to} and processes "
                     + (f"{len(self.replayed)} input files again ({_names(self.replayed)})" if self.replayed
                        else "no input file again")
                     + f", as checkpoints from chk-{self.next_checkpoint_id} on")
        return "; ".join(parts)

    def _output_line(self) -> str:
        if self.output_url is None:
            return "no output named: only the checkpoints" + (" would be" if self.dry_run else " were") + " rolled back"
        ids = sorted(self.output) if self.dry_run else list(self.undone)
        if not ids:
            return f"no output of theirs is visible in {self.output_url}"
        files = sum(len(self.output.get(cid, ())) for cid in ids)
        return (f"{'would undo' if self.dry_run else 'undid'} the output of checkpoints {ids} in {self.output_url} "
                f"({files} files)")

    def lines(self) -> list[str]:
        """The message, then a line per retired checkpoint: its output files (the dry run's detail)."""
        out = [self.message]
        for cid, kind in self.retired:
            files = self.output.get(cid, ())
            out.append(f"  chk-{cid} ({kind}): " + (f"{len(files)} output files: {_names(files)}" if files
                                                     else "no visible output"))
        return out

    def to_json(self) -> dict[str, Any]:
        return {"job": self.job_url, "to": self.to, "dry_run": self.dry_run, "nothing_to_do": self.nothing_to_do,
                "retired": [cid for cid, _ in self.retired],
                "savepoints_retired": [cid for cid, kind in self.retired if kind == "savepoint"],
                "output": self.output_url, "output_undone": {str(cid): list(files) for cid, files in
                                                             sorted(self.output.items())},
                "undone": list(self.undone), "replayed": list(self.replayed), "files_deleted": self.files_deleted,
                "next_checkpoint_id": self.next_checkpoint_id, "summary": self.message}


def _names(names: tuple[str, ...]) -> str:
    shown = [n.rsplit("/", 1)[-1] for n in names[:SHOWN]]
    return ", ".join(shown) + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")


def rollback_job(storage: CheckpointStorage, sink: OutputSink | None, to: int, *, dry_run: bool = False
                 ) -> RollbackReport:
    """Roll job `storage` back to its retained checkpoint `to`, and `sink`'s output with it (see
    the module's docstring). With `dry_run` nothing changes: the report says what would.

    Raises:
        RollbackRefused: `to` is not retained (the retained ids are named), is another job's
            savepoint, a newer `_metadata` cannot be read, or a run of the job is between its steps.
    """
    listing = CompletedCheckpointStore(storage).load_all()
    target = _target(storage, listing, to)
    newer = [m for m in listing.checkpoints if m.checkpoint_id > to]
    if not newer:
        return RollbackReport(storage.job_url, to, (), {}, (), next_id_after(storage, to), _url(sink), dry_run)
    _refuse_run_in_progress(storage, newer[0].checkpoint_id)
    # An erased copy (`sparkpoint erase`) stands for its original's batch: the sink recorded that id.
    output = {cid: tuple(files) for cid, files in
              sorted((sink.committed(after=output_id(target)) if sink else {}).items())}
    done = recorded_offsets(target)  # replayed: what the newest retired one records (above its floor) and `to` lacks
    replayed = tuple(f for f in recorded_offsets(newer[0]).consumed if not done.includes(f))
    retired = tuple((m.checkpoint_id, m.kind) for m in newer)
    report = RollbackReport(storage.job_url, to, retired, output, replayed,
                            max(next_id_after(storage, to), newer[0].checkpoint_id + 1), _url(sink), dry_run)
    if dry_run:
        return report
    ids, deleted = CheckpointCoordinator(storage).retire_above(to, reason=f"rollback to checkpoint {to}")
    # Exactly the retired ones: a run that started from `to` once they were gone may have committed
    # above them already, and its output stays.
    undone = sink.drop(sorted({*ids, *output})) if sink is not None else []
    log.info("rolled back %s to chk-%s: retired %s, undid the output of %s", storage.job_url, to, ids, undone)
    kinds = dict(retired)
    return RollbackReport(report.job_url, to, tuple((cid, kinds.get(cid, "checkpoint")) for cid in reversed(ids)),
                          output, replayed, next_id_after(storage, to), report.output_url, files_deleted=deleted,
                          undone=tuple(undone))


def rollback(config: PipelineConfig, to: int, *, operators: tuple[KeyedOperator, ...] = (),
             dry_run: bool = False) -> RollbackReport:
    """`rollback_job` of the job `config` names, with the output sink its runs (of `operators`)
    commit to: a table records a transaction per emitting operator."""
    storage = CheckpointStorage(config.checkpoints_url, config.job_id, config.storage_options)
    return rollback_job(storage, open_output(config, operators), to, dry_run=dry_run)


def _url(sink: OutputSink | None) -> str | None:
    return sink.url if sink is not None else None


def _target(storage: CheckpointStorage, listing: StoreListing, to: int) -> CheckpointMetadata:
    """Checkpoint `to`, when the job can be rolled back to it."""
    if to in listing.unreadable:  # another job's savepoint copied in, or a damaged `_metadata`
        raise RollbackRefused(
            f"cannot roll back {storage.job_url} to chk-{to}: it is not a checkpoint of job {storage.job_id!r} "
            f"({listing.unreadable[to]}). A savepoint of another job is started from, not rolled back to: "
            f"`sparkpoint run --from-checkpoint {storage.job_url}/chk-{to}`; a damaged one is repaired or removed by "
            "hand (`sparkpoint verify` lists it)")
    unreadable = sorted(cid for cid in listing.unreadable if cid > to)
    if unreadable:
        cid = unreadable[-1]
        raise RollbackRefused(
            f"cannot roll back {storage.job_url} to chk-{to}: chk-{cid}/_metadata cannot be read "
            f"({listing.unreadable[cid]}), so what it committed cannot be undone; repair or remove "
            f"{storage.job_url}/chk-{cid} by hand (`sparkpoint verify` lists it), then roll back")
    found = [m for m in listing.checkpoints if m.checkpoint_id == to]
    if not found:
        retained = ", ".join(f"{m.checkpoint_id}" + (" (savepoint)" if m.is_savepoint else "")
                             for m in reversed(listing.checkpoints))
        raise RollbackRefused(
            f"cannot roll back {storage.job_url} to chk-{to}: it is not retained; the retained checkpoints are "
            + (retained or "none") + " (`sparkpoint list`). Roll back to one of them, or start a job from a "
            "savepoint elsewhere with `sparkpoint run --from-checkpoint URL`")
    return found[0]


def _refuse_run_in_progress(storage: CheckpointStorage, latest: int) -> None:
    """A run between its two steps (an orchestrator's), or one still settling the latest
    checkpoint, leaves its attempt persisted: retiring checkpoints under it would let it commit
    on top of state the rollback took away. (A run of one process, `sparkpoint run`, persists
    nothing: a commit it makes over a retired checkpoint fails the protocol's own checks.)"""
    live = [a for a in list_attempts(storage).attempts if a.checkpoint_id >= latest]
    if live:
        raise RollbackRefused(
            f"cannot roll back {storage.job_url}: a run is in progress: {_attempt_line(storage, live[-1])}. Let "
            "its step finish (or, if its run died, run the pipeline's recover job), then roll back")


def _attempt_line(storage: CheckpointStorage, attempt: PendingAttempt) -> str:
    _, holder = current_holder(storage, attempt.checkpoint_id, attempt.attempt_id)
    held = f", being completed by {holder.describe()}" if holder is not None and holder.side == COMPLETE else ""
    return (f"attempt {attempt.attempt_id} of checkpoint {attempt.checkpoint_id} is pending "
            f"({storage.job_url}/{attempt.path}{held})")
