"""Exceptions of the sparkpoint core.

Every message says what went wrong *and* what the user can do next.
"""

from __future__ import annotations


class SparkpointError(Exception):
    """Base class of every error sparkpoint raises on purpose."""


class StorageError(SparkpointError):
    """The checkpoint storage cannot be reached or used as asked."""


class PathEscapesJobDirectory(StorageError):
    """A path would read, write or delete outside the job's own directory."""


class MetadataError(SparkpointError):
    """A `_metadata` file cannot be read or fails validation."""


class CheckpointAlreadyExists(SparkpointError, FileExistsError):
    """Another writer committed the same checkpoint id first."""


class CheckpointSuperseded(CheckpointAlreadyExists):
    """A newer checkpoint completed while this one committed (another writer): it was withdrawn."""


class SavepointOvertaken(SparkpointError):
    """A savepoint into the job directory could not be committed: the job committed its id while it
    copied, or the checkpoint to copy is still being completed. Nothing of the savepoint is left."""


class UnknownSharedState(SparkpointError):
    """A checkpoint references a shared file the registry does not know."""


class DeletionBlocked(SparkpointError):
    """Deletion is stopped because some retained `_metadata` cannot be read."""


class CheckpointNotFound(SparkpointError):
    """The requested checkpoint does not exist in the store."""


class CheckpointCorrupted(SparkpointError):
    """A checkpoint's file is missing or differs from what `_metadata` records."""

    def __init__(self, message: str, *, checkpoint_id: int | None = None, path: str | None = None):
        super().__init__(message)
        self.checkpoint_id = checkpoint_id
        self.path = path


class CheckpointDeclined(SparkpointError):
    """A checkpoint cannot complete (missing acknowledgements, wrong state)."""


class StateBackendError(SparkpointError):
    """The local RocksDB state cannot be opened or used as asked."""


class LocalStateError(StateBackendError):
    """The local RocksDB state cannot be used for a reason of this machine's (a lock, the open-file
    limit, a disk error), not of the checkpoint's: never a reason to fall back."""


class OperatorStateMismatch(StateBackendError):
    """A checkpoint's operators do not fit the job's (an operator missing on either side, another
    max parallelism). Never a reason to fall back: an older checkpoint has the same shape."""
