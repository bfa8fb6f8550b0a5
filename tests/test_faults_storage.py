"""Storage faults (issue 11, item 2): hundreds of checkpoints of real RocksDB state over a
filesystem that fails a random fraction of its operations (errors, timeouts, truncated writes,
writes whose response is lost, listing and read errors).

What must hold: every checkpoint that completed restores exactly (against a dict model of the
state at its trigger), the failed ones are aborted and what they left is swept, retries make
progress, and nothing a retained checkpoint references is ever deleted.
"""

from __future__ import annotations

import random
import uuid
from pathlib import Path
from typing import Any

import fsspec
import pytest

from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.errors import SparkpointError
from sparkpoint.checkpoint.storage import CheckpointStorage, RetryPolicy
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.checkpoint.sweep import sweep_orphans
from sparkpoint.state.backend import RocksDBStateBackend, take_checkpoint
from sparkpoint.state.engine.verify import verify_checkpoint
from sparkpoint.testing import FaultyFileSystem, faulty_storage
from tests.conftest import s3_options
from tests.support.backends import make_backends
from tests.support.reliability import count_round, counts, report, scale

MAX_P = 16
FAST_RETRY = RetryPolicy(attempts=2, first_wait=0.0005, max_wait=0.002)
PATIENT_RETRY = RetryPolicy(attempts=6, first_wait=0.0005, max_wait=0.002)


class RecordingCoordinator(CheckpointCoordinator):
    """Remembers every id it triggered, so the test knows which state each id must hold."""

    triggered: list[int]

    def trigger(self, **kwargs: Any):  # type: ignore[no-untyped-def]
        pending = super().trigger(**kwargs)
        self.__dict__.setdefault("triggered", []).append(pending.checkpoint_id)
        return pending


def backends(storage: CheckpointStorage, local: Path, **kw: Any) -> list[RocksDBStateBackend]:
    return make_backends(storage, local, max_parallelism=MAX_P, **kw)


def restored_state(storage: CheckpointStorage, meta: Any, local: Path) -> dict[str, int]:
    subtasks = backends(storage, local, local_recovery=False)
    try:
        for b in subtasks:
            b.restore(meta)
        return counts(subtasks)
    finally:
        for b in subtasks:
            b.close()


def retained_paths(clean: CheckpointStorage) -> tuple[list[Any], set[str]]:
    listing = CompletedCheckpointStore(clean).load_all()
    assert not listing.unreadable, listing.unreadable
    return listing.checkpoints, {p for m in listing.checkpoints for p in m.references()}


def run_under_faults(
    tmp_path: Path, *, checkpoints: int, seed: int, rate: float, restore_every: int = 1,
    url: str | None = None, options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """`checkpoints` rounds of writes + checkpoint; each `restore_every`-th completed one is restored
    right away (RocksDB opens dominate the run time), every retained one at restarts and at the end."""
    url = url or f"memory://faults-{uuid.uuid4().hex}"
    storage, fs = faulty_storage(url, "job", options, rate=rate, seed=seed, retry=FAST_RETRY)
    clean = CheckpointStorage(url, "job", options)  # the same files, no faults: the test's own eyes
    rng = random.Random(seed)
    with fs.paused():
        coord = RecordingCoordinator(storage, num_retained=2)
        subtasks = backends(storage, tmp_path / "local")
        for b in subtasks:
            b.restore(None)
    model: dict[str, int] = {}
    expected: dict[int, dict[str, int]] = {}
    completed: list[int] = []
    failed = restarts = 0
    for round_ in range(checkpoints):
        count_round(subtasks, model, sorted({f"k{rng.randrange(3000):05d}" for _ in range(60)}))
        if round_ % 25 == 24:
            subtasks[round_ % 2].compact()  # rewritten SSTs: the next checkpoint uploads them again
        before = len(coord.__dict__.get("triggered", []))
        try:
            done = take_checkpoint(coord, subtasks)
            completed.append(done.checkpoint_id)
        except (OSError, SparkpointError):
            failed += 1
        for cid in coord.__dict__.get("triggered", [])[before:]:
            expected[cid] = dict(model)
        retained, referenced = retained_paths(clean)
        # Nothing a retained checkpoint references was ever deleted, and every one of them is whole.
        assert not referenced & set(map(clean.relpath, fs.deleted))
        for meta in retained:
            assert verify_checkpoint(clean, meta, deep=False) == [], meta.checkpoint_id
        newest = max((m.checkpoint_id for m in retained), default=None)
        if completed and completed[-1] == newest and len(completed) % restore_every == 0:
            latest = retained[0]
            assert restored_state(clean, latest, tmp_path / f"check-{latest.checkpoint_id}") == expected[
                latest.checkpoint_id
            ]
        if round_ % 50 == 49:  # a restart: a new coordinator and a restore, both under faults
            restarts += 1
            for b in subtasks:  # the "crashed" process's databases
                b.close()
            # A restart looks up every chk-N directory, and memory:// keeps the empty directories of
            # aborted checkpoints: with two tries per call a pass without a fault gets rare. Patience.
            storage.retry = PATIENT_RETRY
            subtasks, coord = restart(storage, tmp_path / f"restart-{round_}", model, expected)
            storage.retry = FAST_RETRY
    # Every retained checkpoint restores exactly what was in the state when it was triggered.
    retained, referenced = retained_paths(clean)
    for meta in retained:
        assert verify_checkpoint(clean, meta, deep=True) == []
        assert restored_state(clean, meta, tmp_path / f"final-{meta.checkpoint_id}") == expected[meta.checkpoint_id]
    for b in subtasks:
        b.close()
    # What failed checkpoints left is the sweep's; after it, only referenced files remain.
    orphans = len(sweep_orphans(clean, grace_seconds=0).orphans)
    left = {f.path for top in ["shared", *[f"chk-{c}" for c in clean.checkpoint_dirs()]] for f in clean.walk(top)}
    assert left == referenced, (left ^ referenced)
    assert fs.total_injected > 0 and storage.retried > 0
    assert len(completed) >= checkpoints // 2, f"retries made too little progress: {len(completed)} of {checkpoints}"
    return {
        "seed": seed, "rate": rate, "checkpoints": checkpoints, "completed": len(completed), "failed": failed,
        "restarts": restarts, "faults": fs.total_injected, "retried": storage.retried, "swept_orphans": orphans,
        **{f"fault_{k}": v for k, v in sorted(fs.injected.items())}, "failures_found": 0,
    }


def restart(
    storage: CheckpointStorage, local: Path, model: dict[str, int], expected: dict[int, dict[str, int]]
) -> tuple[list[RocksDBStateBackend], RecordingCoordinator]:
    """Start over from the latest checkpoint through the faulty storage; retry what the faults break."""
    errors: list[str] = []
    for attempt in range(20):
        subtasks = backends(storage, local / str(attempt))
        try:
            coord = RecordingCoordinator(storage, num_retained=2)
            latest = coord.store.latest()  # raises on an I/O error: never quietly an older checkpoint
            for b in subtasks:
                b.restore(latest)
            break
        except (OSError, SparkpointError) as e:
            errors.append(f"{type(e).__name__}: {e}")
            for b in subtasks:
                b.close()
    else:
        raise AssertionError(f"no restart succeeded in 20 attempts: {errors}")
    restored = counts(subtasks)
    newest = max(CompletedCheckpointStore(CheckpointStorage(storage.url, storage.job_id, storage.storage_options))
                 .checkpoint_ids())
    assert latest is not None and latest.checkpoint_id == newest and restored == expected[newest]
    model.clear()
    model.update(restored)  # the writes after the latest checkpoint are lost with the "crash"
    return subtasks, coord


def test_fifty_checkpoints_under_storage_faults_restore_exactly_and_leave_no_orphan(tmp_path: Path):
    """Fifty rounds: two compactions (rounds 25 and 50) and the restart under faults (round 50)
    are among them; make soak runs 500 checkpoints under each of 6 seeds and two fault rates."""
    row = run_under_faults(tmp_path, checkpoints=50, seed=11, rate=0.06, restore_every=5)
    assert row["failed"] > 0, "the fault rate should make some checkpoints fail"
    report("faults_storage_quick", [row])


@pytest.mark.s3
def test_storage_faults_on_s3_restore_exactly_and_leave_no_orphan(tmp_path: Path, s3_endpoint: str):
    """The same over s3fs against moto in server mode: the faults come on top of real HTTP (25
    rounds, one compaction among them; the restart under faults is the memory:// test's)."""
    options = s3_options(s3_endpoint)
    bucket = "faults" + uuid.uuid4().hex[:10]
    fsspec.filesystem("s3", **options).mkdir(bucket)
    row = run_under_faults(tmp_path, checkpoints=scale("fault_s3_checkpoints", 25), seed=5, rate=0.06,
                           restore_every=5, url=f"s3://{bucket}/checkpoints", options=options)
    report("faults_storage_s3", [row])


@pytest.mark.soak
@pytest.mark.timeout(6 * 3600)  # the scale comes from the environment
def test_storage_faults_soak(tmp_path: Path):
    rows = [
        run_under_faults(tmp_path / f"{seed}-{rate}", checkpoints=scale("fault_checkpoints", 500), seed=seed, rate=rate)
        for seed in range(scale("fault_seeds", 6))
        for rate in (0.03, 0.06)
    ]
    report("faults_storage", rows)


def test_lost_response_to_the_metadata_commit_is_still_one_outcome(tmp_path: Path):
    """The exclusive create of `_metadata` wrote, then timed out: the retry finds the file, the
    coordinator reads it back, sees its own bytes and completes; nothing it uploaded is deleted."""
    url = f"memory://lost-{uuid.uuid4().hex}"
    fs = FaultyFileSystem(url, rate=1.0, kinds=["lost_response"])
    storage = CheckpointStorage(url, "job", filesystem=fs, retry=FAST_RETRY)
    with fs.paused():
        coord = CheckpointCoordinator(storage)
        subtasks = backends(storage, tmp_path / "local")
        for b in subtasks:
            b.restore(None)
        count_round(subtasks, {}, ["a", "b", "c"])
        pending = coord.trigger(expected={"counts": 2})
        for b in subtasks:
            coord.acknowledge(pending.checkpoint_id, b.snapshot(pending.checkpoint_id))
    fs.rate = 0.0

    def lose_only_the_commit(path: str, mode: str = "rb", *a: Any, **kw: Any) -> Any:
        fs.rate = 1.0 if path.endswith("_metadata") and "x" in mode else 0.0
        try:
            return FaultyFileSystem.open(fs, path, mode, *a, **kw)
        finally:
            fs.rate = 0.0

    fs.open = lose_only_the_commit  # type: ignore[method-assign]
    done = coord.complete(pending.checkpoint_id)
    assert fs.injected["lost_response"] == 1 and storage.retried == 1
    clean = CheckpointStorage(url, "job")
    assert CompletedCheckpointStore(clean).checkpoint_ids() == [done.checkpoint_id]
    assert verify_checkpoint(clean, done.metadata) == []
    assert restored_state(clean, done.metadata, tmp_path / "check") == {"a": 1, "b": 1, "c": 1}


def test_a_timeout_on_lookup_is_not_taken_for_a_missing_metadata(tmp_path: Path):
    """fsspec's `exists` answers False on any error: a retained checkpoint hidden by one timeout
    would drop out of the registry's count and its files could be deleted by retention."""
    url = f"memory://exists-{uuid.uuid4().hex}"
    fs = FaultyFileSystem(url, rate=1.0, kinds=["timeout"])
    storage = CheckpointStorage(url, "job", filesystem=fs, retry=RetryPolicy(attempts=1))
    with fs.paused():
        storage.write_bytes("chk-1/_metadata", b"{}")
    with pytest.raises(TimeoutError):
        storage.exists("chk-1/_metadata")
    with pytest.raises(TimeoutError):
        storage.completed_checkpoint_ids()
    fs.rate = 0.0
    assert storage.completed_checkpoint_ids() == [1] and not storage.exists("chk-2/_metadata")
