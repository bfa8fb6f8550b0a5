"""The checkpoint protocol: storage over fsspec, `_metadata`, the shared-state registry, the
completed-checkpoint store, the coordinator, retention, the orphan sweep, savepoints.

Knows nothing of RocksDB, Spark or Dagster (DESIGN.md, "Layers"): a plain Python program can
checkpoint files with it; `sparkpoint.state` puts a RocksDB keyed-state backend over it.
"""

from sparkpoint.checkpoint.coordinator import CheckpointCoordinator, CompletedCheckpoint, PendingCheckpoint
from sparkpoint.checkpoint.errors import (
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
from sparkpoint.checkpoint.metadata import (
    CheckpointMetadata,
    CheckpointStats,
    FileHandle,
    KeyGroupRange,
    OperatorState,
    RestoreLineage,
    SubtaskStateHandle,
)
from sparkpoint.checkpoint.registry import RegistryEntry, SharedStateRegistry
from sparkpoint.checkpoint.retention import ClaimMode, ExternalizedRetention, JobStatus
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.checkpoint.sweep import SweepReport, sweep_orphans

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
