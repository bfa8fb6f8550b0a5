"""The restore half of the RocksDB backend: the working database when its marker names the
checkpoint, else a verified task-local copy, else a verified download from stable storage; the
changelog chain replayed; rescaling by key group; fallback across checkpoints (rule 10: only
corruption falls back)."""

from __future__ import annotations

import logging
import shutil
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from rocksdict import Rdict

from sparkpoint.checkpoint.crash import crash_point
from sparkpoint.checkpoint.errors import (
    CheckpointCorrupted,
    LocalStateError,
    OperatorStateMismatch,
    SparkpointError,
    StateBackendError,
)
from sparkpoint.checkpoint.files import check_handle_shape, download_verified
from sparkpoint.checkpoint.interleave import storage_step
from sparkpoint.checkpoint.metadata import CheckpointMetadata, KeyGroupRange, SubtaskStateHandle
from sparkpoint.checkpoint.retention import ClaimMode
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.state import changelog
from sparkpoint.state.changelog import ChangelogFormatError
from sparkpoint.state.handles import SIDECAR_KEYS, key_group_bounds
from sparkpoint.state.migration import migrate_records
from sparkpoint.state.record import RecordCodec
from sparkpoint.state.restore import (
    local_copy_matches,
    materialize,
    record_fingerprints,
)
from sparkpoint.state.rocksdb import (
    compact_all,
    ensure_column_families,
    flush_all,
    is_corruption,
    list_states,
    open_db,
    scan_options,
)
from sparkpoint.state.schema import check_declarations, restored_declarations
from sparkpoint.state.subtask import SubtaskState

log = logging.getLogger(__name__)
_MERGE_BATCH = 10_000


@dataclass(frozen=True)
class RestoreResult:
    """How a subtask got its state."""

    checkpoint_id: int | None  # None: started empty
    source: str  # empty | working | local | primary | rescale
    files: int = 0
    downloaded_bytes: int = 0
    seconds: float = 0.0
    fell_back_from: tuple[int, ...] = ()
    problems: tuple[str, ...] = field(default=())
    migrated: int = 0  # entries rewritten because their RecordCodec's fields changed


class Restoring(SubtaskState):
    """Restoring a subtask from a checkpoint (see `RocksDBStateBackend.restore`)."""

    def restore(
        self,
        checkpoint: CheckpointMetadata | None,
        *,
        claim_mode: ClaimMode | str = "CLAIM",
        source: CheckpointStorage | None = None,
        allow_missing: bool = False,
    ) -> RestoreResult:
        """Open this subtask's state as of `checkpoint` (None: empty).

        A checkpoint without this operator is an OperatorStateMismatch unless `allow_missing`
        (a new operator added to the job starts empty only when the user says so).

        Tries, in order: the working database if it is exactly that checkpoint, the task-local
        copy if every file verifies, then stable storage. Several old subtasks overlapping this
        key-group range (a rescale) are merged. Raises CheckpointCorrupted naming the bad file.
        `source` is the job directory `checkpoint` lives in, when it is another job's: its files
        are read, never referenced, so the first checkpoint after it is full.

        The states this backend was given (`states=`) are compared with what the checkpoint
        recorded first (StateSchemaIncompatible before anything is read), then opened: entries
        of a RecordCodec whose fields changed are rewritten in the new shape.
        """
        recorded = restored_declarations(checkpoint, self.operator, self.descriptors, self.key_type)
        changes = check_declarations(self.operator, recorded, self.declarations, checkpoint)
        result = self._restore(checkpoint, claim_mode=claim_mode, source=source, allow_missing=allow_missing)
        return self._open_declarations(recorded, changes, result)

    def restore_entries(self, checkpoint: CheckpointMetadata, fill: Callable[[Rdict], None]) -> RestoreResult:
        """A scratch state holding the entries of `checkpoint` that `fill` copies into its empty
        database, opened as `restore` opens the whole checkpoint: its clocks, the declarations it
        recorded, and each declared state read in the fields that checkpoint recorded (entries of
        a RecordCodec whose fields changed since are rewritten in the new shape first).

        What `sparkpoint diff` reads the keys that may differ with, without restoring every file.

        Args:
            checkpoint: the snapshot the entries come from (its `_metadata`).
            fill: writes the raw entries (keys and values as stored, sidecar keys included) into the
                database it is given; it may create column families.

        Returns:
            The `RestoreResult` (source "empty", `migrated` counting the entries rewritten).

        Raises:
            StateSchemaIncompatible: the declared states cannot read what `checkpoint` recorded.
        """
        recorded = restored_declarations(checkpoint, self.operator, self.descriptors, self.key_type)
        changes = check_declarations(self.operator, recorded, self.declarations, checkpoint)
        result = self._restore(None)
        self._time = checkpoint_clock(checkpoint)
        self._declared = declared_states(checkpoint, self.operator, self.key_group_range)
        fill(self._open_db())
        return self._open_declarations(recorded, changes, result)

    def _open_declarations(self, recorded: Mapping[str, Any] | None, changes: set[str],
                           result: RestoreResult) -> RestoreResult:
        """Rewrite the entries of the `changes` states from the fields `recorded` into the declared
        ones, then open every declared state."""
        started = time.monotonic()
        migrated = 0
        for name, descriptor in self.descriptors.items():
            old = (recorded or {}).get(name)
            if name in changes and old is not None:
                migrated += migrate_records(self, name, RecordCodec.from_spec(old["codec"]), descriptor.codec)
            self._open_declared(name, descriptor)
        if migrated:
            log.info("%s/%s: %d entries rewritten in their states' new fields in %.2fs", self.operator, self.subtask,
                     migrated, time.monotonic() - started)
            result = replace(result, migrated=migrated, seconds=result.seconds + time.monotonic() - started)
        return result

    def _restore(
        self,
        checkpoint: CheckpointMetadata | None,
        *,
        claim_mode: ClaimMode | str = "CLAIM",
        source: CheckpointStorage | None = None,
        allow_missing: bool = False,
    ) -> RestoreResult:
        started = time.monotonic()
        self._source = source or self.storage
        foreign = self._source.job_url != self.storage.job_url
        self.close()
        self._states.clear()
        self._sweepers.clear()
        self._time = checkpoint_clock(checkpoint)
        self._declared = declared_states(checkpoint, self.operator, self.key_group_range)
        self._pending.clear()
        self._forget_log()
        self.dir.mkdir(parents=True, exist_ok=True)
        self._drop_leftovers()
        claim = ClaimMode(claim_mode)
        if checkpoint is not None and self.operator not in checkpoint.operators and not allow_missing:
            raise OperatorStateMismatch(
                f"checkpoint {checkpoint.checkpoint_id} holds no state of operator {self.operator!r} (it has "
                f"{', '.join(sorted(checkpoint.operators))}); restoring it would start {self.operator} empty. "
                "Allow new operators explicitly to do so."
            )
        if checkpoint is None or self.operator not in checkpoint.operators:
            self._reset_empty()
            return RestoreResult(None, "empty", seconds=time.monotonic() - started)
        op = checkpoint.operators[self.operator]
        if op.max_parallelism != self.max_parallelism:
            raise OperatorStateMismatch(
                f"checkpoint {checkpoint.checkpoint_id} stores {self.operator} with max parallelism "
                f"{op.max_parallelism}, this job uses {self.max_parallelism}: key groups would not match. "
                f"Run with --max-parallelism {op.max_parallelism}."
            )
        handles = [h for h in op.subtasks if h.key_group_range.intersects(self.key_group_range)]
        cid = checkpoint.checkpoint_id
        if len(handles) == 1 and handles[0].key_group_range == self.key_group_range:
            result = self._restore_one(handles[0], cid, started)
            if claim is ClaimMode.CLAIM and not foreign:
                self._confirm_base(cid, handles[0])
                self._log_base = cid
            else:  # NO_CLAIM: the first checkpoint is full, it owns nothing of the restored one
                self.forget_base()
        else:
            result = self._restore_rescaled(handles, cid, started)
            self.forget_base()  # a fresh incremental history
        self._drop_local_checkpoints(keep={cid} if self.local_recovery and result.source != "rescale" else set())
        return result

    def _restore_one(self, handle: SubtaskStateHandle, cid: int, started: float) -> RestoreResult:
        check_handle_shape(handle, cid)
        files = len(handle.shared) + len(handle.private)
        marker = self._read_marker()
        if marker == self._marker_for(cid, handle) and self.db_path.is_dir():
            try:
                self._open_db()
                self._clean = True
                return RestoreResult(cid, "working", files=files, seconds=time.monotonic() - started)
            except StateBackendError as e:  # a copy replaces it: no checkpoint is touched either way
                log.warning("working database of checkpoint %s does not open (%s); restoring a copy", cid, e)
        self._forget_working()
        local = self.dir / f"chk-{cid}"
        problems: tuple[str, ...] = ()
        if self.local_recovery and local.is_dir():
            storage_step("read", str(local))  # the task-local copy
            problems = tuple(str(p) for p in local_copy_matches(local, handle))
            if not problems:
                try:
                    self._install(local, handle, cid)
                except CheckpointCorrupted as e:  # RocksDB's own checks refuse it
                    problems = (f"{local}: {e}",)
                    shutil.rmtree(local, ignore_errors=True)
                else:
                    record_fingerprints(local, [f.local_name for f in handle.files()], {})  # all checked now
                    self._write_marker(cid, handle)
                    self._repair_primary(handle, deep=False)  # a missing or truncated primary file: rewritten
                    return RestoreResult(cid, "local", files=files, seconds=time.monotonic() - started)
            log.warning("task-local copy of checkpoint %s fails verification, using stable storage: %s", cid,
                        "; ".join(problems))
            # kept until the download replaces it: its good files may repair a bad primary copy
        downloaded = self._download(handle, cid)
        self._write_marker(cid, handle)
        return RestoreResult(
            cid, "primary", files=files, downloaded_bytes=downloaded, seconds=time.monotonic() - started,
            problems=problems,
        )

    def _download(self, handle: SubtaskStateHandle, cid: int) -> int:
        target = self.dir / f"download-{uuid.uuid4().hex[:8]}"
        try:
            downloaded = download_verified(self._source, handle, cid, target)
        except CheckpointCorrupted:
            if not self._repair_primary(handle, deep=True):
                raise
            downloaded = download_verified(self._source, handle, cid, target)
        try:
            if self.local_recovery:  # keep the verified files as the task-local copy
                local = self.dir / f"chk-{cid}"
                storage_step("write", str(local))
                shutil.rmtree(local, ignore_errors=True)
                names = [f.local_name for f in handle.files()]
                materialize(target, local, names)
                record_fingerprints(local, names, {})  # every file was just checksummed
            self._install(target, handle, cid)
        finally:
            shutil.rmtree(target, ignore_errors=True)
        return downloaded

    def _repair_primary(self, handle: SubtaskStateHandle, *, deep: bool) -> bool:
        """Rewrite the handle's bad files in stable storage from good task-local copies (see
        `repair`); True when every bad file was repaired. `deep` checks CRC32s, else sizes only.
        Never writes into another job's directory; a failure here is logged, not raised."""
        from sparkpoint.state.repair import problems_of_handle_files, repair_files

        if self._source.job_url != self.storage.job_url:
            return False
        files = {f.path: f for f in handle.files()}
        try:
            bad = problems_of_handle_files(self.storage, list(files.values()), deep=deep)
            report = repair_files(self.storage, self.dir.parent, [(files[p.path], p.problem) for p in bad])
        except (SparkpointError, OSError) as e:
            log.warning("could not check or repair the primary copy of %s subtask %s: %s", self.operator,
                        self.subtask, e)
            return False
        for path, why in sorted(report.unrepairable.items()):
            log.error("%s/%s cannot be repaired: %s", self.storage.job_url, path, why)
        return bool(report.repaired) and not report.unrepairable

    def _install(self, source: Path, handle: SubtaskStateHandle, cid: int) -> Rdict:
        """Make db/ the state of `handle` from its verified files in `source`: the materialized
        RocksDB files, then the changelog chain replayed in checkpoint order."""
        names = [f.local_name for f in handle.files()]
        materialize(source, self.db_path, [n for n in names if not changelog.is_changelog(n)])
        crash_point("mid-restore")
        db = self._open_restored(cid)
        try:
            self._replay_chain(db, self.db_path, source, handle, cid)
        except CheckpointCorrupted:
            self.db = None
            db.close()
            self._forget_working()
            raise
        return db

    def _replay_chain(self, db: Rdict, db_path: Path, source: Path, handle: SubtaskStateHandle, cid: int) -> None:
        chain = sorted(f.local_name for f in handle.files() if changelog.is_changelog(f.local_name))
        if not chain:
            return
        ensure = lambda names: ensure_column_families(db, str(db_path), names, self.options)  # noqa: E731
        limit = changelog.raw_limit(sum(f.size for f in handle.files()))
        try:
            for name in chain:
                changelog.replay(db, source / name, ensure, max_raw=limit)
        except ChangelogFormatError as e:
            raise CheckpointCorrupted(
                f"checkpoint {cid} cannot be restored: the changelog of {self.operator} subtask {self.subtask} "
                f"does not decode although it matches _metadata ({e}); run `sparkpoint verify`",
                checkpoint_id=cid,
            ) from e
        # The marker written next says db/ is checkpoint `cid`: without a WAL, that holds only
        # once the replayed entries are in SSTs.
        flush_all(db, list_states(str(db_path)))

    def _restore_rescaled(self, handles: list[SubtaskStateHandle], cid: int, started: float) -> RestoreResult:
        """Merge the old subtasks overlapping our key-group range (Flink's rescaling)."""
        self._forget_working()
        if not handles:  # no old subtask held any of our key groups
            self._reset_empty()
            return RestoreResult(cid, "rescale", seconds=time.monotonic() - started)
        for h in handles:
            check_handle_shape(h, cid)
        lower, upper = key_group_bounds(self.key_group_range)
        # The old instance with the largest overlap becomes our database, clipped to our range.
        handles = sorted(handles, key=lambda h: -_overlap(h.key_group_range, self.key_group_range))
        downloaded = 0
        work = self.dir / f"rescale-{uuid.uuid4().hex[:8]}"
        try:
            sources = []
            for i, h in enumerate(handles):
                target = work / str(i)
                downloaded += download_verified(self._source, h, cid, target)
                sources.append(target)
            db = self._install(sources[0], handles[0], cid)
            for source, h in zip(sources[1:], handles[1:]):
                self._replay_in_place(source, h, cid)
            names = self.state_names()
            for name in names:
                cf = db.get_column_family(name)
                if lower > b"\x00\x00":
                    cf.delete_range(b"\x00\x00", lower)
                if upper < b"\x80":  # key groups stop at 0x7fff
                    cf.delete_range(upper, b"\x80")
            for source in sources[1:]:
                self._merge_from(source, lower, upper)
            compact_all(db, self.state_names())  # drop the clipped ranges before the first upload
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return RestoreResult(
            cid, "rescale", files=sum(len(h.shared) + len(h.private) for h in handles),
            downloaded_bytes=downloaded, seconds=time.monotonic() - started,
        )

    def _replay_in_place(self, source: Path, handle: SubtaskStateHandle, cid: int) -> None:
        """Apply a rescale source's changelog chain to its own (scratch) directory."""
        if not any(changelog.is_changelog(f.local_name) for f in handle.files()):
            return
        try:
            db = open_db(str(source), [], self.options, create=False)
        except StateBackendError as e:
            if not is_corruption(e):
                raise _not_corruption(self, cid, e) from e
            raise CheckpointCorrupted(f"RocksDB refuses a verified subtask directory while rescaling: {e}") from e
        try:
            self._replay_chain(db, source, source, handle, cid)
        finally:
            db.close()

    def _open_restored(self, checkpoint_id: int) -> Rdict:
        """Files that match `_metadata` and that RocksDB reports as corrupt are a bad checkpoint,
        not a bad backend: the caller falls back to an older checkpoint, as for a corrupt file.
        Any other refusal (a lock held by another process, too many open files, an I/O error of the
        local disk) is this machine's, not the checkpoint's: the task fails and is retried, and
        no checkpoint or output is touched (DESIGN rule 10)."""
        try:
            return self._open_db()
        except StateBackendError as e:
            if not is_corruption(e):
                raise _not_corruption(self, checkpoint_id, e) from e
            self._forget_working()
            raise CheckpointCorrupted(
                f"checkpoint {checkpoint_id} cannot be restored: RocksDB refuses the files of {self.operator} "
                f"subtask {self.subtask} although they match _metadata ({e}); run `sparkpoint verify` to find a "
                "checkpoint that verifies",
                checkpoint_id=checkpoint_id,
            ) from e

    def _merge_from(self, source: Path, lower: bytes, upper: bytes) -> None:
        from rocksdict import WriteBatch

        db = self._open_db()
        try:
            other = open_db(str(source), [], self.options, create=False, read_only=True)
        except StateBackendError as e:
            if not is_corruption(e):
                raise _not_corruption(self, None, e) from e
            raise CheckpointCorrupted(f"RocksDB refuses a verified subtask directory while rescaling: {e}") from e
        try:
            names = list_states(str(source))
            ensure_column_families(db, str(self.db_path), names, self.options)
            for name in names:
                handle = db.get_column_family_handle(name)
                opts = scan_options(upper)  # held while the iterator lives: it reads the bound from it
                it = other.get_column_family(name).iter(opts)
                try:
                    it.seek(lower)
                    batch, n = WriteBatch(raw_mode=True), 0
                    while it.valid():
                        batch.put(it.key(), it.value(), handle)
                        n += 1
                        if n % _MERGE_BATCH == 0:
                            db.write(batch)
                            batch = WriteBatch(raw_mode=True)
                        it.next()
                    it.status()
                finally:
                    del it  # a live iterator holds `other` open, even from a traceback
                # A state's format key (its entries carry TTL stamps) lies beyond every key group:
                # the database we grew from may lack the state, or the key, altogether.
                for sidecar in SIDECAR_KEYS:
                    stamped = other.get_column_family(name).get(sidecar)
                    if stamped is not None:
                        batch.put(sidecar, stamped, handle)
                db.write(batch)
        finally:
            other.close()

    def _reset_empty(self) -> None:
        self._forget_working()
        self.forget_base()
        self._drop_local_checkpoints(keep=set())
        self._open_db(create=True)


def _not_corruption(backend: SubtaskState, checkpoint_id: int | None, error: BaseException) -> LocalStateError:
    which = f" for checkpoint {checkpoint_id}" if checkpoint_id is not None else ""
    return LocalStateError(
        f"RocksDB cannot open the local state of {backend.operator} subtask {backend.subtask}{which}, "
        f"for a reason that is not corruption ({error}); the task fails and is retried, and "
        "every checkpoint and its output are kept. Look at the local disk of this machine (space, open-file "
        "limit, another process holding the database)"
    )


def _overlap(a: KeyGroupRange, b: KeyGroupRange) -> int:
    return max(0, min(a.end, b.end) - max(a.start, b.start) + 1)


def declared_states(checkpoint: CheckpointMetadata | None, operator: str, kg_range: KeyGroupRange
                    ) -> dict[str, dict[str, Any]]:
    """Each state's kind and TTL (and a RecordCodec's fields) as the snapshots this subtask
    restores recorded them (the old subtasks overlapping its key groups, on a rescale)."""
    if checkpoint is None or operator not in checkpoint.operators:
        return {}
    declared: dict[str, dict[str, Any]] = {}
    for handle in checkpoint.operators[operator].subtasks:
        if _overlap(handle.key_group_range, kg_range) and handle.facts is not None:
            for name, fact in handle.facts["states"].items():
                if fact["kind"] != "unknown":
                    declared.setdefault(name, {"kind": fact["kind"], "ttl": fact["ttl"],
                                               **({"codec": fact["codec"]} if "codec" in fact else {})})
    return declared


def checkpoint_clock(checkpoint: CheckpointMetadata | None) -> dict[str, int | None]:
    """The clocks as of a checkpoint, what a restored state's TTL expires against until the next
    batch sets its own: its time (when it was committed) and the watermark it recorded."""
    if checkpoint is None:
        return {}
    clock: dict[str, int | None] = {}
    try:
        clock["processing"] = int(datetime.fromisoformat(checkpoint.created_at).timestamp() * 1_000_000)
    except (TypeError, ValueError):
        pass
    offsets = checkpoint.source_offsets
    watermark = offsets.get("watermark") if isinstance(offsets, dict) else None
    if isinstance(watermark, int) and not isinstance(watermark, bool):
        clock["event"] = watermark
    return clock


def restore_with_fallback(
    backends: Sequence[Restoring],
    checkpoints: list[CheckpointMetadata],
    *,
    claim_mode: ClaimMode | str = "CLAIM",
    fallback: bool = True,
) -> list[RestoreResult]:
    """Restore every backend from the first of `checkpoints` (newest first) that all can restore.

    The fallback is per checkpoint, never per subtask: all subtasks (and the source offsets the
    caller takes from the same metadata) come from one checkpoint. Without `fallback` the first
    failure is raised; with it, a checkpoint that cannot be restored is logged loudly and the
    next older one is tried, and each result says which ones failed.
    """
    failed: list[int] = []
    problems: list[str] = []
    for meta in checkpoints:
        try:
            results = [b.restore(meta, claim_mode=claim_mode) for b in backends]
        except (OperatorStateMismatch, LocalStateError):
            raise  # an older checkpoint has the same operators, and this machine's trouble: no fallback
        except (CheckpointCorrupted, StateBackendError) as e:
            if not fallback:
                raise
            path = getattr(e, "path", None)
            if path and all(path in m.paths() for m in checkpoints):  # falling back cannot help
                from sparkpoint.state.repair import every_checkpoint_needs

                ids = [m.checkpoint_id for m in checkpoints]
                raise CheckpointCorrupted(every_checkpoint_needs(path, ids, str(e)), path=path) from e
            log.error("checkpoint %s cannot be restored, falling back to an older one: %s", meta.checkpoint_id, e)
            failed.append(meta.checkpoint_id)
            problems.append(str(e))
            continue
        return [replace(r, fell_back_from=tuple(failed), problems=r.problems + tuple(problems)) for r in results]
    if failed:
        raise CheckpointCorrupted(f"no retained checkpoint can be restored (tried {failed}): " + "; ".join(problems))
    return [b.restore(None) for b in backends]
