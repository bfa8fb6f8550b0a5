"""The RocksDB keyed-state backend of one (operator, subtask): the `state` an operator's functions
receive.

It is where the two rooms of `sparkpoint.state` meet, and holds a part of each, as Flink's RocksDB
backend holds its strategies. Towards the operator, the subtask's states (`states.SubtaskStates`):
it opens the states the operator names, checks them against the operator's declarations and keeps
the clocks TTL and timers read. Towards storage, the engine's three parts: the local state
(`engine.localstate`: the RocksDB instance, its column families and local files over the subtask's
key-group range, and the stores the states are opened over), the restorer (`engine.restoring`) and
the snapshotter (`engine.snapshotting`), each given the local state explicitly. Its own code is
the order in which a restore and a snapshot call on them.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self, TypeVar

from sparkpoint.checkpoint.coordinator import CheckpointCoordinator, CompletedCheckpoint
from sparkpoint.checkpoint.errors import (
    CheckpointCorrupted,
    LocalStateError,
    OperatorStateMismatch,
    StateBackendError,
    UnknownSharedState,
)
from sparkpoint.checkpoint.metadata import CheckpointMetadata, KeyGroupRange, SubtaskStateHandle
from sparkpoint.checkpoint.retention import ClaimMode
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.lazy import lazy_module
from sparkpoint.state.codecs import Codec
from sparkpoint.state.engine import partial
from sparkpoint.state.engine.changelog import (
    WORKING_LEVEL0_TRIGGER,
    WORKING_SIZE_AMPLIFICATION,
    ChangeLog,
    ChangelogOptions,
)
from sparkpoint.state.engine.localstate import LocalState, handle_digest
from sparkpoint.state.engine.partial import PartialRestore, SstRange
from sparkpoint.state.engine.restoring import Restorer, RestoreResult
from sparkpoint.state.engine.rocksdb import EXACT_UP_TO, RocksDBOptions
from sparkpoint.state.engine.snapshotting import Snapshotter
from sparkpoint.state.keygroups import key_group_range
from sparkpoint.state.kinds import KeyedState, ListState, MapState, ReducingState, ValueState
from sparkpoint.state.kinds.base import SWEEP_LIMIT
from sparkpoint.state.states import SubtaskStates
from sparkpoint.state.timers import TimerService
from sparkpoint.state.ttl import StateTtl

if TYPE_CHECKING:
    import rocksdict
    from rocksdict import Rdict
else:
    rocksdict = lazy_module("rocksdict")

__all__ = ["RestoreResult", "RocksDBStateBackend", "handle_digest", "restore_with_fallback", "take_checkpoint"]

log = logging.getLogger(__name__)

V = TypeVar("V")


class RocksDBStateBackend:
    """One subtask's keyed state in RocksDB: the `state` an operator's functions receive.

    sparkpoint makes one per (operator, subtask) and hands it to `process(batch, state)`,
    `export(state)`, `on_timer(fired, state)` and `bootstrap(table, state)`; it holds the states of
    that subtask's key-group range, restores them from a checkpoint and snapshots them into the
    next one. An operator opens its states by name: each name is one state of one kind, kept
    across batches and checkpoints.

    Example:
        ```python
        def process(batch, state):
            counts = batch.groupby("user").size()
            state.value_state("clicks", StructCodec("<q")).update_many(
                counts.index.tolist(), lambda k, old: ((old[0] if old else 0) + int(counts[k]),))
        ```
    """

    def __init__(
        self,
        storage: CheckpointStorage,
        operator: str,
        subtask: int,
        *,
        parallelism: int,
        max_parallelism: int = 128,
        local_dir: str | os.PathLike[str],
        options: RocksDBOptions | None = None,
        incremental: bool = True,
        local_recovery: bool = True,
        changelog: ChangelogOptions | None = None,
        states: Mapping[str, Any] | None = None,
        key_type: str | None = None,
    ):
        if not operator or "/" in operator or operator in (".", ".."):
            raise ValueError(f"invalid operator name {operator!r}")
        self.storage = storage
        self.operator = operator
        self.subtask = subtask
        self.parallelism = parallelism
        self.max_parallelism = max_parallelism
        self.key_group_range: KeyGroupRange = key_group_range(max_parallelism, parallelism, subtask)
        self.options = options or RocksDBOptions()
        self.incremental = incremental
        self.local_recovery = local_recovery
        self.changelog = changelog or ChangelogOptions()
        self._local = LocalState(
            Path(local_dir) / storage.job_id / operator / str(subtask), operator=operator, subtask=subtask,
            key_group_range=self.key_group_range, max_parallelism=max_parallelism, options=self._working_options(),
            log=ChangeLog() if self.changelog.enabled else None,
        )
        self._states = SubtaskStates(self._local, operator=operator, subtask=subtask, max_parallelism=max_parallelism,
                                     key_group_range=self.key_group_range, states=states, key_type=key_type)
        self._restorer = Restorer(self._local, storage, local_recovery=local_recovery)
        self._snapshotter = Snapshotter(self._local, storage, incremental=incremental, local_recovery=local_recovery,
                                        changelog=self.changelog)
        self._partial: PartialRestore | None = None
        # After `restore_partial`: the facts its next snapshot records (None: the restored handle's)
        self.partial_facts: dict[str, Any] | None = None

    def __repr__(self) -> str:
        return repr(self._local)

    def _working_options(self) -> RocksDBOptions:
        """With the changelog on, the working database is kept nearly compact: its SSTs are what
        the chain is weighed against (`sparkpoint.state.engine.changelog.ChangelogOptions`)."""
        if not self.changelog.enabled:
            return self.options
        return replace(self.options, size_amplification_percent=WORKING_SIZE_AMPLIFICATION,
                       level0_trigger=min(self.options.level0_trigger, WORKING_LEVEL0_TRIGGER))

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def dir(self) -> Path:
        """This subtask's local directory (`engine.localstate` describes its layout)."""
        return self._local.dir

    @property
    def db_path(self) -> Path:
        return self._local.db_path

    @property
    def db(self) -> Rdict | None:
        """The working database while it is open."""
        return self._local.db

    @property
    def confirmed_checkpoint(self) -> int | None:
        return self._snapshotter.base_id

    # --- the states, as the operator opens them: the subtask's states' ----------------------------

    def value_state(self, name: str, codec: Codec[V], ttl: StateTtl | None = None) -> ValueState[V]:
        """One value per key: a `ValueState` of this subtask's key-group range.

        Calls with the same name in one batch return the same handle. A state asked for with another
        kind, codec or TTL than its declaration (`KeyedOperator(states=...)`), or with another kind or
        TTL than an earlier call, is refused.

        Example:
            ```python
            totals = state.value_state("totals", StructCodec("<q"), ttl=StateTtl(30 * 86400))
            ```

        Args:
            name: the state's name (a RocksDB column family of its own); not `"default"` or `"__timers__"`.
            codec: how its values are stored (`RecordCodec`, `JsonCodec`, `StructCodec`, `BytesCodec`).
            ttl: entries expire that long after their last write (`StateTtl`); None: never.

        Returns:
            The state's handle.

        Raises:
            StateBackendError: the name is declared or used otherwise (kind, codec, TTL).
            ValueError: the name is empty, `"default"` or `"__timers__"`.
        """
        return self._states.open(ValueState, name, codec, ttl)

    def map_state(self, name: str, codec: Codec[V], ttl: StateTtl | None = None) -> MapState[V]:
        """Per key a map of user key -> value: a `MapState`; with `ttl` each entry expires on its own.

        Example:
            ```python
            pages = state.map_state("pages", JsonCodec())
            ```

        Args:
            name: the state's name; not `"default"` or `"__timers__"`.
            codec: how its values are stored.
            ttl: each entry expires that long after its last write (`StateTtl`); None: never.

        Returns:
            The state's handle.

        Raises:
            StateBackendError: the name is declared or used otherwise (kind, codec, TTL).
            ValueError: the name is empty, `"default"` or `"__timers__"`.
        """
        return self._states.open(MapState, name, codec, ttl)

    def list_state(self, name: str, codec: Codec[V], ttl: StateTtl | None = None) -> ListState[V]:
        """Per key a list of values: a `ListState`; an append is one write, whatever the list's length.

        Example:
            ```python
            clicks = state.list_state("clicks", JsonCodec(), ttl=StateTtl(3600, clock="event"))
            ```

        Args:
            name: the state's name; not `"default"` or `"__timers__"`.
            codec: how its elements are stored.
            ttl: each element expires that long after it was written (`StateTtl`); None: never.

        Returns:
            The state's handle.

        Raises:
            StateBackendError: the name is declared or used otherwise (kind, codec, TTL).
            ValueError: the name is empty, `"default"` or `"__timers__"`.
        """
        return self._states.open(ListState, name, codec, ttl)

    def reducing_state(
        self, name: str, codec: Codec[V], reduce: Callable[[V, V], V], ttl: StateTtl | None = None
    ) -> ReducingState[V]:
        """Per key one value that each `add` folds into with `reduce(old, new)`: a `ReducingState`.

        Example:
            ```python
            spend = state.reducing_state("spend", StructCodec("<d"), lambda a, b: (a[0] + b[0],))
            ```

        Args:
            name: the state's name; not `"default"` or `"__timers__"`.
            codec: how its values are stored.
            reduce: `reduce(old, new)` returns the folded value.
            ttl: a value expires that long after its last write (`StateTtl`); None: never.

        Returns:
            The state's handle.

        Raises:
            StateBackendError: the name is declared or used otherwise (kind, codec, TTL).
            ValueError: the name is empty, `"default"` or `"__timers__"`.
        """
        state = self._states.open(ReducingState, name, codec, ttl, reduce=reduce)
        state.reduce = reduce
        return state

    @property
    def timers(self) -> TimerService:
        """This subtask's timers (`register`, `register_many`, `delete`, `list`): a `TimerService`.

        They fire after the batch that makes them due, into the operator's `on_timer`.

        Example:
            ```python
            state.timers.register(user, last_click + pd.Timedelta(minutes=30))
            ```
        """
        return self._states.timers()

    @property
    def timers_used(self) -> bool:
        """Whether this subtask has a timer column family (made by a register, now or before)."""
        return self._states.timers_used()

    def declared(self, name: str) -> KeyedState[Any]:
        """The handle of a state the operator declares (`KeyedOperator(states=...)`), of its
        declared kind, codec and TTL.

        Example:
            ```python
            totals = state.declared("totals")   # a ValueState of the declared RecordCodec
            ```

        Args:
            name: the declared state's name.

        Returns:
            A `ValueState`, `MapState`, `ListState` or `ReducingState`, as declared.

        Raises:
            KeyError: the operator declares no state `name`.
        """
        return self._states.declared(name)

    def last_declaration(self, name: str) -> dict[str, Any] | None:
        """State `name`'s kind and TTL (and a RecordCodec's fields) as last declared: by the operator
        when it opened the state, else as the restored checkpoint recorded (None: neither)."""
        return self._states.last_declaration(name)

    def raw_state(self, name: str, ttl: StateTtl | None = None) -> KeyedState[bytes]:
        """A handle on state `name` whose values are the stored bytes, of any kind, with `ttl`
        (what the TTL sweep and the export of raw entries read). The caller releases it."""
        return self._states.raw_state(name, ttl)

    def state_names(self) -> list[str]:
        return self._local.state_names()

    # --- time: what TTL expires against ---------------------------------------------------------

    @property
    def default_clock(self) -> str:
        """A timer's clock when none is named: "processing", or "event" when the pipeline has event time."""
        return self._states.default_clock

    @default_clock.setter
    def default_clock(self, clock: str) -> None:
        self._states.default_clock = clock

    def set_time(self, processing_us: int | None = None, watermark_us: int | None = None) -> None:
        """The clocks of the batch about to run: its processing time and the watermark it
        advances to (microseconds since the epoch, UTC). Unset, processing time is the restored
        checkpoint's time, else the wall clock; the watermark is the restored checkpoint's."""
        self._states.set_time(processing_us, watermark_us)

    def clock(self, kind: str) -> int | None:
        """The time now on a clock, as TTL and timers see it: the batch's processing time, or the watermark.

        In `process` and `on_timer` the processing clock is the batch's processing time (the
        driver's clock when the batch started, one time for every subtask, standing still while
        the batch runs) and the event clock is the watermark this batch advances to (its rows
        included, less the allowed lateness): a row of the batch may be below it without being
        late, since late rows are those below the watermark the batch started with. In `export`
        (`read_state`, `sparkpoint state`), the checkpoint's: its commit time and its watermark.

        Example:
            ```python
            def process(batch, state):
                watermark = state.clock("event")        # None until the pipeline has a watermark
                if watermark is not None:
                    closed = batch[batch["clicked_at"] < pd.Timestamp(watermark, unit="us", tz="UTC")]
            ```

        Args:
            kind: "event" (the watermark) or "processing" (the batch's processing time).

        Returns:
            Microseconds since the epoch, UTC; for "event", None while there is no watermark (the
            pipeline has no `event_time`, or no row has been seen yet).

        Raises:
            ValueError: another kind.
        """
        return self._states.clock(kind)

    def expire(self, limit: int = SWEEP_LIMIT) -> int:
        """The TTL sweep of one batch: every state with a TTL deletes the expired entries among the
        next `limit` it looks at. Returns the entries deleted."""
        return self._states.expire(limit)

    def facts(self) -> dict[str, Any]:
        """What this subtask's state holds now, for people: per state its kind and TTL as declared
        and its entries (exact up to `EXACT_UP_TO`, RocksDB's estimate beyond: Flink's
        `estimate-num-keys` metric), the timers pending (count, earliest) and fired, the entries the
        TTL sweep removed, since the last call (each snapshot reports its batch's)."""
        self._local.open_db()  # refused before a restore
        return self._states.facts(exact_up_to=EXACT_UP_TO)

    # --- restore: the restorer's, around the states' declarations and clocks --------------------

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
        recorded, changes = self._states.check(checkpoint)
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
        recorded, changes = self._states.check(checkpoint)
        result = self._restore(None)
        self._states.reset(checkpoint)
        fill(self._local.open_db())
        return self._open_declarations(recorded, changes, result)

    def _open_declarations(self, recorded: Mapping[str, Any] | None, changes: set[str],
                           result: RestoreResult) -> RestoreResult:
        started = time.monotonic()
        migrated = self._states.open_declarations(recorded, changes)
        if migrated:
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
        self._forget_for_restore(checkpoint)
        result, base = self._restorer.restore(checkpoint, claim_mode=claim_mode, source=source,
                                              allow_missing=allow_missing)
        if base is not None and result.checkpoint_id is not None:
            self._snapshotter.rebase(result.checkpoint_id, base)
            self._snapshotter.log_base = result.checkpoint_id
        else:
            self._snapshotter.forget_base()
        return result

    def _forget_for_restore(self, checkpoint: CheckpointMetadata | None) -> None:
        self.close()
        self._states.reset(checkpoint)
        self._snapshotter.forget_pending()
        self._snapshotter.placeholders = frozenset()
        self._partial = None
        self._local.forget_log()

    def restore_partial(self, checkpoint: CheckpointMetadata,
                        choose: Callable[[Mapping[str, SstRange]], set[str]]) -> PartialRestore:
        """Open this subtask's state as of `checkpoint` with only the SST files `choose` names
        (given every SST's level and key range) downloaded; the others are placeholders that no
        read may reach (`sparkpoint.state.engine.partial`). The backend must have been made with
        `RocksDBOptions(placeholders=True)`. No declaration is opened (they live in files the
        reads may not need): the states are read raw. Its next snapshot re-references every file
        it does not rewrite, uploads no placeholder, and carries `checkpoint`'s facts and
        declarations (`snapshot`).

        Raises:
            PartialRestoreRefused: the subtask's state cannot be restored in part (a changelog chain).
            CheckpointCorrupted: a downloaded file differs from `_metadata`.
        """
        self._forget_for_restore(checkpoint)
        done = partial.restore(self._local, self.storage, checkpoint, choose)
        self._snapshotter.rebase(checkpoint.checkpoint_id, done.handle)
        self._snapshotter.placeholders = done.placeholders
        self._partial = done
        return done

    # --- snapshot: the snapshotter's, with the states' facts and declarations -------------------

    def snapshot(self, checkpoint_id: int, *, full: bool = False) -> SubtaskStateHandle:
        """Take checkpoint N of this subtask and upload what the confirmed base lacks.

        `full` (or `incremental=False`) uploads every file: the baseline, and what the first
        checkpoint after a NO_CLAIM restore does anyway (its base is empty). With the changelog
        on, a checkpoint uploads one changelog file until the chain calls for a materialization.
        """
        return self._snapshotter.snapshot(checkpoint_id, full=full, annotate=self._annotate,
                                          expired_before=self._states.expired_before())

    def _annotate(self, handle: SubtaskStateHandle) -> SubtaskStateHandle:
        if self._partial is not None:  # counting would read every file: the restored handle's, as adjusted
            before = self._partial.handle
            return replace(handle, facts=self.partial_facts if self.partial_facts is not None else before.facts,
                           states=before.states)
        return replace(handle, facts=self.facts(), states=self._states.declarations or None)

    def confirm(self, checkpoint_id: int) -> None:
        """Checkpoint N completed: its files become the base of the next incremental snapshot.

        N must be pending here. (Another process learns of N through `restore(N)`, which
        checks its local files against N's handle before taking them as the base.)
        """
        self._snapshotter.confirm(checkpoint_id)

    def abort(self, checkpoint_id: int) -> None:
        """Checkpoint N will never complete: forget it (the coordinator deletes its uploads)."""
        self._snapshotter.abort(checkpoint_id)

    def forget_base(self) -> None:
        """The confirmed base can no longer be trusted (the coordinator declined a reference to it,
        another writer subsumed it): the next snapshot uploads every file again."""
        self._snapshotter.forget_base()

    # --- the local state ---------------------------------------------------------------------

    def compact(self) -> None:
        """Force a full compaction (tests and benchmarks use it to provoke rewritten SSTs)."""
        self._local.compact()

    def close(self) -> None:
        if self._local.db is not None:
            self._local.flush()
            self._states.release()
            self._local.close()

    def dispose(self) -> None:
        """Close and delete every local file of this subtask."""
        self.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def discard_local_state(self) -> None:
        """Forget the working database, every task-local copy and any materialization in steps
        (`staging`: made of the same files), without flushing anything: what
        to do when RocksDB reports corruption in them (`rocksdb.is_corruption`). The next
        `restore` reads stable storage."""
        if self._local.db is not None:
            self._states.release()
        self._local.discard()

def take_checkpoint(
    coordinator: CheckpointCoordinator,
    backends: Sequence[RocksDBStateBackend],
    *,
    source_offsets: Any = None,
    kind: str = "checkpoint",
    full: bool = False,
    checkpoint_id: int | None = None,
) -> CompletedCheckpoint:
    """One whole checkpoint of in-process subtasks: trigger, snapshot, acknowledge, complete,
    confirm; any failure aborts it everywhere. (Spark runs the snapshots in its tasks instead.)
    `checkpoint_id`: take exactly that id (see `CheckpointCoordinator.trigger`)."""
    expected: dict[str, int] = {}
    for b in backends:
        expected[b.operator] = b.parallelism
    pending = coordinator.trigger(kind=kind, expected=expected, checkpoint_id=checkpoint_id)
    cid = pending.checkpoint_id
    try:
        for b in backends:
            coordinator.acknowledge(cid, b.snapshot(cid, full=full))
        done = coordinator.complete(cid, source_offsets=source_offsets)
    except BaseException as e:
        coordinator.abort(cid, reason="a subtask failed to snapshot")
        for b in backends:
            b.abort(cid)
            if isinstance(e, UnknownSharedState):  # declined reuse: re-upload next time (rule 2)
                b.forget_base()
        raise
    for b in backends:
        b.confirm(cid)
    return done


def restore_with_fallback(
    backends: Sequence[RocksDBStateBackend],
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
                from sparkpoint.state.engine.repair import every_checkpoint_needs

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
