"""Unit-testing a keyed operator without Spark: `OperatorHarness` runs it on real RocksDB in a
temporary directory, batch by batch, with clocks the test moves (Spark 4's `TwsTester`).

Every step is the pipeline's own: rows are routed to subtasks by key group
(`keygroups.subtasks_of`), late rows are split off and the watermark advanced by
`sparkpoint.state.eventtime`, each subtask's batch is `operators.run_batch` (clocks, `process`,
timers into `on_timer`, the TTL sweep), and a snapshot is a real incremental checkpoint (changelog
on, as a pipeline's default) taken through the `CheckpointCoordinator`, which a new harness
restores at any parallelism through key groups.
"""

from __future__ import annotations

import shutil
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Self

import pandas as pd

from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.errors import SparkpointError
from sparkpoint.checkpoint.metadata import CheckpointMetadata
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.state.backend import RocksDBStateBackend, take_checkpoint
from sparkpoint.state.engine.changelog import ChangelogOptions
from sparkpoint.state.eventtime import (
    advance,
    check_event_time,
    event_micros,
    iso_micros,
    lateness_micros,
    split_late,
)
from sparkpoint.state.extract import export_table
from sparkpoint.state.keygroups import arrow_keys, check_parallelism, subtask_for_key, subtasks_of
from sparkpoint.state.operators import KeyedOperator, run_batch
from sparkpoint.state.timers import micros

JOB_ID = "harness"
# Retention never deletes a snapshot: every one a test took stays restorable.
_RETAIN_ALL = 1 << 30


class HarnessError(SparkpointError, ValueError):
    """The harness was used in a way the pipeline would not allow (a clock moved backwards, a
    watermark without an event time, input without the operator's columns, a closed harness)."""


class _Directory:
    """A temporary directory deleted when the last object holding it lets go (or at exit)."""

    def __init__(self, prefix: str):
        self.path = tempfile.mkdtemp(prefix=prefix)
        self._finalizer = weakref.finalize(self, shutil.rmtree, self.path, ignore_errors=True)

    def delete(self) -> None:
        self._finalizer()


@dataclass(frozen=True)
class HarnessSnapshot:
    """A checkpoint an `OperatorHarness` took (`snapshot()`), to give `OperatorHarness.restore`.

    It names the checkpoint and carries what the harness's clocks were. The checkpoint's files
    live in a temporary directory that stays as long as this value (or the harness) is referenced.

    Example:
        ```python
        snap = harness.snapshot()
        snap.metadata().operators["last_page"].states       # what the checkpoint recorded
        with OperatorHarness.restore(snap, parallelism=3) as h:
            ...
        ```

    Args:
        operator: the operator the harness ran.
        checkpoints_url: the harness's checkpoint storage (a `file://` URL).
        checkpoint_id: the checkpoint's id.
        parallelism: the harness's parallelism when it took it.
        max_parallelism: its key groups.
        event_time: its event-time column, or None.
        allowed_lateness: its allowed lateness (seconds).
        late: "drop" or "process".
        watermark: the watermark then (microseconds since the epoch, UTC), or None.
        processing_time: the processing clock then (microseconds since the epoch, UTC).
        late_rows: late rows counted until then.
    """

    operator: KeyedOperator
    checkpoints_url: str  # the harness's checkpoint storage (a file:// URL; job id `JOB_ID`)
    checkpoint_id: int
    parallelism: int
    max_parallelism: int
    event_time: str | None
    allowed_lateness: float
    late: str
    watermark: int | None  # µs since the epoch, UTC
    processing_time: int  # µs since the epoch, UTC
    late_rows: int
    _files: _Directory = field(repr=False, compare=False)

    def metadata(self) -> CheckpointMetadata:
        """The checkpoint's `_metadata`, read from its storage.

        Example:
            ```python
            snap.metadata().operators["spend"].states
            ```

        Returns:
            A `sparkpoint.checkpoint.metadata.CheckpointMetadata`.
        """
        return CompletedCheckpointStore(self._storage()).load(self.checkpoint_id)

    def _storage(self) -> CheckpointStorage:
        return CheckpointStorage(self.checkpoints_url, JOB_ID)


class OperatorHarness:
    """Runs one keyed operator on real RocksDB in a temporary directory, without Spark.

        from sparkpoint.testing import OperatorHarness

        with OperatorHarness(sessions, parallelism=2, event_time="ts", allowed_lateness=5) as h:
            out = h.process(events)                  # its output, timers the batch fired included
            closed = h.advance_watermark(pd.Timestamp("2026-01-01", tz="UTC"))
            table = h.export()                       # the state as one table, sorted by key
            snap = h.snapshot()
        with OperatorHarness.restore(snap, parallelism=3) as h3:  # rescaled through key groups
            ...

    Each batch goes the pipeline's way: rows routed to subtasks by key group; with `event_time`,
    rows below the watermark the batch starts with are late (counted in `late_rows`, dropped
    unless `late="process"`) and the watermark advances to the batch's highest event time less
    `allowed_lateness`, never back; then every subtask runs `process`, fires its due timers into
    `on_timer` and sweeps expired TTL entries.

    The processing clock is the harness's own and stands still until `advance_processing_time`
    moves it: it starts at `processing_time` (default: the wall clock when the harness is made),
    so TTL and processing-time timers are deterministic. `watermark`, `processing_time` and the
    clock arguments are int microseconds since the epoch, UTC, or any datetime a timer takes.

    Args:
        operator: the `KeyedOperator` under test.
        parallelism: subtasks, each its own RocksDB instance over a range of key groups.
        max_parallelism: key groups (kept across `snapshot` and `restore`).
        event_time: the input's event-time column (a timestamp), or None for processing time only.
        allowed_lateness: seconds the watermark trails the highest event time seen.
        late: rows below the watermark: "drop" (the default) or "process".
        processing_time: where the processing clock starts (default: now).

    Raises:
        HarnessError: a setting the pipeline would refuse (parallelism, event time, lateness).
    """

    def __init__(
        self,
        operator: KeyedOperator,
        *,
        parallelism: int = 1,
        max_parallelism: int = 128,
        event_time: str | None = None,
        allowed_lateness: float = 0,
        late: str = "drop",
        processing_time: Any = None,
    ):
        self._configure(operator, parallelism, max_parallelism, event_time, allowed_lateness, late, processing_time)
        self._open(None, None)

    def _configure(
        self, operator: KeyedOperator, parallelism: int, max_parallelism: int, event_time: str | None,
        allowed_lateness: float, late: str, processing_time: Any,
    ) -> None:
        if not isinstance(operator, KeyedOperator):
            raise HarnessError(f"OperatorHarness runs a KeyedOperator, got {type(operator).__name__}")
        problems = check_event_time(event_time, allowed_lateness, late)
        try:
            check_parallelism(parallelism, max_parallelism)
        except (TypeError, ValueError) as e:
            problems.append(str(e))
        if problems:
            raise HarnessError(f"OperatorHarness({operator.name}): " + "; ".join(problems))
        self.operator = operator
        self.parallelism = parallelism
        self.max_parallelism = max_parallelism
        self.event_time = event_time
        self.allowed_lateness = allowed_lateness
        self.late = late
        self.processing_time: int = micros(processing_time) if processing_time is not None else int(time.time() * 1e6)
        self.watermark: int | None = None
        self.late_rows = 0  # rows below the watermark their batch started with, all batches so far
        self._local = _Directory("sparkpoint-harness-local-")
        self._files: _Directory | None = _Directory("sparkpoint-harness-checkpoints-")
        self._storage = CheckpointStorage(f"file://{self._files.path}", JOB_ID)
        self._backends: list[RocksDBStateBackend] = []
        self._coordinator: CheckpointCoordinator | None = None
        self._closer = weakref.finalize(self, _close, self._backends, self._local)

    def _open(self, checkpoint: CheckpointMetadata | None, source: CheckpointStorage | None) -> None:
        try:
            for subtask in range(self.parallelism):
                backend = RocksDBStateBackend(
                    self._storage, self.operator.uid, subtask, parallelism=self.parallelism,
                    max_parallelism=self.max_parallelism, local_dir=self._local.path,
                    changelog=ChangelogOptions(enabled=True), states=self.operator.states,
                    key_type=self.operator.key_type,
                )
                self._backends.append(backend)
                backend.restore(checkpoint, source=source)
                # A restore sets the checkpoint's clocks (its commit time): the harness's stand.
                backend.default_clock = "event" if self.event_time is not None else "processing"
                backend.set_time(processing_us=self.processing_time, watermark_us=self.watermark)
        except BaseException:
            self.close()
            raise
        self._coordinator = CheckpointCoordinator(self._storage, num_retained=_RETAIN_ALL)

    @classmethod
    def restore(
        cls, snapshot: HarnessSnapshot, parallelism: int | None = None, *, operator: KeyedOperator | None = None
    ) -> Self:
        """A new harness holding the state of `snapshot`, at any parallelism: state, timers and
        TTL times follow their keys' key groups. The clocks, `late_rows`, max parallelism and
        event-time settings are the snapshot's.

        Example:
            ```python
            with OperatorHarness.restore(snap, parallelism=3, operator=spend_v2) as h:   # rescaled, new code
                h.export()
            ```

        Args:
            snapshot: what `snapshot()` returned.
            parallelism: subtasks of the new harness (default: the snapshot's).
            operator: a new version of the operator (same uid; its name may differ) to run on the restored state.

        Returns:
            The new harness (close it, or use it in a `with` block).

        Raises:
            HarnessError: the snapshot's files are gone.
            OperatorStateMismatch: `operator` has another uid than the snapshot's, or a declared state it
                cannot read (`StateSchemaIncompatible`).
        """
        harness = cls.__new__(cls)
        harness._configure(
            operator or snapshot.operator, snapshot.parallelism if parallelism is None else parallelism,
            snapshot.max_parallelism, snapshot.event_time, snapshot.allowed_lateness, snapshot.late,
            snapshot.processing_time,
        )
        harness.watermark = snapshot.watermark
        harness.late_rows = snapshot.late_rows
        source = snapshot._storage()
        try:
            meta = snapshot.metadata()
        except SparkpointError as e:
            harness.close()
            raise HarnessError(
                f"snapshot {snapshot.checkpoint_id} of {snapshot.operator.name} cannot be read: {e}") from e
        harness._open(meta, source)
        return harness

    # --- running ---------------------------------------------------------------------------------

    def process(self, df: pd.DataFrame) -> pd.DataFrame:
        """Run one batch: every subtask processes its rows and fires the timers the batch makes due.

        The operator sees its `key` and `columns` only, as in a pipeline (list the event-time
        column in `columns` to read it). Bad input is refused before any state is touched. An
        exception of the operator itself leaves the subtasks that ran changed and the watermark and
        `late_rows` as they were (a pipeline would restore its last checkpoint: restore a snapshot to do
        the same).

        Example:
            ```python
            out = h.process(pd.DataFrame({"user": ["ann", "bob"], "page": ["/", "/cart"]}))
            ```

        Args:
            df: the batch, with the operator's key and columns (other columns are ignored).

        Returns:
            What every subtask emitted (`process`'s changed rows and what `on_timer` returned), in
            subtask order; an empty DataFrame when nothing. The pipeline's sink would add a
            `checkpoint_id` column; the harness returns the rows as the operator made them.

        Raises:
            HarnessError: a column the operator reads is missing, or a key is null.
            EventTimeError: the event-time column is missing, not a timestamp, or has a null.
        """
        backends = self._live()
        op = self.operator
        where = f"the batch given to {op.name}"
        missing = [c for c in op.input_columns() if c not in df.columns]
        if missing:
            raise HarnessError(f"{where} lacks column(s) {', '.join(missing)}; {op.name} reads "
                               f"{', '.join(op.input_columns())} (key {op.key!r})")
        keys = df[op.key]
        if keys.isna().any():
            raise HarnessError(f"{where}: column {op.key!r} has {int(keys.isna().sum())} null key(s); "
                               f"{op.name} cannot key them")
        owners = subtasks_of(arrow_keys(keys), self.max_parallelism, self.parallelism)
        times = event_micros(df, self.event_time, where) if self.event_time is not None else None
        start = mark = self.watermark
        if times is not None:
            highest = int(times.max()) if len(times) else None
            mark = advance(start, highest, lateness_micros(self.allowed_lateness))
        outputs, late = [], 0
        for subtask, backend in enumerate(backends):
            mine = owners == subtask
            rows = df.loc[mine].reset_index(drop=True)
            if times is not None:
                split = split_late(rows, times[mine], start, self.late)
                late += split.late
                rows = split.kept
            outputs.append(self._run(backend, rows[op.input_columns()], mark))
        self.watermark, self.late_rows = mark, self.late_rows + late
        return _concat(outputs)

    def advance_processing_time(self, ts: Any) -> pd.DataFrame:
        """Move the processing clock to `ts`: due processing-time timers fire, processing-time
        TTL expires against it.

        Example:
            ```python
            fired = h.advance_processing_time(t0 + pd.Timedelta(minutes=31))
            ```

        Args:
            ts: the new processing time: a datetime or int microseconds since the epoch, UTC.

        Returns:
            What `on_timer` emitted (an empty DataFrame when nothing).

        Raises:
            HarnessError: `ts` is before the processing time now.
        """
        at = micros(ts)
        if at < self.processing_time:
            raise HarnessError(f"processing time cannot go back: it is {iso_micros(self.processing_time)}, "
                               f"asked for {iso_micros(at)}")
        self.processing_time = at
        return self._fire()

    def advance_watermark(self, ts: Any) -> pd.DataFrame:
        """Move the watermark to `ts` (as if a batch had advanced it): due event-time timers fire,
        event-time TTL expires against it.

        Example:
            ```python
            closed = h.advance_watermark(pd.Timestamp("2026-01-01 11:00", tz="UTC"))
            ```

        Args:
            ts: the new watermark: a datetime or int microseconds since the epoch, UTC.

        Returns:
            What `on_timer` emitted (an empty DataFrame when nothing).

        Raises:
            HarnessError: the harness has no `event_time`, or `ts` is below the watermark now.
        """
        if self.event_time is None:
            raise HarnessError(f"the harness of {self.operator.name} has no event_time, so no watermark: give "
                               "OperatorHarness(..., event_time=column) or use advance_processing_time")
        at = micros(ts)
        if self.watermark is not None and at < self.watermark:
            raise HarnessError(
                f"the watermark never goes back: it is {iso_micros(self.watermark)}, asked for {iso_micros(at)}")
        self.watermark = at
        return self._fire()

    def _fire(self) -> pd.DataFrame:
        empty = pd.DataFrame({c: pd.Series(dtype=object) for c in self.operator.input_columns()})
        return _concat([self._run(b, empty, self.watermark) for b in self._live()])

    def _run(self, backend: RocksDBStateBackend, rows: pd.DataFrame, watermark: int | None) -> pd.DataFrame | None:
        out = run_batch(self.operator, backend, rows, processing_us=self.processing_time,
                        watermark_us=watermark, event_time=self.event_time is not None)
        if out is None or isinstance(out, pd.DataFrame):
            return out
        if self.operator.emits:  # the pipeline's sink would fail on it
            raise HarnessError(f"{self.operator.name} emits, but its process returned a {type(out).__name__}, "
                               "not a DataFrame or None")
        return None  # the pipeline ignores what an operator that does not emit returns

    # --- looking inside ----------------------------------------------------------------------------

    def export(self) -> pd.DataFrame:
        """The operator's `export` over every subtask as one table, sorted by the key column (if
        the export has it). Entries whose TTL expired by the harness's clocks are not in it.

        Example:
            ```python
            assert h.export().to_dict("records") == [{"user": "bob", "page": "/pay"}]
            ```

        Returns:
            A DataFrame, as `read_state` gives a pipeline's.
        """
        return export_table(self.operator, self._live())

    def state_of(self, key: bytes | str) -> RocksDBStateBackend:
        """The state of the subtask that owns `key` (to look at its timers, for instance).

        Example:
            ```python
            h.state_of("ann").timers.list("ann")
            ```

        Args:
            key: a key, `str` or `bytes`.

        Returns:
            That subtask's `RocksDBStateBackend`.
        """
        return self._live()[subtask_for_key(key, self.max_parallelism, self.parallelism)]

    # --- checkpoints -------------------------------------------------------------------------------

    def snapshot(self) -> HarnessSnapshot:
        """Take a checkpoint of every subtask (incremental, with the changelog) and return what
        `OperatorHarness.restore` needs, clocks and `late_rows` included.

        Example:
            ```python
            snap = h.snapshot()
            ```

        Returns:
            A `HarnessSnapshot`.
        """
        backends = self._live()
        assert self._coordinator is not None and self._files is not None
        offsets = {"watermark": self.watermark} if self.watermark is not None else None
        done = take_checkpoint(self._coordinator, backends, source_offsets=offsets)
        return HarnessSnapshot(
            operator=self.operator, checkpoints_url=self._storage.url, checkpoint_id=done.checkpoint_id,
            parallelism=self.parallelism, max_parallelism=self.max_parallelism, event_time=self.event_time,
            allowed_lateness=self.allowed_lateness, late=self.late, watermark=self.watermark,
            processing_time=self.processing_time, late_rows=self.late_rows, _files=self._files,
        )

    # --- life cycle --------------------------------------------------------------------------------

    def close(self) -> None:
        """Close every RocksDB instance and delete the working files; the checkpoint files stay
        while a snapshot of them is referenced. Calling it again does nothing.

        Example:
            ```python
            h = OperatorHarness(op)
            try:
                h.process(batch)
            finally:
                h.close()          # or: with OperatorHarness(op) as h: ...
            ```
        """
        self._closer()
        self._coordinator = None
        self._files = None  # deleted now, unless a snapshot still holds them

    @property
    def closed(self) -> bool:
        """Whether the harness is closed (any use then raises `HarnessError`)."""
        return not self._closer.alive

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self._local.path}"
        return f"OperatorHarness({self.operator.name}, parallelism={self.parallelism}, {state})"

    def _live(self) -> list[RocksDBStateBackend]:
        if self.closed:
            raise HarnessError(f"the harness of {self.operator.name} is closed; make a new one (or restore a snapshot)")
        return self._backends


def _close(backends: list[RocksDBStateBackend], local: _Directory) -> None:
    """Close the databases, then delete their directory (also when a harness is never closed)."""
    try:
        for backend in backends:
            backend.close()
    finally:
        backends.clear()
        local.delete()


def _concat(frames: list[pd.DataFrame | None]) -> pd.DataFrame:
    rows = [f for f in frames if f is not None and len(f)]
    return pd.concat(rows, ignore_index=True) if rows else pd.DataFrame()


__all__ = ["HarnessError", "HarnessSnapshot", "OperatorHarness"]
