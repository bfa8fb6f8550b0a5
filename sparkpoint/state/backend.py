"""The RocksDB keyed-state backend of one (operator, subtask): the `state` an operator's functions
receive.

It is where the two rooms of `sparkpoint.state` meet. Towards the operator it opens the states
the operator names (the kinds of `sparkpoint.state.kinds`, each over a store of the engine),
checks them against the operator's declarations and keeps the clocks TTL and timers read.
Towards storage it holds the engine's three parts, as Flink's RocksDB backend holds its
strategies: the local state (`engine.localstate`: the RocksDB instance, its column families and
local files over the subtask's key-group range), the restorer (`engine.restoring`) and the
snapshotter (`engine.snapshotting`), each given the local state explicitly.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Self, TypeVar

from rocksdict import Rdict

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
from sparkpoint.state.codecs import BytesCodec, Codec
from sparkpoint.state.engine.changelog import ChangeLog, ChangelogOptions
from sparkpoint.state.engine.localstate import LocalState, handle_digest
from sparkpoint.state.engine.restoring import Restorer, RestoreResult
from sparkpoint.state.engine.rocksdb import EXACT_UP_TO, RocksDBOptions, entry_count
from sparkpoint.state.engine.snapshotting import Snapshotter
from sparkpoint.state.eventtime import checkpoint_clock
from sparkpoint.state.keygroups import key_group_range
from sparkpoint.state.kinds import KeyedState, ListState, MapState, ReducingState, ValueState
from sparkpoint.state.kinds.base import SWEEP_LIMIT
from sparkpoint.state.migration import migrate_records
from sparkpoint.state.record import RecordCodec
from sparkpoint.state.schema import (
    DeclaredStates,
    StateDescriptor,
    StateSchemaIncompatible,
    check_declarations,
    compare_records,
    declarations,
    declared_states,
    restored_declarations,
)
from sparkpoint.state.timers import TIMERS, TimerService
from sparkpoint.state.ttl import StateTtl

__all__ = ["RestoreResult", "RocksDBStateBackend", "handle_digest", "restore_with_fallback", "take_checkpoint"]

log = logging.getLogger(__name__)
_RAW = BytesCodec()

V = TypeVar("V")
S = TypeVar("S", bound="KeyedState[Any]")

_KINDS: dict[str, Any] = {"value": ValueState, "map": MapState, "list": ListState, "reducing": ReducingState}


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
            key_group_range=self.key_group_range, max_parallelism=max_parallelism, options=self.options,
            log=ChangeLog() if self.changelog.enabled else None,
        )
        self._restorer = Restorer(self._local, storage, local_recovery=local_recovery)
        self._snapshotter = Snapshotter(self._local, storage, incremental=incremental, local_recovery=local_recovery,
                                        changelog=self.changelog)
        self._states: dict[str, KeyedState[Any]] = {}
        self._sweepers: dict[str, KeyedState[bytes]] = {}  # TTL sweeps of states no batch opened
        # Each state's kind and TTL as last declared: by the operator when it opens one, else as the
        # restored checkpoint's facts recorded (how the sweep reaches a state no batch opens).
        self._declared: dict[str, dict[str, Any]] = {}
        self._time: dict[str, int | None] = {}  # "processing" / "event" -> microseconds (set_time)
        self.default_clock = "processing"  # a timer's clock when none is named ("event" with event time)
        # The states the operator declares (`KeyedOperator.states`): opened by every restore,
        # recorded in each snapshot's handle, hence in `_metadata`.
        self.descriptors = DeclaredStates(states)
        self.key_type = key_type
        self.declarations = declarations(self.descriptors, key_type)

    def __repr__(self) -> str:
        return repr(self._local)

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
        return self._state(ValueState, name, codec, ttl)

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
        return self._state(MapState, name, codec, ttl)

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
        return self._state(ListState, name, codec, ttl)

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
        state = self._state(ReducingState, name, codec, ttl, reduce=reduce)
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
        service = self._states.get(TIMERS) or self._add_state(TimerService, TIMERS, _RAW)
        assert isinstance(service, TimerService)
        service.default_clock = self.default_clock
        service.event_time = self.default_clock == "event"
        return service

    @property
    def timers_used(self) -> bool:
        """Whether this subtask has a timer column family (made by a register, now or before)."""
        return TIMERS in self._states or TIMERS in self.state_names()

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
        if name not in self.descriptors:
            raise KeyError(f"{self.operator} declares no state {name!r}; it declares "
                           f"{', '.join(self.descriptors) or 'none'}")
        return self._states.get(name) or self._open_declared(name, self.descriptors[name])

    def _open_declared(self, name: str, d: StateDescriptor) -> KeyedState[Any]:
        extra = {"reduce": d.reduce} if d.kind == "reducing" else {}
        return self._state(_KINDS[d.kind], name, d.codec, d.ttl, **extra)

    def _state(self, kind: type[S], name: str, codec: Codec[Any], ttl: StateTtl | None, **extra: Any) -> S:
        if name == TIMERS and kind is not TimerService:
            raise ValueError(f"{TIMERS!r} is the timers' column family: name the state otherwise")
        d = self.descriptors.get(name)
        if d is not None and (_KINDS[d.kind] is not kind or d.codec != codec or d.ttl != ttl):
            raise StateBackendError(
                f"state {name!r} of {self.operator} is declared as a {d.kind} state of {d.codec!r} with TTL {d.ttl}, "
                f"and asked for as a {kind.KIND} state of {codec!r} with TTL {ttl}: use the declaration "
                f"(state.declared({name!r}))")
        state = self._states.get(name) or self._add_state(kind, name, codec, ttl, **extra)
        if not isinstance(state, kind):
            raise StateBackendError(
                f"state {name!r} of {self.operator} is a {type(state).__name__}, not a {kind.__name__}")
        if state.ttl != ttl:
            raise StateBackendError(
                f"state {name!r} of {self.operator} was asked for with TTL {state.ttl} and now {ttl}: declare it "
                "one way")
        return state

    def _add_state(
        self, kind: Any, name: str, codec: Codec[Any], ttl: StateTtl | None = None, **extra: Any
    ) -> KeyedState[Any]:
        if not name or name == "default":
            raise ValueError(f"invalid state name {name!r}")
        self._local.ensure_states([name])
        if name not in self.descriptors:  # declared states were evolved by the restore, before any open
            self._evolve_undeclared(name, codec)
        state: KeyedState[Any] = kind(
            self._local.store(name), name, codec, self.max_parallelism, self.key_group_range, ttl=ttl,
            clock=self.clock, **extra,
        )
        state.settle_format()
        self._declared[name] = state.declaration()
        self._states[name] = state
        return state

    def _evolve_undeclared(self, name: str, codec: Codec[Any]) -> None:
        """A state the operator does not declare, opened with a RecordCodec whose fields differ from
        those the restored snapshot recorded: its entries are rewritten in the new fields (added,
        removed, widened, reordered, made nullable) before the handle reads any, or the change is
        refused. Without this, `int64 -> float64` in a record of numbers only decoded the old
        bytes as other numbers, without an error."""
        old = self._declared.get(name, {}).get("codec")
        if not isinstance(codec, RecordCodec) or old is None or old["fields"] == codec.spec()["fields"]:
            return
        _, problems = compare_records(old, codec.spec())
        if problems:
            raise StateSchemaIncompatible(
                f"state {name!r} of {self.operator} was checkpointed with RecordCodec fields {old['fields']} and "
                f"is opened with {codec.spec()['fields']}: " + "; ".join(problems)
                + ". Keep the old fields, or start the changed state under a new name")
        started = time.monotonic()
        rewritten = self._migrate(name, RecordCodec.from_spec(old), codec)
        log.info("%s/%s: %d entries of state %s rewritten in its new fields in %.2fs", self.operator, self.subtask,
                 rewritten, name, time.monotonic() - started)

    # --- time: what TTL expires against -----------------------------------------------------------

    def set_time(self, processing_us: int | None = None, watermark_us: int | None = None) -> None:
        """The clocks of the batch about to run: its processing time and the watermark it
        advances to (microseconds since the epoch, UTC). Unset, processing time is the restored
        checkpoint's time, else the wall clock; the watermark is the restored checkpoint's."""
        if processing_us is not None:
            self._time["processing"] = int(processing_us)
        if watermark_us is not None:
            self._time["event"] = max(int(watermark_us), self._time.get("event") or int(watermark_us))

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
        if kind not in ("event", "processing"):
            raise ValueError(f"a clock is 'event' or 'processing', got {kind!r}")
        now = self._time.get(kind)
        if now is None and kind == "processing":
            return int(time.time() * 1_000_000)
        return now

    def expire(self, limit: int = SWEEP_LIMIT) -> int:
        """The TTL sweep of one batch: every state with a TTL deletes the expired entries among the
        next `limit` it looks at. Returns the entries deleted."""
        removed = sum(state.expire(limit) for state in self._states.values() if state.ttl is not None)
        for name in self.state_names():  # states this batch did not open: as declared when last opened
            if name in self._states or name == TIMERS:
                continue
            sweeper = self._sweepers.get(name) or self._sweeper(name)
            if sweeper is not None:
                removed += sweeper.expire(limit)
        return removed

    def _sweeper(self, name: str) -> KeyedState[bytes] | None:
        """A handle on state `name` that only sweeps, with the TTL of its last declaration (None:
        it has none, or it was checkpointed before sparkpoint recorded declarations)."""
        declared = self._declared.get(name, {}).get("ttl")
        if not declared:
            return None
        sweeper = self.raw_state(name, StateTtl(**declared))
        self._sweepers[name] = sweeper  # its counts reach this snapshot's facts
        return sweeper

    def raw_state(self, name: str, ttl: StateTtl | None = None) -> KeyedState[bytes]:
        """A handle on state `name` whose values are the stored bytes, of any kind, with `ttl`
        (what the TTL sweep and the export of raw entries read). The caller releases it."""
        return KeyedState(self._local.store(name), name, BytesCodec(), self.max_parallelism, self.key_group_range,
                          ttl=ttl, clock=self.clock)

    def state_names(self) -> list[str]:
        return self._local.state_names()

    def facts(self) -> dict[str, Any]:
        """What this subtask's state holds now, for people: per state its kind and TTL as declared
        and its entries (exact up to `EXACT_UP_TO`, RocksDB's estimate beyond: Flink's
        `estimate-num-keys` metric), the timers pending (count, earliest) and fired, the entries the
        TTL sweep removed, since the last call (each snapshot reports its batch's)."""
        db = self._local.open_db()
        states: dict[str, Any] = {}
        timers = {"pending": 0, "earliest": None, "fired": 0}
        for name in self.state_names():
            cf = db.get_column_family(name)
            if name == TIMERS:
                service = self.timers
                timers["pending"], timers["earliest"] = service.pending(exact_up_to=EXACT_UP_TO)
                timers["fired"], service.fired = service.fired, 0
                continue
            declared = self._declared.get(name, {"kind": "unknown", "ttl": None})
            states[name] = {**declared, "entries": entry_count(cf, exact_up_to=EXACT_UP_TO)}
        expired = 0
        for state in [*self._states.values(), *self._sweepers.values()]:
            expired, state.expired_removed = expired + state.expired_removed, 0
        return {"states": states, "timers": timers, "expired_removed": expired}

    def _migrate(self, name: str, old: RecordCodec, new: Any) -> int:
        """Rewrite the stored entries of state `name` from `old`'s fields into `new`'s (`migration`)."""
        if name not in self.state_names():
            return 0
        store = self._local.store(name)
        try:
            return migrate_records(store, old, new)
        finally:
            store.release()

    # --- restore: the restorer's, around the model's declarations and clocks ---------------------

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
        fill(self._local.open_db())
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
                migrated += self._migrate(name, RecordCodec.from_spec(old["codec"]), descriptor.codec)
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
        self.close()
        self._time = checkpoint_clock(checkpoint)
        self._declared = declared_states(checkpoint, self.operator, self.key_group_range)
        self._snapshotter.forget_pending()
        self._local.forget_log()
        result, base = self._restorer.restore(checkpoint, claim_mode=claim_mode, source=source,
                                              allow_missing=allow_missing)
        if base is not None and result.checkpoint_id is not None:
            self._snapshotter.rebase(result.checkpoint_id, base)
            self._snapshotter.log_base = result.checkpoint_id
        else:
            self._snapshotter.forget_base()
        return result

    # --- snapshot: the snapshotter's, with the model's facts and declarations ------------------

    def snapshot(self, checkpoint_id: int, *, full: bool = False) -> SubtaskStateHandle:
        """Take checkpoint N of this subtask and upload what the confirmed base lacks.

        `full` (or `incremental=False`) uploads every file: the baseline, and what the first
        checkpoint after a NO_CLAIM restore does anyway (its base is empty). With the changelog
        on, a checkpoint uploads one changelog file until the chain calls for a materialization.
        """
        return self._snapshotter.snapshot(checkpoint_id, full=full, annotate=self._annotate)

    def _annotate(self, handle: SubtaskStateHandle) -> SubtaskStateHandle:
        return replace(handle, facts=self.facts(), states=self.declarations or None)

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
            self._release_states()
            self._local.close()

    def _release_states(self) -> None:
        for state in [*self._states.values(), *self._sweepers.values()]:
            state.release()
        self._states.clear()
        self._sweepers.clear()

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
            self._release_states()
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
