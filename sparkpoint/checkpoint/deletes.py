"""Deletes in bulk: a list of exact paths, never a pattern (DESIGN rule 11), sent in batches where
the store takes them.

On S3 (s3fs, or any filesystem with its `_call_s3`) one `DeleteObjects` request carries up to
1,000 keys of one bucket: about 1,000 times fewer requests than a `DELETE` per file (s3fs's own
`rm` of a list would do the same, but it expands each path first, and a `[` or `*` in a key makes
that a glob). Keys the batch reports as not deleted are tried again one by one (`rm_file`, with the
caller's retries of a transient error), and what still fails is reported, key by key, with why.
Elsewhere a file is one `rm_file`, in parallel on the caller's threads. A key already gone is no
failure (a delete is idempotent, and an earlier try's response may have been lost).
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from sparkpoint.checkpoint.errors import StorageError
from sparkpoint.checkpoint.interleave import storage_step

S3_BATCH = 1000  # S3's limit of keys per DeleteObjects
SHOWN = 5  # failures named in a message
T = TypeVar("T")

Retrying = Callable[..., Any]  # (what, fn, *args) -> fn(*args), tried again on a transient error
Parallel = Callable[[Callable[[Any], Any], Sequence[Any]], list[Any]]  # fn over items, results in order


@dataclass(frozen=True)
class DeleteFailure:
    """One path that could not be deleted, and why (the store's code and message, or the error)."""

    path: str
    reason: str


@dataclass(frozen=True)
class DeleteReport:
    """What a bulk delete did: the paths asked, the requests sent (a batch is one), the paths tried
    again one by one, and those that still failed."""

    asked: int
    requests: int
    retried: int = 0
    failed: tuple[DeleteFailure, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.failed

    def describe_failures(self) -> str:
        """`3 of 2000 files could not be deleted: a (AccessDenied: ...); ...`."""
        shown = "; ".join(f"{f.path} ({f.reason})" for f in self.failed[:SHOWN])
        more = f" and {len(self.failed) - SHOWN} more" if len(self.failed) > SHOWN else ""
        return f"{len(self.failed)} of {self.asked} files could not be deleted: {shown}{more}"


class DeletesFailed(StorageError):
    """Some files of a bulk delete could not be deleted, even one by one; `report` names them and why.
    The files deleted stay deleted; those left are the orphan sweep's (or the next cleanup's)."""

    def __init__(self, report: DeleteReport, where: str):
        super().__init__(f"{report.describe_failures()} in {where}; the rest were deleted. Check the store's "
                         "permissions (or object locks) on those keys; the next prune or sweep tries them again")
        self.report = report


def _once(what: str, fn: Callable[..., T], *args: Any) -> T:
    return fn(*args)


def _serial(fn: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
    return [fn(item) for item in items]


def is_s3(fs: Any) -> bool:
    """An s3fs filesystem (DeleteObjects is there to call); a wrapper that passes other calls on
    to one (`sparkpoint.testing.FaultyFileSystem`) is not: its deletes go through it, one by one."""
    return callable(getattr(type(fs), "_call_s3", None))


def delete_exact(fs: Any, paths: Iterable[str], *, retrying: Retrying = _once,
                 parallel: Parallel = _serial) -> DeleteReport:
    """Delete exactly `paths` (full paths of `fs`, as `fs.rm_file` takes them), in batches on S3.

    `retrying(what, fn, *args)` runs one request, tried again on a transient error; `parallel`
    maps a function over items (the caller's threads). Never raises for a file that fails: the
    report says which and why."""
    unique = sorted(set(paths))
    if not unique:
        return DeleteReport(0, 0)
    if is_s3(fs):
        batches = [unique[i:i + S3_BATCH] for i in range(0, len(unique), S3_BATCH)]
        refused = [f for found in parallel(lambda b: _delete_batch(fs, b, retrying), batches) for f in found]
        requests = len(batches)
    else:
        refused, requests = [(p, "") for p in unique], 0
    if not refused:
        return DeleteReport(len(unique), requests)
    again = parallel(lambda pr: _delete_one(fs, pr[0], retrying), refused)
    failed = tuple(DeleteFailure(path, why) for (path, _), why in zip(refused, again) if why is not None)
    if is_s3(fs):
        return DeleteReport(len(unique), requests + len(refused), len(refused), failed)
    return DeleteReport(len(unique), len(refused), 0, failed)


def _delete_batch(fs: Any, paths: list[str], retrying: Retrying) -> list[tuple[str, str]]:
    """One DeleteObjects of `paths` (one bucket each: a batch of several buckets is split); the
    paths it did not delete, with the store's reason."""
    from fsspec.asyn import sync

    by_bucket: dict[str, list[str]] = {}
    for path in paths:
        by_bucket.setdefault(fs.split_path(path)[0], []).append(path)
    refused: list[tuple[str, str]] = []
    for bucket, group in by_bucket.items():
        keys = {fs.split_path(p)[1]: p for p in group}
        for path in group:
            storage_step("delete", path)
            fs.invalidate_cache(path)
            fs.invalidate_cache(posixpath.dirname(path))
        request = {"Objects": [{"Key": key} for key in keys], "Quiet": True}
        try:
            call = partial(sync, fs.loop, fs._call_s3, "delete_objects", Bucket=bucket, Delete=request)
            out = retrying(f"deleting {len(keys)} files in {bucket}", call)
        except (OSError, StorageError) as e:  # the request as a whole: each key on its own next
            refused += [(p, f"{type(e).__name__}: {e}") for p in group]
            continue
        for error in out.get("Errors", []) or []:
            if error.get("Code") == "NoSuchKey":
                continue
            path = keys.get(error.get("Key", ""), f"{bucket}/{error.get('Key')}")
            refused.append((path, f"{error.get('Code', 'Error')}: {error.get('Message', '')}".rstrip(": ")))
    return refused


def _delete_one(fs: Any, path: str, retrying: Retrying) -> str | None:
    """Delete one file; None when it is gone, else why not."""
    storage_step("delete", path)
    try:
        retrying(f"deleting {path}", fs.rm_file, path)
    except FileNotFoundError:
        return None
    except (OSError, StorageError) as e:
        return f"{type(e).__name__}: {e}"
    return None
