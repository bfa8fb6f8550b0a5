"""Verifying a checkpoint on stable storage: every file present, of its recorded size and CRC32,
every changelog decoding within the bound its state allows; which retained checkpoint verifies."""


from __future__ import annotations

import zlib

from sparkpoint.checkpoint.errors import PathEscapesJobDirectory
from sparkpoint.checkpoint.files import FileProblem, mismatch
from sparkpoint.checkpoint.metadata import CheckpointMetadata, FileHandle
from sparkpoint.checkpoint.paths import is_changelog_name
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.state.engine.changelog import ChangelogFormatError, decode, raw_limit

_CHUNK = 4 * 1024 * 1024


def verify_checkpoint(storage: CheckpointStorage, meta: CheckpointMetadata, *, deep: bool = True) -> list[FileProblem]:
    """Every file a restore of the checkpoint reads: present, of the recorded size and (with
    `deep`) CRC32. Not the staged slices it lists: no restore reads them, and a checkpoint that
    does not verify is fallen back from (its output retracted) or stops a recovery."""
    files = {f.path: f for f in meta.restored_files()}
    limit = raw_limit(meta.stats.state_size)
    problems = storage.parallel(lambda f: _check(storage, f, deep, limit),
                                sorted(files.values(), key=lambda f: f.path))
    return [p for p in problems if p is not None]


def _check(storage: CheckpointStorage, f: FileHandle, deep: bool, limit: int | None = None) -> FileProblem | None:
    try:
        size: int | None = storage.info(f.path).size
    except FileNotFoundError:
        size = None
    except PathEscapesJobDirectory as e:  # a link: reported, never read through
        return FileProblem(f.path, f.local_name, str(e))
    problem = mismatch(f, size, (lambda: _stored_crc32(storage, f.path)) if deep else None)
    if deep and problem is None and is_changelog_name(f.local_name):
        problem = _changelog_problem(storage, f, raw_limit(f.size) if limit is None else limit)
    return FileProblem(f.path, f.local_name, problem) if problem else None


check_stored_file = _check  # one file, for the repair of a subtask's files


def _changelog_problem(storage: CheckpointStorage, f: FileHandle, limit: int) -> str | None:
    """A changelog whose CRC32 matches may still not decode (written wrong): restoring would fail."""
    try:
        decode(storage.read_bytes(f.path), f.local_name, max_raw=limit)
    except ChangelogFormatError as e:
        return f"does not decode: {e}"
    return None


def _stored_crc32(storage: CheckpointStorage, rel: str) -> int:
    crc, size = 0, 0
    with storage.fs.open(storage.abspath(rel), "rb") as stream:
        while chunk := stream.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    storage.count_request("GET", down=size)
    return crc & 0xFFFFFFFF


def newest_verifying(storage: CheckpointStorage, below: int) -> int | None:
    """The newest retained checkpoint older than `below` whose every file verifies (None: none)."""
    from sparkpoint.checkpoint.store import CompletedCheckpointStore

    for meta in CompletedCheckpointStore(storage).load_all().checkpoints:
        if meta.checkpoint_id < below and not verify_checkpoint(storage, meta):
            return meta.checkpoint_id
    return None


def restore_hint(storage: CheckpointStorage, failed: int) -> str:
    """What to do when checkpoint `failed` cannot be restored, naming only one that verifies."""
    good = newest_verifying(storage, failed)
    if good is None:
        return f"no retained checkpoint older than {failed} verifies"
    return f"checkpoint {good} verifies: restore it with --checkpoint {good}"
