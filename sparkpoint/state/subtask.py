"""One subtask's local RocksDB state: its directory under `<local_dir>/<job_id>/<operator>/<subtask>/`,
the working database and the marker that says which checkpoint it holds, its registered states,
task-local copies and their clean-up. `restoring` and `snapshotting` build the backend's two
halves on it; `sparkpoint.state.backend.RocksDBStateBackend` is the whole."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Self, TypeVar

from rocksdict import Rdict

from sparkpoint.checkpoint.errors import (
    StateBackendError,
)
from sparkpoint.checkpoint.interleave import storage_step
from sparkpoint.checkpoint.metadata import FileHandle, KeyGroupRange, SubtaskStateHandle
from sparkpoint.checkpoint.paths import checkpoint_id_of_dir
from sparkpoint.checkpoint.storage import CheckpointStorage, fsync_dir
from sparkpoint.state import staging
from sparkpoint.state.changelog import ChangeLog, ChangelogOptions
from sparkpoint.state.codecs import BytesCodec, Codec
from sparkpoint.state.handles import SWEEP_LIMIT, ListState, MapState, ReducingState, ValueState, _KeyedState
from sparkpoint.state.keygroups import key_group_range
from sparkpoint.state.localfiles import write_replacing
from sparkpoint.state.migration import migrate_records
from sparkpoint.state.record import RecordCodec
from sparkpoint.state.rocksdb import (
    EXACT_UP_TO,
    RocksDBOptions,
    compact_all,
    ensure_column_families,
    entry_count,
    flush_all,
    list_states,
    open_db,
)
from sparkpoint.state.schema import (
    DeclaredStates,
    StateDescriptor,
    StateSchemaIncompatible,
    compare_records,
    declarations,
)
from sparkpoint.state.timers import TIMERS, TimerService
from sparkpoint.state.ttl import StateTtl

log = logging.getLogger(__name__)
_RAW = BytesCodec()


V = TypeVar("V")
S = TypeVar("S", bound="_KeyedState[Any]")


_KINDS: dict[str, Any] = {"value": ValueState, "map": MapState, "list": ListState, "reducing": ReducingState}
_MARKER = "working.json"
# Present while the confirmed base's RocksDB files may be another database's than db/ (a
# materialization in steps switched to a database built from its slices): a snapshot of db/ then
# reuses no file of the base by name. Gone once db/ is rebuilt from a checkpoint's files, or a
# snapshot of db/'s own files is confirmed.
SWITCHED = "base-built-elsewhere"


def handle_digest(handle: SubtaskStateHandle) -> str:
    """Identifies one acknowledged snapshot: same digest, same files."""
    parts = sorted(f"{f.path}:{f.size}:{f.crc32}" for f in handle.stored())
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


class SubtaskState:
    """The local state of one (operator, subtask); see `RocksDBStateBackend`."""

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
        self.dir = Path(local_dir) / storage.job_id / operator / str(subtask)
        self.db: Rdict | None = None
        self.changelog = changelog or ChangelogOptions()
        self._states: dict[str, _KeyedState[Any]] = {}
        self._sweepers: dict[str, _KeyedState[bytes]] = {}  # TTL sweeps of states no batch opened
        # Each state's kind and TTL as last declared: by the operator when it opens one, else as the
        # restored checkpoint's facts recorded (how the sweep reaches a state no batch opens).
        self._declared: dict[str, dict[str, Any]] = {}
        self._time: dict[str, int | None] = {}  # "processing" / "event" -> microseconds (set_time)
        self.default_clock = "processing"  # a timer's clock when none is named ("event" with event time)
        self._base: dict[str, FileHandle] = {}  # confirmed: local name -> uploaded shared file
        self._base_id: int | None = None
        self._base_handle: SubtaskStateHandle | None = None
        self._pending: dict[int, SubtaskStateHandle] = {}
        self._native_pending: set[int] = set()  # pending snapshots of db/'s own files
        self._staged_now: list[FileHandle] = []  # the slices the snapshot being taken lists
        self._log = ChangeLog() if self.changelog.enabled else None
        self._log_base: int | None = None  # the checkpoint the logged changes start from
        self._clean = False  # db/ equals the checkpoint named in working.json
        self._source = storage  # the job directory the last restore read from
        # The states the operator declares (`KeyedOperator.states`): opened by every restore,
        # recorded in each snapshot's handle, hence in `_metadata`.
        self.descriptors = DeclaredStates(states)
        self.key_type = key_type
        self.declarations = declarations(self.descriptors, key_type)

    def __repr__(self) -> str:
        return f"RocksDBStateBackend({self.operator}/{self.subtask}, kg={self.key_group_range}, dir={self.dir})"

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def db_path(self) -> Path:
        return self.dir / "db"

    @property
    def confirmed_checkpoint(self) -> int | None:
        return self._base_id

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

    def declared(self, name: str) -> _KeyedState[Any]:
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

    def _open_declared(self, name: str, d: StateDescriptor) -> _KeyedState[Any]:
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
    ) -> _KeyedState[Any]:
        if not name or name == "default":
            raise ValueError(f"invalid state name {name!r}")
        db = self._open_db()
        ensure_column_families(db, str(self.db_path), [name], self.options)
        if name not in self.descriptors:  # declared states were evolved by the restore, before any open
            self._evolve_undeclared(name, codec)
        state: _KeyedState[Any] = kind(
            db, name, codec, self.max_parallelism, self.key_group_range, on_write=self._before_write, log=self._log,
            ttl=ttl, clock=self.clock, **extra,
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
        rewritten = migrate_records(self, name, RecordCodec.from_spec(old), codec)
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

    def _sweeper(self, name: str) -> _KeyedState[bytes] | None:
        """A handle on state `name` that only sweeps, with the TTL of its last declaration (None:
        it has none, or it was checkpointed before sparkpoint recorded declarations)."""
        declared = self._declared.get(name, {}).get("ttl")
        if not declared:
            return None
        db = self._open_db()
        sweeper = _KeyedState(db, name, BytesCodec(), self.max_parallelism, self.key_group_range,
                              on_write=self._before_write, log=self._log, ttl=StateTtl(**declared), clock=self.clock)
        self._sweepers[name] = sweeper  # its counts reach this snapshot's facts
        return sweeper

    def state_names(self) -> list[str]:
        return list_states(str(self.db_path)) if self.db_path.exists() else []

    def facts(self) -> dict[str, Any]:
        """What this subtask's state holds now, for people: per state its kind and TTL as declared
        and its entries (exact up to `EXACT_UP_TO`, RocksDB's estimate beyond: Flink's
        `estimate-num-keys` metric), the timers pending (count, earliest) and fired, the entries the
        TTL sweep removed, since the last call (each snapshot reports its batch's)."""
        db = self._open_db()
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

    def _before_write(self) -> None:
        # The first write after a snapshot makes db/ differ from that checkpoint. The unlink is
        # made durable before the write: RocksDB may persist an SST of this batch at any moment.
        if self._clean:
            self._clean = False
            (self.dir / _MARKER).unlink(missing_ok=True)
            fsync_dir(str(self.dir))

    def _forget_working(self) -> None:
        (self.dir / _MARKER).unlink(missing_ok=True)
        (self.dir / SWITCHED).unlink(missing_ok=True)  # the next db/ is made from a checkpoint's files
        self._clean = False
        if self.db_path.exists():
            # Out of the way at once, deleted in the background: freeing the blocks of a working
            # database that ran ahead (a compaction's fresh output) took 0.5 s per GB measured,
            # on the critical path of every restore that cannot reuse it.
            trash = self.dir / f"{_TRASH}{uuid.uuid4().hex[:8]}"
            self.db_path.rename(trash)
            _delete_in_background(trash)

    def forget_base(self) -> None:
        """The confirmed base can no longer be trusted (the coordinator declined a reference to it,
        another writer subsumed it): the next snapshot uploads every file again."""
        self._base, self._base_id, self._base_handle = {}, None, None

    def _confirm_base(self, checkpoint_id: int, handle: SubtaskStateHandle) -> None:
        self._base = {f.local_name: f for f in handle.shared}
        self._base_id = checkpoint_id
        self._base_handle = handle

    def _forget_log(self) -> None:
        if self._log is not None:
            self._log.clear()
        self._log_base = None

    def compact(self) -> None:
        """Force a full compaction (tests and benchmarks use it to provoke rewritten SSTs)."""
        db = self._open_db()
        self._before_write()
        compact_all(db, self.state_names())

    def close(self) -> None:
        if self.db is not None:
            flush_all(self.db, self.state_names())
            self._release_states()
            self.db.close()
            self.db = None

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
        if self.db is not None:
            db, self.db = self.db, None
            self._release_states()
            try:
                db.close()
            except Exception as e:  # noqa: BLE001  rocksdict raises bare Exception; the files go anyway
                log.warning("closing the corrupt database of %s: %s", self, e)
        self._forget_working()
        self._drop_local_checkpoints(keep=set())
        # A materialization in steps going on: its snapshot is hard links to db/'s SSTs of then,
        # and its slices were read from them. Kept, the next snapshot would read the same bad
        # block again, and every checkpoint after it fail the same way.
        staging.drop_all(self.dir)

    def _open_db(self, *, create: bool = False) -> Rdict:
        if self.db is None:
            if not create and not self.db_path.exists():
                raise StateBackendError(f"{self}: call restore() first (with None to start empty)")
            self.db = open_db(str(self.db_path), [], self.options, create=create)
        return self.db

    def _read_marker(self) -> dict[str, Any] | None:
        try:
            data = json.loads((self.dir / _MARKER).read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def _write_marker(self, checkpoint_id: int, handle: SubtaskStateHandle, job_url: str | None = None) -> None:
        write_replacing(self.dir / _MARKER, json.dumps(self._marker_for(checkpoint_id, handle, job_url)).encode())
        self._clean = True

    def _marker_for(self, checkpoint_id: int, handle: SubtaskStateHandle, job_url: str | None = None) -> dict[str, Any]:
        job = job_url or self._source.job_url
        return {"job": job, "checkpoint_id": checkpoint_id, "digest": handle_digest(handle)}

    def _drop_local_checkpoints(self, *, keep: set[int]) -> None:
        for entry in self.dir.iterdir() if self.dir.exists() else []:
            cid = checkpoint_id_of_dir(entry.name)
            if cid is not None and cid not in keep:
                storage_step("delete", str(entry))  # a task-local copy
                shutil.rmtree(entry, ignore_errors=True)

    def _drop_leftovers(self) -> None:
        """Scratch directories of a process that died mid-restore."""
        for entry in self.dir.iterdir():
            if entry.name.startswith(_TRASH):
                _delete_in_background(entry)
            elif entry.name.startswith(("download-", "rescale-")) or ".tmp-" in entry.name:
                shutil.rmtree(entry, ignore_errors=True)

    def _delete_quietly(self, rels: list[str]) -> None:
        try:
            self.storage.delete(rels)
        except Exception as e:  # best effort: the orphan sweep gets what is left
            log.warning("could not delete the uploads of a failed snapshot: %s", e)


_TRASH = "trash-"  # a local directory on its way out (`_delete_in_background`)


_deleting: set[Path] = set()


_deleting_lock = threading.Lock()


def _delete_in_background(path: Path) -> None:
    """Delete the directory `path` on a daemon thread, once per process. One left over by a process
    that died first is found by the next restore (`_drop_leftovers`)."""
    with _deleting_lock:
        if path in _deleting:
            return
        _deleting.add(path)

    def delete() -> None:
        try:
            if path.is_symlink():  # the link goes, never what it points to
                path.unlink(missing_ok=True)
            shutil.rmtree(path, ignore_errors=True)
        finally:
            with _deleting_lock:
                _deleting.discard(path)

    threading.Thread(target=delete, name=f"sparkpoint-delete-{path.name}", daemon=True).start()
