"""Event time: the watermark and late rows, one definition for a pipeline's batches and the harness.

The watermark is the highest event time seen so far minus the allowed lateness; it never goes
back. A row is *late* when its event time is below the watermark its batch starts with: it is
counted, and dropped (`late="drop"`, the default) or processed (`late="process"`). After the batch
the watermark advances to what the batch saw; event-time timers at or below it fire and
event-time TTL expires against it. Times are int64 microseconds since the epoch, UTC.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from sparkpoint.checkpoint.errors import SparkpointError
from sparkpoint.checkpoint.metadata import CheckpointMetadata, iso_micros
from sparkpoint.lazy import lazy_module

if TYPE_CHECKING:
    import numpy as np
    import pandas as pd
else:
    np = lazy_module("numpy")
    pd = lazy_module("pandas")

LATE_MODES = ("drop", "process")
# An input file whose highest event time is this far beyond its batch's processing time is a bad
# file (a producer's unit mix-up: one row in year 2999 would move the watermark for good).
MAX_FUTURE_EVENT_TIME = 24 * 3600.0
__all__ = ["LATE_MODES", "MAX_FUTURE_EVENT_TIME", "EventTimeError", "LateSplit", "advance", "check_event_time",
           "check_max_future_event_time", "event_micros", "iso_micros", "lateness_micros", "split_late"]


class EventTimeError(SparkpointError):
    """The event-time column is missing, not a timestamp, or has no value in a row."""


def check_event_time(event_time: str | None, allowed_lateness: float, late: str) -> list[str]:
    """What is wrong with a pipeline's (or harness's) event-time settings, as messages."""
    problems = []
    if event_time is not None and (not isinstance(event_time, str) or not event_time):
        problems.append(f"event_time must name a timestamp column, got {event_time!r}")
    if isinstance(allowed_lateness, bool) or not isinstance(allowed_lateness, (int, float)) \
            or not math.isfinite(allowed_lateness) or allowed_lateness < 0:
        problems.append(f"allowed_lateness must be a number of seconds >= 0, got {allowed_lateness!r}")
    if late not in LATE_MODES:
        problems.append(f"late must be one of {', '.join(LATE_MODES)}, got {late!r}")
    return problems


def check_max_future_event_time(value: float | None) -> list[str]:
    """What is wrong with a `max_future_event_time` setting (seconds, or None: no bound), as messages."""
    if value is None:
        return []
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        return [f"max_future_event_time must be a number of seconds >= 0 (or none: no bound), got {value!r}"]
    return []


def lateness_micros(allowed_lateness: float) -> int:
    return int(round(float(allowed_lateness) * 1_000_000))


def event_micros(batch: pd.DataFrame, column: str, where: str) -> np.ndarray:
    """The event times of `batch` as int64 microseconds since the epoch, UTC (naive values are
    taken as UTC); a missing column, a column that is not a timestamp, or a null is an error."""
    if column not in batch.columns:
        have = ", ".join(map(str, batch.columns))
        raise EventTimeError(f"{where} has no event-time column {column!r}; it has: {have}")
    values = batch[column]
    if not pd.api.types.is_datetime64_any_dtype(values.dtype):
        raise EventTimeError(f"{where}: event-time column {column!r} is {values.dtype}, not a timestamp")
    if values.isna().any():
        raise EventTimeError(f"{where}: event-time column {column!r} has {int(values.isna().sum())} null "
                             "value(s); every row needs an event time")
    if isinstance(values.dtype, pd.DatetimeTZDtype):
        values = values.dt.tz_convert("UTC").dt.tz_localize(None)
    return np.asarray(values.astype("datetime64[us]").astype("int64"))


def advance(watermark: int | None, max_event_us: int | None, lateness_us: int) -> int | None:
    """The watermark after a batch whose highest event time is `max_event_us` (None: no rows)."""
    if max_event_us is None:
        return watermark
    candidate = int(max_event_us) - int(lateness_us)
    return candidate if watermark is None else max(watermark, candidate)


@dataclass(frozen=True)
class LateSplit:
    kept: pd.DataFrame  # the rows the operators get
    late: int  # rows below the watermark the batch started with


def split_late(batch: pd.DataFrame, times_us: np.ndarray, watermark: int | None, late: str) -> LateSplit:
    """`batch` without its late rows (with them, for `late="process"`), and how many were late."""
    if watermark is None or not len(batch):
        return LateSplit(batch, 0)
    is_late = times_us < watermark
    count = int(is_late.sum())
    if not count or late == "process":
        return LateSplit(batch, count)
    return LateSplit(batch.loc[~is_late].reset_index(drop=True), count)


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
