"""Who may act on a persisted attempt: its claim, a file created exclusively on storage.

`<job>/_pending/chk-<N>-<attempt id>.claim` is created by whichever side acts first: a completer
before it writes `_metadata`, an abort before it deletes anything, and a recovery *fence* before
it sweeps (so that an attempt of the failed run that was not persisted yet can never commit what
the sweep takes). Exclusion comes from the exclusive create, never from a look made before
acting (DESIGN rule 9).

The record says who holds the claim (side, host, boot, PID namespace, process id and its start
time, when, why), so a step that finds its own attempt claimed can tell the user what happened,
and a retry can take over a completion whose holder is known to be dead: a process of this host,
this boot and this PID namespace that no longer exists (a host name alone is shared by the pods
of a `hostNetwork` node). A takeover is itself an exclusive create, of the next *generation* of
the claim (`.claim.1`, `.claim.2`, ...): two retries never complete at once, and the one that
holds the newest generation is the completer. A claim is released only by its own writer.

A fence (`fence`) is recovery's word that a failed run's attempts may never commit:
`_fenced/<attempt id>`, which a completer reads again right after its `_metadata` landed and, if it
is there, withdraws that `_metadata` before anything else (DESIGN rule 9: a tombstone re-checked
after the commit), and a claim at the id such an attempt usually takes, which stops it earlier.
Fences older than `FENCE_LIFETIME` are deleted by `prune` (no zombie lives that long; and one that
did would find its swept uploads missing before it commits).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass

from sparkpoint.checkpoint.errors import CheckpointAlreadyExists
from sparkpoint.checkpoint.paths import validate_name
from sparkpoint.checkpoint.processes import boot_id as _boot_id
from sparkpoint.checkpoint.processes import pid_namespace as _pid_namespace
from sparkpoint.checkpoint.processes import process_start as _process_start
from sparkpoint.checkpoint.retired import next_id_after
from sparkpoint.checkpoint.storage import CheckpointStorage

log = logging.getLogger(__name__)

PENDING_DIR = "_pending"
COMPLETE, ABORT = "complete", "abort"  # the two sides that may claim an attempt


def claim_path(checkpoint_id: int, attempt_id: str) -> str:
    return f"{PENDING_DIR}/chk-{checkpoint_id}-{attempt_id}.claim"


FENCED_DIR = "_fenced"  # beside `_pending`: fences are no attempts
FENCE_LIFETIME = 7 * 24 * 3600.0


@dataclass(frozen=True)
class Claim:
    """One claim record, as stored (JSON)."""

    side: str
    at: float
    by: str  # unique per claim: a write whose response was lost is recognised as our own
    host: str = ""
    pid: int = 0
    pid_start: str | None = None
    reason: str = ""
    boot: str | None = None
    pidns: str | None = None

    @classmethod
    def mine(cls, side: str, reason: str = "") -> Claim:
        pid = os.getpid()
        return cls(side, time.time(), uuid.uuid4().hex, socket.gethostname(), pid, _process_start(pid), reason,
                   _boot_id(), _pid_namespace())

    def dumps(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def loads(cls, data: bytes) -> Claim:
        raw = json.loads(data)
        if not isinstance(raw, dict) or raw.get("side") not in (COMPLETE, ABORT):
            raise ValueError(f"not a claim record: {data[:120]!r}")
        def text(key: str) -> str | None:
            return str(raw[key]) if raw.get(key) is not None else None

        return cls(str(raw["side"]), float(raw.get("at") or 0.0), str(raw.get("by") or ""), str(raw.get("host") or ""),
                   int(raw.get("pid") or 0), text("pid_start"), str(raw.get("reason") or ""), text("boot"),
                   text("pidns"))

    def holder_is_gone(self) -> bool:
        """Known dead: a process of this host, this boot and this PID namespace that no longer
        exists (or whose pid another process now has). A holder anywhere else, or one whose
        record lacks any of these, is never known dead from here."""
        here = (socket.gethostname(), _boot_id(), _pid_namespace())
        if not self.pid or self.pid_start is None or None in here or (self.host, self.boot, self.pidns) != here:
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # alive, another user's
            pass
        started = _process_start(self.pid)
        return started is not None and started != self.pid_start

    def describe(self) -> str:
        """Who and when: `process 4242 on host-a at 2026-11-26 15:57:44 UTC`."""
        who = f"process {self.pid} on {self.host}" if self.pid else "an earlier sparkpoint"
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.at)) if self.at else "at an unknown time"
        return f"{who} at {when}"


def claim(
    storage: CheckpointStorage, checkpoint_id: int, attempt_id: str, side: str, *, reason: str = ""
) -> Claim | None:
    """Claim attempt `attempt_id` at checkpoint N for `side` (COMPLETE or ABORT) by exclusive
    create: the claim that lets this caller act (None: it may not).

    Exactly one completer may act as long as its holder lives; aborts are idempotent, so every
    aborter may act once an abort holds the claim. A claim that cannot be read is taken for the
    other side's: acting on a guess could delete what a completer commits.
    """
    return _create(storage, claim_path(checkpoint_id, validate_name(attempt_id, "attempt id")), side, reason)


def _create(storage: CheckpointStorage, path: str, side: str, reason: str) -> Claim | None:
    mine = Claim.mine(side, reason)
    record = mine.dumps()
    try:
        storage.commit_exclusive(path, record)
        return mine
    except (FileExistsError, CheckpointAlreadyExists):
        pass
    try:
        held = storage.read_bytes(path)
        holder = Claim.loads(held)
    except Exception as e:
        log.warning("claim %s/%s cannot be read (%s): taking it for the other side's", storage.job_url, path, e)
        return None
    if held == record or (side == ABORT and holder.side == ABORT):  # == record: our own write, its response lost
        return holder
    return None


def generation_path(checkpoint_id: int, attempt_id: str, generation: int) -> str:
    """Generation 0 is the claim itself; a takeover creates the next one."""
    base = claim_path(checkpoint_id, attempt_id)
    return base if generation == 0 else f"{base}.{generation}"


def current_holder(storage: CheckpointStorage, checkpoint_id: int, attempt_id: str) -> tuple[int, Claim | None]:
    """(the newest generation of the attempt's claim, its record; None: none, or unreadable)."""
    generation, held = 0, read_claim(storage, checkpoint_id, attempt_id)
    while held is not None and held.side == COMPLETE:
        try:
            data = storage.read_bytes(generation_path(checkpoint_id, attempt_id, generation + 1))
        except FileNotFoundError:
            break
        generation += 1
        try:
            held = Claim.loads(data)
        except Exception:
            return generation, None
    return generation, held


def take_over(storage: CheckpointStorage, checkpoint_id: int, attempt_id: str) -> tuple[int, Claim] | None:
    """Become the completer of an attempt whose completing holder is known dead: an exclusive
    create of the claim's next generation (another retry that got there first wins). Returns
    (generation, our claim), or None when the holder is not known dead or another took over."""
    generation, held = current_holder(storage, checkpoint_id, attempt_id)
    if held is None or held.side != COMPLETE or not held.holder_is_gone():
        return None
    mine = _create(storage, generation_path(checkpoint_id, attempt_id, generation + 1), COMPLETE,
                   f"took over from {held.describe()}")
    return (generation + 1, mine) if mine is not None else None


def release(storage: CheckpointStorage, checkpoint_id: int, attempt_id: str, generation: int, mine: Claim) -> None:
    """Give up our own claim (a completion that failed before its commit): only the record we
    wrote, never one another writer holds at that name."""
    path = generation_path(checkpoint_id, attempt_id, generation)
    try:
        held = Claim.loads(storage.read_bytes(path))
    except Exception:
        return
    if held.by == mine.by:
        storage.delete([path])


def read_claim(storage: CheckpointStorage, checkpoint_id: int, attempt_id: str) -> Claim | None:
    """The attempt's claim (None: no claim, or one that cannot be read)."""
    try:
        return Claim.loads(storage.read_bytes(claim_path(checkpoint_id, attempt_id)))
    except Exception:
        return None


def claim_holder(storage: CheckpointStorage, checkpoint_id: int, attempt_id: str) -> str | None:
    """Which side holds the attempt's claim (None: no claim, or an unreadable one)."""
    held = read_claim(storage, checkpoint_id, attempt_id)
    return held.side if held is not None else None


def fence(storage: CheckpointStorage, attempt_ids: tuple[str, ...], *, reason: str) -> dict[str, str]:
    """Make sure none of `attempt_ids` (a failed run's, whose process may live on as a zombie)
    can commit a checkpoint any more.

    First `_fenced/<attempt id>`: a completer of such an attempt reads it right after its
    `_metadata` landed and withdraws that `_metadata` (whatever id it took, even one above
    everything listed here, as after a fallback). Then, to spare a zombie the work, the claim for
    the abort at the id it would usually take, the one after the latest completed checkpoint.

    Returns "<id>@chk-<N>" -> "fenced", or the side that held that claim already: a completer that
    claimed first persisted its attempt before its claim, so a listing of the attempts made after
    this call finds it and keeps its uploads."""
    for attempt_id in dict.fromkeys(attempt_ids):
        try:
            storage.commit_exclusive(f"{FENCED_DIR}/{validate_name(attempt_id, 'attempt id')}",
                                     Claim.mine(ABORT, reason).dumps())
        except (FileExistsError, CheckpointAlreadyExists):
            pass  # fenced before
    following = next_id_after(storage, max(storage.completed_checkpoint_ids(), default=0))
    outcome = {}
    for attempt_id in dict.fromkeys(attempt_ids):
        if claim(storage, following, attempt_id, ABORT, reason=reason):
            outcome[f"{attempt_id}@chk-{following}"] = "fenced"
        else:
            outcome[f"{attempt_id}@chk-{following}"] = claim_holder(storage, following, attempt_id) or "unreadable"
    return outcome


def fenced(storage: CheckpointStorage, attempt_id: str) -> str | None:
    """Why attempt `attempt_id` may never commit (a recovery fenced it), or None."""
    try:
        data = storage.read_bytes(f"{FENCED_DIR}/{attempt_id}")
    except FileNotFoundError:
        return None
    try:
        held = Claim.loads(data)
        return f"fenced by {held.reason or 'recovery'} ({held.describe()})"
    except Exception:
        return "fenced by recovery (its record cannot be read)"


def forget_fences(storage: CheckpointStorage, *, older_than: float = FENCE_LIFETIME, now: float | None = None) -> int:
    """Delete fences older than `older_than` seconds (a fence whose age storage does not tell
    stays); returns how many."""
    now = time.time() if now is None else now
    doomed = [f.path for f in storage.walk(FENCED_DIR)
              if not f.symlink and f.modified and now - f.modified > older_than]
    storage.delete(doomed)
    storage.remove_empty_dirs(FENCED_DIR)
    return len(doomed)
