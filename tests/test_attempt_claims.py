"""A late completer and a recovery abort of the same persisted attempt, interleaved at every
storage operation of either side: they exclude each other through the attempt's claim, so the job
ends either with checkpoint 2 complete (every file present, its output committed once) or without
it (checkpoint 1 intact, no output of 2), never with a checkpoint that references deleted files.

No Spark: the subtasks' uploads are made by `tests.support.helpers.FakeSubtask`, the sink rows by the
real exactly-once sink, and both sides are the real `complete_attempt` and `settle_attempts`,
each with its own storage object, as two processes would have.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pytest

from sparkpoint.checkpoint.metadata import metadata_path
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.pipeline.attempt import (
    AttemptAborted,
    PendingAttempt,
    complete_attempt,
    finish_step,
    list_attempts,
    save_attempt,
)
from sparkpoint.pipeline.claims import claim_path
from sparkpoint.pipeline.driver import StatefulPipeline
from sparkpoint.pipeline.maintenance import settle_attempts
from sparkpoint.pipeline.runtime import PipelineConfig
from sparkpoint.spark.offsets import SourceOffsets
from sparkpoint.state.engine.verify import verify_checkpoint
from sparkpoint.state.sample import SAMPLE_OPERATORS
from tests.support.helpers import FakeSubtask

OPERATORS = ("item_reach", "user_totals")
STORAGE_CALLS = (
    "exists", "read_bytes", "write_bytes", "info", "commit_exclusive", "delete", "walk",
    "completed_checkpoint_ids", "checkpoint_dirs", "remove_empty_dirs",
)


def pipeline(tmp_path: Path) -> StatefulPipeline:
    """One process's view of the job: its own storage and sink objects."""
    config = PipelineConfig(
        input_url=str(tmp_path / "in"), checkpoints_url=f"file://{tmp_path}/ckpt", job_id="job",
        output_url=f"file://{tmp_path}/out", num_retained=1, parallelism=1, local_dir=str(tmp_path / "local"),
    )
    return StatefulPipeline(None, config, SAMPLE_OPERATORS)


def make_attempt(p: StatefulPipeline, subtasks: dict[str, FakeSubtask], cid: int, files: list[str]) -> PendingAttempt:
    handles, staged = [], []
    for name in OPERATORS:
        sub = subtasks[name]
        local = [f"{cid:06d}.sst", *[f"{c:06d}.sst" for c in range(1, cid)]]
        sub.write(local[0])
        handles.append(sub.snapshot(cid, local).dumps())
        rows = pd.DataFrame({"key": [f"{name}-{cid}"], "value": [cid]})
        staged += p.sink.stage(cid, name, 0, rows)
    consumed = [f"b{i}.parquet" for i in range(1, cid + 1)]
    return PendingAttempt(
        job_id="job", checkpoint_id=cid, attempt_id=uuid.uuid4().hex, expected=dict.fromkeys(OPERATORS, 1),
        handles=tuple(handles), staged=tuple(sorted(staged)), source_offsets=SourceOffsets(tuple(consumed)).to_json(),
        files=tuple(files), subtasks=(), rows=1, started_at=time.time(),
    )


def setup_job(tmp_path: Path) -> tuple[StatefulPipeline, StatefulPipeline, PendingAttempt]:
    (tmp_path / "in").mkdir(parents=True)
    completer, aborter = pipeline(tmp_path), pipeline(tmp_path)
    subtasks = {
        name: FakeSubtask(completer.storage, tmp_path / "work" / name, operator=name) for name in OPERATORS
    }
    first = make_attempt(completer, subtasks, 1, ["b1.parquet"])
    complete_attempt(completer, first)
    for sub in subtasks.values():
        sub.confirm(1)
    second = make_attempt(completer, subtasks, 2, ["b2.parquet"])
    save_attempt(completer.storage, second)
    return completer, aborter, second


def run_other_at(p: StatefulPipeline, k: int, other: Callable[[], object]) -> list[str]:
    """Before the k-th storage operation (or sink commit) of `p`, run `other` once, wholly."""
    seen: list[str] = []

    def wrap(name: str, fn: Callable[..., object]) -> Callable[..., object]:
        def call(*args: object, **kwargs: object) -> object:
            seen.append(name)
            if len(seen) == k:
                try:
                    other()
                except Exception as e:  # the other side may fail cleanly: what counts is the end state
                    seen.append(f"other failed: {type(e).__name__}: {e}")
            return fn(*args, **kwargs)
        return call

    for name in STORAGE_CALLS:
        setattr(p.storage, name, wrap(name, getattr(p.storage, name)))
    assert p.sink is not None
    object.__setattr__(p.sink, "commit", wrap("sink.commit", p.sink.commit))  # a frozen dataclass
    return seen


def completes(completer: StatefulPipeline, attempt: PendingAttempt) -> Callable[[], object]:
    return lambda: finish_step(completer, [attempt.attempt_id])


def aborts(aborter: StatefulPipeline) -> Callable[[], object]:
    return lambda: settle_attempts(aborter.storage, aborter.sink)


def assert_one_outcome(tmp_path: Path, attempt: PendingAttempt, where: str) -> str:
    """Checkpoint 2 is complete and whole, with its output, or absent with checkpoint 1 whole."""
    check = pipeline(tmp_path)
    settle_attempts(check.storage, check.sink)  # a later recovery settles whatever is left
    check.begin()  # and a later start finishes a sink commit that a completer left undone
    store = CompletedCheckpointStore(check.storage)
    ids = store.checkpoint_ids()
    assert ids, where
    latest = store.load(ids[0])
    assert verify_checkpoint(check.storage, latest) == [], f"{where}: the latest checkpoint lost files"
    assert check.sink is not None
    committed = check.sink.committed()
    if ids[0] == 2:
        assert sorted(committed) == [1, 2], f"{where}: checkpoint 2 completed without its output: {committed}"
        return "completed"
    assert ids == [1], where
    assert sorted(committed) == [1], f"{where}: output of an aborted checkpoint is visible: {committed}"
    leftovers = [f.path for f in attempt.new_files() if check.storage.exists(f.path)]
    assert not leftovers, f"{where}: the aborted attempt's uploads stay: {sorted(leftovers)}"
    return "aborted"


def count_calls(tmp_path: Path, side: str) -> int:
    completer, aborter, attempt = setup_job(tmp_path)
    seen = run_other_at(completer if side == "completer" else aborter, 0, lambda: None)
    (finish_step(completer, [attempt.attempt_id]) if side == "completer" else settle_attempts(aborter.storage,
                                                                                                aborter.sink))
    return len(seen)


@pytest.mark.parametrize("paused", ["completer", "aborter"])
def test_abort_and_late_completion_exclude_each_other_at_every_interleaving(tmp_path: Path, paused: str):
    calls = count_calls(tmp_path / "count", paused)
    assert calls > 10, "the interleaving must reach inside both sides"
    outcomes = []
    for k in range(1, calls + 2):
        root = tmp_path / f"k{k}"
        completer, aborter, attempt = setup_job(root)
        if paused == "completer":
            seen = run_other_at(completer, k, aborts(aborter))
            try:
                finish_step(completer, [attempt.attempt_id])
            except AttemptAborted:
                pass
        else:
            seen = run_other_at(aborter, k, completes(completer, attempt))
            settle_attempts(aborter.storage, aborter.sink)
        where = f"{paused} paused before operation {k} ({seen[k - 1] if k <= len(seen) else 'the end'})"
        outcomes.append(assert_one_outcome(root, attempt, where))
    # Both ends are reached: an abort before the claim wins, a completion before the abort wins.
    assert {"completed", "aborted"} <= set(outcomes), outcomes


def test_a_completer_that_finds_the_abort_claim_writes_nothing(tmp_path: Path):
    completer, aborter, attempt = setup_job(tmp_path)
    settlement = settle_attempts(aborter.storage, aborter.sink)
    assert settlement.aborted == (2,)
    with pytest.raises(AttemptAborted, match="aborted by recovery"):
        complete_attempt(completer, attempt, persisted=True)
    assert not completer.storage.exists(metadata_path(2))
    assert completer.storage.exists(claim_path(2, attempt.attempt_id)), "the tombstone stays for late completers"
    assert CompletedCheckpointStore(completer.storage).checkpoint_ids() == [1]


def test_an_abort_leaves_an_attempt_its_completer_claimed(tmp_path: Path):
    completer, aborter, attempt = setup_job(tmp_path)
    from sparkpoint.pipeline.claims import COMPLETE, claim

    assert claim(completer.storage, 2, attempt.attempt_id, COMPLETE)  # a completer is between its claim and its commit
    settlement = settle_attempts(aborter.storage, aborter.sink)
    assert settlement.left_to_completer == (2,) and settlement.aborted == ()
    assert all(aborter.storage.exists(f.path) for f in attempt.new_files()), "nothing of the attempt is deleted"
    assert [a.attempt_id for a in list_attempts(aborter.storage).attempts] == [attempt.attempt_id]


def test_an_unreadable_attempt_record_blocks_no_other_work_and_recovery_sets_it_aside(tmp_path: Path):
    from sparkpoint.pipeline.attempt import AttemptError, load_attempt
    from sparkpoint.pipeline.maintenance import prune

    completer, aborter, attempt = setup_job(tmp_path)
    broken = "_pending/chk-2-0123456789abcdef.json"
    completer.storage.write_bytes(broken, b'{"format": "sparkpoint-pending-att')  # a half-written record
    assert list(list_attempts(completer.storage).unreadable) == [broken]
    with pytest.raises(AttemptError, match="cannot be read"):
        load_attempt(completer.storage, "0123456789abcdef")  # its own step is told, clearly
    report = prune(completer.storage, num_retained=1, orphan_grace_seconds=0)  # not blocked
    assert report.stale_attempts == 0
    done = finish_step(completer, [attempt.attempt_id])  # nor is a materialization
    assert done is not None and done[1].checkpoint_id == 2
    settled = settle_attempts(aborter.storage, aborter.sink)  # what recover does first
    assert settled.set_aside == ("_pending/unreadable/chk-2-0123456789abcdef.json",)
    assert not aborter.storage.exists(broken)
    assert aborter.storage.read_bytes(settled.set_aside[0]) == b'{"format": "sparkpoint-pending-att'
    assert list_attempts(aborter.storage).unreadable == {}


def test_gc_keeps_the_uploads_of_pending_attempts(tmp_path: Path):
    from sparkpoint.cli import main

    completer, _, attempt = setup_job(tmp_path)
    stray = "shared/user_totals/0/stray.sst"  # an orphan of no attempt: gc deletes it
    completer.storage.write_bytes(stray, b"x")
    assert main(["gc", "--checkpoints", f"file://{tmp_path}/ckpt", "--job-id", "job", "--grace", "0"]) == 0
    assert not completer.storage.exists(stray)
    assert all(completer.storage.exists(f.path) for f in attempt.new_files()), "a pending attempt's uploads stay"
    done = finish_step(completer, [attempt.attempt_id])  # so its checkpoint step still completes
    assert done is not None and verify_checkpoint(completer.storage, done[1]) == []
