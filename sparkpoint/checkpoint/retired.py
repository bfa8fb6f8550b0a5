"""Checkpoint ids that were retired (discarded by a fallback or a rollback) are never taken again.

A table sink records every checkpoint id it committed (an Iceberg snapshot's summary, Delta's app
transaction version) and takes an id it recorded for a commit already done: a replayed batch
committed under a discarded checkpoint's id would be dropped as a repeat, silently. So before
any `_metadata` is discarded, `<job>/_retired/chk-<M>` is written for the highest id M going, and
every writer takes its next id above every such M (`next_id_after`), in any process, long after
the discarded `chk-*` directories are gone. The markers are a few bytes, one per fallback or
rollback; nothing deletes them (the sweep looks only under `shared/` and `chk-*/`).
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable

from sparkpoint.checkpoint.paths import checkpoint_id_of_dir
from sparkpoint.checkpoint.storage import CheckpointStorage

RETIRED_DIR = "_retired"


def record_retired(storage: CheckpointStorage, checkpoint_ids: Iterable[int], *, reason: str = "") -> None:
    """Note the highest of `checkpoint_ids` as retired, before any of them is discarded (a marker
    that exists already is written again: the same name, the same meaning)."""
    ids = list(checkpoint_ids)
    if ids:
        storage.write_bytes(f"{RETIRED_DIR}/chk-{max(ids)}", reason.encode())


def highest_retired(storage: CheckpointStorage) -> int:
    """The highest checkpoint id ever retired in this job directory (0: none)."""
    ids = (checkpoint_id_of_dir(posixpath.basename(f.path)) for f in storage.walk(RETIRED_DIR))
    return max((i for i in ids if i is not None), default=0)


def next_id_after(storage: CheckpointStorage, checkpoint_id: int) -> int:
    """The id a writer that resumes from `checkpoint_id` (0: from nothing) takes next: the one
    after it, or after the highest retired id when that is higher. Two writers that resume from
    the same checkpoint compute the same id, so the exclusive create of its `_metadata` still
    decides between them (DESIGN rule 6)."""
    return max(checkpoint_id, highest_retired(storage)) + 1
