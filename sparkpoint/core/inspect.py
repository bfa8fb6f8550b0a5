"""Looking inside checkpoints: verify every file, open an operator's state read-only."""

from __future__ import annotations

import shutil
import tempfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sparkpoint.core.backend import RocksDBStateBackend
from sparkpoint.core.changelog import ChangelogFormatError, decode, raw_limit
from sparkpoint.core.errors import OperatorStateMismatch, PathEscapesJobDirectory
from sparkpoint.core.metadata import CheckpointMetadata, FileHandle, OperatorState
from sparkpoint.core.paths import is_changelog_name
from sparkpoint.core.progress import ProgressCounter, ProgressFn, reporting
from sparkpoint.core.restore import FileProblem, mismatch
from sparkpoint.core.storage import CheckpointStorage

_CHUNK = 4 * 1024 * 1024


def verify_checkpoint(storage: CheckpointStorage, meta: CheckpointMetadata, *, deep: bool = True) -> list[FileProblem]:
    """Every file `_metadata` lists: present, of the recorded size and (with `deep`) CRC32."""
    files = {f.path: f for f in meta.files()}
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
    crc = 0
    with storage.fs.open(storage.abspath(rel), "rb") as stream:
        while chunk := stream.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc & 0xFFFFFFFF


def newest_verifying(storage: CheckpointStorage, below: int) -> int | None:
    """The newest retained checkpoint older than `below` whose every file verifies (None: none)."""
    from sparkpoint.core.store import CompletedCheckpointStore

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


def operator_state_of(meta: CheckpointMetadata, operator: str) -> OperatorState:
    """The state of `operator` in `meta`; an operator it does not hold is named with those it does."""
    if operator not in meta.operators:
        known = ", ".join(sorted(meta.operators)) or "none"
        raise OperatorStateMismatch(f"checkpoint {meta.checkpoint_id} has no operator {operator!r}; it has: {known}")
    return meta.operators[operator]


@contextmanager
def operator_states(
    storage: CheckpointStorage, meta: CheckpointMetadata, operator: str, work_dir: str | None = None,
    progress: ProgressFn | None = None,
) -> Iterator[list[RocksDBStateBackend]]:
    """Every subtask of `operator` at checkpoint `meta`, restored (verified) into a scratch dir;
    `progress` hears of the bytes downloaded."""
    op = operator_state_of(meta, operator)
    source = reporting(storage, ProgressCounter(sum(f.size for h in op.subtasks for f in h.files()), progress))
    scratch = Path(tempfile.mkdtemp(prefix="sparkpoint-export-", dir=work_dir))
    backends = []
    try:
        for handle in op.subtasks:
            b = RocksDBStateBackend(
                source, operator, handle.subtask, parallelism=op.parallelism, max_parallelism=op.max_parallelism,
                local_dir=scratch, local_recovery=False,
            )
            b.restore(meta)
            backends.append(b)
        yield backends
    finally:
        for b in backends:
            b.close()
        shutil.rmtree(scratch, ignore_errors=True)
