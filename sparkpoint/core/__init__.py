"""The checkpoint core: storage, `_metadata`, registry, store, coordinator, state backend.

Knows nothing of Spark or Dagster; a plain Python program can checkpoint and restore with it.
"""

from sparkpoint.core.coordinator import CheckpointCoordinator, CompletedCheckpoint, PendingCheckpoint
from sparkpoint.core.errors import (
    CheckpointAlreadyExists,
    CheckpointCorrupted,
    CheckpointDeclined,
    CheckpointNotFound,
    DeletionBlocked,
    MetadataError,
    OperatorStateMismatch,
    PathEscapesJobDirectory,
    SparkpointError,
    StorageError,
    UnknownSharedState,
)
from sparkpoint.core.metadata import (
    CheckpointMetadata,
    CheckpointStats,
    FileHandle,
    KeyGroupRange,
    OperatorState,
    RestoreLineage,
    SubtaskStateHandle,
)
from sparkpoint.core.registry import RegistryEntry, SharedStateRegistry
from sparkpoint.core.retention import ClaimMode, ExternalizedRetention, JobStatus
from sparkpoint.core.storage import CheckpointStorage
from sparkpoint.core.store import CompletedCheckpointStore
from sparkpoint.core.sweep import SweepReport, sweep_orphans

__all__ = [
    "CheckpointAlreadyExists",
    "CheckpointCoordinator",
    "CheckpointCorrupted",
    "CheckpointDeclined",
    "CheckpointMetadata",
    "CheckpointNotFound",
    "CheckpointStats",
    "CheckpointStorage",
    "ClaimMode",
    "CompletedCheckpoint",
    "CompletedCheckpointStore",
    "DeletionBlocked",
    "ExternalizedRetention",
    "FileHandle",
    "JobStatus",
    "KeyGroupRange",
    "MetadataError",
    "OperatorState",
    "OperatorStateMismatch",
    "PathEscapesJobDirectory",
    "PendingCheckpoint",
    "RegistryEntry",
    "RestoreLineage",
    "SharedStateRegistry",
    "SparkpointError",
    "StorageError",
    "SubtaskStateHandle",
    "SweepReport",
    "UnknownSharedState",
    "sweep_orphans",
]
