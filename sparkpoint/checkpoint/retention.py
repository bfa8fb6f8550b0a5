"""Retention policies: pure functions of plain data, no I/O (tested as tables of cases)."""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum


class JobStatus(StrEnum):
    FINISHED = "FINISHED"
    CANCELED = "CANCELED"
    FAILED = "FAILED"
    SUSPENDED = "SUSPENDED"


class ExternalizedRetention(StrEnum):
    """Flink's `execution.checkpointing.externalized-checkpoint-retention`."""

    RETAIN_ON_CANCELLATION = "RETAIN_ON_CANCELLATION"
    DELETE_ON_CANCELLATION = "DELETE_ON_CANCELLATION"
    NO_EXTERNALIZED_CHECKPOINTS = "NO_EXTERNALIZED_CHECKPOINTS"


class ClaimMode(StrEnum):
    CLAIM = "CLAIM"
    NO_CLAIM = "NO_CLAIM"


# Flink's CheckpointProperties: which terminal job status discards the retained checkpoints.
_DISCARD_ON: dict[ExternalizedRetention, frozenset[JobStatus]] = {
    ExternalizedRetention.NO_EXTERNALIZED_CHECKPOINTS: frozenset(JobStatus),
    ExternalizedRetention.DELETE_ON_CANCELLATION: frozenset({JobStatus.FINISHED, JobStatus.CANCELED}),
    ExternalizedRetention.RETAIN_ON_CANCELLATION: frozenset(),
}


def discard_on_shutdown(retention: ExternalizedRetention | str, status: JobStatus | str) -> bool:
    """Whether shutting down with `status` deletes the retained checkpoints (never savepoints)."""
    return JobStatus(status) in _DISCARD_ON[ExternalizedRetention(retention)]


def checkpoints_to_subsume(retained: Sequence[tuple[int, str]], num_retained: int) -> list[int]:
    """Ids of checkpoints to drop so that `num_retained` checkpoints remain.

    `retained` holds (checkpoint id, kind). Savepoints count toward nothing and are never
    returned; the latest checkpoint is never returned, whatever `num_retained` says.
    """
    keep = max(1, num_retained)
    checkpoints = sorted(cid for cid, kind in retained if kind == "checkpoint")
    return checkpoints[: max(0, len(checkpoints) - keep)]


def parse_bool(value: str | bool) -> bool:
    if isinstance(value, bool):
        return value
    lowered = value.strip().lower()
    if lowered in ("true", "1", "yes", "on"):
        return True
    if lowered in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {value!r}")
