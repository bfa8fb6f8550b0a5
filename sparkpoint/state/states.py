"""The states of one subtask as its operator sees them: the model-facing part of the backend.

`SubtaskStates` opens the states an operator names (the kinds of `sparkpoint.state.kinds`), checks
each against the operator's declarations (`KeyedOperator(states=...)`) and against what the restored
checkpoint recorded, evolves the stored entries of a RecordCodec whose fields changed, keeps the
clocks TTL and timers read, sweeps expired entries, and reports what the states hold. All it needs
of storage is a store per name (`StateStores`); the engine's local state is one, and the backend
(`sparkpoint.state.backend`) hands it over.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any, Protocol, TypeVar

from sparkpoint.checkpoint.errors import StateBackendError
from sparkpoint.checkpoint.metadata import CheckpointMetadata, KeyGroupRange
from sparkpoint.state.codecs import BytesCodec, Codec
from sparkpoint.state.eventtime import checkpoint_clock
from sparkpoint.state.kinds import KeyedState, ListState, MapState, ReducingState, ValueState
from sparkpoint.state.kinds.base import SWEEP_LIMIT, StateStore
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

log = logging.getLogger(__name__)
S = TypeVar("S", bound="KeyedState[Any]")

KINDS: dict[str, Any] = {"value": ValueState, "map": MapState, "list": ListState, "reducing": ReducingState}


class StateStores(Protocol):
    """What a subtask's states need of the storage engine: one store per named state
    (`sparkpoint.state.engine.localstate.LocalState` is the engine's)."""

    def state_names(self) -> list[str]:
        """The names of the states stored (timers included)."""

    def ensure_states(self, names: list[str]) -> None:
        """Make room for the named states the storage lacks."""

    def store(self, name: str) -> StateStore:
        """State `name`'s entries; the caller releases the store."""

    def entry_count(self, name: str, *, exact_up_to: int) -> int:
        """State `name`'s entries: counted up to `exact_up_to`, estimated beyond."""


class SubtaskStates:
    """The states of one (operator, subtask) over its key-group range, opened by name.

    A name is one state of one kind, codec and TTL: as the operator declares it, and as every
    earlier open in the same batch asked for it. `last_declaration` keeps each state's kind and
    TTL as last declared (by the operator when it opens one, else as the restored checkpoint
    recorded): how the TTL sweep reaches a state no batch opens.
    """

    def __init__(self, stores: StateStores, *, operator: str, subtask: int, max_parallelism: int,
                 key_group_range: KeyGroupRange, states: Mapping[str, Any] | None, key_type: str | None):
        self.stores = stores
        self.operator = operator
        self.subtask = subtask
        self.max_parallelism = max_parallelism
        self.key_group_range = key_group_range
        # The states the operator declares: opened by every restore, recorded in each snapshot's
        # handle, hence in `_metadata`.
        self.descriptors = DeclaredStates(states)
        self.key_type = key_type
        self.declarations = declarations(self.descriptors, key_type)
        self.default_clock = "processing"  # a timer's clock when none is named ("event" with event time)
        self._open: dict[str, KeyedState[Any]] = {}
        self._sweepers: dict[str, KeyedState[bytes]] = {}  # TTL sweeps of states no batch opened
        self._declared: dict[str, dict[str, Any]] = {}
        self._time: dict[str, int | None] = {}  # "processing" / "event" -> microseconds (set_time)

    # --- opening a state ---------------------------------------------------------------------------

    def open(self, kind: type[S], name: str, codec: Codec[Any], ttl: StateTtl | None, **extra: Any) -> S:
        """State `name` as a `kind` of `codec` and `ttl`, refused if declared or opened otherwise."""
        if name == TIMERS and kind is not TimerService:
            raise ValueError(f"{TIMERS!r} is the timers' column family: name the state otherwise")
        d = self.descriptors.get(name)
        if d is not None and (KINDS[d.kind] is not kind or d.codec != codec or d.ttl != ttl):
            raise StateBackendError(
                f"state {name!r} of {self.operator} is declared as a {d.kind} state of {d.codec!r} with TTL {d.ttl}, "
                f"and asked for as a {kind.KIND} state of {codec!r} with TTL {ttl}: use the declaration "
                f"(state.declared({name!r}))")
        state = self._open.get(name) or self._add(kind, name, codec, ttl, **extra)
        if not isinstance(state, kind):
            raise StateBackendError(
                f"state {name!r} of {self.operator} is a {type(state).__name__}, not a {kind.__name__}")
        if state.ttl != ttl:
            raise StateBackendError(
                f"state {name!r} of {self.operator} was asked for with TTL {state.ttl} and now {ttl}: declare it "
                "one way")
        return state

    def declared(self, name: str) -> KeyedState[Any]:
        """The handle of declared state `name`, of its declared kind, codec and TTL (KeyError: undeclared)."""
        if name not in self.descriptors:
            raise KeyError(f"{self.operator} declares no state {name!r}; it declares "
                           f"{', '.join(self.descriptors) or 'none'}")
        return self._open.get(name) or self._open_declared(name, self.descriptors[name])

    def timers(self) -> TimerService:
        """This subtask's timer service, on the default clock."""
        service = self._open.get(TIMERS) or self._add(TimerService, TIMERS, BytesCodec())
        assert isinstance(service, TimerService)
        service.default_clock = self.default_clock
        service.event_time = self.default_clock == "event"
        return service

    def timers_used(self) -> bool:
        """Whether this subtask has a timer column family (made by a register, now or before)."""
        return TIMERS in self._open or TIMERS in self.stores.state_names()

    def raw_state(self, name: str, ttl: StateTtl | None = None) -> KeyedState[bytes]:
        """A handle on state `name` whose values are the stored bytes, of any kind, with `ttl`. The
        caller releases it."""
        return KeyedState(self.stores.store(name), name, BytesCodec(), self.max_parallelism, self.key_group_range,
                          ttl=ttl, clock=self.clock)

    def last_declaration(self, name: str) -> dict[str, Any] | None:
        """State `name`'s kind and TTL (and a RecordCodec's fields) as last declared: by the operator
        when it opened the state, else as the restored checkpoint recorded (None: neither)."""
        return self._declared.get(name)

    def release(self) -> None:
        """Let go of every open handle (before the storage closes)."""
        for state in [*self._open.values(), *self._sweepers.values()]:
            state.release()
        self._open.clear()
        self._sweepers.clear()

    def _open_declared(self, name: str, d: StateDescriptor) -> KeyedState[Any]:
        extra = {"reduce": d.reduce} if d.kind == "reducing" else {}
        return self.open(KINDS[d.kind], name, d.codec, d.ttl, **extra)

    def _add(self, kind: Any, name: str, codec: Codec[Any], ttl: StateTtl | None = None,
             **extra: Any) -> KeyedState[Any]:
        if not name or name == "default":
            raise ValueError(f"invalid state name {name!r}")
        self.stores.ensure_states([name])
        if name not in self.descriptors:  # declared states were evolved by the restore, before any open
            self._evolve_undeclared(name, codec)
        state: KeyedState[Any] = kind(
            self.stores.store(name), name, codec, self.max_parallelism, self.key_group_range, ttl=ttl,
            clock=self.clock, **extra,
        )
        state.settle_format()
        self._declared[name] = state.declaration()
        self._open[name] = state
        return state

    # --- declarations across a restore ---------------------------------------------------------------

    def check(self, checkpoint: CheckpointMetadata | None) -> tuple[Mapping[str, Any] | None, set[str]]:
        """What `checkpoint` recorded of the declared states, and the names of those whose fields
        changed since; StateSchemaIncompatible when the declarations cannot read it."""
        recorded = restored_declarations(checkpoint, self.operator, self.descriptors, self.key_type)
        return recorded, check_declarations(self.operator, recorded, self.declarations, checkpoint)

    def reset(self, checkpoint: CheckpointMetadata | None) -> None:
        """Start over from `checkpoint` (None: empty): its clocks, and the declarations it recorded.
        The caller released every handle first (`release`)."""
        self._time = checkpoint_clock(checkpoint)
        self._declared = declared_states(checkpoint, self.operator, self.key_group_range)

    def open_declarations(self, recorded: Mapping[str, Any] | None, changes: set[str]) -> int:
        """Rewrite the entries of the `changes` states from the fields `recorded` into the declared
        ones, then open every declared state. Returns the entries rewritten."""
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
        return migrated

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

    def _migrate(self, name: str, old: RecordCodec, new: Any) -> int:
        """Rewrite the stored entries of state `name` from `old`'s fields into `new`'s (`migration`)."""
        if name not in self.stores.state_names():
            return 0
        store = self.stores.store(name)
        try:
            return migrate_records(store, old, new)
        finally:
            store.release()

    # --- time: what TTL expires against, and the sweep ---------------------------------------------

    def set_time(self, processing_us: int | None = None, watermark_us: int | None = None) -> None:
        """The clocks of the batch about to run (see `RocksDBStateBackend.set_time`)."""
        if processing_us is not None:
            self._time["processing"] = int(processing_us)
        if watermark_us is not None:
            self._time["event"] = max(int(watermark_us), self._time.get("event") or int(watermark_us))

    def clock(self, kind: str) -> int | None:
        """The time now on clock `kind` (see `RocksDBStateBackend.clock`)."""
        if kind not in ("event", "processing"):
            raise ValueError(f"a clock is 'event' or 'processing', got {kind!r}")
        now = self._time.get(kind)
        if now is None and kind == "processing":
            return int(time.time() * 1_000_000)
        return now

    def expire(self, limit: int = SWEEP_LIMIT) -> int:
        """The TTL sweep of one batch: every state with a TTL deletes the expired entries among the
        next `limit` it looks at. Returns the entries deleted."""
        removed = sum(state.expire(limit) for state in self._open.values() if state.ttl is not None)
        for name in self.stores.state_names():  # states this batch did not open: as declared when last opened
            if name in self._open or name == TIMERS:
                continue
            sweeper = self._sweepers.get(name) or self._sweeper(name)
            if sweeper is not None:
                removed += sweeper.expire(limit)
        return removed

    def expired_before(self) -> dict[str, int]:
        """Per state with a TTL (open, or as declared when last opened), the time stamp before
        which its entries are expired now: what a rewrite of the state may leave out, since no
        read returns them any more (clocks only advance)."""
        out: dict[str, int] = {}
        for name in self.stores.state_names():
            if name == TIMERS:
                continue
            state = self._open.get(name)
            declared = self._declared.get(name, {}).get("ttl")
            ttl = state.ttl if state is not None else StateTtl(**declared) if declared else None
            now = None if ttl is None else self.clock(ttl.clock)
            if ttl is not None and now is not None:
                out[name] = now - ttl.micros
        return out

    def _sweeper(self, name: str) -> KeyedState[bytes] | None:
        """A handle on state `name` that only sweeps, with the TTL of its last declaration (None:
        it has none, or it was checkpointed before sparkpoint recorded declarations)."""
        declared = self._declared.get(name, {}).get("ttl")
        if not declared:
            return None
        sweeper = self.raw_state(name, StateTtl(**declared))
        self._sweepers[name] = sweeper  # its counts reach this snapshot's facts
        return sweeper

    # --- facts ---------------------------------------------------------------------------------------

    def facts(self, *, exact_up_to: int) -> dict[str, Any]:
        """What the states hold now (see `RocksDBStateBackend.facts`); entries are counted up to
        `exact_up_to`, estimated beyond."""
        states: dict[str, Any] = {}
        timers = {"pending": 0, "earliest": None, "fired": 0}
        for name in self.stores.state_names():
            if name == TIMERS:
                service = self.timers()
                timers["pending"], timers["earliest"] = service.pending(exact_up_to=exact_up_to)
                timers["fired"], service.fired = service.fired, 0
                continue
            declared = self._declared.get(name, {"kind": "unknown", "ttl": None})
            states[name] = {**declared, "entries": self.stores.entry_count(name, exact_up_to=exact_up_to)}
        expired = 0
        for state in [*self._open.values(), *self._sweepers.values()]:
            expired, state.expired_removed = expired + state.expired_removed, 0
        return {"states": states, "timers": timers, "expired_removed": expired}
