"""Who may act on a persisted attempt: its claim, a file created exclusively on storage.

`<job>/_pending/chk-<N>-<attempt id>.claim` is created by whichever side acts first: a completer
before it writes `_metadata`, an abort before it deletes anything, and a recovery *fence* before
it sweeps (so that an attempt of the failed run that was not persisted yet can never commit what
the sweep takes). Exclusion comes from the exclusive create, never from a look made before
acting (DESIGN rule 9).

The record says who holds the claim (side, host, process id and its start time, when, why), so a
step that finds its own attempt claimed can tell the user what happened, and a retry can take
over a completion whose holder is known to be dead: a process of this host that no longer
exists. Two completers of one attempt are safe (the exclusive create of `_metadata` lets one
commit, and the other never deletes what the committed `_metadata` references); what must never
happen is a completion beside an abort, and the claim excludes that.
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
from sparkpoint.checkpoint.storage import CheckpointStorage

log = logging.getLogger(__name__)

PENDING_DIR = "_pending"
COMPLETE, ABORT = "complete", "abort"  # the two sides that may claim an attempt


def claim_path(checkpoint_id: int, attempt_id: str) -> str:
    return f"{PENDING_DIR}/chk-{checkpoint_id}-{attempt_id}.claim"


def _process_start(pid: int) -> str | None:
    """When process `pid` started (clock ticks since boot, from /proc): with the pid, it names one
    process even after the pid is reused. None where /proc does not say."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()
    return fields[19] if len(fields) > 19 else None  # field 22 of the line, 20th after the name


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

    @classmethod
    def mine(cls, side: str, reason: str = "") -> Claim:
        pid = os.getpid()
        return cls(side, time.time(), uuid.uuid4().hex, socket.gethostname(), pid, _process_start(pid), reason)

    def dumps(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def loads(cls, data: bytes) -> Claim:
        raw = json.loads(data)
        if not isinstance(raw, dict) or raw.get("side") not in (COMPLETE, ABORT):
            raise ValueError(f"not a claim record: {data[:120]!r}")
        return cls(str(raw["side"]), float(raw.get("at") or 0.0), str(raw.get("by") or ""), str(raw.get("host") or ""),
                   int(raw.get("pid") or 0), raw.get("pid_start"), str(raw.get("reason") or ""))

    def holder_is_gone(self) -> bool:
        """Known dead: a process of this host that no longer exists (or whose pid another process
        now has). A holder on another host is never known dead from here."""
        if not self.pid or self.host != socket.gethostname():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # alive, another user's
            pass
        started = _process_start(self.pid)
        return self.pid_start is not None and started is not None and started != self.pid_start

    def describe(self) -> str:
        """Who and when: `process 4242 on host-a at 2026-11-26 15:57:44 UTC`."""
        who = f"process {self.pid} on {self.host}" if self.pid else "an earlier sparkpoint"
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.at)) if self.at else "at an unknown time"
        return f"{who} at {when}"


def claim(storage: CheckpointStorage, checkpoint_id: int, attempt_id: str, side: str, *, reason: str = "") -> bool:
    """Claim attempt `attempt_id` at checkpoint N for `side` (COMPLETE or ABORT) by exclusive
    create: True when this caller may act.

    Exactly one completer may act as long as its holder lives; aborts are idempotent, so every
    aborter may act once an abort holds the claim. A claim that cannot be read is taken for the
    other side's: acting on a guess could delete what a completer commits.
    """
    path = claim_path(checkpoint_id, validate_name(attempt_id, "attempt id"))
    record = Claim.mine(side, reason).dumps()
    try:
        storage.commit_exclusive(path, record)
        return True
    except (FileExistsError, CheckpointAlreadyExists):
        pass
    try:
        held = storage.read_bytes(path)
        holder = Claim.loads(held).side
    except Exception as e:
        log.warning("claim %s/%s cannot be read (%s): taking it for the other side's", storage.job_url, path, e)
        return False
    return held == record or (side == ABORT and holder == ABORT)  # == record: our own write, its response lost


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
    can commit a checkpoint any more: claim each for the abort at every id it could still
    commit, from the latest completed checkpoint + 1 (the id a run resuming from the latest
    takes) to the highest `chk-N` directory + 1 (the id a run that fell back takes); a lower id
    exists already, or is declined as older than the latest.

    Returns "<id>@chk-<N>" -> "fenced", or the side that held that claim already: a completer that
    claimed first persisted its attempt before its claim, so a listing of the attempts made after
    this call finds it and keeps its uploads."""
    latest = max(storage.completed_checkpoint_ids(), default=0)
    highest = max(storage.checkpoint_dirs(), default=0)
    outcome = {}
    for attempt_id in dict.fromkeys(attempt_ids):
        for cid in range(latest + 1, max(latest, highest) + 2):
            if claim(storage, cid, attempt_id, ABORT, reason=reason):
                outcome[f"{attempt_id}@chk-{cid}"] = "fenced"
            else:
                outcome[f"{attempt_id}@chk-{cid}"] = claim_holder(storage, cid, attempt_id) or "unreadable"
    return outcome
