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
from typing import TYPE_CHECKING, Any

from sparkpoint.checkpoint.paths import validate_name
from sparkpoint.checkpoint.phases import phase
from sparkpoint.lazy import lazy_module
from sparkpoint.state.backend import RocksDBStateBackend
from sparkpoint.state.record import parse_field
from sparkpoint.state.schema import DeclaredStates, declarations
from sparkpoint.state.timers import no_timers_without_on_timer

if TYPE_CHECKING:
    import numpy as np
    import pandas as pd
else:
    np = lazy_module("numpy")
    pd = lazy_module("pandas")

ProcessFn = Callable[["pd.DataFrame", RocksDBStateBackend], "pd.DataFrame | None"]


ExportFn = Callable[[RocksDBStateBackend], "pd.DataFrame"]
OnTimerFn = Callable[["pd.DataFrame", RocksDBStateBackend], "pd.DataFrame | None"]
BootstrapFn = Callable[["pd.DataFrame", RocksDBStateBackend], None]


@dataclass(frozen=True)
class KeyedOperator:
    """A keyed operator: your function over one subtask's rows of a batch and its RocksDB state.

    A pipeline runs `parallelism` subtasks of each operator; a key belongs to one key group and a key
    group to one subtask, so `process` sees every row of its keys and only those. It is called once
    per batch in each subtask that has rows of the batch (never with an empty batch); it reads and
    writes `state` in batches, and returns the rows it changed when the operator `emits`. Guide:
    [Writing operators](../writing-operators.md).

    Example:
        ```python
        COUNT = StructCodec("<q")

        def process(batch, state):                      # one subtask's rows (pandas) and its state
            counts = batch.groupby("user").size()
            state.value_state("count", COUNT).update_many(
                counts.index.tolist(), lambda k, old: ((old[0] if old else 0) + int(counts[k]),))

        def export(state):                              # the subtask's state as a table
            return pd.DataFrame([(k.decode(), v[0]) for k, v in state.value_state("count", COUNT).items()],
                                columns=["user", "count"])

        clicks = KeyedOperator("clicks", key="user", process=process, export=export)
        ```

    Args:
        name: the operator's name: Dagster asset keys, output file names, logs (letters, digits, `.`, `_`, `-`).
        key: the input column the state is keyed by.
        process: `process(batch, state)`: `batch` is a pandas DataFrame of the subtask's rows with the
            columns `key` and `columns`; `state` a `RocksDBStateBackend`. Returns a DataFrame of the rows
            it changed (when `emits`: they go to the exactly-once sink), or None.
        export: `export(state)` returns the subtask's state as a DataFrame (what `read_state`,
            `sparkpoint state` and the harness's `export` show, every subtask in one table).
        columns: the other input columns `process` reads (only these are read from the input files).
        emits: its changed rows (and what `on_timer` returns) go to the exactly-once sink, which adds a
            `checkpoint_id` column.
        schema: the columns `export` makes, as a mapping or (column, type) pairs: shown by Dagster as the
            SSTable asset's column schema; nothing checks the export against it.
        on_timer: `on_timer(fired, state)`, called after each batch's `process` with the timers the batch
            made due, never with none. `fired` is a pandas DataFrame, one row per timer in timestamp
            order, processing- and event-time timers together: `key` (`str`, the key as registered,
            so an int key column's keys are their string form; `bytes` for a key that is not UTF-8)
            and `timestamp` (`datetime64[us, UTC]`). `state` is the subtask's `RocksDBStateBackend`, as
            `process` gets it, its clocks the batch's (`state.clock("event")`: the watermark). It
            returns a DataFrame or None; what it returns goes to the sink like `process`'s changed
            rows.
        bootstrap: `bootstrap(table, state)` writes the initial state from one subtask's rows of a table
            (keyed by `key`, every column) into an empty state: `sparkpoint bootstrap` makes a savepoint of it.
        states: the states `process` uses, declared (Flink's state descriptors): name -> a codec (a value
            state) or a `StateDescriptor`. Recorded in `_metadata`, so a restore and `check-upgrade`
            know each state's schema without running the operator, `RecordCodec` fields evolve across
            restores, and `sparkpoint state --raw` reads them once the code is gone. States not declared
            work as before.
        key_type: the key column's Arrow type (e.g. "string", "int64"), recorded with each declared
            state: a restore by code whose key type differs is refused.
        uid: what checkpoints key this operator's state by (`_metadata`, `shared/<uid>/`, the registry,
            local directories); default: the name. Keep it when renaming the operator, and its state stays.

    Raises:
        ValueError: a name or uid that cannot name a directory.
        RecordSchemaError: a `key_type` that is not an Arrow type name.
    """

    name: str
    key: str
    process: ProcessFn
    export: ExportFn
    columns: tuple[str, ...] = ()
    emits: bool = False
    schema: Mapping[str, str] | tuple[tuple[str, str], ...] = ()
    on_timer: OnTimerFn | None = None
    bootstrap: BootstrapFn | None = None
    states: Mapping[str, Any] | DeclaredStates = DeclaredStates()
    key_type: str | None = None
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
        """The input columns the operator reads: its key, then `columns`.

        Example:
            ```python
            KeyedOperator("pages", key="user", columns=("page",), ...).input_columns()   # ["user", "page"]
            ```

        Returns:
            Column names, the key first.
        """
        return [self.key, *[c for c in self.columns if c != self.key]]

    def declarations(self) -> dict[str, dict[str, Any]]:
        """The declared states as `_metadata` records them (what `compare_states` takes as `new`).

        Example:
            ```python
            compare_states(snapshot.metadata().operators["spend"].states, spend.declarations())
            ```

        Returns:
            State name -> its declaration (kind, key type, TTL, codec).
        """
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
    with phase("process"):
        changed = op.process(batch, state) if len(batch) else None
    with phase("timers"):
        fired = fire_timers(op, state, processing_us=processing_us, watermark_us=state.clock("event"))
    if fired:  # what the timers emitted is committed with this batch's checkpoint, like its rows
        changed = pd.concat([c for c in [changed, *fired] if c is not None and len(c)], ignore_index=True)
    with phase("expire"):
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
