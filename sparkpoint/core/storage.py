"""Checkpoint storage: one job directory on any fsspec filesystem.

Every path the rest of sparkpoint hands in is relative to the job directory and is checked by
`validate_relative` before any I/O: a path that would escape is an error, never an action. On a
local filesystem a symlink anywhere below the job directory is never followed: reading, writing
or deleting through it is refused, and listings report it instead of entering it. No path is ever
handed to a glob (a `[` in a user's directory name is a character, not a pattern).
"""

from __future__ import annotations

import logging
import os
import posixpath
import re
import stat
import uuid
import zlib
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from sparkpoint.core.errors import CheckpointAlreadyExists, PathEscapesJobDirectory, StorageError
from sparkpoint.core.metadata import FileHandle
from sparkpoint.core.paths import checkpoint_id_of_dir, validate_relative

_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_CHUNK = 4 * 1024 * 1024
log = logging.getLogger(__name__)


def crc32_of_file(local_path: str) -> int:
    crc = 0
    with open(local_path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc & 0xFFFFFFFF


@dataclass(frozen=True)
class StoredFile:
    path: str  # relative to the job directory
    size: int
    modified: float  # POSIX seconds; 0.0 when the filesystem does not say
    symlink: bool = False  # a link found in the job directory: reported, never followed or deleted


class CheckpointStorage:
    """The directory `<checkpoints_dir>/<job_id>/` on an fsspec filesystem."""

    def __init__(
        self,
        checkpoints_dir: str,
        job_id: str,
        storage_options: dict[str, Any] | None = None,
        *,
        max_workers: int = 8,
    ):
        if not _JOB_ID.match(job_id or ""):
            raise StorageError(
                f"job id {job_id!r} is not valid: use 1-128 letters, digits, '.', '_' or '-', "
                "starting with a letter or digit"
            )
        try:
            fs, base = fsspec.core.url_to_fs(checkpoints_dir, **(storage_options or {}))
        except (ValueError, ImportError) as e:
            raise StorageError(
                f"cannot open checkpoint storage {checkpoints_dir!r}: {e}. "
                "Give an fsspec URL such as file:///data/checkpoints, memory://ckpt or s3://bucket/path"
            ) from e
        self.url = checkpoints_dir
        self.job_id = job_id
        self.storage_options = dict(storage_options or {})
        self.fs = fs
        self.root = posixpath.join(base.rstrip("/") or "/", job_id)
        self.max_workers = max_workers
        self._local = isinstance(fs, LocalFileSystem)

    def __repr__(self) -> str:
        return f"CheckpointStorage({self.url!r}, job_id={self.job_id!r})"

    @property
    def job_url(self) -> str:
        return str(self.fs.unstrip_protocol(self.root))

    # --- paths ---------------------------------------------------------------------------------

    def abspath(self, rel: str) -> str:
        try:
            validate_relative(rel)
        except ValueError as e:
            raise PathEscapesJobDirectory(
                f"refusing to touch {rel!r}: it is not inside the job directory {self.job_url} ({e})"
            ) from e
        path = f"{self.root}/{rel}"
        if self._local:
            self._refuse_symlinks(rel)
        return path

    def _refuse_symlinks(self, rel: str) -> None:
        """A link below the job directory may lead anywhere: never read, write or delete through it."""
        current = self.root
        for part in rel.split("/"):
            current = f"{current}/{part}"
            if os.path.islink(current):
                raise PathEscapesJobDirectory(
                    f"refusing to touch {rel!r}: {self.relpath_unchecked(current)} in {self.job_url} is a symbolic "
                    f"link to {os.readlink(current)!r}; sparkpoint never follows links in a job directory. "
                    "Replace the link with the real files, or remove it."
                )

    def relpath_unchecked(self, absolute: str) -> str:
        return absolute[len(self.root.rstrip("/")) + 1 :]

    def relpath(self, absolute: str) -> str:
        absolute = self.fs._strip_protocol(absolute)
        prefix = self.root.rstrip("/") + "/"
        if not absolute.startswith(prefix):
            raise PathEscapesJobDirectory(f"{absolute!r} is outside the job directory {self.job_url}")
        return validate_relative(absolute[len(prefix) :])

    # --- single files --------------------------------------------------------------------------

    def exists(self, rel: str) -> bool:
        return bool(self.fs.exists(self.abspath(rel)))

    def read_bytes(self, rel: str) -> bytes:
        return bytes(self.fs.cat_file(self.abspath(rel)))

    def write_bytes(self, rel: str, data: bytes) -> None:
        path = self.abspath(rel)
        self._makedirs([path])
        with self.fs.open(path, "wb") as f:
            f.write(data)

    def info(self, rel: str) -> StoredFile:
        info = self.fs.info(self.abspath(rel))
        return StoredFile(path=rel, size=int(info.get("size") or 0), modified=_modified(info))

    def commit_exclusive(self, rel: str, data: bytes) -> None:
        """Create `rel` with `data` if and only if it does not exist yet; all or nothing.

        Raises CheckpointAlreadyExists when another writer created it first.
        """
        path = self.abspath(rel)
        self._makedirs([path])
        if self._local:
            self._commit_local(path, data)
            return
        try:
            with self.fs.open(path, "xb") as f:
                f.write(data)
        except FileExistsError as e:
            raise CheckpointAlreadyExists(f"{self.job_url}/{rel} was already written by another writer") from e

    def _commit_local(self, path: str, data: bytes) -> None:
        # Write a temporary file, fsync it, then link it into place: the link is atomic and
        # fails if the target exists, so readers never see a half-written _metadata.
        tmp = f"{path}.{uuid.uuid4().hex}.tmp"
        try:
            with open(tmp, "xb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)
            except FileExistsError as e:
                raise CheckpointAlreadyExists(f"{path} was already written by another writer") from e
            fsync_dir(posixpath.dirname(path))
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass

    # --- many files, in parallel ---------------------------------------------------------------

    def put_files(self, pairs: Sequence[tuple[str, str]]) -> None:
        """Upload (local path, relative target) pairs in parallel."""
        self.upload(pairs, checkpoint_id=0)

    def upload(self, pairs: Sequence[tuple[str, str]], checkpoint_id: int) -> list[FileHandle]:
        """Upload (local path, relative target) pairs in parallel; return handles with size and CRC32."""
        targets = [(local, rel, self.abspath(rel)) for local, rel in pairs]
        self._makedirs([t for _, _, t in targets])

        def one(item: tuple[str, str, str]) -> FileHandle:
            local, rel, target = item
            handle = FileHandle(
                local_name=os.path.basename(local),
                path=rel,
                size=os.path.getsize(local),
                crc32=crc32_of_file(local),
                created_by=checkpoint_id,
            )
            self.fs.put_file(local, target)
            if self._local:
                _fsync_file(target)
            return handle

        handles = self.parallel(one, targets)
        if self._local:
            for d in {posixpath.dirname(t) for _, _, t in targets}:
                fsync_dir(d)
        return handles

    def get_files(self, pairs: Sequence[tuple[str, str]]) -> None:
        """Download (relative source, local path) pairs in parallel."""
        sources = [(self.abspath(rel), local) for rel, local in pairs]
        for _, local in sources:
            os.makedirs(os.path.dirname(local) or ".", exist_ok=True)
        self.parallel(lambda p: self.fs.get_file(p[0], p[1]), sources)

    def delete(self, rels: Iterable[str]) -> int:
        """Delete files in parallel; files already gone are fine. Returns how many were asked.

        Every path is checked before the first delete: one that is not safely inside the job
        directory (`..`, a link) raises PathEscapesJobDirectory and nothing is deleted.
        """
        paths = {self.abspath(rel) for rel in rels}
        if not paths:
            return 0

        def rm(path: str) -> None:
            try:
                self.fs.rm_file(path)
            except FileNotFoundError:
                pass

        self.parallel(rm, sorted(paths))
        return len(paths)

    def parallel(self, fn: Any, items: Sequence[Any]) -> list[Any]:
        """`fn` over `items` on this storage's worker threads, results in order."""
        if len(items) <= 1:
            return [fn(item) for item in items]
        with ThreadPoolExecutor(max_workers=min(self.max_workers, len(items))) as pool:
            return list(pool.map(fn, items))

    def _makedirs(self, paths: Iterable[str]) -> None:
        for d in sorted({posixpath.dirname(p) for p in paths}):
            self.fs.makedirs(d, exist_ok=True)

    # --- listing -------------------------------------------------------------------------------

    def job_dir_exists(self) -> bool:
        return bool(self.fs.exists(self.root))

    def checkpoint_dirs(self) -> list[int]:
        """Ids of every `chk-N` directory, with or without `_metadata`, ascending."""
        self.fs.invalidate_cache(self.root)  # another writer may have committed since we last looked
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        ids = [checkpoint_id_of_dir(posixpath.basename(e.rstrip("/"))) for e in entries]
        return sorted(i for i in ids if i is not None)

    def completed_checkpoint_ids(self) -> list[int]:
        """Ids of every `chk-N` whose `_metadata` exists, ascending.

        Lists the directories and tests each for `_metadata`. A `chk-N` that is a link counts: the
        store then reports it as unreadable, which stops deletion until someone looks.
        """
        ids = self.checkpoint_dirs()

        def committed(cid: int) -> bool:
            try:
                return self.exists(f"chk-{cid}/_metadata")
            except PathEscapesJobDirectory:
                return True

        return [cid for cid, yes in zip(ids, self.parallel(committed, ids)) if yes]

    def walk(self, top: str) -> list[StoredFile]:
        """Every file below `top` (relative), with size and modification time; links are listed
        as links (`symlink=True`), never entered. Names that are no safe relative path are skipped."""
        if self._local:
            return self._walk_local(top)
        base = self.abspath(top)
        try:
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return []
        stored = [self._stored(info) for info in found.values() if info.get("type", "file") == "file"]
        return [f for f in stored if f is not None]

    def _walk_local(self, top: str) -> list[StoredFile]:
        validate_relative(top)
        base = f"{self.root}/{top}"
        parts = top.split("/")
        for i in range(len(parts)):  # `top` itself, or a directory above it, may be a link
            head = f"{self.root}/{'/'.join(parts[: i + 1])}"
            if os.path.islink(head):
                return [self._lstat(head)]
        out: list[StoredFile] = []
        for dirpath, dirnames, filenames in os.walk(base):  # followlinks=False: linked dirs not entered
            for name in dirnames + filenames:
                full = os.path.join(dirpath, name)
                try:
                    entry = self._lstat(full)
                except FileNotFoundError:
                    continue
                if entry.symlink or name in filenames:
                    out.append(entry)
        return [f for f in out if f.path]

    def _lstat(self, full: str) -> StoredFile:
        st = os.lstat(full)
        rel = self.relpath_unchecked(full)
        try:
            validate_relative(rel)
        except ValueError as e:
            log.warning("skipping %s in %s: %s", rel, self.job_url, e)
            rel = ""
        return StoredFile(rel, st.st_size, st.st_mtime, symlink=stat.S_ISLNK(st.st_mode))

    def remove_empty_dirs(self, top: str) -> None:
        """Local filesystems keep empty directories after deletes; object stores have none."""
        if not self._local:
            return
        base = self.abspath(top)
        for dirpath, _, _ in sorted(os.walk(base), key=lambda t: -len(t[0])):
            try:
                os.rmdir(dirpath)
            except OSError:
                pass

    def _stored(self, info: dict[str, Any]) -> StoredFile | None:
        try:
            path = self.relpath(info["name"])
        except (ValueError, PathEscapesJobDirectory) as e:
            log.warning("skipping %s in %s: %s", info.get("name"), self.job_url, e)
            return None
        return StoredFile(path=path, size=int(info.get("size") or 0), modified=_modified(info))


def _modified(info: dict[str, Any]) -> float:
    for key in ("mtime", "LastModified", "created", "last_modified", "updated"):
        value = info.get(key)
        if value is None:
            continue
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return 0.0


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """Make a directory's entries (a create, rename or unlink in it) durable, where supported."""
    try:
        _fsync_file(path)
    except OSError:
        pass
