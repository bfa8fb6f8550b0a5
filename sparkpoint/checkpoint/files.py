"""A checkpoint's files against what `_metadata` records (rule 7): the problems a file can have,
presence and size from one listing per directory, and the verified download of a subtask's files
to local disk, each checked for size and CRC32 before anything reads it.

RocksDB opens a directory with a flipped data block and then iterates zero rows without a word
(unless the iterator's status is asked), so every file from stable storage is checked against
the size and CRC32 that `_metadata` recorded.
"""


from __future__ import annotations

import posixpath
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sparkpoint.checkpoint.errors import CheckpointCorrupted, PathEscapesJobDirectory
from sparkpoint.checkpoint.interleave import storage_step
from sparkpoint.checkpoint.metadata import FileHandle, SubtaskStateHandle
from sparkpoint.checkpoint.storage import CheckpointStorage, StoredFile, crc32, crc32_of_file

_CHUNK = 4 * 1024 * 1024


@dataclass(frozen=True)
class FileProblem:
    """One file that is not what `_metadata` says it is."""

    path: str
    local_name: str
    problem: str

    def __str__(self) -> str:
        return f"{self.path} ({self.local_name}): {self.problem}"


def mismatch(f: FileHandle, size: int | None, crc_of: Callable[[], int] | None) -> str | None:
    """What differs from `_metadata` (None: nothing). `size` None means missing; the CRC32 is
    computed (by `crc_of`) only when the size matches; `crc_of` None skips it."""
    if size is None:
        return "missing"
    if size != f.size:
        return f"size {size} bytes, _metadata records {f.size}"
    crc = crc_of() if crc_of is not None else f.crc32
    if crc != f.crc32:
        return f"CRC32 {crc:08x}, _metadata records {f.crc32:08x}"
    return None


def stored_size_problems(storage: CheckpointStorage, files: list[FileHandle]) -> list[FileProblem]:
    """Presence and size of `files` on storage, from one listing per directory they sit in (a
    subtask's files share one: on an object store a request or two, not one per file).

    Storage that cannot be reached raises (StorageError): a file is "missing" only when storage
    said so. Taken for missing, an endpoint down for a moment would have the driver's check after
    a commit fall back from a checkpoint that verifies (rule 10)."""
    listed: dict[str, StoredFile | None] = {}

    def listing(directory: str) -> list[tuple[str, StoredFile | None]]:
        try:
            return [(s.path, s) for s in storage.walk(directory)]
        except (ValueError, PathEscapesJobDirectory):  # the job directory itself, or no safe path: file by file
            return [(f.path, _stored_or_none(storage, f.path)) for f in files if _listed_in(f.path) == directory]

    for found in storage.parallel(listing, sorted({_listed_in(f.path) for f in files})):
        listed.update(found)
    problems = []
    for f in sorted(files, key=lambda f: f.path):
        stored = listed.get(f.path)
        problem = "is a symbolic link" if stored is not None and stored.symlink else mismatch(
            f, stored.size if stored is not None else None, None)
        if problem:
            problems.append(FileProblem(f.path, f.local_name, problem))
    return problems


def stored_content_problems(storage: CheckpointStorage, files: list[FileHandle]) -> list[FileProblem]:
    """Size and CRC32 of `files` as stored, each one read whole (rule 15: a file reused by newer
    checkpoints is only as good as its bytes). Storage that cannot be reached raises."""
    def check(f: FileHandle) -> FileProblem | None:
        size, crc = 0, 0
        try:
            storage_step("read", storage.abspath(f.path))
            with storage.fs.open(storage.abspath(f.path), "rb") as stream:
                while chunk := stream.read(_CHUNK):
                    crc = crc32(chunk, crc)
                    size += len(chunk)
        except FileNotFoundError:
            return FileProblem(f.path, f.local_name, "missing")
        finally:
            storage.count_request("GET", down=size)
        problem = mismatch(f, size, lambda: crc)
        return FileProblem(f.path, f.local_name, problem) if problem else None

    return [p for p in storage.parallel(check, sorted(files, key=lambda f: f.path)) if p is not None]


def _listed_in(path: str) -> str:
    """The directory whose one (recursive) listing tells about `path`: a checkpoint's private files
    of every operator and subtask share one, `chk-N`; shared files one per subtask."""
    top = path.split("/", 1)[0]
    return top if top.startswith("chk-") and "/" in path else posixpath.dirname(path)


def _stored_or_none(storage: CheckpointStorage, rel: str) -> StoredFile | None:
    try:
        return storage.info(rel)
    except (FileNotFoundError, ValueError, PathEscapesJobDirectory):  # missing, or a path no one may read
        return None


def check_local_file(local: Path, f: FileHandle) -> str | None:
    """None when `local` has the recorded size and CRC32, else what is wrong."""
    try:
        size: int | None = local.stat().st_size
    except FileNotFoundError:
        size = None
    return mismatch(f, size, lambda: crc32_of_file(str(local)))


def check_handle_shape(handle: SubtaskStateHandle, checkpoint_id: int) -> None:
    """A RocksDB directory needs CURRENT and a MANIFEST; without them it would open empty."""
    names = {f.local_name for f in handle.files()}
    where = f"chk-{checkpoint_id}/_metadata, operator {handle.operator} subtask {handle.subtask}"
    if "CURRENT" not in names:
        raise CheckpointCorrupted(
            f"{where} lists no CURRENT file: RocksDB would open an empty database. "
            "Restore an older checkpoint (sparkpoint verify lists the good ones).",
            checkpoint_id=checkpoint_id,
        )
    if not any(n.startswith("MANIFEST-") for n in names):
        raise CheckpointCorrupted(
            f"{where} lists no MANIFEST file. Restore an older checkpoint.", checkpoint_id=checkpoint_id
        )
    if len(names) != len(handle.shared) + len(handle.private):
        raise CheckpointCorrupted(f"{where} lists the same local file name twice", checkpoint_id=checkpoint_id)




def download_verified(
    storage: CheckpointStorage, handle: SubtaskStateHandle, checkpoint_id: int, target: Path
) -> int:
    """Download every file of `handle` into the new directory `target`, verified; returns bytes.

    On any problem `target` is removed and CheckpointCorrupted names the file and checkpoint.
    """
    check_handle_shape(handle, checkpoint_id)
    target.mkdir(parents=True)
    files = list(handle.files())
    try:
        try:
            written = storage.download([(f.path, str(target / f.local_name)) for f in files])
        except FileNotFoundError as e:
            missing = next((f for f in files if not storage.exists(f.path)), None)
            name = missing.path if missing else str(e)
            raise _corrupted(checkpoint_id, handle, name, "is missing from stable storage") from e
        for f, (size, crc) in zip(files, written):  # size and CRC32 of each local copy
            problem = mismatch(f, size, _known(crc))
            if problem:
                raise _corrupted(checkpoint_id, handle, f.path, f"differs: {problem}")
    except BaseException:
        shutil.rmtree(target, ignore_errors=True)
        raise
    return sum(f.size for f in files)


def _known(crc: int) -> Callable[[], int]:
    return lambda: crc


def _corrupted(checkpoint_id: int, handle: SubtaskStateHandle, path: str, what: str) -> CheckpointCorrupted:
    # No guess at an older id here: it may be subsumed or bad too. `newest_verifying` finds one.
    return CheckpointCorrupted(
        f"checkpoint {checkpoint_id} cannot be restored: {path} (operator {handle.operator}, subtask "
        f"{handle.subtask}) {what}; run `sparkpoint verify` to list the retained checkpoints that verify",
        checkpoint_id=checkpoint_id,
        path=path,
    )
