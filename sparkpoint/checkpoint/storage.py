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
import stat
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from typing import Any, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from sparkpoint.checkpoint import ledger
from sparkpoint.checkpoint.crash import crash_point
from sparkpoint.checkpoint.deletes import DeleteReport, DeletesFailed, delete_exact
from sparkpoint.checkpoint.errors import CheckpointAlreadyExists, PathEscapesJobDirectory, StorageError
from sparkpoint.checkpoint.interleave import storage_step
from sparkpoint.checkpoint.metadata import FileHandle
from sparkpoint.checkpoint.paths import checkpoint_id_of_dir, is_plain_name, validate_relative
from sparkpoint.checkpoint.phases import phase

_CHUNK = 4 * 1024 * 1024
log = logging.getLogger(__name__)
T = TypeVar("T")

# CRC-32 (zlib's polynomial, initial value and result: the values in `_metadata` do not depend on
# it). ISA-L computes it with carry-less multiplication, several times faster than zlib 1.2, and
# CRC32 is what bounds a verified copy on a local disk; zlib is the fallback when isal is absent.
def storage_url(location: str) -> str:
    """The one way a user's location becomes an fsspec URL, on every route (CLI, notebook API,
    Dagster resources): a URL stays as it is; a bare path becomes `file://` + its absolute path,
    taken literally. Never `Path.as_uri()`: it percent-encodes a space, `#`, `%` or non-ASCII,
    and fsspec's `file://` does not decode, so the files would land in `my%20project/`."""
    if "://" in location:
        return location
    return "file://" + os.path.abspath(os.path.expanduser(location))


def _fastest_crc32() -> tuple[Callable[[Any, int], int], str]:
    try:
        from isal import isal_zlib
    except ImportError:  # pragma: no cover - depends on the environment
        return zlib.crc32, "zlib"
    return isal_zlib.crc32, "isal"


_crc32, CRC32_IMPLEMENTATION = _fastest_crc32()


def crc32(data: Any, value: int = 0) -> int:
    """CRC32 of a bytes-like object, continuing from `value`; same results as `zlib.crc32`."""
    return _crc32(data, value) & 0xFFFFFFFF


def size_and_crc32(local_path: str) -> tuple[int, int]:
    """Bytes read and CRC32 of a local file, in one pass."""
    size, crc = 0, 0
    with open(local_path, "rb", buffering=0) as f, _buffer() as view:
        while n := f.readinto(view):
            with view[:n] as chunk:
                crc = _crc32(chunk, crc)
            size += n
    return size, crc & 0xFFFFFFFF


def crc32_of_file(local_path: str) -> int:
    return size_and_crc32(local_path)[1]


def copy_with_crc32(source: str, target: str, *, fsync: bool = False) -> tuple[int, int]:
    """Copy a local file to `target` (created or truncated) in one pass; returns the size and CRC32
    of the bytes written, so what the checksum vouches for is exactly what the copy holds."""
    size, crc = 0, 0
    with open(source, "rb", buffering=0) as src, open(target, "wb") as dst, _buffer() as view:
        while n := src.readinto(view):
            with view[:n] as chunk:
                crc = _crc32(chunk, crc)
                dst.write(chunk)  # a buffered writer: all of it or an error
            size += n
        if fsync:
            dst.flush()
            os.fsync(dst.fileno())
    return size, crc & 0xFFFFFFFF


_buffers = threading.local()


def _buffer() -> memoryview:
    """This thread's copy buffer, allocated once (zero-filling 4 MB per file costs more than a
    small file's copy)."""
    buffer = getattr(_buffers, "buffer", None)
    if buffer is None:
        buffer = _buffers.buffer = bytearray(_CHUNK)
    return memoryview(buffer)


@dataclass(frozen=True)
class RetryPolicy:
    """How often an idempotent storage operation is tried on a transient error, and how long to wait.

    Transient: an OSError that says nothing about the file itself (a timeout, a reset connection,
    a 5xx). FileNotFoundError, FileExistsError, PermissionError and the like are answers, not
    accidents, and are never retried.
    """

    attempts: int = 5
    first_wait: float = 0.05
    max_wait: float = 2.0

    def wait(self, attempt: int) -> float:
        return min(self.max_wait, self.first_wait * 2.0**attempt)


_ANSWERS = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)


_CLIENT_LIBRARIES = frozenset({"botocore", "aiobotocore", "aiohttp", "google", "azure", "requests", "urllib3"})


def _network_client_error(error: BaseException) -> bool:
    """An error of an object store's client library (not an OSError, which fsspec maps its
    answers to): an endpoint that does not answer, credentials it refuses."""
    module = type(error).__module__.partition(".")[0]
    return module in _CLIENT_LIBRARIES and not isinstance(error, OSError)


def is_transient(error: BaseException) -> bool:
    return isinstance(error, OSError) and not isinstance(error, _ANSWERS)


@dataclass(frozen=True, slots=True)  # one per file: 10^6 and more in a large job
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
        filesystem: Any = None,
        retry: RetryPolicy | None = None,
    ):
        """`filesystem`: an fsspec filesystem to use instead of the one `checkpoints_dir` names (e.g.
        `sparkpoint.testing.FaultyFileSystem` around it); the URL still gives the path."""
        if not is_plain_name(job_id):
            raise StorageError(
                f"job id {job_id!r} is not valid: use 1-128 letters, digits, '.', '_' or '-', "
                "starting with a letter or digit"
            )
        checkpoints_dir = storage_url(checkpoints_dir)
        try:
            fs, base = fsspec.core.url_to_fs(checkpoints_dir, **(storage_options or {}))
            fs = filesystem if filesystem is not None else fs
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
        self.retry = retry or RetryPolicy()
        self.retried = 0  # transient errors retried so far (the fault tests read it)
        self.delete_requests = 0  # delete requests sent so far off the local disk (a batch of keys is one)
        self.last_delete: DeleteReport | None = None  # the last bulk delete off the local disk
        self._local = isinstance(fs, LocalFileSystem)
        # On S3 every HTTP request is counted from botocore's hooks; elsewhere each operation here.
        self._seam_counts = not ledger.watch(fs)
        ledger.mark_checkpoints(self.root)

    def __repr__(self) -> str:
        return f"CheckpointStorage({self.url!r}, job_id={self.job_id!r})"

    @property
    def is_local(self) -> bool:
        """On this machine's filesystem (file://), where a metadata call costs a syscall."""
        return self._local

    def _retrying(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)`, tried again on a transient error (only for operations that are idempotent:
        reads, listings, deletes, and writes of a whole file under a name nobody else writes)."""
        for attempt in range(self.retry.attempts):
            try:
                return fn(*args)
            except Exception as e:
                if _network_client_error(e):  # the filesystem's client gave up (its own retries included)
                    raise StorageError(
                        f"checkpoint storage {self.url} cannot be reached: {what} failed ({type(e).__name__}: {e}); "
                        "check the URL and the storage options (endpoint, credentials)"
                    ) from e
                if not is_transient(e) or attempt == self.retry.attempts - 1:
                    raise
                self.retried += 1
                log.info("%s in %s failed (%r); trying again (%d of %d)", what, self.job_url, e, attempt + 2,
                         self.retry.attempts)
                time.sleep(self.retry.wait(attempt))
        raise AssertionError("unreachable")

    def count_request(self, op: str, *, up: int = 0, down: int = 0) -> None:
        """One operation of the request ledger (`sparkpoint.checkpoint.ledger`), where no hook counts it."""
        if self._seam_counts:
            ledger.count(op, up=up, down=down)

    @property
    def job_url(self) -> str:
        return str(self.fs.unstrip_protocol(self.root))

    # --- paths ---------------------------------------------------------------------------------

    def abspath(self, rel: str) -> str:
        return self._abspath(rel, None)

    def _abspath(self, rel: str, plain_dirs: set[str] | None) -> str:
        """`abspath`; `plain_dirs` remembers directories already found to be no link (one batch)."""
        try:
            validate_relative(rel)
        except ValueError as e:
            raise PathEscapesJobDirectory(
                f"refusing to touch {rel!r}: it is not inside the job directory {self.job_url} ({e})"
            ) from e
        path = f"{self.root}/{rel}"
        if self._local:
            self._refuse_symlinks(rel, plain_dirs)
        return path

    def _refuse_symlinks(self, rel: str, plain_dirs: set[str] | None = None) -> None:
        """A link below the job directory may lead anywhere: never read, write or delete through it."""
        current = self.root
        parts = rel.split("/")
        for i, part in enumerate(parts):
            current = f"{current}/{part}"
            is_dir = i < len(parts) - 1
            if is_dir and plain_dirs is not None and current in plain_dirs:
                continue
            if os.path.islink(current):
                raise PathEscapesJobDirectory(
                    f"refusing to touch {rel!r}: {self.relpath_unchecked(current)} in {self.job_url} is a symbolic "
                    f"link to {os.readlink(current)!r}; sparkpoint never follows links in a job directory. "
                    "Replace the link with the real files, or remove it."
                )
            if is_dir and plain_dirs is not None:
                plain_dirs.add(current)

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
        """Only "not found" means absent: fsspec's own `exists` says False on any error, and a
        `_metadata` that a timeout hid would drop a retained checkpoint from the registry's count."""
        path = self.abspath(rel)
        storage_step("info", path)
        self.count_request("HEAD")
        try:
            self._retrying(f"looking up {rel}", self.fs.info, path)
        except (FileNotFoundError, NotADirectoryError):
            return False
        return True

    def read_bytes(self, rel: str) -> bytes:
        path = self.abspath(rel)
        storage_step("read", path)
        data = bytes(self._retrying(f"reading {rel}", self.fs.cat_file, path))
        self.count_request("GET", down=len(data))
        return data

    def write_bytes(self, rel: str, data: bytes) -> None:
        path = self.abspath(rel)
        storage_step("write", path)  # before anything of it happens, its directories too
        self._makedirs([path])
        self._retrying(f"writing {rel}", self._write, path, data)
        self.count_request("PUT", up=len(data))

    def _write(self, path: str, data: bytes) -> None:
        with self.fs.open(path, "wb") as f:
            f.write(data)

    def info(self, rel: str) -> StoredFile:
        path = self.abspath(rel)
        storage_step("info", path)
        self.count_request("HEAD")
        info = self._retrying(f"looking up {rel}", self.fs.info, path)
        return StoredFile(path=rel, size=int(info.get("size") or 0), modified=modified_time(info))

    def commit_exclusive(self, rel: str, data: bytes) -> None:
        """Create `rel` with `data` if and only if it does not exist yet; all or nothing.

        Raises CheckpointAlreadyExists when the file exists. A transient error is tried again;
        when the first try did write before its response was lost, the next one finds the file and
        raises CheckpointAlreadyExists too: only the caller can tell (by reading it back) whether
        the file holds its own bytes, so the error is never taken for a win or a loss here.
        """
        path = self.abspath(rel)
        storage_step("create", path)  # before anything of it happens, its directories too
        self._makedirs([path])
        self.count_request("PUT", up=len(data))
        if self._local:
            self._commit_local(path, data)
            return
        try:
            self._retrying(f"committing {rel}", self._create_exclusive, path, data)
        except FileExistsError as e:
            raise CheckpointAlreadyExists(f"{self.job_url}/{rel} was already written by another writer") from e

    def _create_exclusive(self, path: str, data: bytes) -> None:
        with self.fs.open(path, "xb") as f:
            f.write(data)

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
        """Upload (local path, relative target) pairs in parallel; return handles with size and CRC32.

        On a local filesystem each file is copied, checksummed and fsynced in one pass. Elsewhere
        the CRC32 pass over the local file (from the page cache) is cheap next to the transfer,
        which the filesystem's own `put_file` does best.
        """
        targets = [(local, rel, self.abspath(rel)) for local, rel in pairs]
        self._makedirs([t for _, _, t in targets])

        def one(item: tuple[str, str, str]) -> FileHandle:
            local, rel, target = item
            storage_step("upload", target)
            if self._local:
                size, crc = copy_with_crc32(local, target, fsync=True)
            else:
                size, crc = size_and_crc32(local)
                self._retrying(f"uploading {rel}", self.fs.put_file, local, target)  # a fresh name: idempotent
            self.count_request("PUT", up=size)
            crash_point("mid-upload")  # this file is stored, the others of the batch maybe not
            return FileHandle(local_name=os.path.basename(local), path=rel, size=size, crc32=crc,
                              created_by=checkpoint_id)

        with phase("upload"):
            handles = self.parallel(one, targets)  # waits on fsync: all the workers (measured faster)
        if self._local:
            for d in {posixpath.dirname(t) for _, _, t in targets}:
                fsync_dir(d)
        return handles

    def download(self, pairs: Sequence[tuple[str, str]]) -> list[tuple[int, int]]:
        """Download (relative source, local path) pairs in parallel; return the size and CRC32 of
        each local copy, read back from the page cache right after it was written: the bytes
        RocksDB will open. A missing source raises FileNotFoundError.

        The filesystem's own `get_file` copies (in the kernel on a local disk); measured on a
        local disk, it and a CRC32 pass over the copy beat copying and checksumming through a
        user-space buffer in one pass (~110-130% against ~30-130% of a plain `get`, erratic).
        """
        sources = [(self.abspath(rel), local) for rel, local in pairs]
        for d in {os.path.dirname(local) or "." for _, local in sources}:
            os.makedirs(d, exist_ok=True)

        def one(item: tuple[str, str]) -> tuple[int, int]:
            source, local = item
            storage_step("download", source)
            self._retrying(f"downloading {source}", self.fs.get_file, source, local)
            size, crc = size_and_crc32(local)
            self.count_request("GET", down=size)
            return size, crc

        with phase("download"):
            return self.parallel(one, sources, workers=self._copy_workers)

    def get_files(self, pairs: Sequence[tuple[str, str]]) -> None:
        """Download (relative source, local path) pairs in parallel."""
        sources = [(self.abspath(rel), local) for rel, local in pairs]
        for _, local in sources:
            os.makedirs(os.path.dirname(local) or ".", exist_ok=True)

        def one(item: tuple[str, str]) -> None:
            storage_step("download", item[0])
            self._retrying(f"downloading {item[0]}", self.fs.get_file, item[0], item[1])
            self.count_request("GET", down=os.path.getsize(item[1]))

        self.parallel(one, sources)

    def delete(self, rels: Iterable[str]) -> int:
        """Delete files; files already gone are fine. Returns how many were asked.

        Every path is checked before the first delete: one that is not safely inside the job
        directory (`..`, a link) raises PathEscapesJobDirectory and nothing is deleted. On S3 the
        deletes go in batches of 1,000 keys (`sparkpoint.checkpoint.deletes`), a key the batch
        refused is tried again alone; files that still fail raise DeletesFailed naming them (the
        others stay deleted). Elsewhere one delete per file, in parallel.
        """
        plain_dirs: set[str] = set()
        paths = sorted({self._abspath(rel, plain_dirs) for rel in rels})
        if not paths:
            return 0
        for _ in paths:
            self.count_request("DELETE")
        if self._local:  # a thread per run of neighbouring paths: unlinks in one directory queue up anyway
            n = max(1, min(self.max_workers, len(paths) // 256))
            self.parallel(_unlink_all, [paths[i * len(paths) // n : (i + 1) * len(paths) // n] for i in range(n)])
            return len(paths)
        report = delete_exact(self.fs, paths, retrying=self._retrying, parallel=self.parallel)
        self.delete_requests += report.requests
        self.last_delete = report
        if not report.ok:
            raise DeletesFailed(report, self.job_url)
        return len(paths)

    def parallel(self, fn: Any, items: Sequence[Any], *, workers: int | None = None) -> list[Any]:
        """`fn` over `items` on this storage's worker threads (at most `workers`), results in order."""
        if len(items) <= 1 or min(workers or self.max_workers, self.max_workers) == 1:
            return [fn(item) for item in items]
        with ThreadPoolExecutor(max_workers=min(workers or self.max_workers, self.max_workers, len(items))) as pool:
            return list(pool.map(fn, items))

    @property
    def _copy_workers(self) -> int | None:
        """Copies into the page cache are bound by memory and CPU: more threads than cores only
        contend (measured on 2 cores: 8 threads ~60%, 2 threads ~100% of one `sendfile` copy)."""
        return (os.cpu_count() or 2) if self._local else None

    def _makedirs(self, paths: Iterable[str]) -> None:
        for d in sorted({posixpath.dirname(p) for p in paths}):
            self._retrying(f"creating {d}", self.fs.makedirs, d, True)

    # --- listing -------------------------------------------------------------------------------

    def job_dir_exists(self) -> bool:
        storage_step("info", self.root)
        self.count_request("HEAD")
        return bool(self._retrying("looking for the job directory", self.fs.exists, self.root))

    def checkpoint_dirs(self) -> list[int]:
        """Ids of every `chk-N` directory, with or without `_metadata`, ascending."""
        self.fs.invalidate_cache(self.root)  # another writer may have committed since we last looked
        storage_step("list", f"{self.root}/chk-*")
        self.count_request("LIST")
        try:
            entries = self._retrying("listing the checkpoints", self.fs.ls, self.root, False)
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
        storage_step("walk", f"{self.root}/{top}")
        self.count_request("LIST")
        if self._local:
            return self._walk_local(top)
        base = self.abspath(top)
        self.fs.invalidate_cache(base)  # other processes write here (Spark tasks, other writers)
        try:
            found = self._retrying(f"listing {top}", partial(self.fs.find, base, detail=True))
        except FileNotFoundError:
            return []
        finally:  # a cached listing would make a later `info` miss a file another process writes
            self.fs.invalidate_cache()
        stored = [self._stored(info) for info in found.values() if info.get("type", "file") == "file"]
        return [f for f in stored if f is not None]

    def _walk_local(self, top: str) -> list[StoredFile]:
        validate_relative(top)
        parts = top.split("/")
        for i in range(len(parts)):  # `top` itself, or a directory above it, may be a link
            head = f"{self.root}/{'/'.join(parts[: i + 1])}"
            if os.path.islink(head):
                return [self._lstat(head)]
        out: list[StoredFile] = []
        self._scan_local(f"{self.root}/{top}", top, out)
        return out

    def _scan_local(self, directory: str, rel_dir: str, out: list[StoredFile]) -> None:
        """Files and links below `directory`, one lstat each; linked directories are not entered."""
        try:
            entries = list(os.scandir(directory))
        except (FileNotFoundError, NotADirectoryError):
            return
        for entry in entries:
            rel = f"{rel_dir}/{entry.name}"
            try:
                if entry.is_dir(follow_symlinks=False):
                    self._scan_local(entry.path, rel, out)
                    continue
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:  # deleted while we looked
                continue
            try:
                validate_relative(rel)
            except ValueError as e:
                log.warning("skipping %s in %s: %s", rel, self.job_url, e)
                continue
            out.append(StoredFile(rel, st.st_size, st.st_mtime, symlink=stat.S_ISLNK(st.st_mode)))

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
        storage_step("rmdir", f"{self.root}/{top}")
        removed: set[str] = set()
        for dirpath, dirnames, filenames in os.walk(self.abspath(top), topdown=False):
            if filenames or any(os.path.join(dirpath, d) not in removed for d in dirnames):
                continue  # not empty (a link to a directory counts as content): no failing rmdir
            try:
                os.rmdir(dirpath)
                removed.add(dirpath)
            except OSError:
                pass

    def remove_created_dirs(self, rels: Iterable[str], *, job_dir: bool = False) -> None:
        """Remove the directories that hold `rels` (files already deleted) when they are empty,
        deepest first, and with `job_dir` the job directory itself; literally, never a pattern
        (fsspec's generic `rm(recursive=True)` would expand `[...]`, `*` and `?` in a user's
        path and delete a neighbour). Object stores have no directories to remove."""
        if not self._local and _object_store(self.fs):
            return
        dirs = {""} if job_dir else set()
        for rel in rels:
            parts = validate_relative(rel).split("/")[:-1]
            dirs.update("/".join(parts[:i]) for i in range(1, len(parts) + 1))
        for rel in sorted(dirs, key=lambda d: (-d.count("/") if d else 1, d)):  # deepest first, the job last
            try:
                path = self.root if not rel else self._abspath(rel, None)
                if self._local:
                    os.rmdir(path)  # an empty directory only; a link is no directory
                else:
                    self.fs.rmdir(path)
            except (OSError, ValueError, StorageError):
                pass  # not empty, gone, not a directory, or a link (never followed)

    def _stored(self, info: dict[str, Any]) -> StoredFile | None:
        try:
            path = self.relpath(info["name"])
        except (ValueError, PathEscapesJobDirectory) as e:
            log.warning("skipping %s in %s: %s", info.get("name"), self.job_url, e)
            return None
        return StoredFile(path=path, size=int(info.get("size") or 0), modified=modified_time(info))


def move_file(fs: Any, source: str, target: str) -> None:
    """One file, literally: a rename on a local disk, copy + delete elsewhere (the generic
    `fs.mv` expands `[...]`, `*` and `?` in the names it is given)."""
    if isinstance(fs, LocalFileSystem):
        os.replace(fs._strip_protocol(source), fs._strip_protocol(target))
    else:
        fs.cp_file(source, target)
        fs.rm_file(source)


def _object_store(fs: Any) -> bool:
    """Buckets and prefixes, no directories (and `rmdir` of a bucket path would delete a bucket)."""
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    return bool(protocols & {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "r2"})


def modified_time(info: dict[str, Any]) -> float:
    """When an fsspec entry was last modified, in seconds since the epoch (0.0: the store does not say)."""
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


def _unlink_all(paths: list[str]) -> None:
    for path in paths:
        storage_step("delete", path)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


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
