"""Keyed operators: a function over one subtask's pandas batch and its RocksDB state.

A user writes their own the same way the sample operators (`sparkpoint.state.sample`) are:

    def process(batch: pd.DataFrame, state: RocksDBStateBackend) -> pd.DataFrame | None
    def export(state: RocksDBStateBackend) -> pd.DataFrame

`process` sees only rows whose key belongs to the subtask; it pre-aggregates with pandas, then
reads and writes the state in batches. What it returns are the rows it changed (the sink's
input, for operators that emit). `export` turns the subtask's state back into a table.
An operator may also take `bootstrap(table, state)`: the initial state from a table (Flink's
State Processor API, Spark's initial-state DataFrame), run once per subtask by `sparkpoint
bootstrap` over that subtask's rows of the table, into a savepoint a job starts from.
Nothing here imports Spark: `sparkpoint state` exports a checkpoint without a JVM.
"""


from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from sparkpoint.checkpoint.paths import validate_name
from sparkpoint.state.backend import RocksDBStateBackend
from sparkpoint.state.record import parse_field
from sparkpoint.state.schema import DeclaredStates, declarations
from sparkpoint.state.timers import no_timers_without_on_timer

ProcessFn = Callable[[pd.DataFrame, RocksDBStateBackend], "pd.DataFrame | None"]


ExportFn = Callable[[RocksDBStateBackend], pd.DataFrame]
OnTimerFn = Callable[[pd.DataFrame, RocksDBStateBackend], "pd.DataFrame | None"]
BootstrapFn = Callable[[pd.DataFrame, RocksDBStateBackend], None]


@dataclass(frozen=True)
class KeyedOperator:
    name: str
    key: str  # the input column the state is keyed by
    process: ProcessFn
    export: ExportFn
    columns: tuple[str, ...] = ()  # other input columns `process` reads
    emits: bool = False  # its changed rows go to the exactly-once sink
    # The table `export` makes, as (column, type) pairs (a mapping is accepted): shown by the
    # orchestrator (Dagster's column schema); nothing checks the export against it.
    schema: Mapping[str, str] | tuple[tuple[str, str], ...] = ()
    # Called after each batch's `process` with the timers the batch made due (`fired`: columns
    # `key` and `timestamp`, in timestamp order); what it returns goes to the sink like
    # `process`'s changed rows.
    on_timer: OnTimerFn | None = None
    # Writes the initial state from one subtask's rows of an initial table (keyed by `key`, every
    # column of the table) into an empty state: `sparkpoint bootstrap` turns it into a savepoint.
    bootstrap: BootstrapFn | None = None
    # The states `process` uses, declared (Flink's state descriptors): name -> a codec (a value
    # state) or a `StateDescriptor` (kind, codec, TTL). Recorded in `_metadata`, so a restore
    # and the pre-flight know each state's schema without running the operator, RecordCodec
    # fields evolve across restores, and `state --raw` reads them once the code is gone.
    # States not declared work as before.
    states: Mapping[str, Any] | DeclaredStates = DeclaredStates()
    # The key column's Arrow type (e.g. "string", "int64"), recorded with each declared state: a
    # restore by code whose key type differs is refused (stored keys would not be found).
    key_type: str | None = None
    # What checkpoints key this operator's state by (`_metadata`, `shared/<uid>/`, the registry,
    # local directories); None: the name (a str once constructed). Keep it when renaming the
    # operator, and its state stays with it.
    uid: str = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        validate_name(self.name, "operator name")  # it names output files and the orchestrator's assets
        object.__setattr__(self, "uid", validate_name(self.uid if self.uid is not None else self.name,
                                                      "operator uid"))  # it names directories
        if not isinstance(self.states, DeclaredStates):
            object.__setattr__(self, "states", DeclaredStates(self.states))
        if self.key_type is not None:
            object.__setattr__(self, "key_type", parse_field(self.key, self.key_type).text)
        pairs = self.schema.items() if isinstance(self.schema, Mapping) else self.schema
        object.__setattr__(self, "schema", tuple((str(c), str(t)) for c, t in pairs))

    def input_columns(self) -> list[str]:
        return [self.key, *[c for c in self.columns if c != self.key]]

    def declarations(self) -> dict[str, dict[str, Any]]:
        """The declared states as `_metadata` records them (`sparkpoint.state.schema`)."""
        assert isinstance(self.states, DeclaredStates)
        return declarations(self.states, self.key_type)


def run_batch(
    op: KeyedOperator, state: RocksDBStateBackend, batch: pd.DataFrame, *, processing_us: int | None,
    watermark_us: int | None = None, event_time: bool = False,
) -> pd.DataFrame | None:
    """One batch of one subtask, as the pipeline's tasks and the test harness run it: set the
    clocks (the batch's processing time, the watermark it advances to), `process` its rows, fire
    the timers they made due into `on_timer`, then the bounded TTL sweep. Returns what goes to the
    sink: `process`'s changed rows and what the timers emitted (None when neither made rows)."""
    state.default_clock = "event" if event_time else "processing"
    state.set_time(processing_us=processing_us, watermark_us=watermark_us)
    changed = op.process(batch, state) if len(batch) else None
    fired = fire_timers(op, state, processing_us=processing_us, watermark_us=state.clock("event"))
    if fired:  # what the timers emitted is committed with this batch's checkpoint, like its rows
        changed = pd.concat([c for c in [changed, *fired] if c is not None and len(c)], ignore_index=True)
    state.expire()  # the TTL sweep: bounded, its deletes go into this checkpoint like any write
    return changed


def run_bootstrap(
    op: KeyedOperator, state: RocksDBStateBackend, table: pd.DataFrame, *, processing_us: int | None,
    event_time: bool = False,
) -> None:
    """The initial state of one subtask: `op.bootstrap` over the subtask's rows of the initial
    table (possibly none), into `state`, freshly restored empty. The clocks are set as a batch
    sets them (what a TTL entry is stamped with; which clock a timer takes by default); timers it
    registers fire after the job's first batch, so an operator without `on_timer` is refused."""
    if op.bootstrap is None:
        raise ValueError(f"operator {op.name!r} has no bootstrap function")
    state.default_clock = "event" if event_time else "processing"
    state.set_time(processing_us=processing_us)
    op.bootstrap(table, state)
    if state.timers_used:
        no_timers_without_on_timer(op.name, state.timers, op.on_timer is not None)


def fire_timers(
    op: KeyedOperator, state: RocksDBStateBackend, *, processing_us: int | None, watermark_us: int | None
) -> list[pd.DataFrame]:
    """Fire every timer due by the batch's time and watermark into `op.on_timer`, once each, in
    timestamp order, until none is due (a timer `on_timer` registers for a time already due fires
    in the same batch). Returns what `on_timer` emitted. Timers registered by an operator without
    `on_timer` are refused, naming it."""
    if not state.timers_used:
        return []
    timers = state.timers
    no_timers_without_on_timer(op.name, timers, op.on_timer is not None)
    emitted = []
    while op.on_timer is not None:
        fired = timers.pop_due(processing=processing_us, event=watermark_us)
        if fired.empty:
            break
        out = op.on_timer(fired, state)
        if out is not None and len(out):
            emitted.append(out)
    return emitted


def to_micros(ts: pd.Series) -> np.ndarray:
    """Timestamps as int64 microseconds since the epoch, UTC (naive values are taken as UTC)."""
    if isinstance(ts.dtype, pd.DatetimeTZDtype):
        ts = ts.dt.tz_convert("UTC").dt.tz_localize(None)
    return np.asarray(ts.astype("datetime64[us]").astype("int64"))


def from_micros(values: list[int] | np.ndarray) -> pd.Series:
    return pd.Series(pd.to_datetime(np.asarray(values, dtype="int64"), unit="us", utc=True)).astype(
        "datetime64[us, UTC]"
    )


# --- user_totals: per user count, sum, min, max of amount and the latest ts ----------------------
