"""Bad input files: the checks every batch file meets before any Spark work, and what happens to
a file that fails one (`on_bad_file`), Databricks' `badRecordsPath` for whole files.

The checks (`ParquetDirectorySource.check_files`, one read of each footer, shared with the
event-time watermark): a readable Parquet file, with every column an operator reads, each key
column of the operator's declared `key_type` and without nulls, and the event-time column a
timestamp without nulls.

- `on_bad_file="fail"` (the default): the batch stops before anything is triggered or uploaded,
  with a `BadInputFile` naming the file, the check and the ways on. No recovery is launched for it
  (the same input would fail the same way).
- `on_bad_file="skip"`: the batch goes on with its good files; the bad ones are consumed with it
  (the source offsets advance past them, so they are never offered again) and recorded in the
  checkpoint's `_metadata` as skipped, with the check and the reason. A batch of bad files only
  still commits a checkpoint, which processes no row.

`sparkpoint.pipeline.skipping.skip_file` is the explicit way out of "fail": one checkpoint,
through the same protocol, that consumes nothing but marks one unconsumed file skipped with the
user's reason.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable
from dataclasses import dataclass

from sparkpoint.checkpoint.metadata import CheckpointMetadata, SkippedFile
from sparkpoint.spark.source import BadInputFile, BatchSource, FileVerdict, InputNeeds
from sparkpoint.state.operators import KeyedOperator

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


class FileChecks:
    """The verdicts of one pipeline's input files, each file's footer read once per process: a
    batch file does not change once landed (the input is append-only), so the check made before
    Spark starts is the one the batch uses."""

    def __init__(self, needs: InputNeeds, on_bad_file: str):
        self.needs, self.on_bad_file = needs, on_bad_file
        self._seen: dict[str, FileVerdict] = {}

    def verdicts(self, source: BatchSource, files: list[str]) -> list[FileVerdict]:
        """The verdict of each of `files`, in order (a footer is read only the first time)."""
        new = [f for f in files if f not in self._seen]
        for verdict in source.check_files(new, self.needs) if new else []:
            self._seen[verdict.name] = verdict
        return [self._seen[f] for f in files]

    def forget(self, files: Iterable[str]) -> None:
        """Check `files` again next time: a file that failed while it may still have been landing
        (a half-copied Parquet file has no footer yet)."""
        for name in files:
            self._seen.pop(name, None)

    def batch(self, source: BatchSource, files: list[str]) -> BatchCheck:
        """The checks of `files` of `source`; under "fail" the first bad file raises `BadInputFile`."""
        verdicts = self.verdicts(source, files)
        bad = tuple(v for v in verdicts if not v.ok)
        if bad and self.on_bad_file == "fail":
            raise bad_file_error(bad[0])
        times = [v.max_event_time for v in verdicts if v.ok and v.max_event_time is not None]
        return BatchCheck(tuple(v.name for v in verdicts if v.ok), bad, max(times) if times else None)


def bad_file_error(verdict: FileVerdict) -> BadInputFile:
    """The "fail" policy's error: the file, the check, and the three ways on, in one line."""
    return bad_file_message(verdict.name, verdict.check or "", verdict.reason or "")


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
    return [SkippedFile(v.name, v.check or "", v.reason or "", checkpoint_id) for v in verdicts]


def carried_skips(meta: CheckpointMetadata | None) -> tuple[SkippedFile, ...]:
    """The skipped files a checkpoint that restores `meta` carries on."""
    return meta.skipped_files if meta is not None else ()
