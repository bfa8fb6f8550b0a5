"""Completing a pending attempt beside recovery, retries and zombies of the failed run: a
recovery's abort that lost the claim keeps the output its completer commits (N1 of the fourth
review), recovery fences a zombie of the failed run before its sweep (N2), two completers of one
attempt commit it once, a retry takes over from a completer that died after its claim (N4) but
leaves a live one alone, and a fence that lands while a completion commits withdraws it.

The races run real code (`complete_attempt`, `settle_attempts`, `clear_failed_attempts`,
`finish_step`) as actors of the interleaving checker (`tests/support/interleavings.py`), with the
one schedule each needs; the checker's own tests explore all of them."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest

from sparkpoint.checkpoint.errors import CheckpointAlreadyExists, CheckpointDeclined
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.pipeline.attempt import (
    AttemptAborted,
    AttemptInProgress,
    complete_attempt,
    finish_step,
    load_attempt,
)
from sparkpoint.pipeline.claims import ABORT, COMPLETE, Claim, claim, claim_path
from sparkpoint.pipeline.maintenance import settle_attempts
from sparkpoint.state.engine.verify import verify_checkpoint
from tests.support.interleavings import (
    SCENARIOS,
    Checker,
    Run,
    _first_checkpoint,
    _persisted,
    canary,
    dead_holder_claim,
    expected,
    land,
    legs,
    visible_output,
)


@pytest.fixture(scope="module")
def checkers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Checker]:
    root = tmp_path_factory.mktemp("stories")
    names = ("claimed-completer-vs-recovery-abort", "uploaded-zombie-vs-recovery-sweep")
    return {name: Checker(SCENARIOS[name], root / name) for name in names}


def test_an_abort_that_lost_the_claim_keeps_the_output_its_completer_commits(checkers: dict[str, Checker]):
    """N1: recovery's abort finds the claim taken and chk-2 absent; the completer's `_metadata`
    lands before the abort lists the checkpoints. The abort took that listing for another
    writer's chk-2 and discarded the staged output the completer was about to commit (rule 9)."""
    outcome = checkers["claimed-completer-vs-recovery-abort"].run(legs(
        ("recoverer", "list", 2),  # stop after looking at chk-2 (absent), before listing the checkpoints
        ("completer", "move"),  # `_metadata` committed, its sink commit not yet made
        ("recoverer", None),
        ("completer", None),
    ))
    assert outcome.errors == {}, outcome.errors
    assert outcome.violations == []


def test_recovery_fences_a_zombie_of_the_failed_run_before_its_sweep(checkers: dict[str, Checker]):
    """N2: the failed run's zombie persists its attempt after recovery listed the attempts and
    checks its uploads before the sweep deletes them; it then committed over deleted files and,
    with num_retained=1, subsumed the only good checkpoint. Now recovery fences the failed run's
    attempt first: the zombie's claim fails and it commits nothing."""
    outcome = checkers["uploaded-zombie-vs-recovery-sweep"].run(legs(
        ("recoverer", "delete"),  # attempts listed, orphans found, nothing deleted yet
        ("zombie", "create chk-2/_metadata"),  # persisted, claimed, uploads checked
        ("recoverer", None),
        ("zombie", None),
    ))
    assert outcome.violations == []
    assert "AttemptAborted" in outcome.errors.get("zombie", ""), outcome.errors
    assert "fenced the failed run" in outcome.errors["zombie"]


# --- retries and takeovers of one attempt -------------------------------------------------------


def world(tmp_path: Path) -> Run:
    run = Run(tmp_path, f"memory://attempt-completion-{tmp_path.name}")
    land(run, 3)
    canary(run)
    _first_checkpoint(run)
    _persisted(run, "run-a")
    return run


def assert_exact(run: Run) -> None:
    """After the rest of the input: output once per batch, state as recomputed."""
    run.pipeline("after").run()
    want_rows, want_totals = expected(run)
    assert visible_output(run) == want_rows
    from sparkpoint.state.extract import state_table
    from tests.support.interleavings import BALANCES

    _, state = state_table(run.storage(), BALANCES)
    assert dict(zip(state["acct"], state["balance"].astype(int))) == want_totals


def test_two_completers_of_one_attempt_commit_it_once_and_keep_its_files(tmp_path: Path):
    """A retry that takes over beside a completer still alive: the exclusive create lets one
    commit; the other must not delete the files the winner's `_metadata` references."""
    run = world(tmp_path)
    first, second = run.pipeline("first"), run.pipeline("second")
    attempt = load_attempt(first.storage, "run-a")
    assert attempt is not None
    complete_attempt(first, attempt)
    with pytest.raises(CheckpointAlreadyExists):
        complete_attempt(second, attempt)  # the CLI's path: not persisted, no claim
    meta = CompletedCheckpointStore(run.storage()).load(2)
    assert verify_checkpoint(run.storage(), meta) == [], "the loser deleted the winner's files"
    assert_exact(run)


def test_a_retry_completes_an_attempt_whose_completer_died_after_its_claim(tmp_path: Path):
    """N4: the completer was killed between its claim and `_metadata` (kill -9, OOM). Every retry
    was refused with "aborted by recovery", though no recovery ran."""
    run = world(tmp_path)
    dead_holder_claim(run.storage(), 2, "run-a")
    done = finish_step(run.pipeline("retry"), ["run-a"])
    assert done is not None and done[1].checkpoint_id == 2
    assert not run.storage().exists(claim_path(2, "run-a")), "the attempt is settled"
    assert_exact(run)


def test_a_retry_commits_the_output_of_an_attempt_its_dead_completer_had_committed(tmp_path: Path):
    run = world(tmp_path)
    first = run.pipeline("first")
    attempt = load_attempt(first.storage, "run-a")
    assert attempt is not None
    first.sink = None  # killed after `_metadata`, before its sink commit
    complete_attempt(first, attempt)
    dead_holder_claim(run.storage(), 2, "run-a")
    done = finish_step(run.pipeline("retry"), ["run-a"])
    assert done is not None and done[1].checkpoint_id == 2
    assert 2 in run.pipeline("retry").sink.committed()  # type: ignore[union-attr]
    assert_exact(run)


def test_a_retry_leaves_an_attempt_to_a_live_completer_and_says_who_holds_it(tmp_path: Path):
    run = world(tmp_path)
    live = Claim(COMPLETE, time.time(), "live", socket.gethostname(), os.getppid(), None)
    run.storage().commit_exclusive(claim_path(2, "run-a"), live.dumps())
    with pytest.raises(AttemptInProgress, match=rf"being completed by process {os.getppid()} on .*recover job"):
        finish_step(run.pipeline("retry"), ["run-a"])
    assert not run.storage().exists("chk-2/_metadata")
    attempt = load_attempt(run.storage(), "run-a")
    assert attempt is not None and all(run.storage().exists(f.path) for f in attempt.new_files())


def test_a_completer_told_it_was_aborted_hears_by_whom(tmp_path: Path):
    run = world(tmp_path)
    late = run.pipeline("late")
    attempt = load_attempt(late.storage, "run-a")  # a completer that read its attempt, then stalled
    assert attempt is not None
    recoverer = run.pipeline("recoverer")
    assert settle_attempts(recoverer.storage, recoverer.sink).aborted == (2,)
    held = json.loads(run.storage().read_bytes(claim_path(2, "run-a")))
    assert held["side"] == ABORT and held["host"] == socket.gethostname() and held["pid"] == os.getpid()
    with pytest.raises(AttemptAborted, match=r"aborted by recovery \(process \d+ on .* UTC\): nothing was committed"):
        complete_attempt(late, attempt, persisted=True)


# --- claims: a dead holder is known dead only here; takeovers and fences --------------------------


def test_a_holder_is_known_dead_only_on_this_host_boot_and_pid_namespace(tmp_path: Path):
    import dataclasses
    import subprocess

    from sparkpoint.pipeline.claims import _process_start

    gone = subprocess.Popen(["sleep", "30"])
    started = _process_start(gone.pid)
    gone.kill()
    gone.wait()
    dead = dataclasses.replace(Claim.mine(COMPLETE), pid=gone.pid, pid_start=started)
    assert dead.holder_is_gone()
    # a pod on the same node with hostNetwork: same host name, its own PID namespace
    assert not dataclasses.replace(dead, pidns="4026531836-elsewhere").holder_is_gone()
    assert not dataclasses.replace(dead, boot="another-boot").holder_is_gone()
    assert not dataclasses.replace(dead, pid_start=None).holder_is_gone(), "a record that cannot tell"
    assert not Claim.mine(COMPLETE).holder_is_gone(), "this very process"


def test_one_retry_takes_a_dead_completers_claim_over_and_a_claim_is_released_by_its_writer_only(tmp_path: Path):
    from sparkpoint.pipeline.claims import current_holder, generation_path, release, take_over

    run = world(tmp_path)
    storage = run.storage()
    dead_holder_claim(storage, 2, "run-a")
    first = take_over(storage, 2, "run-a")
    assert first is not None and first[0] == 1
    assert take_over(storage, 2, "run-a") is None, "the first taker is alive: a second retry gets nothing"
    assert current_holder(storage, 2, "run-a")[1] == first[1]
    release(storage, 2, "run-a", 1, Claim.mine(COMPLETE))  # not ours: stays
    assert storage.exists(generation_path(2, "run-a", 1))
    release(storage, 2, "run-a", 1, first[1])
    assert not storage.exists(generation_path(2, "run-a", 1))


def test_a_completion_is_withdrawn_when_a_fence_landed_while_it_committed(tmp_path: Path):
    """The fence is read again right after `_metadata` landed, whatever id the completer took."""
    from sparkpoint.pipeline.claims import fence

    run = world(tmp_path)
    zombie = run.pipeline("zombie")
    attempt = load_attempt(zombie.storage, "run-a")
    assert attempt is not None
    assert claim(zombie.storage, 2, "run-a", COMPLETE)  # the zombie claimed before the recovery looked
    fence(run.storage(), ("run-a",), reason="recovery of the failed run")
    with pytest.raises(CheckpointDeclined, match="withdrawn right after its commit: fenced by recovery"):
        complete_attempt(zombie, attempt)
    assert CompletedCheckpointStore(run.storage()).checkpoint_ids() == [1]
    assert verify_checkpoint(run.storage(), CompletedCheckpointStore(run.storage()).load(1)) == []
    assert_exact(run)


def test_prune_forgets_fences_only_once_no_zombie_can_be_alive(tmp_path: Path):
    from sparkpoint.pipeline.claims import FENCE_LIFETIME, fence, fenced, forget_fences

    run = world(tmp_path)
    storage = run.storage()
    fence(storage, ("run-a",), reason="recovery of the failed run")
    assert fenced(storage, "run-a") and forget_fences(storage) == 0, "a fresh fence stays"
    assert forget_fences(storage, now=time.time() + FENCE_LIFETIME + 60) == 1
    assert fenced(storage, "run-a") is None
