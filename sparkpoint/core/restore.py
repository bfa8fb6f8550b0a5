"""Getting a subtask's files onto local disk, verified before RocksDB ever sees them (rule 7).

RocksDB opens a directory with a flipped data block and then iterates zero rows without a word
(unless the iterator's status is asked), so every file from stable storage is checked against the
size and CRC32 that `_metadata` recorded.

A task-local copy is checked the same way, with one exception that makes local recovery cost
no reads at all: an SST whose inode still has the identity (device, inode, size, mtime) it had
when its content was last checked against a CRC32 is taken as it is. What a fingerprint cannot
see, a rewrite that puts the old mtime back or bits rotting on disk, RocksDB sees: every block of
an SST carries its own checksum, verified on every read, and the MANIFEST (always CRC-checked)
records each SST's size and unique id, checked on open. Every read path of the state surfaces
that error (iterators ask for their status), and the task that meets it discards the local state
and restores from stable storage (`rocksdb.is_corruption`).
"""

from __future__ import annotations

import json
import os
import posixpath
import shutil
import stat
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from sparkpoint.core.errors import CheckpointCorrupted
from sparkpoint.core.localfiles import write_replacing
from sparkpoint.core.metadata import FileHandle, SubtaskStateHandle
from sparkpoint.core.storage import CheckpointStorage, StoredFile, crc32_of_file

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


def stored_size_problems(storage: CheckpointStorage, files: list[FileHandle]) -> list[FileProblem]:
    """Presence and size of `files` on storage, from one listing per directory they sit in (a
    subtask's files share one: on an object store a request or two, not one per file)."""
    listed: dict[str, StoredFile] = {}
    for directory in sorted({posixpath.dirname(f.path) for f in files}):
        listed.update((s.path, s) for s in storage.walk(directory))
    problems = []
    for f in sorted(files, key=lambda f: f.path):
        stored = listed.get(f.path)
        problem = "is a symbolic link" if stored is not None and stored.symlink else mismatch(
            f, stored.size if stored is not None else None, None)
        if problem:
            problems.append(FileProblem(f.path, f.local_name, problem))
    return problems

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


FINGERPRINTS = "fingerprints.json"  # in a task-local chk-N/: the SSTs checked since they last changed


def _fingerprint(st: os.stat_result) -> list[int]:
    # Not ctime: the hard links that snapshots, compactions and restores add to and remove from
    # these very inodes move it all the time.
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]


def read_fingerprints(directory: Path) -> dict[str, list[int]]:
    """The fingerprints recorded for `directory` ({} when none or unreadable)."""
    try:
        data = json.loads((directory / FINGERPRINTS).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, list)}


def record_fingerprints(directory: Path, checked: Iterable[str], vouched_by: dict[str, list[int]]) -> None:
    """Record the identity of the SSTs in `directory` whose content is known to match `_metadata`:
    the names in `checked` (just checksummed: uploaded or downloaded) and those `vouched_by` an
    earlier record of the same, unchanged inode. Anything else is checksummed at its next restore."""
    checked = set(checked)
    prints: dict[str, list[int]] = {}
    with os.scandir(directory) as entries:
        for entry in entries:
            if not entry.name.endswith(SHARED_SUFFIXES) or not entry.is_file(follow_symlinks=False):
                continue
            now = _fingerprint(entry.stat(follow_symlinks=False))
            if entry.name in checked or vouched_by.get(entry.name) == now:
                prints[entry.name] = now
    write_replacing(directory / FINGERPRINTS, json.dumps(prints, sort_keys=True).encode())


def local_copy_matches(directory: Path, handle: SubtaskStateHandle, *, deep: bool = False) -> list[FileProblem]:
    """Compare a task-local directory with the handle; empty list when every file matches.

    Every file's size is checked. Its content is checksummed too, unless it is an SST whose
    fingerprint is unchanged since its content was last checked (see the module's text); `deep`
    checksums every file. Many megabytes to checksum go to several threads, largest first (CRC32
    releases the GIL); a few small files are cheaper on this one.
    """
    prints = {} if deep else read_fingerprints(directory)
    files = list(handle.files())
    problems: dict[int, str | None] = {}
    to_read: list[int] = []
    for i, f in enumerate(files):
        try:
            st = (directory / f.local_name).stat(follow_symlinks=False)
        except FileNotFoundError:
            problems[i] = mismatch(f, None, None)
            continue
        if not stat.S_ISREG(st.st_mode):  # a link would have RocksDB read outside the local directory
            problems[i] = "not a regular file (a symbolic link or a directory)"
        elif st.st_size != f.size:
            problems[i] = mismatch(f, st.st_size, None)
        elif prints.get(f.local_name) == _fingerprint(st):
            problems[i] = None
        else:
            to_read.append(i)

    def checksum(i: int) -> tuple[int, str | None]:
        return i, mismatch(files[i], files[i].size, lambda: crc32_of_file(str(directory / files[i].local_name)))

    to_read.sort(key=lambda i: -files[i].size)
    if len(to_read) > 1 and sum(files[i].size for i in to_read) > _THREADED_BYTES:
        with ThreadPoolExecutor(max_workers=min(len(to_read), os.cpu_count() or 2)) as pool:
            problems.update(pool.map(checksum, to_read))
    else:
        problems.update(map(checksum, to_read))
    return [FileProblem(f.path, f.local_name, p) for i, f in enumerate(files) if (p := problems[i])]


_THREADED_BYTES = 16 << 20  # below this, starting threads costs more than they save


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
