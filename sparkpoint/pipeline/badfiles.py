"""Bad input files: the checks every batch file meets before any Spark work, and what happens to
a file that fails one (`on_bad_file`), Databricks' `badRecordsPath` for whole files.

The checks (`ParquetDirectorySource.check_files`, one read of each footer, shared with the
event-time watermark): a readable Parquet file, with every column an operator reads, each key
column of the operator's declared `key_type` and without nulls, and the event-time column a
timestamp without nulls, whose highest value is at most `max_future_event_time` beyond the
batch's processing time (`future_event_times`).

- `on_bad_file="fail"` (the default): the batch stops before anything is triggered or uploaded,
  with a `BadInputFile` naming the file, the check and the ways on. No recovery is launched for it
  (the same input would fail the same way).
- `on_bad_file="skip"`: the batch goes on with its good files; the bad ones are consumed with it
  (the source offsets advance past them, so they are never offered again) and recorded in the
  checkpoint's `_metadata` as skipped, with the check, the reason, and the file's size and
  modification time. A batch of bad files only still commits a checkpoint, which processes no row.

Either verdict needs settled content (DESIGN rule 18): a file still being copied fails every
check. So a file that fails is skipped or refused only once its size and modification time have
stopped changing (`sparkpoint.spark.settling`, the rule the input sensor and `--follow` use), and
after its checks were read again from that settled content. Until then a batch ends before it:
the files before it are taken, it stays unconsumed and is offered again by the next run
(`FileChecks.take`). A skipped file found later with another size or modification time was still
being written when it was skipped: every start says so (`changed_skips`), naming the file. A
table's data files are committed once written (`BatchSource.whole`): a verdict on one is final.

`sparkpoint.pipeline.skipping.skip_file` is the explicit way out of "fail": one checkpoint,
through the same protocol, that consumes nothing but marks one unconsumed file skipped with the
user's reason.
"""

from __future__ import annotations

import logging
import shlex
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from sparkpoint.checkpoint.metadata import CheckpointMetadata, SkippedFile
from sparkpoint.spark.offsets import SourceError
from sparkpoint.spark.settling import SETTLE_SECONDS, FileSeen, settle
from sparkpoint.spark.source import BadInputFile, BatchSource, FileVerdict, InputNeeds
from sparkpoint.state.eventtime import MAX_FUTURE_EVENT_TIME, iso_micros, lateness_micros
from sparkpoint.state.operators import KeyedOperator

log = logging.getLogger(__name__)

ON_BAD_FILE = ("fail", "skip")
MANUAL = "manual"  # the check of a file skipped by `sparkpoint skip`


def check_on_bad_file(value: object) -> list[str]:
    """What is wrong with an `on_bad_file` setting, as messages (none: nothing)."""
    if value not in ON_BAD_FILE:
        return [f"on_bad_file must be one of {', '.join(ON_BAD_FILE)}, got {value!r}"]
    return []


def input_needs(operators: Iterable[KeyedOperator], event_time: str | None) -> InputNeeds:
    """What every input file must give `operators` (and the event-time column)."""
    ops = list(operators)
    return InputNeeds(columns={op.name: tuple(op.input_columns()) for op in ops},
                      keys={op.name: (op.key, op.key_type) for op in ops}, event_time=event_time)


@dataclass(frozen=True)
class BatchCheck:
    """A batch's files after their checks: the good ones to process, the bad ones to skip."""

    good: tuple[str, ...]
    bad: tuple[FileVerdict, ...]
    max_event_time: int | None  # over the good files (µs; None: no event time, or no rows)


class InputFileNotSettled(SourceError):
    """A batch was asked to skip or refuse a file that fails its checks while it may still be
    being written (DESIGN rule 18); nothing was triggered or consumed."""


class FileChecks:
    """The verdicts of one pipeline's input files, each file's footer read once per process: a
    batch file does not change once landed (the input is append-only), so the check made before
    Spark starts is the one the batch uses. A file that fails is the exception: it may still be
    landing, so its verdict counts only once it has settled (`take`)."""

    def __init__(self, needs: InputNeeds, on_bad_file: str, *, settle_seconds: float = SETTLE_SECONDS,
                 max_future_event_time: float | None = MAX_FUTURE_EVENT_TIME,
                 clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep):
        self.needs, self.on_bad_file = needs, on_bad_file
        self.max_future_event_time = max_future_event_time
        self.settle_seconds = settle_seconds
        self._clock, self._sleep = clock, sleep
        self._seen: dict[str, FileVerdict] = {}
        self._looks: dict[str, FileSeen] = {}  # failing files not settled yet: the last look at each
        self._settled: set[str] = set()  # failing files whose verdict was read from settled content
        self._said: set[tuple[str, int]] = set()  # (file, size) a wait was logged for
        self.waiting: str | None = None  # why the last `take` ended before a file (None: it did not)

    def verdicts(self, source: BatchSource, files: list[str]) -> list[FileVerdict]:
        """The verdict of each of `files`, in order (a footer is read only the first time)."""
        new = [f for f in files if f not in self._seen]
        for verdict in source.check_files(new, self.needs) if new else []:
            self._seen[verdict.name] = self._not_in_the_future(source, verdict)
        return [self._seen[f] for f in files]

    def _not_in_the_future(self, source: BatchSource, verdict: FileVerdict) -> FileVerdict:
        """`verdict`, or the `future_event_times` check's when the file's highest event time lies
        more than `max_future_event_time` beyond now (the batch's processing time, within the
        seconds before its Spark job starts): one such row would move the watermark for good, and
        every later row would be late."""
        if not verdict.ok or verdict.max_event_time is None or self.max_future_event_time is None:
            return verdict
        now = int(self._clock() * 1_000_000)
        if verdict.max_event_time <= now + lateness_micros(self.max_future_event_time):
            return verdict
        ahead = (verdict.max_event_time - now) / 86_400_000_000
        return replace(verdict, check="future_event_times", reason=(
            f"input file {source.url_of(verdict.name)}: event-time column {self.needs.event_time!r} reaches "
            f"{_iso(verdict.max_event_time)}, {ahead:,.1f} days beyond the batch's processing time "
            f"{iso_micros(now)} (max_future_event_time {self.max_future_event_time:g} s): a unit mix-up in the "
            "producer (milliseconds for microseconds)? It would move the watermark past every later row"))

    def forget(self, files: Iterable[str]) -> None:
        """Check `files` again next time: a file that failed while it may still have been landing
        (a half-copied Parquet file has no footer yet)."""
        for name in files:
            self._seen.pop(name, None)
            self._settled.discard(name)

    def take(self, source: BatchSource, files: list[str], settle_seconds: float | None = None) -> list[str]:
        """`files`, in order, up to the first that fails its checks and has not settled
        (`settle_seconds`, default the instance's): a batch may take those. A failing file that
        has settled is checked once more, so its verdict is of its settled content (it may pass
        now). `waiting` says why the list ends early."""
        self.waiting = None
        for i, verdict in enumerate(self.verdicts(source, files)):
            if verdict.ok or verdict.name in self._settled:
                continue
            if source.whole:  # committed whole (a table's data file): its verdict is final
                whole = source.stat(verdict.name)
                self._seen[verdict.name] = replace(verdict, size=whole.size, modified=whole.modified)
                self._settled.add(verdict.name)
                continue
            why = self._settle(source, verdict.name, self.settle_seconds if settle_seconds is None else settle_seconds)
            if why is None:
                continue
            self.waiting = (f"input file {source.url_of(verdict.name)} fails its checks ({verdict.check}) and may "
                            f"still be being written ({why}); it is not consumed, and is taken (or refused) once it "
                            "has settled: run again then")
            stat = self._looks[verdict.name]
            if (verdict.name, stat.size) not in self._said:  # once per size: a follow loop polls often
                self._said.add((verdict.name, stat.size))
                log.warning("%s", self.waiting)
            return files[:i]
        return files

    def _settle(self, source: BatchSource, name: str, settle_seconds: float) -> str | None:
        """None once failing file `name` has settled and its verdict was read from that content
        (kept in `_seen` with its size and modification time); otherwise what it waits for."""
        before = self._looks.get(name)
        stat = source.stat(name)
        seen, why = settle(before, name, stat, self._clock(), settle_seconds)
        if before is None and (why is None or stat.modified is None):
            # One look proves nothing: a file server whose clock lags ours dates a file being
            # written in the past, and some give no time at all. A second look, `settle_seconds`
            # later, must find it unchanged (a failing file only: a good one is never waited for).
            self._sleep(max(0.0, seen.since + settle_seconds - self._clock()))
            again = source.stat(name)
            if (again.size, again.modified) != (stat.size, stat.modified):
                self._looks[name] = FileSeen(name, again.size, again.modified, self._clock())
                self.forget([name])
                return f"it changed between two looks {settle_seconds:g} s apart, {stat.size} -> {again.size} bytes"
            seen, why = settle(seen, name, again, self._clock(), settle_seconds)
        self._looks[name] = seen
        self.forget([name])
        if why is not None:
            return why
        verdict = self.verdicts(source, [name])[0]  # read from the settled content
        after = source.stat(name)
        if (after.size, after.modified) != (stat.size, stat.modified):
            self.forget([name])
            self._looks[name] = FileSeen(name, after.size, after.modified, self._clock())
            return f"it changed while it was checked, {stat.size} -> {after.size} bytes"
        del self._looks[name]
        if not verdict.ok:
            self._seen[name] = replace(verdict, size=stat.size, modified=stat.modified)
            self._settled.add(name)
        return None

    def batch(self, source: BatchSource, files: list[str]) -> BatchCheck:
        """The checks of `files` of `source`; under "fail" the first bad file raises `BadInputFile`.
        A failing file that has not settled raises `InputFileNotSettled` (callers pick files with
        `take`, which ends a batch before such a file)."""
        if len(self.take(source, files)) < len(files):
            raise InputFileNotSettled(f"{self.waiting}; nothing was consumed")
        verdicts = self.verdicts(source, files)
        bad = tuple(v for v in verdicts if not v.ok)
        if bad and self.on_bad_file == "fail":
            raise bad_file_error(bad[0])
        times = [v.max_event_time for v in verdicts if v.ok and v.max_event_time is not None]
        return BatchCheck(tuple(v.name for v in verdicts if v.ok), bad, max(times) if times else None)


def bad_file_error(verdict: FileVerdict) -> BadInputFile:
    """The "fail" policy's error: the file, the check, and the three ways on, in one line."""
    return bad_file_message(verdict.name, verdict.check or "", verdict.reason or "")


def skip_command(file: str, flags: Iterable[tuple[str, str]]) -> str:
    """`sparkpoint skip` of `file`, quoted for a shell, with `flags`: the pipeline reference and
    the locations and settings the run that met the file was given, so that the command looks
    for it where that run read it."""
    words = ["sparkpoint", "skip", *(word for pair in flags for word in pair), file, "--reason", "TEXT"]
    return f"`{shlex.join(words)}`"


def bad_file_message(file: str, check: str, reason: str, skip_how: str | None = None) -> BadInputFile:
    """`BadInputFile` for `file`, saying how to skip it (`skip_how`; default: the command, and
    the Dagster job by its pattern)."""
    skip_how = skip_how or (f"`sparkpoint skip --pipeline MODULE:ATTR {shlex.quote(file)} --reason TEXT` (in "
                            "Dagster, the pipeline's <name>_skip_file job)")
    return BadInputFile(
        f"{reason} (check {check!r}; on_bad_file=\"fail\": nothing was uploaded). Land a fixed copy under a new "
        f"name, or skip this file: {skip_how}, or set on_bad_file=\"skip\" to record bad files as skipped and go on",
        file=file, check=check, reason=reason,
    )


def skipped_entries(verdicts: Iterable[FileVerdict], checkpoint_id: int) -> list[SkippedFile]:
    """The `_metadata` entries of the bad files a checkpoint skips, each with the size and
    modification time its verdict was read at."""
    return [SkippedFile(v.name, v.check or "", v.reason or "", checkpoint_id, v.size, v.modified) for v in verdicts]


def carried_skips(meta: CheckpointMetadata | None) -> tuple[SkippedFile, ...]:
    """The skipped files a checkpoint that restores `meta` carries on."""
    return meta.skipped_files if meta is not None else ()


RECHECK_SKIPPED = 32  # a start looks again at this many of the most recently skipped files


def changed_skips(source: BatchSource, meta: CheckpointMetadata | None) -> list[str]:
    """A warning per file a check skipped (among the `RECHECK_SKIPPED` most recent) whose size
    or modification time is no longer what they were when it was skipped: it was still being
    written, and its complete content was never processed. A file that is gone says nothing (it
    was moved to be processed under a new name, or out of the input)."""
    lines = []
    for skipped in [s for s in carried_skips(meta) if s.size is not None][-RECHECK_SKIPPED:]:
        try:
            stat = source.stat(skipped.file)
        except SourceError:  # gone, or not readable right now: the next start looks again
            continue
        if (stat.size, stat.modified) == (skipped.size, skipped.modified):
            continue
        lines.append(
            f"input file {source.url_of(skipped.file)} was skipped by chk-{skipped.checkpoint_id} ({skipped.check}) "
            f"at {skipped.size} bytes, modified {_when(skipped.modified)}; it is now {stat.size} bytes, modified "
            f"{_when(stat.modified)}: it was still being written, and its complete content was never processed. "
            f"To process it, move it to a new name in the input (the next run reads it as a new batch); to leave "
            f"it skipped, move it out of the input. Every start says this until then"
        )
    return lines


def _iso(micros: int) -> str:
    """µs since the epoch as ISO 8601 UTC, or as a number beyond year 9999."""
    try:
        return iso_micros(micros)
    except OverflowError:
        return f"{micros} µs since the epoch"


def _when(modified: float | None) -> str:
    if modified is None:
        return "at an unknown time"
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(modified))
