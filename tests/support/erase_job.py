"""A job of a user's accounts operator on real RocksDB, for the erase tests: a value state with
a TTL, a map, a list, a reducing state and timers, across a rescale (2 -> 3 subtasks) and a
savepoint in the job directory; and a driver that erases keys in a process of its own (the
crash-point tests kill it).

    python -m tests.support.erase_job <checkpoints dir> <job id> <key> [<key> ...]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pandas as pd

from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.savepoint import take_savepoint
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.pipeline.erase import EraseScope, erase_job, state_key
from sparkpoint.state.backend import RocksDBStateBackend, take_checkpoint
from sparkpoint.state.codecs import JsonCodec, StructCodec
from sparkpoint.state.keygroups import key_group_for
from sparkpoint.state.ttl import StateTtl

OPERATOR = "accounts"
MAX_P = 16
USERS = [f"acct-{i:03d}" for i in range(60)]
AMOUNT = StructCodec[tuple[float]]("<d")
DUE = pd.Timestamp("2031-01-01", tz="UTC")


def _biggest(a: tuple[float], b: tuple[float]) -> tuple[float]:
    return a if a[0] >= b[0] else b


def _backends(storage: CheckpointStorage, local: Path, parallelism: int) -> list[RocksDBStateBackend]:
    return [RocksDBStateBackend(storage, OPERATOR, i, parallelism=parallelism, max_parallelism=MAX_P,
                                local_dir=local) for i in range(parallelism)]


def _write(b: RocksDBStateBackend, round_: int) -> None:
    mine = [u for u in USERS if key_group_for(u, MAX_P) in b.key_group_range]
    b.set_time(processing_us=int(time.time() * 1e6))
    b.value_state("balance", JsonCodec(), ttl=StateTtl(30 * 24 * 3600)).put_many((u, round_ * 10) for u in mine)
    seen = b.map_state("seen", JsonCodec())
    for u in mine:
        seen.put(u, f"shop-{round_}", round_)
    b.list_state("payments", JsonCodec()).add_many((u, {"round": round_}) for u in mine)
    b.reducing_state("largest", AMOUNT, _biggest).add_many((u, (float(round_),)) for u in mine)
    b.timers.register_many([(u, DUE + pd.Timedelta(days=round_)) for u in mine])


def build_job(storage: CheckpointStorage, local: Path) -> None:
    """chk-1, chk-2 at 2 subtasks; chk-3 at 3 subtasks (a rescale); chk-4 a savepoint of chk-3."""
    coordinator = CheckpointCoordinator(storage, num_retained=5)
    backends = _backends(storage, local / "p2", 2)
    for b in backends:
        b.restore(None)
    for round_ in (1, 2):
        for b in backends:
            _write(b, round_)
        take_checkpoint(coordinator, backends)
    for b in backends:
        b.dispose()
    latest = CompletedCheckpointStore(storage).load_all().checkpoints[0]
    backends = _backends(storage, local / "p3", 3)
    for b in backends:
        b.restore(latest)
        _write(b, 3)
    take_checkpoint(coordinator, backends)
    for b in backends:
        b.dispose()
    take_savepoint(storage)


def read_all(storage: CheckpointStorage, cid: int, local: Path) -> dict[str, Any]:
    """Every user's entries of every state in checkpoint `cid`, restored at its own parallelism."""
    meta = CompletedCheckpointStore(storage).load(cid)
    p = meta.operators[OPERATOR].parallelism
    out: dict[str, Any] = {}
    for b in _backends(storage, local / f"read-{cid}", p):
        b.restore(meta)
        mine = [u for u in USERS if key_group_for(u, MAX_P) in b.key_group_range]
        balance = b.value_state("balance", JsonCodec(), ttl=StateTtl(30 * 24 * 3600))
        seen = b.map_state("seen", JsonCodec())
        payments = b.list_state("payments", JsonCodec())
        largest = b.reducing_state("largest", AMOUNT, _biggest)
        timers = b.timers
        by_time = timers.due("processing", 1 << 62)  # the other index of the timers
        for u in mine:
            out[u] = (balance.get(u), sorted(seen.entries(u)), payments.get(u), largest.get(u), timers.list(u),
                      [at for at, raw in by_time if raw == u.encode()])
        b.dispose()
    return out


def scope(keys: list[str]) -> EraseScope:
    return EraseScope(tuple(state_key(k) for k in keys), (OPERATOR,), {"account": tuple(keys)})


def main(argv: list[str]) -> int:
    storage = CheckpointStorage(argv[0], argv[1])
    report = erase_job(storage, scope(argv[2:]))
    print(report.message)
    return 0 if report.verified else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
