"""Exactly-once Parquet sink: rows become visible only when their checkpoint completes.

Tasks write their changed rows to `<output>/_staging/chk-<N>/` (readers skip `_` directories).
The staged names travel in the checkpoint's `_metadata`; once `_metadata` is committed the
driver moves them to `<output>/part-<N>-<subtask>.parquet`. The move is idempotent, so a driver
that died between the checkpoint and the move finishes it on restart; a batch that failed never
leaves its staging directory, and its replay writes under the replay's checkpoint id.
"""

from __future__ import annotations

import logging
import posixpath
import re
import uuid
from dataclasses import dataclass
from typing import Any

import fsspec
import pandas as pd

from sparkpoint.core.errors import SparkpointError

log = logging.getLogger(__name__)
_PART = re.compile(r"^part-(\d{8})-(\d{5})\.parquet$")
_STAGED = re.compile(r"^_staging/chk-(\d+)/(\d{5})-[0-9a-f]{12}\.parquet$")


class SinkError(SparkpointError):
    """The output location cannot be written as asked."""


@dataclass(frozen=True)
class ExactlyOnceParquetSink:
    url: str
    storage_options: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def at(cls, url: str, storage_options: dict[str, Any] | None = None) -> ExactlyOnceParquetSink:
        sink = cls(url.rstrip("/"), tuple(sorted((storage_options or {}).items())))
        try:
            sink._fs()
        except (ValueError, ImportError) as e:
            raise SinkError(f"cannot open output {url!r}: {e}") from e
        return sink

    def _fs(self) -> tuple[Any, str]:
        fs, root = fsspec.core.url_to_fs(self.url, **dict(self.storage_options))
        return fs, root.rstrip("/")

    # --- in the tasks ----------------------------------------------------------------------------

    def stage(self, checkpoint_id: int, subtask: int, rows: pd.DataFrame) -> str | None:
        """Write one subtask's changed rows for checkpoint N, invisible; returns the staged name."""
        if rows.empty:
            return None
        fs, root = self._fs()
        rel = f"_staging/chk-{checkpoint_id}/{subtask:05d}-{uuid.uuid4().hex[:12]}.parquet"
        fs.makedirs(posixpath.dirname(f"{root}/{rel}"), exist_ok=True)
        frame = rows.assign(checkpoint_id=pd.Series([checkpoint_id] * len(rows), dtype="int64", index=rows.index))
        with fs.open(f"{root}/{rel}", "wb") as f:
            frame.to_parquet(f, index=False)
        return rel

    # --- on the driver ---------------------------------------------------------------------------

    def commit(self, checkpoint_id: int, staged: list[str]) -> int:
        """Make checkpoint N's staged rows visible; safe to repeat. Returns files moved now."""
        fs, root = self._fs()
        moved = 0
        for rel in staged:
            m = _STAGED.match(rel)
            if not m or int(m.group(1)) != checkpoint_id:
                raise SinkError(f"{rel!r} is not a staged file of checkpoint {checkpoint_id}")
            target = f"{root}/part-{checkpoint_id:08d}-{m.group(2)}.parquet"
            if fs.exists(f"{root}/{rel}"):
                fs.mv(f"{root}/{rel}", target)
                moved += 1
            elif not fs.exists(target):
                raise SinkError(
                    f"checkpoint {checkpoint_id} staged {rel} but neither it nor {target} exists: "
                    "the output was changed by hand"
                )
        self._remove(fs, f"{root}/_staging/chk-{checkpoint_id}")
        return moved

    def committed(self) -> dict[int, list[str]]:
        """Visible part files by checkpoint id."""
        fs, root = self._fs()
        if not fs.exists(root):
            return {}
        out: dict[int, list[str]] = {}
        for path in fs.ls(root, detail=False):
            m = _PART.match(posixpath.basename(path))
            if m:
                out.setdefault(int(m.group(1)), []).append(path)
        return out

    def rollback(self, after: int) -> list[int]:
        """Hide the output of checkpoints newer than `after` (they are about to be replayed)."""
        fs, _ = self._fs()
        dropped = sorted(cid for cid in self.committed() if cid > after)
        for cid in dropped:
            for path in self.committed()[cid]:
                fs.rm_file(path)
        return dropped

    def discard_staging(self, keep: set[int]) -> None:
        """Delete staging directories of checkpoints that never completed."""
        fs, root = self._fs()
        if not fs.exists(f"{root}/_staging"):
            return
        for path in fs.ls(f"{root}/_staging", detail=False):
            name = posixpath.basename(path.rstrip("/"))
            if name.startswith("chk-") and name[4:].isdigit() and int(name[4:]) not in keep:
                self._remove(fs, path)

    @staticmethod
    def _remove(fs: Any, path: str) -> None:
        try:
            fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass
