"""The checkpoint coordinator: trigger -> acknowledge -> complete | abort, and shutdown.

Invariants:

1. A checkpoint is committed by the exclusive create of its `_metadata`, and only after every
   expected subtask acknowledged and every referenced file is known or new in this checkpoint.
2. Deletion happens only after a commit, only of files whose registry count fell to 0 and that
   the job owns, and `_metadata` goes before the files it lists (a crash in between leaves
   orphans for the sweep, never a retained checkpoint with missing files).
3. The latest completed checkpoint and savepoints are never subsumed. Completing checkpoint N
   aborts pending checkpoints older than N; one of those cannot complete after N.
4. An abort deletes only files created by the aborted checkpoint.
5. The reference check holds against storage at commit time: before it, the registry is rebuilt
   whenever the completed checkpoints on storage differ from the ones it counted (another
   coordinator committed or subsumed), so a file another writer deleted is never re-referenced.
   If another writer commits between that check and our commit, a reused file that no other
   retained checkpoint holds is looked up on storage; when it is gone, our `_metadata` (which
   could never be restored) is withdrawn and the completion fails, and nothing is subsumed.
6. Once `_metadata` is committed the checkpoint is complete: a failure in the bookkeeping after
   it (registry, subsumption deletes) is logged, left to the orphan sweep, and the registry is
   rebuilt before the next deletion.
7. Retired ids stay retired: a rollback or a fallback (`retire_above`) notes the ids it retires
   (`sparkpoint.checkpoint.retired`) before it deletes anything, and no writer takes one again. A
   checkpoint whose base was retired while it committed is withdrawn (`complete`'s `base`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from sparkpoint.checkpoint import store
from sparkpoint.checkpoint.crash import crash_point
from sparkpoint.checkpoint.errors import CheckpointDeclined, CheckpointSuperseded, DeletionBlocked, UnknownSharedState
from sparkpoint.checkpoint.files import stored_content_problems, stored_size_problems
from sparkpoint.checkpoint.metadata import (
    CheckpointMetadata,
    CheckpointStats,
    OperatorState,
    RestoreLineage,
    SkippedFile,
    SubtaskStateHandle,
    checkpoint_dir,
    coverage_problem,
    metadata_path,
    utc_now_iso,
)
from sparkpoint.checkpoint.paths import private_dir, shared_dir
from sparkpoint.checkpoint.retention import (
    ExternalizedRetention,
    JobStatus,
    checkpoints_to_subsume,
    discard_on_shutdown,
)
from sparkpoint.checkpoint.retired import highest_retired, record_retired
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore

log = logging.getLogger(__name__)


@dataclass
class PendingCheckpoint:
    checkpoint_id: int
    kind: str
    expected: Mapping[str, int] | None  # operator -> parallelism; None: accept what arrives
    started: float = field(default_factory=time.monotonic)
    acks: dict[tuple[str, int], SubtaskStateHandle] = field(default_factory=dict)
    names: Mapping[str, str] = field(default_factory=dict)  # operator uid -> display name, for `_metadata`

    def missing(self) -> list[tuple[str, int]]:
        if self.expected is None:
            return []
        return [(op, i) for op, p in sorted(self.expected.items()) for i in range(p) if (op, i) not in self.acks]


@dataclass(frozen=True)
class CompletedCheckpoint:
    """What `complete` did: the committed metadata and the bookkeeping around it."""

    metadata: CheckpointMetadata
    files_new: int
    files_reused: int
    files_deleted: int
    subsumed: tuple[int, ...]
    duration_s: float
    deletion_blocked: str | None = None

    @property
    def checkpoint_id(self) -> int:
        return self.metadata.checkpoint_id


class CheckpointCoordinator:
    def __init__(
        self,
        storage: CheckpointStorage,
        *,
        num_retained: int = 1,
        retention: ExternalizedRetention | str = ExternalizedRetention.RETAIN_ON_CANCELLATION,
        lineage: RestoreLineage | None = None,
        unowned: frozenset[str] = frozenset(),
    ):
        if num_retained < 1:
            raise ValueError(f"num_retained must be at least 1, got {num_retained}")
        self.storage = storage
        self.store = CompletedCheckpointStore(storage)
        self.num_retained = num_retained
        self.retention = ExternalizedRetention(retention)
        self.pending: dict[int, PendingCheckpoint] = {}
        self.unowned = frozenset(unowned)
        latest = self._rebuild()
        # Lineage and unowned files are carried forward from the checkpoint we resume from.
        self.lineage = lineage if lineage is not None else (latest.lineage if latest else None)
        self.unowned = frozenset(unowned) | (latest.unowned if latest else frozenset())
        self.registry.mark_unowned(self.unowned)
        self._last_triggered = 0

    # --- protocol ------------------------------------------------------------------------------

    def next_checkpoint_id(self) -> int:
        """The highest id seen anywhere + 1: triggered, retained, pending, a `chk-N` directory, or
        retired by a fallback or a rollback (`sparkpoint.checkpoint.retired`), whose directory is gone."""
        known = [self._last_triggered, *self._kinds, *self.pending, *self.storage.checkpoint_dirs(),
                 highest_retired(self.storage)]
        return max(known, default=0) + 1

    def trigger(
        self,
        *,
        kind: str = "checkpoint",
        expected: Mapping[str, int] | None = None,
        checkpoint_id: int | None = None,
        names: Mapping[str, str] | None = None,
    ) -> PendingCheckpoint:
        """Start checkpoint N (by default the highest id seen anywhere + 1). `names`: the
        operators' display names by uid, recorded beside their state.

        A driver that resumed from checkpoint K may ask for exactly K + 1: then a zombie driver
        that resumed from the same K races for the same id, and the exclusive create of
        `_metadata` lets only one of them commit (rule 6).
        """
        if kind not in ("checkpoint", "savepoint"):
            raise ValueError(f"kind must be checkpoint or savepoint, got {kind!r}")
        if checkpoint_id is not None and (checkpoint_id < 1 or checkpoint_id in self.pending):
            raise ValueError(f"checkpoint id {checkpoint_id} is invalid or already pending")
        cid = checkpoint_id if checkpoint_id is not None else self.next_checkpoint_id()
        self._last_triggered = max(self._last_triggered, cid)
        pending = PendingCheckpoint(cid, kind, dict(expected) if expected is not None else None,
                                    names=dict(names or {}))
        self.pending[cid] = pending
        return pending

    def acknowledge(self, checkpoint_id: int, handle: SubtaskStateHandle) -> None:
        pending = self._pending(checkpoint_id)
        if handle.checkpoint_id != checkpoint_id:
            raise CheckpointDeclined(f"handle for checkpoint {handle.checkpoint_id} sent to checkpoint {checkpoint_id}")
        key = (handle.operator, handle.subtask)
        if pending.expected is not None and handle.operator not in pending.expected:
            raise CheckpointDeclined(f"checkpoint {checkpoint_id} expects no operator {handle.operator!r}")
        _check_layout(handle)
        if key in pending.acks and pending.acks[key] != handle:
            # A retried task acknowledged twice: keep the first, drop the second's new files
            # (never one the registry knows, whatever the handle claims).
            kept = {g.path for g in pending.acks[key].stored()}
            self.storage.delete(
                f.path for f in handle.new_files() if f.path not in kept and not self.registry.is_known(f.path)
            )
            return
        pending.acks[key] = handle

    def complete(
        self, checkpoint_id: int, source_offsets: Any = None, *, recheck: Callable[[], str | None] | None = None,
        skipped_files: tuple[SkippedFile, ...] = (), base: int | None = None,
        observe: Callable[[CheckpointStats], CheckpointStats] | None = None, created_at: str | None = None,
    ) -> CompletedCheckpoint:
        """Commit checkpoint N (see the invariants above). `recheck`, called right after the
        commit, says why this checkpoint must not stand after all (a fence a recovery set while we
        committed): the `_metadata` is then withdrawn before anything else and CheckpointDeclined
        is raised. `base`: the checkpoint of this job N's state was restored from; when its
        `_metadata` is gone right after the commit (a rollback or a fallback retired it), N is
        withdrawn too and CheckpointSuperseded raised (invariant 7). `skipped_files`: the input
        files consumed unprocessed up to N, recorded as given. `observe`: adds what the caller
        observed of N to its stats, right before the commit (the storage requests it made, the
        time it took: `CheckpointStats.observed`). `created_at`: the time N's state stands for
        when it is not now (an erased copy keeps its original's: TTL reads expire against it)."""
        pending = self._pending(checkpoint_id)
        started = pending.started
        try:
            self._sync_with_storage()
            newer = [cid for cid in self._kinds if cid > checkpoint_id]
            if newer and pending.kind == "checkpoint":
                raise CheckpointDeclined(
                    f"checkpoint {checkpoint_id} is subsumed: the newer {self._kinds[max(newer)]} {max(newer)} "
                    "completed first"
                )
            meta = replace(self._build_metadata(pending, source_offsets), skipped_files=tuple(skipped_files))
            if created_at is not None:
                meta = replace(meta, created_at=created_at)
            if observe is not None:
                meta = replace(meta, stats=observe(meta.stats))
        except BaseException:
            self.abort(checkpoint_id, reason="completion failed before the commit")
            raise
        known = set(self._kinds) | self._unreadable
        crash_point("before-metadata")
        self._commit(meta)
        crash_point("after-metadata-before-registry")
        subsumed: list[int] = []
        deleted, blocked = 0, None
        try:
            self._withdraw_if_fenced(meta, recheck)
            self._withdraw_if_base_retired(meta, base)
            self._withdraw_if_broken(meta, known)
            self.pending.pop(checkpoint_id, None)
            if meta.kind == "checkpoint":  # Flink: a completed checkpoint subsumes older pending ones
                for older in [c for c, p in self.pending.items() if c < checkpoint_id and p.kind == "checkpoint"]:
                    self.abort(older, reason=f"subsumed by completed checkpoint {checkpoint_id}")
            self._register(meta, known)
            subsumed, deleted, blocked = self.subsume(newest=meta)
        except (UnknownSharedState, CheckpointSuperseded, CheckpointDeclined):  # withdrawn: never usable
            raise
        except Exception as e:  # the checkpoint is committed: what is left undone is the sweep's
            self.pending.pop(checkpoint_id, None)
            self._stale = True
            blocked = f"bookkeeping after committing checkpoint {checkpoint_id} failed ({e}); the sweep cleans up"
            log.error("checkpoint %s is complete, but %s", checkpoint_id, blocked)
        new = sum(1 for f in meta.files() if f.created_by == checkpoint_id)
        return CompletedCheckpoint(
            metadata=meta,
            files_new=new,
            files_reused=len(meta.paths()) - new,
            files_deleted=deleted,
            subsumed=tuple(subsumed),
            duration_s=time.monotonic() - started,
            deletion_blocked=blocked,
        )

    def _commit(self, meta: CheckpointMetadata) -> None:
        """Write `_metadata` exclusively; when the outcome is unclear, read it back (rule 4).

        A lost response to a successful write (an S3 PUT retried into 412, a timeout) must not
        make us delete files our own committed `_metadata` references.
        """
        cid, data = meta.checkpoint_id, meta.dumps()
        if len(data) > store.MAX_METADATA_BYTES:  # no reader would open it, and it would block every deletion
            reason = (f"its _metadata would be {len(data)} bytes, more than the {store.MAX_METADATA_BYTES} a reader "
                      f"opens ({len(meta.paths())} files); lower the parallelism or changelog_max_chain")
            self.abort(cid, reason=reason)
            raise CheckpointDeclined(f"checkpoint {cid} is not committed: {reason}")
        try:
            self.storage.commit_exclusive(meta.metadata_path, data)
            return
        except BaseException as e:
            error: BaseException = e
        try:
            committed = self.storage.read_bytes(meta.metadata_path)
        except FileNotFoundError:
            committed = None
        except Exception as e:  # cannot tell what is there: keep every file, the sweep decides later
            self.pending.pop(cid, None)
            log.error("checkpoint %s: commit outcome unknown (%s; read-back: %s); deleting nothing", cid, error, e)
            raise error from None
        if committed == data:
            log.warning("checkpoint %s: the commit reported %r but our _metadata is in place", cid, error)
            return
        reason = "another writer committed the same checkpoint id" if committed else "the commit failed"
        try:  # count what the winner's `_metadata` references: a completer of the same attempt shares our files
            self._rebuild()
        except Exception as e:  # cannot tell what is referenced: keep every file, the sweep decides later
            self.pending.pop(cid, None)
            log.error("checkpoint %s: %s, and the registry cannot be rebuilt (%s); deleting nothing", cid, reason, e)
            raise error from None
        self.abort(cid, reason=reason)
        raise error

    def _withdraw_if_broken(self, meta: CheckpointMetadata, known: set[int]) -> None:
        """Another writer committed or subsumed between our checks and our commit (invariant 5):
        withdraw ours when a reused file of ours is gone with a checkpoint of theirs, or when a
        checkpoint newer than ours completed meanwhile (ours is then stale: a writer that started
        from the newer one has consumed its batch, and our sink commit would repeat output). A
        newer savepoint does not count: it is a copy of ours, taken right after our commit."""
        cid = meta.checkpoint_id
        current = set(self.storage.completed_checkpoint_ids()) - {cid}
        if current == known:
            return
        self._rebuild()
        # A savepoint consumes no batch: one newer than ours is a copy of ours (it takes exactly the
        # id after the checkpoint it copies), and withdrawing ours would drop its batch's output.
        newer = sorted(c for c in current - known if c > cid and self._kinds.get(c) != "savepoint")
        others = {p for c in self.registry.checkpoint_ids() if c != cid for p in self.registry.paths_of(c)}
        suspects = sorted({f.path for f in meta.files() if f.created_by != cid and f.path not in others})
        gone = [p for p, there in zip(suspects, self.storage.parallel(self.storage.exists, suspects)) if not there]
        if not gone and not newer:
            return
        why = f"it reuses {gone}, which another writer deleted" if gone else f"checkpoint {newer[-1]} completed"
        log.error("checkpoint %s: %s while it committed: withdrawing it", cid, why)
        self.storage.delete([meta.metadata_path])  # if this fails, it stays committed and nothing is subsumed
        try:  # its own uploads: best effort, the sweep gets what is left
            self._rebuild()
            self.abort(cid, reason=why)
        except Exception as e:
            self._stale = True
            log.warning("checkpoint %s was withdrawn, its uploads are left to the sweep: %s", cid, e)
        if gone:
            raise UnknownSharedState(
                f"checkpoint {cid} re-references {gone[0]}, which another writer deleted while it committed; "
                "it was withdrawn. Restore the latest checkpoint and take the next one."
            )
        raise CheckpointSuperseded(
            f"checkpoint {cid} was withdrawn: the newer checkpoint {newer[-1]} completed while it committed "
            "(another writer on this job). Resume from the latest checkpoint."
        )

    def _withdraw_if_fenced(self, meta: CheckpointMetadata, recheck: Callable[[], str | None] | None) -> None:
        """A tombstone re-checked after the commit (DESIGN rule 9)."""
        why = recheck() if recheck is not None else None
        if why is None:
            return
        self._withdraw(meta, why)
        raise CheckpointDeclined(f"checkpoint {meta.checkpoint_id} was withdrawn right after its commit: {why}")

    def _withdraw_if_base_retired(self, meta: CheckpointMetadata, base: int | None) -> None:
        """Invariant 7: the checkpoint our state was restored from must still be there once our
        `_metadata` landed. A rollback or a fallback deletes every `_metadata` above its target
        before its last listing of them (`retire_above`): either that listing finds ours and
        retires it too, or we find our base gone here. Nothing else removes a base under a writer
        (retention never subsumes the latest checkpoint; a newer one makes ours stale anyway)."""
        if base is None or self.storage.exists(metadata_path(base)):
            return
        why = f"checkpoint {base}, which its state was restored from, was retired (a rollback or a fallback past it)"
        self._withdraw(meta, why)
        raise CheckpointSuperseded(f"checkpoint {meta.checkpoint_id} was withdrawn right after its commit: {why}. "
                                   "Resume from the latest checkpoint.")

    def _withdraw(self, meta: CheckpointMetadata, why: str) -> None:
        """Delete our just-committed `_metadata` before anything else, then our uploads (best effort)."""
        cid = meta.checkpoint_id
        log.error("checkpoint %s: %s while it committed: withdrawing it", cid, why)
        self.storage.delete([meta.metadata_path])
        try:
            self._rebuild()
            self.abort(cid, reason=why)
        except Exception as e:
            self._stale = True
            log.warning("checkpoint %s was withdrawn, its uploads are left to the sweep: %s", cid, e)

    def retire_above(self, checkpoint_id: int, *, reason: str, tries: int = 5) -> tuple[list[int], int]:
        """Retire every completed checkpoint above `checkpoint_id` (a rollback to it, a fallback
        past a damaged one): they must never be restored again (their output is rolled back).
        Their ids are noted as retired first (invariant 7), then their `_metadata` go, newest
        first, and the job is listed again until none is left above: a writer that committed
        meanwhile is retired too, and one that commits after the last listing finds its base gone
        and withdraws. Then the files that only they referenced (a savepoint's copies among them).
        Returns (the retired ids, files deleted); with deletion blocked (an unreadable `_metadata`)
        their files are left to the orphan sweep.

        Raises:
            CheckpointDeclined: other writers kept committing above `checkpoint_id` `tries` times.
        """
        retired: dict[int, CheckpointMetadata] = {}
        for _ in range(tries):
            above = [m for m in self.store.load_all().checkpoints if m.checkpoint_id > checkpoint_id]
            if not above:
                break
            ids = [m.checkpoint_id for m in above]  # newest first
            log.warning("retiring checkpoints %s: %s", sorted(ids), reason)
            record_retired(self.storage, ids, reason=reason)
            self.storage.delete(metadata_path(c) for c in ids)
            retired.update({m.checkpoint_id: m for m in above})
        else:
            raise CheckpointDeclined(f"checkpoints above {checkpoint_id} kept being committed by another writer "
                                     f"while they were retired ({reason}); stop it and try again")
        return sorted(retired), self._delete_retired(retired)

    def retire(self, checkpoints: list[CheckpointMetadata], *, reason: str) -> int:
        """Retire exactly `checkpoints` (an erase's originals, once their rewritten copies with
        newer ids verify): their ids are noted as retired first (invariant 7), then their
        `_metadata` go, oldest first, then the files no retained checkpoint references any more
        (the copies reference every file of theirs that did not hold an erased key). Returns the
        files deleted; with deletion blocked (an unreadable `_metadata`) they are left to the sweep."""
        ids = sorted(m.checkpoint_id for m in checkpoints)
        if not ids:
            return 0
        log.warning("retiring checkpoints %s: %s", ids, reason)
        record_retired(self.storage, ids, reason=reason)
        for cid in ids:
            self.storage.delete([metadata_path(cid)])
            crash_point("erase-mid-retire")
        return self._delete_retired({m.checkpoint_id: m for m in checkpoints})

    def _delete_retired(self, retired: Mapping[int, CheckpointMetadata]) -> int:
        """After retired checkpoints' `_metadata` went: delete the files only they referenced."""
        self._rebuild()
        if not retired or self.registry.deletion_blocked:
            return 0
        unowned = self.unowned.union(*(m.unowned for m in retired.values()))
        doomed = {p for m in retired.values() for p in m.paths()
                  if p not in unowned and not self.registry.is_known(p)}
        deleted = self.storage.delete(doomed)
        for cid in retired:
            self.storage.remove_empty_dirs(checkpoint_dir(cid))
        return deleted

    def abort(self, checkpoint_id: int, *, reason: str = "") -> int:
        """Forget a pending checkpoint and delete what it uploaded, best effort."""
        pending = self.pending.pop(checkpoint_id, None)
        if pending is None:
            return 0
        if self.registry.deletion_blocked:  # some `_metadata` cannot be read: it may reference them
            log.warning("abort of checkpoint %s deletes nothing while %s", checkpoint_id,
                        "; ".join(self.registry.blocked_reasons))
            return 0
        doomed = {f.path for h in pending.acks.values() for f in h.new_files() if not self.registry.is_known(f.path)}
        log.info("aborting checkpoint %s (%s): deleting %d new files", checkpoint_id, reason, len(doomed))
        try:
            return self.storage.delete(doomed)
        except Exception as e:  # best effort: the orphan sweep gets what is left
            log.warning("abort of checkpoint %s could not delete every file: %s", checkpoint_id, e)
            return 0

    def shutdown(self, status: JobStatus | str) -> list[int]:
        """Apply the externalized-checkpoint retention table; returns the discarded ids."""
        for cid in list(self.pending):
            self.abort(cid, reason=f"job {JobStatus(status).value}")
        if not discard_on_shutdown(self.retention, status):
            return []
        doomed = sorted(cid for cid, kind in self._kinds.items() if kind == "checkpoint")
        record_retired(self.storage, doomed, reason=f"job {JobStatus(status).value}")
        self._discard(doomed)
        return doomed

    # --- internals -----------------------------------------------------------------------------

    def _rebuild(self) -> CheckpointMetadata | None:
        """Recount the registry from every retained `_metadata` on storage, one at a time; the
        newest readable checkpoint (None: none)."""
        rebuilt = self.store.rebuild()
        self.registry = rebuilt.registry
        self.registry.mark_unowned(self.unowned)
        self._kinds = dict(rebuilt.kinds)
        self._unreadable = set(rebuilt.unreadable)
        self._stale = False
        return rebuilt.latest

    def _sync_with_storage(self) -> None:
        """Rebuild when storage holds other completed checkpoints than the registry counts."""
        if self._stale or set(self.storage.completed_checkpoint_ids()) != set(self._kinds) | self._unreadable:
            log.warning("the checkpoints on storage changed under this coordinator; rebuilding the registry")
            self._rebuild()

    def _pending(self, checkpoint_id: int) -> PendingCheckpoint:
        try:
            return self.pending[checkpoint_id]
        except KeyError:
            raise CheckpointDeclined(f"checkpoint {checkpoint_id} is not pending (aborted or completed)") from None

    def _build_metadata(self, pending: PendingCheckpoint, source_offsets: Any) -> CheckpointMetadata:
        cid = pending.checkpoint_id
        missing = pending.missing()
        if missing:
            raise CheckpointDeclined(f"checkpoint {cid} lacks acknowledgements from {missing}")
        if not pending.acks:
            raise CheckpointDeclined(f"checkpoint {cid} has no acknowledgement at all")
        referenced: dict[str, int] = {}
        sizes: dict[str, int] = {}
        for handle in pending.acks.values():
            for f in handle.stored():
                if f.created_by > cid:
                    raise CheckpointDeclined(
                        f"checkpoint {cid} references {f.path}, created by the later checkpoint {f.created_by}: "
                        "a snapshot may only reuse files of checkpoints older than itself"
                    )
                referenced[f.path] = f.created_by
                sizes[f.path] = f.size
        self.registry.check_references(cid, referenced)
        by_op: dict[str, list[SubtaskStateHandle]] = {}
        for (op, _), handle in sorted(pending.acks.items()):
            by_op.setdefault(op, []).append(handle)
        operators = {}
        for op, handles in by_op.items():
            max_ps = {h.max_parallelism for h in handles}
            if len(max_ps) != 1:
                raise CheckpointDeclined(f"operator {op!r} acknowledged different max parallelisms {sorted(max_ps)}")
            if [h.subtask for h in handles] != list(range(len(handles))):
                raise CheckpointDeclined(f"operator {op!r} acknowledged subtasks {[h.subtask for h in handles]}")
            max_p = max_ps.pop()
            gap = coverage_problem([h.key_group_range for h in handles], max_p)
            if gap:
                raise CheckpointDeclined(f"operator {op!r} {gap}")
            declared = [h.states for h in handles if h.states is not None]
            if any(d != declared[0] for d in declared):
                raise CheckpointDeclined(f"operator {op!r}: its subtasks declared different states")
            operators[op] = OperatorState(
                max_parallelism=max_p, subtasks=tuple(handles), states=declared[0] if declared else None,
                name=pending.names.get(op),
            )
        new = [p for p, c in referenced.items() if c == cid]
        return CheckpointMetadata(
            job_id=self.storage.job_id,
            checkpoint_id=cid,
            kind=pending.kind,
            created_at=utc_now_iso(),
            source_offsets=source_offsets,
            stats=CheckpointStats(
                state_size=sum(sizes.values()),
                checkpointed_size=sum(sizes[p] for p in new),
                files_new=len(new),
                files_reused=len(referenced) - len(new),
            ),
            operators=operators,
            lineage=self.lineage,
            unowned=self.unowned,
        )

    def _register(self, meta: CheckpointMetadata, known: set[int]) -> None:
        if meta.checkpoint_id in self._kinds:  # rebuilt from storage after our commit already
            return
        if self._stale or set(self._kinds) | self._unreadable != known:
            self._rebuild()
            return
        self.registry.register_checkpoint(meta.checkpoint_id, meta.references())
        self._kinds[meta.checkpoint_id] = meta.kind

    def subsume(self, newest: CheckpointMetadata | None = None) -> tuple[list[int], int, str | None]:
        """Apply retention now (e.g. after `num_retained` was lowered): (subsumed ids, files
        deleted, why deletion was blocked or None).

        With `newest` (the checkpoint just committed), nothing is subsumed unless every file it
        lists, new and re-referenced, is there with its size: older checkpoints are never dropped
        in favour of one that cannot be restored (a damaged reused file, or a new upload an orphan
        sweep took while it committed). One listing per directory."""
        doomed = checkpoints_to_subsume(list(self._kinds.items()), self.num_retained)
        if doomed and newest is None:  # e.g. `prune` after num_retained was lowered: the same guard
            # the newest kept *checkpoint*: a savepoint's files are all its own, it reuses nothing
            kept = sorted(c for c, kind in self._kinds.items() if kind == "checkpoint" and c not in doomed)
            try:
                newest = self.store.load(kept[-1]) if kept else None
            except Exception as e:  # cannot tell whether it is whole: keep everything
                log.error("retention skipped: checkpoint %s cannot be read (%s)", kept[-1], e)
                return [], 0, f"checkpoint {kept[-1]} cannot be read ({e})"
        damage = None
        if doomed and newest is not None:
            problems = stored_size_problems(self.storage, list(newest.files()))
            if problems:
                why = (f"checkpoint {newest.checkpoint_id} lists missing or damaged files ("
                       + "; ".join(str(p) for p in problems[:3]) + f"): checkpoints {doomed} are kept")
                log.error("retention skipped: %s", why)
                return [], 0, why
            doomed, damage = self._keep_fallback_from_damaged_reuse(newest, doomed)
        try:
            deleted = self._discard(doomed)
        except DeletionBlocked as e:
            log.warning("retention skipped: %s", e)
            return [], 0, str(e)
        return doomed, deleted, damage

    def _keep_fallback_from_damaged_reuse(self, newest: CheckpointMetadata, doomed: list[int]
                                          ) -> tuple[list[int], str | None]:
        """Rule 15: a file `newest` reuses is only as good as its bytes. Before retention subsumes
        the last retained checkpoint that does not reference such a file (every checkpoint kept
        does), the file's CRC32 is checked on storage; usually these are the previous
        checkpoint's new files. A damaged one keeps that checkpoint beyond `num_retained`: it is
        the one a restore falls back to. Returns (what may be subsumed, why something was kept)."""
        # Savepoints hold copies of their own and reference no shared file: one kept in the job
        # directory must not hide every reused file from this check.
        kept = {c: self.registry.paths_of(c) for c in self.registry.checkpoint_ids()
                if c not in doomed and self._kinds.get(c, "checkpoint") == "checkpoint"}
        kept.setdefault(newest.checkpoint_id, frozenset(newest.paths()))
        lost = {c: self.registry.paths_of(c) for c in doomed}
        reused = {f.path: f for f in newest.restored_files() if f.created_by != newest.checkpoint_id}
        last_without: dict[str, int] = {}  # reused path -> the newest doomed checkpoint that lacks it
        for path in reused:
            if all(path in paths for paths in kept.values()):
                free = [c for c, paths in lost.items() if path not in paths]
                if free:
                    last_without[path] = max(free)
        if not last_without:
            return doomed, None
        problems = stored_content_problems(self.storage, [reused[p] for p in sorted(last_without)])
        if not problems:
            return doomed, None
        keep = sorted({last_without[p.path] for p in problems})
        why = (f"DAMAGED SHARED FILE: {problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
               + f"; checkpoint {newest.checkpoint_id} and every newer retained checkpoint reuse it, so checkpoint(s) "
               f"{keep} without it are kept beyond num_retained={self.num_retained}: a restore falls back to them. "
               "Run `sparkpoint verify`; a restore from a task-local copy hides the damage until the copy is gone")
        log.error("retention: %s", why)
        return [c for c in doomed if c not in keep], why

    def _discard(self, checkpoint_ids: list[int]) -> int:
        if checkpoint_ids and self.registry.deletion_blocked:
            raise DeletionBlocked("; ".join(self.registry.blocked_reasons))
        deleted = 0
        for cid in checkpoint_ids:
            paths = self.registry.release_checkpoint(cid)
            self._kinds.pop(cid, None)
            meta_path = metadata_path(cid)
            if meta_path in paths:  # the commit point goes first
                self.storage.delete([meta_path])
                paths.discard(meta_path)
            crash_point("mid-subsumption-deletes")
            deleted += self.storage.delete(paths)
            self.storage.remove_empty_dirs(checkpoint_dir(cid))
        return deleted


def _check_layout(handle: SubtaskStateHandle) -> None:
    """New files must sit where the layout says; reused ones may be anywhere the registry knows."""
    shared_prefix = shared_dir(handle.operator, handle.subtask) + "/"
    private_prefix = private_dir(handle.checkpoint_id, handle.operator, handle.subtask) + "/"
    for f in handle.shared + handle.staged:
        if f.created_by == handle.checkpoint_id and not f.path.startswith(shared_prefix):
            raise CheckpointDeclined(f"new shared file {f.path} is not under {shared_prefix}")
    for f in handle.private:
        if f.created_by != handle.checkpoint_id or not f.path.startswith(private_prefix):
            raise CheckpointDeclined(f"private file {f.path} must be new and under {private_prefix}")
