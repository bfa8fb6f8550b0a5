"""Task-local copies of a subtask's files: checked against the handle before RocksDB sees them,
and materialized (hard links) into the working database.

A task-local copy is checked like a download from stable storage (`sparkpoint.checkpoint.files`),
with one exception that makes local recovery cost no reads at all: an SST whose inode still has
the identity (device, inode, size, mtime) it had when its content was last checked against a
CRC32 is taken as it is. What a fingerprint cannot see, a rewrite that puts the old mtime back or
bits rotting on disk, RocksDB sees: every block of an SST carries its own checksum, verified on
every read, and the MANIFEST (always CRC-checked) records each SST's size and unique id, checked
on open. Every read path of the state surfaces that error (iterators ask for their status), and
the task that meets it discards the local state and restores from stable storage
(`rocksdb.is_corruption`).
"""


from __future__ import annotations

import json
import os
import shutil
import stat
import uuid
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sparkpoint.checkpoint.files import FileProblem, mismatch
from sparkpoint.checkpoint.metadata import SubtaskStateHandle
from sparkpoint.checkpoint.storage import crc32_of_file
from sparkpoint.state.engine.localfiles import write_replacing

SHARED_SUFFIXES = (".sst", ".blob")


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


_THREADED_BYTES = 16 << 20  # below this, starting threads costs more than they save


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
