"""Continuous mode: one Spark session for the loop's whole life, each landed batch checkpointed as
it arrives. What `sparkpoint run --follow` and the Dagster `<name>_follow` job both run.

The loop watches the input with `BatchSource.watch` (no full re-listing of a growing directory
per poll: see `sparkpoint.spark.source.DirectoryWatch`) and keeps in memory which names are
consumed, so a poll costs the same after a million files as after ten. Each batch goes through
`StatefulPipeline.checkpoints`, the loop `sparkpoint run` drives: the same two halves, the same
fallback and lost-race handling, the same exactly-once commit. Nothing the loop remembers is
needed to resume: a restart (after Ctrl-C, a kill -9, a failed Dagster run) starts from the
latest completed checkpoint's offsets, as `run` does.

When files land:

* `checkpoint_interval` 0 (the default): a checkpoint starts as soon as a file is pending and
  takes up to `files_per_checkpoint` pending files (1 by default: a checkpoint per file).
* `checkpoint_interval` S > 0: checkpoints start at most every S seconds; one takes every file
  pending when it starts, at most `files_per_checkpoint` of them when that is set above 1, else at
  most `MAX_FILES_PER_INTERVAL`. A file that lands while the previous checkpoint is more than S
  seconds old is taken at once, as without an interval.

A file that fails its checks is taken (to fail or be skipped, as `on_bad_file` says) only once it
has not changed for `settle_seconds` (the rule every batch applies, `sparkpoint.spark.settling`):
until then it may be a copy in progress, whose Parquet footer is not written yet, and a checkpoint
takes only the files before it. A writer that lands files whole (a rename, a hard link) is never
delayed by this.

The loop stops after `max_batches` checkpoints (the pipeline's setting), after `idle_seconds`
with no file pending, when `stop()` says so, or on an interrupt (Ctrl-C, SIGTERM), which
abandons the batch in flight as a crash would: a rerun resumes from the latest checkpoint.
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from sparkpoint.pipeline.driver import Committed, StatefulPipeline
from sparkpoint.pipeline.runtime import BatchStart, PipelineError, offsets_of
from sparkpoint.spark.offsets import SourceError, SourceOffsets
from sparkpoint.spark.source import FULL_LISTING_SECONDS, BatchWatch
from sparkpoint.tables.source import TableChangeRefused

log = logging.getLogger(__name__)

POLL_SECONDS = 0.2  # how often an idle loop looks for new files
MAX_FILES_PER_INTERVAL = 1000  # the cap of a checkpoint under an interval when files_per_checkpoint is 1
RETRY_SECONDS = 300.0  # how long polls that cannot read the input are retried before the loop fails


@dataclass(frozen=True)
class FollowOptions:
    """How the loop follows its input (see the module docstring). The stop after a number of
    checkpoints is the pipeline's `max_batches`."""

    checkpoint_interval: float = 0.0  # seconds between checkpoint starts at most; 0: one per landed batch
    poll_seconds: float = POLL_SECONDS
    idle_seconds: float | None = None  # stop after this long with no file pending; None: never
    settle_seconds: float | None = None  # None: the pipeline's `settle_seconds`
    full_listing_seconds: float = FULL_LISTING_SECONDS

    def cap(self, files_per_checkpoint: int) -> int:
        """The most files one checkpoint takes."""
        if self.checkpoint_interval > 0 and files_per_checkpoint == 1:
            return MAX_FILES_PER_INTERVAL
        return files_per_checkpoint


def check_follow_options(options: FollowOptions) -> list[str]:
    """What is wrong with `options`, as messages naming the setting (none: nothing)."""
    problems = []
    for name, value, least in (("checkpoint interval", options.checkpoint_interval, 0.0),
                               ("poll interval", options.poll_seconds, 0.01),
                               ("settle seconds", options.settle_seconds or 0.0, 0.0),
                               ("full listing seconds", options.full_listing_seconds, 0.0)):
        if not math.isfinite(value) or value < least:
            problems.append(f"{name} must be a number of seconds >= {least:g}, got {value}")
    if options.idle_seconds is not None and (not math.isfinite(options.idle_seconds) or options.idle_seconds < 0):
        problems.append(f"idle seconds must be a number of seconds >= 0, got {options.idle_seconds}")
    return problems


class Inbox:
    """The input files no checkpoint consumed, in the order they will be read (a directory's in
    name order, a table's in commit order): what the watch finds is added, what a committed
    checkpoint took is removed. Only a restart from another checkpoint (a fallback, a lost race)
    reads that checkpoint's whole offsets again."""

    def __init__(self, watch: BatchWatch):
        self.watch = watch
        self.pending: list[str] = []
        self._offsets = SourceOffsets(())  # the latest checkpoint's offsets (what it consumed) ...
        self._taken: set[str] = set()  # ... and the files the last commits took (a table's offsets name none)
        self._synced: int | None = -1  # the checkpoint id the consumed set is that of (-1: none yet)

    def sync(self, start: BatchStart) -> None:
        """Follow `start`: after our own last commit nothing to do; otherwise (the first batch,
        a fallback, a lost race) the consumed set is `start`'s offsets."""
        cid = start.metadata.checkpoint_id if start.metadata is not None else None
        if cid == self._synced:
            return
        self._offsets, self._taken = start.offsets, set()
        self.pending = self.watch.unconsumed(start.offsets)
        self._synced = cid

    def poll(self) -> None:
        try:
            new = self.watch.poll()
        except TableChangeRefused:
            if self.pending:  # the files before the refused commit are taken first
                return
            raise
        for name in new:
            if name in self._taken or self._offsets.includes(name):
                continue
            if self.watch.by_name:
                bisect.insort(self.pending, name)
            else:
                self.pending.append(name)

    def committed(self, done: Committed) -> None:
        taken = set(done.files)
        self._offsets = offsets_of(done.metadata)
        if self._offsets.table is None:  # a directory: its offsets say what was consumed; polls go on from its floor
            self._taken = taken
            self.watch.unconsumed(self._offsets)
        else:  # a table's offsets name no file
            self._taken |= taken
        self.pending = [n for n in self.pending if n not in taken]
        self._synced = done.metadata.checkpoint_id


def follow(pipeline: StatefulPipeline, options: FollowOptions = FollowOptions(), *,
           stop: Callable[[], bool] | None = None, attempt_id: str | None = None,
           sleep: Callable[[float], None] = time.sleep) -> Iterator[Committed]:
    """Checkpoint the pipeline's input as it lands, one `Committed` per checkpoint, until a stop
    condition (see the module docstring). `attempt_id`: persist each batch's attempt under it
    (an orchestrator's run id), so that its recovery can fence this loop."""
    problems = check_follow_options(options)
    if problems:
        raise PipelineError("; ".join(problems))
    inbox = Inbox(pipeline.source.watch(options.full_listing_seconds))
    cap = options.cap(pipeline.config.files_per_checkpoint)
    last_start: float | None = None
    quiet_since = time.monotonic()
    failing_since: float | None = None

    def ready() -> list[str]:
        """Up to `cap` pending files to take now, in order, ending before one that fails its
        checks while it may still be being written (`StatefulPipeline.ready_files`)."""
        return pipeline.ready_files(inbox.pending[:cap], options.settle_seconds)

    def next_files(start: BatchStart, done: int) -> list[str] | None:
        nonlocal last_start, quiet_since, failing_since
        inbox.sync(start)
        while True:
            if stop is not None and stop():
                return None
            now = time.monotonic()
            try:
                inbox.poll()
                files = ready() if inbox.pending and _due(now) else []
                failing_since = None
            except SourceError as e:  # the input cannot be read right now (a 503, a timeout)
                failing_since = failing_since if failing_since is not None else now
                if now - failing_since > RETRY_SECONDS:
                    raise
                log.warning("%s; trying again", e)
                files = []
            if files:
                last_start = now
                return files
            if inbox.pending:
                quiet_since = now
            elif options.idle_seconds is not None and now - quiet_since >= options.idle_seconds:
                log.info("no input file pending for %g s: the loop stops", options.idle_seconds)
                return None
            sleep(_pause(now))

    def _due(now: float) -> bool:
        return last_start is None or now - last_start >= options.checkpoint_interval

    def _pause(now: float) -> float:
        if inbox.pending and not _due(now) and last_start is not None:
            return max(0.0, min(options.poll_seconds, last_start + options.checkpoint_interval - now))
        return options.poll_seconds

    for committed in pipeline.checkpoints(next_files, attempt_id=attempt_id):
        inbox.committed(committed)
        quiet_since = time.monotonic()
        yield committed
