"""Exactly-once Parquet sink: rows become visible only when their checkpoint completes.

Tasks write their changed rows to `<output>/_staging/<job>/chk-<N>/` (readers skip `_`
directories). The staged names travel in the checkpoint's `_metadata`; once `_metadata` is
committed the driver moves them to `<output>/part-<job>~<N>~<operator>~<subtask>.parquet`
(`~` appears in no job id, operator name or number, so a name parses one way only: job `etl`
never takes job `etl-20240101`'s files for its own). The move is idempotent, so a driver that
died between the checkpoint and the move finishes it on restart; a batch that failed never
leaves its staging directory, and its replay is committed under the replay's checkpoint. Several
jobs may share one output directory, and output directories may have `[` in their names.
"""

from __future__ import annotations

import logging
import posixpath
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import fsspec
import pandas as pd

from sparkpoint.checkpoint.interleave import storage_step
from sparkpoint.checkpoint.storage import move_file, storage_url
from sparkpoint.tables.erasing import erase_in_files
from sparkpoint.tables.files import (
    files_below,
    footer_facts,
    present,
    remove_file,
    remove_tree,
    rows_table,
    write_parquet,
)
from sparkpoint.tables.sink import RowsErased, SinkError

log = logging.getLogger(__name__)
_PART = re.compile(
    r"^part-(?P<job>[A-Za-z0-9][A-Za-z0-9._-]*)~(?P<cid>[0-9]{8,})~(?P<op>[A-Za-z0-9][A-Za-z0-9._-]*)~[0-9]{5,}\.parquet$"
)
_STAGED = re.compile(r"^chk-(\d+)/([A-Za-z0-9_.-]+-\d{5})-[0-9a-f]{12}\.parquet$")  # after "_staging/<job>/"


class SinkOutputLost(SinkError):
    """A committed checkpoint's output file is gone: neither its staged copy nor its visible file
    exists, so the rows the checkpoint says it wrote are lost."""


@dataclass(frozen=True)
class ExactlyOnceParquetSink:
    url: str
    job_id: str
    storage_options: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def at(cls, url: str, job_id: str, storage_options: dict[str, Any] | None = None) -> ExactlyOnceParquetSink:
        sink = cls(storage_url(url).rstrip("/"), job_id, tuple(sorted((storage_options or {}).items())))
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

    def check_start(self, outputs: Mapping[str, Sequence[tuple[str, str]]]) -> None:
        """Nothing to refuse before Spark starts: a directory takes any columns."""

    def for_tasks(self) -> ExactlyOnceParquetSink:
        """What the tasks of the next checkpoint stage with: this sink (a directory has no schema)."""
        return self

    def stage(self, checkpoint_id: int, operator: str, subtask: int, rows: pd.DataFrame) -> list[str]:
        """Write one subtask's changed rows for checkpoint N, invisible; returns the staged name
        (none for no rows)."""
        if rows.empty:
            return []
        fs, root = self._fs()
        rel = f"chk-{checkpoint_id}/{operator}-{subtask:05d}-{uuid.uuid4().hex[:12]}.parquet"
        path = f"{root}/{self._staging}/{rel}"
        fs.makedirs(posixpath.dirname(path), exist_ok=True)
        storage_step("write", path)
        write_parquet(fs, path, rows_table(rows, checkpoint_id))
        return [rel]

    # --- on the driver ---------------------------------------------------------------------------

    def commit(self, checkpoint_id: int, staged: list[str], *, resuming: bool = False) -> int:
        """Make checkpoint N's staged rows visible; safe to repeat, and safe while another process
        commits the same checkpoint (a start settling the latest checkpoint beside its late
        completer). Returns files moved now.

        Raises SinkOutputLost when a file is neither staged nor visible: checkpoint N is committed
        and says it wrote those rows, so their loss is an error, never a warning. With `resuming`
        (a later start finishing a commit a crash may have cut short) a commit that finished
        before, its staging directory gone, is left as it is: its visible files are the user's
        from then on (a downstream job may move them)."""
        fs, root = self._fs()
        if resuming and staged and not present(fs, f"{root}/{self._staging}/chk-{checkpoint_id}"):
            return 0
        moved = 0
        for rel in staged:
            operator, subtask = _staged_of(rel, checkpoint_id)
            source = f"{root}/{self._staging}/{rel}"
            target = f"{root}/{part_name(self.job_id, checkpoint_id, operator, int(subtask))}"
            storage_step("move", f"{source} -> {target}")
            try:
                move_file(fs, source, target)
                moved += 1
                continue
            except FileNotFoundError:  # moved before (a repeat), or by another process just now
                pass
            storage_step("info", target)
            fs.invalidate_cache(posixpath.dirname(target))
            if not present(fs, target):
                raise SinkOutputLost(
                    f"checkpoint {checkpoint_id} is committed with output {target}, but neither that file nor its "
                    f"staged copy {source} exists: rows it wrote are lost. Put the file back from a backup of the "
                    f"output. Or, when an older checkpoint is retained (`sparkpoint list`), delete "
                    f"chk-{checkpoint_id}/_metadata by hand so that its batch is processed again from that one (with "
                    "none retained, the job would start empty and write all its output again)"
                )
        storage_step("delete", f"{root}/{self._staging}/chk-{checkpoint_id}")
        remove_tree(fs, f"{root}/{self._staging}/chk-{checkpoint_id}")
        return moved

    def discard_staged(self, checkpoint_id: int, staged: list[str]) -> None:
        """Delete these staged files of checkpoint N only: another attempt at N may be live.
        Every name must be one `stage` makes (never a path that leaves the staging directory)."""
        fs, root = self._fs()
        for rel in staged:
            _staged_of(rel, checkpoint_id)
        for rel in staged:
            storage_step("delete", f"{root}/{self._staging}/{rel}")
            remove_file(fs, f"{root}/{self._staging}/{rel}")

    def committed(self, after: int = 0) -> dict[int, list[str]]:
        """This job's visible part files by checkpoint id, of the checkpoints above `after`: only
        those are kept while the listing is read (the directory holds the output of every
        checkpoint the job ever made)."""
        fs, root = self._fs()
        storage_step("list", f"{root}/part-*")
        if not fs.exists(root):
            return {}
        out: dict[int, list[str]] = {}
        fs.invalidate_cache(root)
        for path in fs.ls(root, detail=False):
            m = _PART.match(posixpath.basename(path.rstrip("/")))
            if m and m.group("job") == self.job_id and int(m.group("cid")) > after:
                out.setdefault(int(m.group("cid")), []).append(path)
        return out

    def rollback(self, after: int) -> list[int]:
        """Hide the output of checkpoints newer than `after` (they are about to be replayed)."""
        return self.drop(list(self.committed(after)))

    def drop(self, checkpoint_ids: list[int]) -> list[int]:
        """Delete the visible output of these checkpoints; returns the ids that had any."""
        fs, _ = self._fs()
        committed = self.committed(min(checkpoint_ids, default=1) - 1)
        dropped = sorted(cid for cid in set(checkpoint_ids) if cid in committed)
        for cid in dropped:
            for path in committed[cid]:
                storage_step("delete", path)
                fs.rm_file(path)
        return dropped

    def facts(self, checkpoint_id: int, staged: list[str]) -> dict[str, Any]:
        """What checkpoint N made visible (`staged`: its `_metadata`'s sink entries): part files,
        rows and columns, from those files' footers (the output directory is never listed: it grows
        by a file per subtask and checkpoint)."""
        fs, root = self._fs()
        names = [part_name(self.job_id, checkpoint_id, op, int(sub))
                 for op, sub in (_staged_of(rel, checkpoint_id) for rel in staged)]
        return footer_facts(fs, self.url, [f"{root}/{name}" for name in names])

    def discard_staging(self, up_to: int) -> None:
        """Delete staging of checkpoints up to `up_to` that never completed. Newer ones may be
        a live writer's (a zombie racing for the next id): they are invisible and left alone."""
        fs, root = self._fs()
        storage_step("list", f"{root}/{self._staging}/chk-*")
        if not fs.exists(f"{root}/{self._staging}"):
            return
        for path in fs.ls(f"{root}/{self._staging}", detail=False):
            name = posixpath.basename(path.rstrip("/"))
            if name.startswith("chk-") and name[4:].isdigit() and int(name[4:]) <= up_to:
                storage_step("delete", path.rstrip("/"))
                remove_tree(fs, path)

    def erase_rows(self, column: str, values: Sequence[object], *, dry_run: bool = False) -> RowsErased:
        """Remove this job's rows whose `column` holds one of `values` from every part file, and
        from staged files not yet committed (a later start would commit them as they are). Each
        file that holds such a row is rewritten under its own name (`sparkpoint.tables.erasing`):
        `committed`, `rollback` and `drop` see the same parts by checkpoint as before, one left
        empty included; the rest are read no further than their footer or key column."""
        fs, root = self._fs()
        scratch = f"{root}/_erase/{self.job_id}"
        if not dry_run:
            storage_step("delete", scratch)
            remove_tree(fs, scratch)  # copies a killed erase left: never visible, never moved
        files = [(cid, path) for cid, paths in sorted(self.committed().items()) for path in sorted(paths)]
        return erase_in_files(fs, self.url, column, list(values), files + self._staged_files(fs, root), scratch,
                              dry_run=dry_run)

    def _staged_files(self, fs: Any, root: str) -> list[tuple[int, str]]:
        """(checkpoint id, path) of every staged file of this job, not yet committed."""
        storage_step("walk", f"{root}/{self._staging}")
        return [(int(m.group(1)), path) for rel, path in files_below(fs, f"{root}/{self._staging}")
                if (m := _STAGED.fullmatch(rel))]


def _staged_of(rel: str, checkpoint_id: int) -> tuple[str, str]:
    """(operator, subtask) of a staged name of checkpoint N; SinkError for anything else."""
    m = _STAGED.fullmatch(rel)
    if not m or int(m.group(1)) != checkpoint_id:
        raise SinkError(f"{rel!r} is not a staged file of checkpoint {checkpoint_id}")
    operator, subtask = m.group(2).rsplit("-", 1)
    return operator, subtask


def part_name(job_id: str, checkpoint_id: int, operator: str, subtask: int) -> str:
    """The visible name of one subtask's output of one checkpoint."""
    return f"part-{job_id}~{checkpoint_id:08d}~{operator}~{subtask:05d}.parquet"
