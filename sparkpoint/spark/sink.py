"""Exactly-once Parquet sink: rows become visible only when their checkpoint completes.

Tasks write their changed rows to `<output>/_staging/<job>/chk-<N>/` (readers skip `_`
directories). The staged names travel in the checkpoint's `_metadata`; once `_metadata` is
committed the driver moves them to `<output>/part-<job>-<N>-<operator>-<subtask>.parquet`. The
move is idempotent, so a driver that died between the checkpoint and the move finishes it on
restart; a batch that failed never leaves its staging directory, and its replay is committed
under the replay's checkpoint. Several jobs may share one output directory.
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
_PART = re.compile(r"^(\d{8})-([A-Za-z0-9_.-]+-\d{5})\.parquet$")  # after "part-<job>-"
_STAGED = re.compile(r"^chk-(\d+)/([A-Za-z0-9_.-]+-\d{5})-[0-9a-f]{12}\.parquet$")  # after "_staging/<job>/"


class SinkError(SparkpointError):
    """The output location cannot be written as asked."""


@dataclass(frozen=True)
class ExactlyOnceParquetSink:
    url: str
    job_id: str
    storage_options: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def at(cls, url: str, job_id: str, storage_options: dict[str, Any] | None = None) -> ExactlyOnceParquetSink:
        sink = cls(url.rstrip("/"), job_id, tuple(sorted((storage_options or {}).items())))
        try:
            sink._fs()
        except (ValueError, ImportError) as e:
            raise SinkError(f"cannot open output {url!r}: {e}") from e
        return sink

    def _fs(self) -> tuple[Any, str]:
        fs, root = fsspec.core.url_to_fs(self.url, **dict(self.storage_options))
        return fs, root.rstrip("/")

    # --- in the tasks ----------------------------------------------------------------------------

    @property
    def _staging(self) -> str:
        return f"_staging/{self.job_id}"

    def stage(self, checkpoint_id: int, operator: str, subtask: int, rows: pd.DataFrame) -> str | None:
        """Write one subtask's changed rows for checkpoint N, invisible; returns the staged name."""
        if rows.empty:
            return None
        fs, root = self._fs()
        rel = f"chk-{checkpoint_id}/{operator}-{subtask:05d}-{uuid.uuid4().hex[:12]}.parquet"
        path = f"{root}/{self._staging}/{rel}"
        fs.makedirs(posixpath.dirname(path), exist_ok=True)
        frame = rows.assign(checkpoint_id=pd.Series([checkpoint_id] * len(rows), dtype="int64", index=rows.index))
        with fs.open(path, "wb") as f:
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
            target = f"{root}/part-{self.job_id}-{checkpoint_id:08d}-{m.group(2)}.parquet"
            if fs.exists(f"{root}/{self._staging}/{rel}"):
                fs.mv(f"{root}/{self._staging}/{rel}", target)
                moved += 1
            elif not fs.exists(target):  # rolled back after a fallback, or removed by hand
                log.warning("checkpoint %s: neither %s nor its staged file exists", checkpoint_id, target)
        self._remove(fs, f"{root}/{self._staging}/chk-{checkpoint_id}")
        return moved

    def committed(self) -> dict[int, list[str]]:
        """This job's visible part files by checkpoint id."""
        fs, root = self._fs()
        if not fs.exists(root):
            return {}
        out: dict[int, list[str]] = {}
        prefix = f"part-{self.job_id}-"
        for path in fs.ls(root, detail=False):
            name = posixpath.basename(path)
            m = _PART.match(name[len(prefix) :]) if name.startswith(prefix) else None
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

    def discard_staging(self, up_to: int) -> None:
        """Delete staging of checkpoints up to `up_to` that never completed. Newer ones may be
        a live writer's (a zombie racing for the next id): they are invisible and left alone."""
        fs, root = self._fs()
        if not fs.exists(f"{root}/{self._staging}"):
            return
        for path in fs.ls(f"{root}/{self._staging}", detail=False):
            name = posixpath.basename(path.rstrip("/"))
            if name.startswith("chk-") and name[4:].isdigit() and int(name[4:]) <= up_to:
                self._remove(fs, path)

    @staticmethod
    def _remove(fs: Any, path: str) -> None:
        try:
            fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass
