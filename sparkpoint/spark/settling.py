"""When an input file has settled: its size and modification time unchanged for a while (DESIGN
rule 18). A file still being copied (a local `cp`, NFS, a FUSE mount, an upload that shows while
in progress) fails every content check, so a verdict on it means nothing until it has settled.

One rule for every reader: the Dagster input sensor before it offers a file, `--follow` and every
batch (`sparkpoint run`, a Dagster or Airflow run) before a file that fails its checks is skipped
or refused. "Unchanged for `settle_seconds`" is seen from the file's modification time, or across
two looks at it (`FileSeen` keeps the earlier look: a filesystem whose clock runs ahead, or that
gives no time).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from sparkpoint.spark.source import BatchStat

SETTLE_SECONDS = 2.0  # a file unchanged this long is complete (a copy writes more often than that)


@dataclass(frozen=True)
class FileSeen:
    """A file as one look saw it, and since when it has looked so."""

    name: str
    size: int
    modified: float | None
    since: float

    def to_cursor(self) -> str:
        return json.dumps({"file": self.name, "size": self.size, "modified": self.modified, "since": self.since})

    @classmethod
    def from_cursor(cls, cursor: str | None) -> FileSeen | None:
        """None for no cursor, or an earlier version's."""
        try:
            raw = json.loads(cursor or "null")
            return cls(str(raw["file"]), int(raw["size"]), raw["modified"], float(raw["since"]))
        except (ValueError, TypeError, KeyError):
            return None


def settle(before: FileSeen | None, name: str, stat: BatchStat, now: float,
           settle_seconds: float = SETTLE_SECONDS) -> tuple[FileSeen, str | None]:
    """(what to keep for the next look, None when `name` has settled, otherwise what to wait for).
    `before`: the last look at it (None: this is the first)."""
    same = before is not None and (before.name, before.size, before.modified) == (name, stat.size, stat.modified)
    seen = before if same and before is not None else FileSeen(name, stat.size, stat.modified, now)
    quiet = now - seen.since
    if stat.modified is not None:
        quiet = max(quiet, now - stat.modified)
    if quiet >= settle_seconds:
        return seen, None
    return seen, (f"waiting for {name} to settle: {stat.size} bytes, unchanged for {max(quiet, 0.0):.1f} s of "
                  f"{settle_seconds:g} s (a file still being written is not read)")
