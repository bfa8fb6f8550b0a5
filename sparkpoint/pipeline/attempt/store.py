"""The pending attempts' store: their records in checkpoint storage, `<job>/_pending/chk-<N>-<attempt
id>.json`, written whole by exclusive create, listed, loaded, forgotten once settled, and set
aside (`_pending/unreadable/`) when they cannot be read.

Storage rather than the orchestrator's IO layer, because recovery needs to find the attempts of
runs that died, from any process, with nothing but the checkpoint URL; the orphan sweep only looks
at `shared/` and `chk-*/`, so these files are managed here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from sparkpoint.checkpoint.errors import PathEscapesJobDirectory
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.pipeline.attempt.record import AttemptError, PendingAttempt
from sparkpoint.pipeline.claims import PENDING_DIR, generation_path

log = logging.getLogger(__name__)

UNREADABLE_DIR = f"{PENDING_DIR}/unreadable"  # attempt records set aside by `recover`
CLAIM_GENERATIONS = 4  # the generations of a claim a takeover may have made


def save_attempt(storage: CheckpointStorage, attempt: PendingAttempt) -> str:
    """Persist the attempt whole or not at all (exclusive create: a reader never sees half)."""
    storage.commit_exclusive(attempt.path, attempt.dumps())
    return attempt.path


@dataclass(frozen=True)
class AttemptListing:
    """The job's persisted attempts, oldest checkpoint first, and the records that cannot be read."""

    attempts: tuple[PendingAttempt, ...]
    unreadable: dict[str, str]  # path under the job directory -> why


def list_attempts(storage: CheckpointStorage) -> AttemptListing:
    """Every persisted attempt; an unreadable record is reported, never an error for the others."""
    found, unreadable = [], {}
    for f in storage.walk(PENDING_DIR):
        if not f.path.endswith(".json") or f.path.startswith(UNREADABLE_DIR + "/"):
            continue
        try:
            found.append(PendingAttempt.loads(storage.read_bytes(f.path), where=f"{storage.job_url}/{f.path}"))
        except FileNotFoundError:  # settled by another process meanwhile
            continue
        except (AttemptError, PathEscapesJobDirectory) as e:  # its content, or a link: never readable
            unreadable[f.path] = str(e)
    if unreadable:
        log.error("unreadable pending attempt records (run the recover job to set them aside): %s",
                  "; ".join(f"{p}: {why}" for p, why in sorted(unreadable.items())))
    return AttemptListing(tuple(sorted(found, key=lambda a: (a.checkpoint_id, a.attempt_id))), unreadable)


def pending_attempts(storage: CheckpointStorage) -> list[PendingAttempt]:
    """Every readable persisted attempt of the job, oldest checkpoint first."""
    return list(list_attempts(storage).attempts)


def load_attempt(storage: CheckpointStorage, attempt_id: str) -> PendingAttempt | None:
    """The attempt `attempt_id` persisted (None when it persisted none: no batch was pending)."""
    listing = list_attempts(storage)
    mine = [p for p in listing.unreadable if p.endswith(f"-{attempt_id}.json")]
    if mine:
        raise AttemptError(f"{storage.job_url}/{mine[0]} cannot be read ({listing.unreadable[mine[0]]}); the recover "
                           "job sets it aside and processes its batch again")
    found = [a for a in listing.attempts if a.attempt_id == attempt_id]
    if len(found) > 1:
        raise AttemptError(f"attempt {attempt_id} persisted {len(found)} pending checkpoints; run the recover job")
    return found[0] if found else None


def pending_paths(storage: CheckpointStorage) -> set[str]:
    """Files the persisted attempts reference: the orphan sweep must keep them."""
    return {f.path for a in pending_attempts(storage) for f in a.new_files()}


def set_aside_unreadable(storage: CheckpointStorage, listing: AttemptListing) -> list[str]:
    """Move unreadable attempt records to `_pending/unreadable/` (kept for a look, never read
    again); their uploads are the orphan sweep's after its grace period. Returns the new paths."""
    moved = []
    for path, why in sorted(listing.unreadable.items()):
        target = f"{UNREADABLE_DIR}/{path.rpartition('/')[2]}"
        try:
            data = storage.read_bytes(path)
        except FileNotFoundError:
            continue
        try:
            storage.commit_exclusive(target, data)
        except FileExistsError:
            pass  # set aside before (a crash before the delete below)
        storage.delete([path])
        log.warning("set aside the unreadable pending attempt %s/%s as %s (%s)", storage.job_url, path, target, why)
        moved.append(target)
    return moved


def forget_tombstones(storage: CheckpointStorage) -> int:
    """Delete the claims of settled attempts (no record left) at or below the latest completed
    checkpoint: a completer of such an attempt can never commit any more (chk-N is another
    writer's, so its exclusive create fails, or a newer checkpoint exists, so its commit is
    declined or withdrawn)."""
    latest = max(storage.completed_checkpoint_ids(), default=0)
    doomed = []
    for f in storage.walk(PENDING_DIR):
        name = f.path.rpartition("/")[2]
        base, dot, generation = f.path.rpartition(".")
        if dot and generation.isdigit():  # a takeover's generation: `chk-N-<id>.claim.<g>`
            base, name = base, base.rpartition("/")[2]
        else:
            base = f.path
        if not f.path.startswith(f"{PENDING_DIR}/chk-") or not base.endswith(".claim"):
            continue
        cid = name[len("chk-"):].partition("-")[0]
        if cid.isdigit() and int(cid) <= latest and not storage.exists(base[: -len(".claim")] + ".json"):
            doomed.append(f.path)
    storage.delete(doomed)
    storage.remove_empty_dirs(PENDING_DIR)
    return len(doomed)


def forget_attempt(storage: CheckpointStorage, attempt: PendingAttempt) -> None:
    """A committed attempt: its record and its claim (every generation a takeover may have made;
    any left over is a tombstone `forget_tombstones` deletes)."""
    claims = [generation_path(attempt.checkpoint_id, attempt.attempt_id, g) for g in range(CLAIM_GENERATIONS)]
    storage.delete([attempt.path, *claims])
    storage.remove_empty_dirs(PENDING_DIR)
