"""Erasing keys from every retained checkpoint and savepoint of a job (`sparkpoint erase`).

A committed `_metadata` is never changed in place. Each retained checkpoint that must change is
written again as a NEW checkpoint (of the same kind) with a new id, by the coordinator like any
other (trigger, acknowledge, an exclusive create of `_metadata`, the registry's counts): in it,
the subtasks whose key-group range holds an erased key's group are restored, the key's entries
deleted and compacted away, and snapshotted against the original (`sparkpoint.state.erasure`);
every other file is the original's, referenced, not copied. Once every copy verifies (below), the
originals are retired through the coordinator (`CheckpointCoordinator.retire`: ids noted as
retired, `_metadata` deleted, then the files nothing references any more).

**The ids.** The copies take ids above every id the job has seen, in the originals' order, and
from the oldest original that holds a key up every newer one is copied (one that holds none
too: it must stay above the older copies), so "the latest checkpoint" is still the newest batch
and `rollback --to N` still means "the state after N's batch". A copy keeps its original's `created_at`
(the processing clock a restore and an export expire TTL'd entries against) and records, in its source
offsets, `erased_from`: the original's id and `output_of`, the checkpoint whose batch wrote the
output it stands for. The exactly-once sink recorded the ORIGINAL ids: a copy commits nothing to
it (its `sink` list is empty; the original's sink commit is finished before copying), the next run
takes an id above the copies (never one the sink recorded: the originals' ids are retired), and a
rollback to a copy undoes the output recorded above its `output_of` (`output_id`).

**A writer like any other** (DESIGN rule 14). An erase refuses to start while a run is between its
steps (a persisted attempt), holds `_erase/lock.json` (an exclusive create; a rerun takes over the
lock of a holder known dead) while it works, and a run's start refuses while it exists (a start
in between would restore an older batch's copy as the latest). A run that was already running
and commits meanwhile is caught by listing the job after the copies committed: a checkpoint
among the copies' ids withdraws them all (the originals are untouched: the job is as before) and
the erase is refused; one above them is erased in the next round. Retention and prune only ever
subsume the oldest ids: an original they take is one the erase retires anyway, and a copy's
files are counted in the registry from its commit on.

**Crash anywhere.** Each copy is committed or not; the originals are retired only after every
copy verified; so a kill -9 leaves, per checkpoint, the original or its copy or both, never a
checkpoint without its files (uploads of a copy never committed are the orphan sweep's). A rerun
with the same keys takes the lock over, keeps the copies already committed (found by their
`erased_from.erase`: the erase's random id, which the lock holds beside the keys' digest, so that no
`_metadata` keeps a hash of an erased key), and goes on.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.crash import crash_point
from sparkpoint.checkpoint.interleave import storage_step
from sparkpoint.checkpoint.metadata import CheckpointMetadata, SubtaskStateHandle
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.pipeline.attempt import list_attempts
from sparkpoint.pipeline.eraselock import EraseRefused, release_lock, take_lock
from sparkpoint.pipeline.erasereport import CheckpointErasure, EraseReport, Verification
from sparkpoint.pipeline.runtime import PipelineConfig, PipelineError, open_output
from sparkpoint.state.erasure import (
    ErasedKey,
    FileFinding,
    SubtaskErasure,
    carry_subtask,
    count_entries,
    erase_subtask,
    erased_keys,
    find_in_files,
    holders,
    partial_rest,
    rest_digest,
    state_kinds,
)
from sparkpoint.state.keygroups import key_group_range
from sparkpoint.state.operators import KeyedOperator
from sparkpoint.tables.sink import Sink

log = logging.getLogger(__name__)

ERASED_FROM = "erased_from"  # in a copy's source offsets: {"checkpoint_id", "output_of", "erase"}
ROUNDS = 3  # rounds of copy, verify, retire: a run that committed above the copies is erased in the next


class EraseNotVerified(PipelineError):
    """The rewritten checkpoints did not verify: they were withdrawn, the originals are kept."""

    def __init__(self, message: str, report: EraseReport):
        super().__init__(message)
        self.report = report


def output_id(meta: CheckpointMetadata) -> int:
    """The checkpoint id the exactly-once sink recorded `meta`'s batches under: its own, or for an
    erased copy its original's (`erased_from.output_of`)."""
    raw = meta.source_offsets.get(ERASED_FROM) if isinstance(meta.source_offsets, dict) else None
    out = raw.get("output_of") if isinstance(raw, dict) else None
    return out if isinstance(out, int) and not isinstance(out, bool) else meta.checkpoint_id


def _erased_from(meta: CheckpointMetadata, erase_id: str) -> int | None:
    raw = meta.source_offsets.get(ERASED_FROM) if isinstance(meta.source_offsets, dict) else None
    if not isinstance(raw, dict) or raw.get("erase") != erase_id:
        return None
    cid = raw.get("checkpoint_id")
    return cid if isinstance(cid, int) and not isinstance(cid, bool) else None


def keys_digest(raws: Sequence[bytes], operators: Sequence[str]) -> str:
    """What names one erase without holding its keys: a SHA-256 over the sorted keys and operators."""
    h = hashlib.sha256()
    for part in [*sorted(set(raws)), b"\x00", *(o.encode() for o in sorted(operators))]:
        h.update(len(part).to_bytes(4, "big") + part)
    return h.hexdigest()


# --- the erase ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class EraseScope:
    """What to erase: per operator uid the keys as the state stores them, and the typed values
    (for the output, by column)."""

    raws: tuple[bytes, ...]
    operators: tuple[str, ...]
    columns: Mapping[str, tuple[object, ...]]  # output column -> the keys' values

    def keys_for(self, meta: CheckpointMetadata, operator: str) -> list[ErasedKey]:
        return erased_keys(self.raws, meta.operators[operator].max_parallelism)


def erase_job(storage: CheckpointStorage, scope: EraseScope, *, sink: Sink | None = None,
              local_dir: str | None = None, dry_run: bool = False) -> EraseReport:
    """Erase `scope`'s keys from every retained checkpoint and savepoint of job `storage` (see the
    module's text), drop this host's task-local copies under `local_dir` that can hold them, then
    remove their rows from `sink`'s output. With `dry_run` nothing changes.

    Raises:
        EraseRefused: a run is between its steps, another erase holds the job, a `_metadata`
            cannot be read, or a run committed among the copies (they were withdrawn).
        EraseNotVerified: a copy still holds an entry of the keys or lost other state; the copies
            were withdrawn and the originals kept.
    """
    digest = keys_digest(scope.raws, scope.operators)
    _refuse_unreadable(storage)
    _refuse_run_in_progress(storage)
    if dry_run:
        return _dry_run(storage, scope, digest, sink)
    erase_id = take_lock(storage, digest)
    try:
        return _erase_locked(storage, scope, digest, erase_id, sink, local_dir)
    except (EraseRefused, EraseNotVerified):
        raise  # each released the lock, or left it to a rerun on purpose
    except BaseException:
        if not _split(storage, erase_id)[1]:  # no copy committed: the job is as it was, runs may start
            release_lock(storage)
        raise


def _erase_locked(storage: CheckpointStorage, scope: EraseScope, digest: str, erase_id: str,
                  sink: Sink | None, local_dir: str | None) -> EraseReport:
    """`erase_job` once it holds the lock; a failure after a copy committed leaves the lock to a rerun."""
    erasures: dict[int, CheckpointErasure] = {}
    retired: list[int] = []
    deleted = 0
    proven: dict[int, Verification] = {}
    with tempfile.TemporaryDirectory(prefix="sparkpoint-erase-") as tmp:
        work = Path(tmp)
        for _ in range(ROUNDS):
            copied = _copy_round(storage, scope, erase_id, sink, work, erasures)
            verification = _verify(storage, scope, erase_id, work, erasures, copies_only=True, proven=set(proven))
            proven.update((v.checkpoint_id, v) for v in verification)
            if not all(v.ok for v in verification):
                _withdraw(storage, erase_id, reason="the erased copies did not verify")
                report = _report(storage, scope, digest, erasures, retired, deleted, verification, sink)
                release_lock(storage)
                raise EraseNotVerified("the erased checkpoints did not verify; they were withdrawn and the originals "
                                       "kept: " + report.message, report)
            crash_point("erase-before-retire")
            done = _retire_originals(storage, erase_id)
            retired += [m.checkpoint_id for m in done[0]]
            deleted += done[1]
            if not copied and not done[0]:
                break
        # The last word: every retained file that can hold a key, read again now that the
        # originals are gone (the rest of each copy's state was compared before they went).
        verification = tuple(_with_rest(v, proven.get(v.checkpoint_id))
                             for v in _verify(storage, scope, erase_id, work, {}, files_only=True))
    dropped = _drop_local_copies(storage, scope, local_dir)
    crash_point("erase-before-output")
    output = _erase_output(sink, scope)
    report = _report(storage, scope, digest, erasures, retired, deleted, verification, sink, dropped, output)
    release_lock(storage)
    log.info("%s", report.message)
    return report


def _report(storage: CheckpointStorage, scope: EraseScope, digest: str, erasures: Mapping[int, CheckpointErasure],
            retired: list[int], deleted: int, verification: tuple[Verification, ...], sink: Sink | None,
            dropped: tuple[str, ...] = (), output: tuple[dict[str, Any], ...] = ()) -> EraseReport:
    return EraseReport(storage.job_url, len(set(scope.raws)), digest, scope.operators,
                       tuple(erasures[c] for c in sorted(erasures)), retired=tuple(sorted(retired)),
                       files_deleted=deleted, verification=verification, local_dropped=dropped, output=output,
                       output_url=sink.url if sink is not None else None,
                       notes=("new ids keep the originals' order; the sink keeps the original ids "
                              "(`erased_from` in each copy)",))


def _listing(storage: CheckpointStorage) -> list[CheckpointMetadata]:
    """The retained checkpoints, oldest first."""
    listing = CompletedCheckpointStore(storage).load_all()
    if listing.unreadable:
        cid, why = sorted(listing.unreadable.items())[-1]
        raise EraseRefused(f"cannot erase from {storage.job_url}: chk-{cid}/_metadata cannot be read ({why}), so "
                           "what it holds cannot be erased; repair or remove it by hand (`sparkpoint verify` lists it)")
    return sorted(listing.checkpoints, key=lambda m: m.checkpoint_id)


def _refuse_unreadable(storage: CheckpointStorage) -> None:
    _listing(storage)


def _refuse_run_in_progress(storage: CheckpointStorage) -> None:
    """A run between its two steps would commit on top of state the erase retires."""
    live = list_attempts(storage).attempts
    if live:
        a = live[-1]
        raise EraseRefused(f"cannot erase from {storage.job_url}: a run is in progress (attempt {a.attempt_id} of "
                           f"checkpoint {a.checkpoint_id} is pending: {storage.job_url}/{a.path}). Let its step "
                           "finish (or, if its run died, run the pipeline's recover job), then erase")


def _split(storage: CheckpointStorage, erase_id: str) -> tuple[list[CheckpointMetadata], dict[int, CheckpointMetadata]]:
    """(the originals: retained checkpoints that are no copy of this erase, oldest first; the
    copies by the id of the original each stands for)."""
    originals, copies = [], {}
    for m in _listing(storage):
        src = _erased_from(m, erase_id)
        if src is None:
            originals.append(m)
        else:
            copies[src] = m
    return originals, copies


def _copy_round(storage: CheckpointStorage, scope: EraseScope, erase_id: str, sink: Sink | None, work: Path,
                erasures: dict[int, CheckpointErasure]) -> int:
    """Write the erased copy of each original that needs one, in order; returns how many."""
    originals, copies = _split(storage, erase_id)
    _refuse_interleaved(storage, erase_id, originals, copies)
    copied = 0
    for meta in originals:
        if meta.checkpoint_id in copies:  # a rerun: copied already (verified against it below), retired after
            erasures.setdefault(meta.checkpoint_id, CheckpointErasure(meta.checkpoint_id, meta.kind,
                                                                      copies[meta.checkpoint_id].checkpoint_id))
            continue
        if meta.checkpoint_id in erasures and erasures[meta.checkpoint_id].new_id is None:
            continue  # an earlier round found none of the keys in it
        must = bool(copies) and meta.checkpoint_id > min(copies)
        _finish_sink_commit(sink, meta)
        erasure = _copy(storage, meta, scope, erase_id, work, must=must or copied > 0)
        if erasure is None:
            erasures[meta.checkpoint_id] = CheckpointErasure(meta.checkpoint_id, meta.kind, None)
            continue
        erasures[meta.checkpoint_id] = erasure
        copied += 1
        crash_point("erase-after-copy")
    return copied


def _refuse_interleaved(storage: CheckpointStorage, erase_id: str, originals: list[CheckpointMetadata],
                        copies: Mapping[int, CheckpointMetadata]) -> None:
    """A checkpoint no copy stands for, committed between two copies' ids (a run that was running
    when the erase started): the copies cannot keep the batches' order. Withdraw them and refuse."""
    if not copies:
        return
    ids = sorted(c.checkpoint_id for c in copies.values())
    among = [m.checkpoint_id for m in originals if ids[0] < m.checkpoint_id < ids[-1]]
    if among:
        _withdraw(storage, erase_id, reason=f"checkpoint(s) {among} were committed among the erased copies")
        release_lock(storage)
        raise EraseRefused(f"a run committed checkpoint(s) {among} of {storage.job_url} while the erase wrote its "
                           "copies; they were withdrawn and nothing was erased. Stop the pipeline's runs, then erase")


def _finish_sink_commit(sink: Sink | None, meta: CheckpointMetadata) -> None:
    """Make the original's output visible (what a start does, `settle_sink`): its copy records no
    staged sink files, and a writer that died after `_metadata` left them staged."""
    offsets = meta.source_offsets
    staged = offsets.get("sink") if isinstance(offsets, dict) else None
    if sink is not None and staged:
        sink.commit(meta.checkpoint_id, [str(s) for s in staged], resuming=True)


def _copy_offsets(meta: CheckpointMetadata, erase_id: str) -> dict[str, Any]:
    raw = meta.source_offsets
    offsets = dict(raw) if isinstance(raw, dict) else {"source": raw}
    if "sink" in offsets:
        offsets["sink"] = []
    offsets[ERASED_FROM] = {"checkpoint_id": meta.checkpoint_id, "output_of": output_id(meta), "erase": erase_id}
    return offsets


def _copy(storage: CheckpointStorage, meta: CheckpointMetadata, scope: EraseScope, erase_id: str, work: Path, *,
          must: bool) -> CheckpointErasure | None:
    """Commit `meta` without the keys as a new checkpoint of its kind; None when it holds none of
    them and need not be copied (`must`: an older one was, so this one must be too)."""
    coordinator = CheckpointCoordinator(storage, num_retained=1 << 30, lineage=meta.lineage, unowned=meta.unowned)
    expected = {op: state.parallelism for op, state in meta.operators.items()}
    names = {op: state.name for op, state in meta.operators.items() if state.name}
    cid = coordinator.trigger(kind=meta.kind, expected=expected, names=names).checkpoint_id
    try:
        handles, erased = _erase_subtasks(storage, meta, scope, cid, work)
        if not erased and not must:
            coordinator.abort(cid, reason="it holds none of the keys")
            storage.remove_empty_dirs(f"chk-{cid}")
            return None
        for op, state in meta.operators.items():
            for h in state.subtasks:
                new = handles.get((op, h.subtask)) or carry_subtask(storage, h, cid)
                coordinator.acknowledge(cid, new)
        crash_point("erase-mid-rewrite")
        coordinator.complete(cid, _copy_offsets(meta, erase_id), skipped_files=meta.skipped_files,
                             created_at=meta.created_at)
    except BaseException:
        coordinator.abort(cid, reason="the erase failed")
        raise
    log.info("erased chk-%s into chk-%s (%d entries)", meta.checkpoint_id, cid, sum(e.entries_removed for e in erased))
    return CheckpointErasure(meta.checkpoint_id, meta.kind, cid, tuple(erased))


def _erase_subtasks(storage: CheckpointStorage, meta: CheckpointMetadata, scope: EraseScope, cid: int, work: Path
                    ) -> tuple[dict[tuple[str, int], SubtaskStateHandle], list[SubtaskErasure]]:
    handles: dict[tuple[str, int], SubtaskStateHandle] = {}
    erased = []
    for op in scope.operators:
        if op not in meta.operators:
            continue
        keys = scope.keys_for(meta, op)
        for h in holders(meta.operators[op].subtasks, keys):
            done = erase_subtask(storage, meta, op, h.subtask, keys, cid, work / f"{cid}-{op}-{h.subtask}")
            if done is not None:
                handles[(op, h.subtask)] = done.handle
                erased.append(done)
    return handles, erased


def _withdraw(storage: CheckpointStorage, erase_id: str, *, reason: str) -> None:
    """Retire this erase's copies whose originals are still retained: the job is as before."""
    originals, copies = _split(storage, erase_id)
    kept = {m.checkpoint_id for m in originals}
    doomed = [c for src, c in copies.items() if src in kept]
    if doomed:
        CheckpointCoordinator(storage).retire(doomed, reason=f"erase withdrawn: {reason}")


def _retire_originals(storage: CheckpointStorage, erase_id: str) -> tuple[list[CheckpointMetadata], int]:
    originals, copies = _split(storage, erase_id)
    _refuse_interleaved(storage, erase_id, originals, copies)
    doomed = [m for m in originals if m.checkpoint_id in copies]
    if not doomed:
        return [], 0
    return doomed, CheckpointCoordinator(storage).retire(doomed, reason="keys erased: replaced by erased copies")


# --- the proof ----------------------------------------------------------------------------------


def _with_rest(final: Verification, earlier: Verification | None) -> Verification:
    if earlier is None:
        return final
    return replace(final, rest_equal=earlier.rest_equal, problems=final.problems + earlier.problems)


def _verify(storage: CheckpointStorage, scope: EraseScope, erase_id: str, work: Path,
            erasures: Mapping[int, CheckpointErasure], *, copies_only: bool = False, files_only: bool = False,
            proven: frozenset[int] | set[int] = frozenset()) -> tuple[Verification, ...]:
    """Every retained checkpoint (`copies_only`: this erase's copies): its files that can hold a
    key read and searched; for a copy, the rest of each rewritten subtask restored and hashed
    against the original's (as recorded when it was rewritten, else against the original itself
    while it is retained: a rerun's copies of a killed erase). `proven`: copies verified already."""
    out = []
    rewritten = {e.new_id: e for e in erasures.values() if e.new_id is not None}
    originals, copies = _split(storage, erase_id)
    kept = {m.checkpoint_id: m for m in originals}
    source = {} if files_only else {c.checkpoint_id: kept.get(src) for src, c in copies.items()}
    for meta in _listing(storage):
        if meta.checkpoint_id in proven or (copies_only and meta.checkpoint_id not in
                                             {c.checkpoint_id for c in copies.values()}):
            continue
        out.append(verify_checkpoint(storage, meta, scope, work / f"verify-{meta.checkpoint_id}",
                                     rewritten.get(meta.checkpoint_id), source.get(meta.checkpoint_id)))
    return tuple(out)


def verify_checkpoint(storage: CheckpointStorage, meta: CheckpointMetadata, scope: EraseScope, work: Path,
                      erasure: CheckpointErasure | None = None, original: CheckpointMetadata | None = None
                      ) -> Verification:
    """The proof for one checkpoint (`Verification`): read every SST and changelog file of each
    subtask of the scope's operators whose range holds a key's group; with `erasure` (how it was
    written), restore each rewritten subtask and compare the rest of its state with the original's
    as it was hashed then; without one but with its `original`, restore both and compare."""
    files = size = ruled_out = 0
    findings: list[FileFinding] = []
    problems: list[str] = []
    for op in scope.operators:
        if op not in meta.operators:
            continue
        keys = scope.keys_for(meta, op)
        for h in holders(meta.operators[op].subtasks, keys):
            checked = find_in_files(storage, h, keys, state_kinds(meta, op), work / f"{op}-{h.subtask}")
            files, size, ruled_out = files + checked.files, size + checked.bytes, ruled_out + checked.ruled_out
            findings += checked.findings
    erased = {(s.operator, s.subtask): s for s in erasure.subtasks} if erasure else {}
    before = {k: (s.digest, s.entries_kept) for k, s in erased.items()}
    if not before and original is not None:
        before = {(op, h.subtask): rest_digest(storage, original, op, h.subtask, scope.keys_for(original, op),
                                               work / f"original-{op}")[:2]
                  for op in scope.operators if op in original.operators
                  for h in holders(original.operators[op].subtasks, scope.keys_for(original, op))}
    rest_equal = None if not before else True
    for (op, subtask), (was, was_kept) in sorted(before.items()):
        sub, keys = erased.get((op, subtask)), scope.keys_for(meta, op)
        differs: list[str] = []
        if sub is not None and sub.proof is not None:  # by its key groups' files: the span, and the files
            digest, kept, left, differs = partial_rest(storage, meta, sub, keys, work / f"rest-{op}")
        else:
            digest, kept, left = rest_digest(storage, meta, op, subtask, keys, work / f"rest-{op}")
        if left:
            problems.append(f"{op} subtask {subtask} still reads {left} entries of the keys")
        if differs:
            rest_equal = False
            problems += differs
        if (digest, kept) != (was, was_kept):
            rest_equal = False
            problems.append(f"{op} subtask {subtask}: {kept} other entries, hashed {digest[:12]}; before the erase "
                            f"{was_kept}, hashed {was[:12]}")
    return Verification(meta.checkpoint_id, files, size, tuple(findings), rest_equal, tuple(problems), ruled_out)


def _dry_run(storage: CheckpointStorage, scope: EraseScope, digest: str, sink: Sink | None) -> EraseReport:
    """Count the keys' entries in every retained checkpoint, changing nothing."""
    out = []
    with tempfile.TemporaryDirectory(prefix="sparkpoint-erase-") as tmp:
        for meta in _listing(storage):
            found = 0
            for op in scope.operators:
                if op not in meta.operators:
                    continue
                keys = scope.keys_for(meta, op)
                for h in holders(meta.operators[op].subtasks, keys):
                    found += count_entries(storage, meta, op, h.subtask, keys, Path(tmp) / f"{meta.checkpoint_id}")
            out.append(CheckpointErasure(meta.checkpoint_id, meta.kind, None, entries_found=found))
    output = _erase_output(sink, scope, dry_run=True)
    return EraseReport(storage.job_url, len(set(scope.raws)), digest, scope.operators, tuple(out), dry_run=True,
                       output=output, output_url=sink.url if sink is not None else None)


# --- task-local copies and the output -----------------------------------------------------------


def _drop_local_copies(storage: CheckpointStorage, scope: EraseScope, local_dir: str | None) -> tuple[str, ...]:
    """Delete this host's task-local state of the scope's operators that can hold a key: the
    working database and the task-local checkpoint copies of each subtask directory whose range
    (at the latest checkpoint's parallelism) holds a key's group, and every directory of a
    subtask the latest checkpoint does not have (an earlier parallelism's)."""
    if not local_dir:
        return ()
    latest = _listing(storage)
    meta = latest[-1] if latest else None
    dropped = []
    for op in scope.operators:
        root = Path(local_dir) / storage.job_id / op
        if not root.is_dir() or root.is_symlink():
            continue
        state = meta.operators.get(op) if meta is not None else None
        keys = scope.keys_for(meta, op) if meta is not None and state is not None else []
        for sub in sorted(root.iterdir()):
            if not sub.name.isdigit() or sub.is_symlink() or not sub.is_dir():
                continue
            i = int(sub.name)
            if state is not None and i < state.parallelism:
                kg = key_group_range(state.max_parallelism, state.parallelism, i)
                if not any(k.key_group in kg for k in keys):
                    continue
            storage_step("delete", str(sub))
            shutil.rmtree(sub)
            dropped.append(str(sub))
    return tuple(dropped)


def _erase_output(sink: Sink | None, scope: EraseScope, *, dry_run: bool = False) -> tuple[dict[str, Any], ...]:
    """The keys' rows removed from the output, per key column (`Sink.erase_rows`)."""
    if sink is None:
        return ()
    return tuple(sink.erase_rows(column, list(values), dry_run=dry_run).to_json()
                 for column, values in scope.columns.items())


# --- from a pipeline's config -------------------------------------------------------------------


def erase(config: PipelineConfig, operators: tuple[KeyedOperator, ...], keys: Sequence[object], *,
          only: Sequence[str] | None = None, dry_run: bool = False) -> EraseReport:
    """`erase_job` of the job `config` names, for `keys` of the operators `only` names (uids; None:
    every operator, which must then share one key column), with the output sink its runs commit to."""
    chosen = choose_operators(operators, only)
    raws = tuple(state_key(k) for k in keys)
    if not raws:
        raise EraseRefused("no key to erase: give --key VALUE or --keys-from FILE")
    columns: dict[str, tuple[object, ...]] = {}
    for op in chosen:
        columns.setdefault(op.key, tuple(keys))
    scope = EraseScope(raws, tuple(op.uid for op in chosen), columns)
    storage = CheckpointStorage(config.checkpoints_url, config.job_id, config.storage_options)
    return erase_job(storage, scope, sink=open_output(config, operators), local_dir=config.local_dir, dry_run=dry_run)


def choose_operators(operators: tuple[KeyedOperator, ...], only: Sequence[str] | None) -> list[KeyedOperator]:
    """The operators an erase acts on: those `only` names by uid, else all, keyed by one column."""
    if only:
        known = {op.uid: op for op in operators}
        unknown = [u for u in only if u not in known]
        if unknown:
            raise EraseRefused(f"unknown operator uid(s) {', '.join(unknown)}; this pipeline's operators are "
                               + ", ".join(f"{op.uid} (keyed by {op.key})" for op in operators))
        return [known[u] for u in dict.fromkeys(only)]
    columns = sorted({op.key for op in operators})
    if len(columns) > 1:
        raise EraseRefused("this pipeline's operators are keyed by different columns ("
                           + "; ".join(f"{c}: {', '.join(op.uid for op in operators if op.key == c)}" for c in columns)
                           + "): name the ones keyed by your key with --operators UID,...")
    return list(operators)


def state_key(value: object) -> bytes:
    """The bytes the state keys `value` by: str and bytes as they are, anything else as the string
    form its key column is keyed by (`sparkpoint.state.keygroups.arrow_keys`)."""
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, bytes | bytearray):
        return bytes(value)
    import pandas as pd

    from sparkpoint.state.keygroups import arrow_keys

    stored = arrow_keys(pd.Series([value])).to_pylist()[0]
    return stored.encode("utf-8") if isinstance(stored, str) else bytes(stored)


def parse_key(text: str, key_type: str | None, column: str) -> object:
    """A key given on the command line as the type of its column (`KeyedOperator.key_type`)."""
    kind = (key_type or "string").lower()
    try:
        if kind in ("string", "large_string", "utf8"):
            return text
        if kind.startswith(("int", "uint")):
            return int(text)
        if kind in ("double", "float", "float64", "float32", "halffloat"):
            return float(text)
        if kind in ("bool", "boolean"):
            if text.lower() not in ("true", "false"):
                raise ValueError(text)
            return text.lower() == "true"
        if kind in ("binary", "large_binary"):
            return text.encode("utf-8")
    except ValueError:
        raise EraseRefused(f"key {text!r} is not of type {kind}, the type of key column {column!r}") from None
    raise EraseRefused(f"keys of column {column!r} are {kind}: the command line cannot give one; use "
                       "sparkpoint.erase_keys with the values")


def with_keys_from(keys: Sequence[str], path: str | None) -> list[str]:
    """The command line's keys, then one per line of `path` (blank lines skipped)."""
    out = list(keys)
    if path:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise EraseRefused(f"--keys-from {path}: {e.strerror or e}") from None
        out += [line.rstrip("\r") for line in text.split("\n") if line.strip()]
    return out


def write_report(report: EraseReport, path: str) -> None:
    Path(path).write_text(json.dumps(report.to_json(), indent=2, sort_keys=True) + "\n", encoding="utf-8")


