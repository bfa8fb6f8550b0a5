"""Repairing stable storage from task-local copies (beyond what Flink and Spark do).

A subtask keeps its last confirmed checkpoint on local disk (`<local_dir>/<job_id>/<operator>/
<subtask>/chk-<N>/`, see `backend`) and its working database in `db/`. When a file in stable
storage is missing or differs from `_metadata`, a local file of the same local name with exactly
the recorded size and CRC32 is the same content: it is written back to the primary path, said
loudly. Nothing is ever repaired from a file that does not match `_metadata`, and nothing is
written outside the job's own directory (every path goes through `CheckpointStorage`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from sparkpoint.checkpoint.errors import CheckpointCorrupted, SparkpointError
from sparkpoint.checkpoint.files import FileProblem, check_local_file
from sparkpoint.checkpoint.interleave import storage_step
from sparkpoint.checkpoint.metadata import CheckpointMetadata, FileHandle
from sparkpoint.checkpoint.paths import checkpoint_id_of_dir
from sparkpoint.checkpoint.storage import CheckpointStorage

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RepairedFile:
    path: str
    source: str  # the local copy it was rewritten from


@dataclass
class RepairReport:
    repaired: list[RepairedFile] = field(default_factory=list)
    unrepairable: dict[str, str] = field(default_factory=dict)  # path -> what is wrong with it
    lost: list[str] = field(default_factory=list)  # messages: a bad file every retained checkpoint needs


def local_copies(operator_dir: Path, f: FileHandle) -> Iterator[Path]:
    """Where a task-local copy of `f` may be: every subtask's checkpoint copies and working db."""
    try:
        subtasks = sorted(p for p in operator_dir.iterdir() if p.is_dir() and not p.is_symlink())
    except (FileNotFoundError, NotADirectoryError):
        return
    for sub in subtasks:
        dirs = sorted((d for d in sub.iterdir() if checkpoint_id_of_dir(d.name) is not None), reverse=True)
        for d in [*dirs, sub / "db"]:
            yield d / f.local_name


def good_local_copy(operator_dir: Path, f: FileHandle) -> Path | None:
    """The first local file with exactly the size and CRC32 `_metadata` records for `f`."""
    for candidate in local_copies(operator_dir, f):
        storage_step("read", str(candidate))  # a task-local copy, read by the driver beside running tasks
        if candidate.is_file() and not candidate.is_symlink() and check_local_file(candidate, f) is None:
            return candidate
    return None


def rewrite_primary(storage: CheckpointStorage, f: FileHandle, local: Path) -> None:
    """Write the verified local copy `local` back to `f.path`; checks what it wrote."""
    written = storage.upload([(str(local), f.path)], f.created_by)[0]
    if (written.size, written.crc32) != (f.size, f.crc32):
        raise CheckpointCorrupted(
            f"{local} changed while it was copied to {f.path}; the primary copy is still bad", path=f.path
        )
    log.warning(
        "REPAIRED %s/%s from the task-local copy %s (size %d, CRC32 %08x, as _metadata records)",
        storage.job_url, f.path, local, f.size, f.crc32,
    )


def repair_files(
    storage: CheckpointStorage, operator_dir: Path, bad: Iterable[tuple[FileHandle, str]]
) -> RepairReport:
    """Rewrite each (file, problem) from a good task-local copy where one exists."""
    report = RepairReport()
    for f, problem in bad:
        local = good_local_copy(operator_dir, f)
        if local is None:
            report.unrepairable[f.path] = f"{problem}; no task-local copy has the recorded size and CRC32"
            continue
        try:
            rewrite_primary(storage, f, local)
        except (SparkpointError, OSError) as e:
            report.unrepairable[f.path] = f"{problem}; rewriting it from {local} failed: {e}"
            continue
        report.repaired.append(RepairedFile(f.path, str(local)))
    return report


def repair_checkpoints(
    storage: CheckpointStorage,
    local_dir: str | Path,
    checkpoints: list[CheckpointMetadata],
    *,
    deep: bool = True,
    retained: list[CheckpointMetadata] | None = None,
) -> RepairReport:
    """Verify `checkpoints` and repair every bad file that has a good local copy.

    `lost` names each file that stays bad although every retained checkpoint (`retained`, by
    default `checkpoints`) needs it.
    """
    from sparkpoint.state.engine.verify import verify_checkpoint

    where: dict[str, tuple[str, FileHandle]] = {}
    bad: dict[str, str] = {}
    for meta in checkpoints:
        for op, state in meta.operators.items():
            for h in state.subtasks:
                for f in h.stored():
                    where.setdefault(f.path, (op, f))
        for p in verify_checkpoint(storage, meta, deep=deep):
            bad.setdefault(p.path, p.problem)
    report = RepairReport()
    for op in sorted({where[p][0] for p in bad}):
        part = repair_files(storage, Path(local_dir) / storage.job_id / op,
                            [(where[p][1], why) for p, why in sorted(bad.items()) if where[p][0] == op])
        report.repaired += part.repaired
        report.unrepairable.update(part.unrepairable)
    retained = checkpoints if retained is None else retained
    ids = [m.checkpoint_id for m in retained]
    for path, why in sorted(report.unrepairable.items()):
        if retained and all(path in m.paths() for m in retained):
            report.lost.append(every_checkpoint_needs(path, ids, why))
    return report


def every_checkpoint_needs(path: str, checkpoint_ids: list[int], problem: str) -> str:
    """The message that stops a run: one bad file, needed by every retained checkpoint, no good copy."""
    return (
        f"{path} is corrupt or missing ({problem}) and every retained checkpoint "
        f"({', '.join(f'chk-{c}' for c in sorted(checkpoint_ids, reverse=True))}) needs it; no good copy exists, "
        "neither in stable storage nor in a task-local directory. No retained checkpoint can be restored: restore "
        "the file from a backup (size and CRC32 are in _metadata) or start the job from a savepoint"
    )


def problems_of_handle_files(storage: CheckpointStorage, files: list[FileHandle], *, deep: bool) -> list[FileProblem]:
    """`verify_checkpoint` for some files of one subtask."""
    from sparkpoint.state.engine.verify import check_stored_file

    # Sizes on a local disk are a stat each: threads would cost more than the calls.
    workers = 1 if storage.is_local and not deep else None
    found = storage.parallel(lambda f: check_stored_file(storage, f, deep), files, workers=workers)
    return [p for p in found if p is not None]
