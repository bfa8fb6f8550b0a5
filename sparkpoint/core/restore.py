"""Getting a subtask's files onto local disk, verified before RocksDB ever sees them (rule 7).

RocksDB opens a directory with a flipped data block and then iterates zero rows without a word,
so every file is checked against the size and CRC32 that `_metadata` recorded, whether it comes
from the task-local copy or from stable storage.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from sparkpoint.core.errors import CheckpointCorrupted
from sparkpoint.core.metadata import FileHandle, SubtaskStateHandle
from sparkpoint.core.storage import CheckpointStorage, crc32_of_file

SHARED_SUFFIXES = (".sst", ".blob")


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


def local_copy_matches(directory: Path, handle: SubtaskStateHandle) -> list[FileProblem]:
    """Compare a task-local directory with the handle; empty list when every file matches.

    Every byte of every file is read and checksummed, every time: a fingerprint of the inode
    (size, mtime, ctime) would not survive the hard links that snapshots, confirmations, RocksDB
    compactions and restores add to and remove from these very inodes (each moves ctime), and
    without ctime an in-place rewrite that puts the old mtime back would go unseen. The files are
    checksummed on several threads, largest first (CRC32 releases the GIL).
    """
    files = list(handle.files())
    by_size = sorted(range(len(files)), key=lambda i: -files[i].size)
    with ThreadPoolExecutor(max_workers=max(1, min(len(files), os.cpu_count() or 2))) as pool:
        checked = pool.map(lambda i: (i, check_local_file(directory / files[i].local_name, files[i])), by_size)
        problems = dict(checked)
    return [FileProblem(f.path, f.local_name, p) for i, f in enumerate(files) if (p := problems[i])]


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


def materialize(source: Path, target: Path, local_names: Iterable[str]) -> None:
    """Make `target` a RocksDB directory of `source`'s files: immutable SSTs as hard links, the
    rest (MANIFEST, CURRENT, OPTIONS, WAL) as copies, since RocksDB appends to or rewrites those."""
    tmp = target.with_name(f"{target.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    try:
        for name in local_names:
            src, dst = source / name, tmp / name
            if name.endswith(SHARED_SUFFIXES):
                try:
                    os.link(src, dst)
                    continue
                except OSError:  # another filesystem: copy instead
                    pass
            shutil.copyfile(src, dst)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _corrupted(checkpoint_id: int, handle: SubtaskStateHandle, path: str, what: str) -> CheckpointCorrupted:
    # No guess at an older id here: it may be subsumed or bad too. `newest_verifying` finds one.
    return CheckpointCorrupted(
        f"checkpoint {checkpoint_id} cannot be restored: {path} (operator {handle.operator}, subtask "
        f"{handle.subtask}) {what}; run `sparkpoint verify` to list the retained checkpoints that verify",
        checkpoint_id=checkpoint_id,
        path=path,
    )
