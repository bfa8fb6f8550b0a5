"""The pending attempt's wire format: what the Spark half of a batch hands the completing half,
as versioned JSON (never pickle), and what a committed `_metadata` records of the attempt that
wrote it (its id, the watermark, how the batch was read).

`PendingAttempt.loads` checks every field it reads; a record it refuses raises `AttemptError`,
naming the record and the way on (the recover job sets it aside).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sparkpoint.checkpoint.errors import SparkpointError
from sparkpoint.checkpoint.ledger import RequestLedger
from sparkpoint.checkpoint.metadata import (
    READ_KEY,
    CheckpointMetadata,
    FileHandle,
    SkippedFile,
    SubtaskStateHandle,
    load_skipped_files,
    read_facts,
    state_facts,
)
from sparkpoint.checkpoint.paths import validate_name
from sparkpoint.checkpoint.phases import Phase, phases_from_json
from sparkpoint.pipeline.claims import PENDING_DIR
from sparkpoint.spark.offsets import SourceOffsets

ATTEMPT_FORMAT = "sparkpoint-pending-attempt"
ATTEMPT_VERSION = 1
ATTEMPT_KEY = "attempt"  # in a committed `_metadata`'s source offsets: the attempt that committed it
WATERMARK_KEY = "watermark"  # ... and the watermark after its batch (pipelines with an event time)


class AttemptError(SparkpointError):
    """A pending attempt cannot be read, found or completed as asked."""



@dataclass(frozen=True)
class SubtaskRun:
    """How one subtask ran in the Spark half."""

    operator: str  # its uid
    subtask: int
    restore: str  # working | local | primary | rescale | empty
    rows: int
    seconds: float
    phases: tuple[Phase, ...] = ()  # its timed phases (sparkpoint.checkpoint.phases); absent in older records
    # Its restore by phase (`sparkpoint.spark.tasks.restore_phases`). Absent in older records.
    restore_phases: dict[str, float] | None = None


RESTORE_PHASES = ("local_seconds", "download_seconds", "open_seconds", "local_bytes", "remote_bytes")


def restore_summary(subtasks: Iterable[SubtaskRun]) -> dict[str, float] | None:
    """A batch's restore by phase: the slowest subtask's seconds of each phase (they run side by
    side), the bytes of all (None: no subtask says)."""
    phases = [s.restore_phases for s in subtasks if s.restore_phases]
    if not phases:
        return None
    return {k: (max if k.endswith("_seconds") else sum)(float(p.get(k, 0)) for p in phases)
            for k in RESTORE_PHASES}


def _restore_phases(raw: Any) -> dict[str, float] | None:
    if raw is None:
        return None
    if not isinstance(raw, dict) or not all(isinstance(raw.get(k, 0), int | float) and raw.get(k, 0) >= 0
                                            for k in RESTORE_PHASES):
        raise ValueError(f"restore phases {str(raw)[:200]!r} are not seconds and bytes >= 0")
    return {k: float(raw.get(k, 0)) for k in RESTORE_PHASES}


@dataclass(frozen=True)
class PendingAttempt:
    """The Spark half's result: everything the completing half needs, as plain JSON."""

    job_id: str
    checkpoint_id: int
    attempt_id: str
    expected: dict[str, int]  # operator -> parallelism
    handles: tuple[str, ...]  # SubtaskStateHandle.dumps(), sorted by (operator, subtask)
    staged: tuple[str, ...]  # sink files staged for this checkpoint
    source_offsets: dict[str, Any]  # SourceOffsets.to_json() after this batch
    files: tuple[str, ...]  # the input files of the batch
    subtasks: tuple[SubtaskRun, ...]
    rows: int
    started_at: float  # POSIX seconds when the checkpoint was triggered
    format_version: int = ATTEMPT_VERSION
    watermark: int | None = None  # the watermark after this batch (µs since the epoch, UTC): event time only
    late_rows: int = 0  # rows of the batch below the watermark it started with
    # Every input file consumed unprocessed up to this checkpoint (`_metadata`'s `skipped_files`):
    # those of the checkpoint it started from, then the ones this batch skipped. Absent in older records.
    skipped_files: tuple[SkippedFile, ...] = ()
    # How the batch was read (`_metadata`'s `source_offsets.read`): its route ("read-all" or
    # "shuffle"), the bytes its tasks read and the batch's bytes on storage. Absent in older records.
    read: dict[str, Any] | None = None
    # The checkpoint of this job the batch's state was restored from (None: it started empty or from
    # another job's checkpoint): its commit stands only while that checkpoint was not retired (a
    # rollback or a fallback past it). Absent in older records.
    base: int | None = None
    # The storage requests of the Spark half: the driver's and every task's (`sparkpoint.checkpoint.ledger`).
    # Absent in older records.
    requests: RequestLedger | None = None

    @property
    def path(self) -> str:
        return attempt_path(self.checkpoint_id, self.attempt_id)

    def state_handles(self) -> list[SubtaskStateHandle]:
        return [SubtaskStateHandle.loads(h) for h in self.handles]

    def new_files(self) -> list[FileHandle]:
        """Files this attempt uploaded (what an abort deletes unless a checkpoint took them)."""
        return [f for h in self.state_handles() for f in h.new_files()]

    def operator_summary(self, operator: str) -> dict[str, Any]:
        """Per operator (by uid): subtasks, SST files new/reused, bytes uploaded, restore path per subtask."""
        handles = [h for h in self.state_handles() if h.operator == operator]
        return {
            **snapshot_summary(handles, self.checkpoint_id),
            "restore": {str(s.subtask): s.restore for s in self.subtasks if s.operator == operator},
            "rows": sum(s.rows for s in self.subtasks if s.operator == operator),
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "format": ATTEMPT_FORMAT, "version": self.format_version, "job_id": self.job_id,
            "checkpoint_id": self.checkpoint_id, "attempt_id": self.attempt_id, "expected": dict(self.expected),
            "handles": list(self.handles), "staged": list(self.staged), "source_offsets": self.source_offsets,
            "files": list(self.files),
            "subtasks": [
                {"operator": s.operator, "subtask": s.subtask, "restore": s.restore, "rows": s.rows,
                 "seconds": s.seconds, **({"phases": [list(p) for p in s.phases]} if s.phases else {}),
                 **({"restore_phases": s.restore_phases} if s.restore_phases is not None else {})}
                for s in self.subtasks
            ],
            "rows": self.rows, "started_at": self.started_at, "watermark": self.watermark,
            "late_rows": self.late_rows,
            **({"skipped_files": [f.to_json() for f in self.skipped_files]} if self.skipped_files else {}),
            **({"read": self.read} if self.read is not None else {}),
            **({"base": self.base} if self.base is not None else {}),
            **({"requests": self.requests.to_json()} if self.requests is not None else {}),
        }

    def dumps(self) -> bytes:
        return json.dumps(self.to_json(), indent=1, allow_nan=False).encode("utf-8")

    @classmethod
    def from_json(cls, raw: Any, *, where: str = "pending attempt") -> PendingAttempt:
        try:
            if not isinstance(raw, dict) or raw.get("format") != ATTEMPT_FORMAT:
                raise ValueError(f"not a {ATTEMPT_FORMAT} document")
            if raw.get("version") != ATTEMPT_VERSION:
                raise ValueError(f"version {raw.get('version')!r}, this sparkpoint reads version {ATTEMPT_VERSION}")
            attempt = cls(
                job_id=str(raw["job_id"]), checkpoint_id=_int(raw["checkpoint_id"]),
                attempt_id=validate_name(str(raw["attempt_id"]), "attempt id"),
                expected={str(k): _int(v) for k, v in dict(raw["expected"]).items()},
                handles=tuple(str(h) for h in raw["handles"]), staged=tuple(str(s) for s in raw["staged"]),
                source_offsets=dict(raw["source_offsets"]), files=tuple(str(f) for f in raw["files"]),
                subtasks=tuple(
                    SubtaskRun(str(s["operator"]), _int(s["subtask"]), str(s["restore"]), _int(s["rows"]),
                               float(s["seconds"]), phases_from_json(s.get("phases")),
                               _restore_phases(s.get("restore_phases")))
                    for s in raw["subtasks"]
                ),
                rows=_int(raw["rows"]), started_at=float(raw["started_at"]),
                watermark=None if raw.get("watermark") is None else _int(raw["watermark"]),
                late_rows=_int(raw.get("late_rows", 0)),
                skipped_files=load_skipped_files(raw.get("skipped_files", []), f"{where}: skipped_files"),
                read=read_facts(raw.get("read")),
                base=None if raw.get("base") is None else _int(raw["base"]),
                requests=RequestLedger.from_json(raw["requests"], f"{where}: requests") if "requests" in raw else None,
            )
            SourceOffsets.from_json(attempt.source_offsets)
            for h in attempt.state_handles():
                if h.checkpoint_id != attempt.checkpoint_id:
                    raise ValueError(f"a handle of checkpoint {h.checkpoint_id} in attempt {attempt.checkpoint_id}")
        except (KeyError, TypeError, ValueError, SparkpointError) as e:
            raise AttemptError(
                f"{where} cannot be read ({e}); abort it with the recover job (or `sparkpoint gc`)"
            ) from e
        return attempt

    @classmethod
    def loads(cls, data: bytes, *, where: str = "pending attempt") -> PendingAttempt:
        try:
            raw = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise AttemptError(f"{where} is not UTF-8 JSON ({e}); abort it with the recover job") from e
        return cls.from_json(raw, where=where)


def snapshot_summary(handles: Iterable[SubtaskStateHandle], checkpoint_id: int) -> dict[str, Any]:
    """One operator's snapshot in checkpoint N: subtasks, SST files new/reused, bytes uploaded."""
    handles = list(handles)
    new = [f for h in handles for f in h.shared + h.staged if f.created_by == checkpoint_id]
    reused = [f for h in handles for f in h.shared + h.staged if f.created_by != checkpoint_id]
    return {
        "checkpoint_id": checkpoint_id,
        "subtasks": len(handles),
        "sst_files_new": len(new),
        "sst_files_reused": len(reused),
        "bytes_uploaded": sum(f.size for h in handles for f in h.new_files()),
        **state_facts(handles),
    }


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{value!r} is not an integer")
    return value


def attempt_path(checkpoint_id: int, attempt_id: str) -> str:
    return f"{PENDING_DIR}/chk-{checkpoint_id}-{attempt_id}.json"


def committed_offsets(attempt: PendingAttempt) -> dict[str, Any]:
    """What `_metadata` records of the attempt that commits it: the source offsets after its
    batch, its staged sink files, and its id (under Dagster the id of the run whose SSTable step
    made it), so that a writer it overtook can say whose checkpoint took its place. `_metadata`
    written before the id was recorded has no `attempt`: readers take it as unknown."""
    offsets: dict[str, Any] = {"source": attempt.source_offsets, "sink": list(attempt.staged),
                               ATTEMPT_KEY: attempt.attempt_id}
    if attempt.watermark is not None:
        offsets[WATERMARK_KEY] = attempt.watermark
    if attempt.read is not None:
        offsets[READ_KEY] = attempt.read
    return offsets




def watermark_of(meta: CheckpointMetadata | None) -> int | None:
    """The watermark a checkpoint recorded (µs since the epoch, UTC; None before any event time)."""
    raw = meta.source_offsets if meta is not None else None
    found = raw.get(WATERMARK_KEY) if isinstance(raw, dict) else None
    return found if isinstance(found, int) and not isinstance(found, bool) else None


def written_by(meta: CheckpointMetadata) -> str | None:
    """The attempt id that committed `meta` (None when its `_metadata` does not record one)."""
    raw = meta.source_offsets
    found = raw.get(ATTEMPT_KEY) if isinstance(raw, dict) else None
    return found if isinstance(found, str) and found else None


def recorded_offsets(meta: CheckpointMetadata) -> SourceOffsets:
    """A checkpoint's source offsets (`includes(name)`: it consumed input file `name`); none
    where they cannot be read."""
    raw = meta.source_offsets
    try:
        return SourceOffsets.from_json(raw.get("source") if isinstance(raw, dict) else raw)
    except SparkpointError:
        return SourceOffsets(())

