"""Listing an input directory from a name on: what a run asks of storage does not grow with the
names it consumed long ago.

Names are relative to the input directory: a file's (`b-000123.parquet`), or, inside a date
partition `date=YYYY-MM-DD/`, the partition's and the file's (`date=2026-11-29/b-1.parquet`).
`names(after)` gives every name above `after` in code point order (S3's):

* On S3 (s3fs) it asks only for keys after it (`ListObjectsV2` with `StartAfter`): one request
  per 1,000 names listed, whatever lies below.
* Date partitions before `after`'s are not listed; its own is listed from `after` on.
* Elsewhere a directory is listed whole (a local directory: one `scandir`) and the names at or
  below `after` dropped.

`after=None` lists everything (`--rescan`, or offsets that settle nothing yet).
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass, field
from typing import Any

PARTITION = re.compile(r"date=\d{4}-\d{2}-\d{2}")


def is_partition(name: str) -> bool:
    """`name` is a date partition's directory name (`date=YYYY-MM-DD`)."""
    return PARTITION.fullmatch(name) is not None


@dataclass
class Entry:
    """One name a listing found: a file or a directory (`info`: what S3's listing says of a file,
    its size and modification time; elsewhere nothing)."""

    name: str
    directory: bool
    info: dict[str, Any] = field(default_factory=dict)


class DirectoryLister:
    """Lists the input directory at `root` of filesystem `fs` from a name on, counting requests."""

    def __init__(self, fs: Any, root: str):
        self.fs, self.root = fs, root
        self.requests = 0  # listing requests made (S3: ListObjectsV2 pages; elsewhere: directories listed)
        self._s3 = is_s3(fs)

    def names(self, after: str | None = None) -> list[Entry]:
        """Every entry above `after` in name order: files, partition files, and other directories
        (as names, never entered)."""
        # From `after`'s partition on (that partition included), when `after` is in one.
        part = after.split("/", 1)[0] if after is not None and "/" in after else None
        out: list[Entry] = []
        for entry in self._list("", part or after, inclusive=part is not None):
            if entry.directory and is_partition(entry.name):
                inner = after.split("/", 1)[1] if after is not None and after.startswith(entry.name + "/") else None
                out += [Entry(f"{entry.name}/{e.name}", e.directory, e.info) for e in self._list(entry.name, inner)]
            elif after is None or entry.name > after:
                out.append(entry)
        return sorted((e for e in out if after is None or e.name > after), key=lambda e: e.name)

    def _list(self, sub: str, after: str | None, inclusive: bool = False) -> list[Entry]:
        """The entries of directory `sub` above `after` (`inclusive`: and `after` itself)."""
        path = posixpath.join(self.root, sub) if sub else self.root
        if self._s3:  # a key equal to `after` is a file no partition is: StartAfter passing it loses nothing
            return self._s3_list(path, after)
        self.requests += 1
        self.fs.invalidate_cache(path)
        names = (posixpath.basename(str(p).rstrip("/")) for p in self.fs.ls(path, detail=False))
        # Names only (a directory of 10^4 entries costs no 10^4 dicts): a partition is known by its name.
        return [Entry(n, is_partition(n) and not sub) for n in names
                if after is None or n > after or (inclusive and n == after)]

    def _s3_list(self, path: str, after: str | None) -> list[Entry]:
        bucket, key, _ = self.fs.split_path(path)
        prefix = key.rstrip("/") + "/" if key else ""
        kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix, "Delimiter": "/"}
        if after is not None:
            kwargs["StartAfter"] = prefix + after
        found: list[Entry] = []
        while True:
            self.requests += 1
            page = self.fs.call_s3("list_objects_v2", **kwargs)
            found += [Entry(c["Key"][len(prefix):], False, {"size": c.get("Size", 0), "LastModified":
                                                            c.get("LastModified")})
                      for c in page.get("Contents", []) if c["Key"] != prefix]
            found += [Entry(p["Prefix"][len(prefix):].rstrip("/"), True) for p in page.get("CommonPrefixes", [])]
            if not page.get("IsTruncated"):
                return found
            kwargs = {**kwargs, "ContinuationToken": page["NextContinuationToken"]}


def protocols(fs: Any) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def is_s3(fs: Any) -> bool:
    return bool({"s3", "s3a"} & set(protocols(fs))) and hasattr(fs, "call_s3") and hasattr(fs, "split_path")
