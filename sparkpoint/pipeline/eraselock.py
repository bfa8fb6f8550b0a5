"""The lock `sparkpoint erase` holds on a job while it rewrites its checkpoints, `_erase/lock.json`.

Taken by an exclusive create; a run's start refuses while it exists (`erase_in_progress`): until the
erase ends, its copies of older checkpoints sit above the latest batch's. A rerun of the same erase
(the same keys' digest) takes over the lock of a holder known dead (`Claim.holder_is_gone`: a
process of this host that no longer exists); any other holder is named and waited for.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from typing import Any

from sparkpoint.checkpoint.errors import CheckpointAlreadyExists, SparkpointError
from sparkpoint.checkpoint.processes import boot_id, pid_namespace, process_start
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.pipeline.claims import Claim

log = logging.getLogger(__name__)

LOCK = "_erase/lock.json"


class EraseRefused(SparkpointError):
    """The erase cannot go ahead now; the message says why and what to do."""


def erase_in_progress(storage: CheckpointStorage) -> str | None:
    """Why a run must not start now (an erase holds the job), or None."""
    try:
        raw = json.loads(storage.read_bytes(LOCK))
    except FileNotFoundError:
        return None
    except Exception as e:  # noqa: BLE001  an unreadable lock still holds the job
        if not _present(storage):
            return None  # no lock: the read failed on its own (a fault of the storage is the run's to meet)
        return f"{storage.job_url}/{LOCK} exists but cannot be read ({e})"
    who = f"process {raw.get('pid')} on {raw.get('host')}"
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(raw.get("at") or 0)))
    return f"an erase of keys by {who} since {when} holds {storage.job_url} ({LOCK})"


def _present(storage: CheckpointStorage) -> bool:
    """Whether the lock is there, asked without reading it; True when even that cannot be told."""
    try:
        return storage.exists(LOCK)
    except Exception:  # noqa: BLE001  unknown: the job stays held
        return True


def _lock_record(digest: str, erase_id: str) -> dict[str, Any]:
    pid = os.getpid()
    return {"keys": digest, "erase": erase_id, "at": time.time(), "host": socket.gethostname(), "pid": pid,
            "pid_start": process_start(pid), "boot": boot_id(), "pidns": pid_namespace(), "by": uuid.uuid4().hex}


def take_lock(storage: CheckpointStorage, digest: str) -> str:
    """Hold the job for the erase of the keys `digest` names; returns the erase's id (a new random
    one, or the id of the dead erase of the same keys taken over: its copies carry it)."""
    record = _lock_record(digest, uuid.uuid4().hex)
    try:
        storage.commit_exclusive(LOCK, json.dumps(record).encode())
        return str(record["erase"])
    except (FileExistsError, CheckpointAlreadyExists):
        pass
    try:
        held = json.loads(storage.read_bytes(LOCK))
    except FileNotFoundError:
        return take_lock(storage, digest)
    holder = Claim("complete", float(held.get("at") or 0), str(held.get("by")), str(held.get("host") or ""),
                   int(held.get("pid") or 0), held.get("pid_start"), "", held.get("boot"), held.get("pidns"))
    if not holder.holder_is_gone():
        raise EraseRefused(f"another erase holds {storage.job_url} ({holder.describe()}, {LOCK}); let it finish. If "
                           "its process is gone on another host, delete that file and run the erase again")
    if held.get("keys") != digest:
        raise EraseRefused(f"an erase of other keys (or operators) died holding {storage.job_url} ({LOCK}, "
                           f"{holder.describe()}): run it again with the same keys to finish it first")
    log.warning("taking over the erase lock of %s from %s, which is gone", storage.job_url, holder.describe())
    erase_id = str(held.get("erase") or record["erase"])
    storage.write_bytes(LOCK, json.dumps({**record, "erase": erase_id}).encode())
    return erase_id


def release_lock(storage: CheckpointStorage) -> None:
    storage.delete([LOCK])
    storage.remove_empty_dirs(LOCK.split("/")[0])
