"""The orphan sweep (rule 8): files nobody references, left by failed or killed uploads."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass

from sparkpoint.checkpoint.errors import DeletionBlocked
from sparkpoint.checkpoint.paths import checkpoint_id_of_dir
from sparkpoint.checkpoint.storage import CheckpointStorage, StoredFile
from sparkpoint.checkpoint.store import CompletedCheckpointStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SweepReport:
    orphans: tuple[StoredFile, ...]
    deleted: bool
    referenced: int
    symlinks: tuple[StoredFile, ...] = ()  # links found in the job directory: reported, never followed
    young: tuple[StoredFile, ...] = ()  # unreferenced, kept: younger than the grace period (a writer may use them)

    @property
    def young_bytes(self) -> int:
        return sum(f.size for f in self.young)

    @property
    def orphan_bytes(self) -> int:
        return sum(f.size for f in self.orphans)


def select_orphans(
    files: Iterable[StoredFile], referenced: set[str], grace_seconds: float, now: float
) -> list[StoredFile]:
    """Pure part: unreferenced files under `shared/` or `chk-*/` at least `grace_seconds` old.

    A file whose age the filesystem does not tell counts as brand new (when in doubt, keep).
    """
    orphans = []
    for f in files:
        if f.symlink:
            continue
        top = f.path.split("/", 1)[0]
        if top != "shared" and checkpoint_id_of_dir(top) is None:
            continue
        if f.path in referenced:
            continue
        age = now - f.modified if f.modified > 0 else 0.0
        if age >= grace_seconds:
            orphans.append(f)
    return sorted(orphans, key=lambda f: f.path)


def referenced_paths(storage: CheckpointStorage, pending_paths: Iterable[str] = ()) -> tuple[set[str], dict[int, str]]:
    """Every path a retained checkpoint references (its files, its unowned files, its `_metadata`),
    those of `pending_paths`, and the `_metadata` of the checkpoints that cannot be read (id -> why):
    one `_metadata` parsed at a time, so what stays is the set of paths."""
    referenced = set(pending_paths)
    unreadable: dict[int, str] = {}
    for cid, outcome in CompletedCheckpointStore(storage).stream():
        if isinstance(outcome, str):
            unreadable[cid] = outcome
            referenced.add(f"chk-{cid}/_metadata")  # a dry run shows what would go, never these
            continue
        referenced |= outcome.paths() | outcome.unowned
        referenced.add(outcome.metadata_path)
    return referenced, unreadable


def sweep_orphans(
    storage: CheckpointStorage,
    *,
    grace_seconds: float = 3600.0,
    dry_run: bool = False,
    pending_paths: Iterable[str] = (),
    now: float | None = None,
) -> SweepReport:
    """Delete (or with `dry_run`, list) files no retained or pending checkpoint references.

    Refuses to delete anything while some `_metadata` cannot be read.
    """
    if not math.isfinite(grace_seconds) or grace_seconds < 0:  # nan would never delete, silently
        raise ValueError(f"the grace period must be a finite number of seconds >= 0, got {grace_seconds}")
    referenced, unreadable = referenced_paths(storage, pending_paths)
    if unreadable and not dry_run:
        raise DeletionBlocked(
            "orphan sweep refused: "
            + "; ".join(f"chk-{cid}/_metadata cannot be read ({why})" for cid, why in sorted(unreadable.items()))
            + ". Its files may still be needed: repair or remove that checkpoint by hand first."
        )
    files = storage.walk("shared") + [f for cid in storage.checkpoint_dirs() for f in storage.walk(f"chk-{cid}")]
    links = tuple(sorted((f for f in files if f.symlink), key=lambda f: f.path))
    for link in links:
        log.warning("%s/%s is a symbolic link: the sweep neither follows nor deletes it", storage.job_url, link.path)
    now = time.time() if now is None else now
    orphans = select_orphans(files, referenced, grace_seconds, now)
    unreferenced = select_orphans(files, referenced, 0.0, now + 1.0)  # any age
    if unreadable:
        blocked_dirs = tuple(f"chk-{cid}/" for cid in sorted(unreadable))
        orphans = [f for f in orphans if not f.path.startswith(blocked_dirs)]
        unreferenced = [f for f in unreferenced if not f.path.startswith(blocked_dirs)]
    old = {f.path for f in orphans}
    young = tuple(f for f in unreferenced if f.path not in old)
    if not dry_run and orphans:
        storage.delete(f.path for f in orphans)
        storage.remove_empty_dirs("shared")
        for cid in storage.checkpoint_dirs():
            storage.remove_empty_dirs(f"chk-{cid}")
    return SweepReport(orphans=tuple(orphans), deleted=not dry_run, referenced=len(referenced), symlinks=links,
                       young=young)
