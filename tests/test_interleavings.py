"""The protocol's actors, interleaved (tests/support/interleavings.py).

`make test` runs every scenario: the one with fewest switch points (a claim held at the race's
eve) with every schedule of at most two preemptions, the others with the schedule without
preemption and one drawn with at most two (random, a fixed seed: the exhaustive set takes hours), and prints the
count of schedules each explored (the terminal summary, `tests/conftest.py`). `make soak` explores
every schedule of at most two preemptions everywhere (three for the claimed completer, up to 1,500
a scenario) and samples 200 more at three. Each run writes its figures to
`build/interleavings/<scenario>-<mode>.json`. The tests that run chosen schedules share the
checker (its template and the steps each actor may be preempted at) of their scenario.

The checker is shown not to be vacuous: with the abort and the sweep as they were before the
fourth review (N1, N2), the savepoint's id as it was before the fifth (item 4), retention
without the checksum of reused files (item 7), the same exploration finds the loss; a commit
without the re-check of its base loses a batch under the schedule of a rollback that shows it; and
a history record written before the commit is found naming a loser of the race.
"""

from __future__ import annotations

import json
import posixpath
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import sparkpoint.checkpoint.savepoint as savepoint_module
import sparkpoint.pipeline.attempt.protocol as attempt_module
import sparkpoint.pipeline.maintenance as maintenance_module
from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.history import write_record
from sparkpoint.checkpoint.savepoint import SavepointResult
from tests.support.interleavings import SCENARIOS, Checker, Report, default_choice, describe, legs

ROOT = Path(__file__).resolve().parent.parent
SEED = 2026
# Every schedule with at most this many preemptions: the scenario with fewest switch points (it
# starts at the race's eve, a claim held) is small enough; the corruption step beside a run
# (every schedule of one preemption before 2026-11-29) is sampled like the others.
EXHAUSTIVE = {"claimed-completer-vs-recovery-abort": 2}
SOAK_BOUND = {"claimed-completer-vs-recovery-abort": 3}  # every schedule of at most this many in make soak
# Whole actors (a run, a recovery that re-processes a batch on RocksDB: 0.2-0.7 s a schedule):
# this many distinct schedules, drawn with SEED: the one without preemption (every sample runs it
# first) and one with at most two preemptions of each race in make test (it drew ten before
# 2026-11-29, then three, when the file was the suite's largest user of CPU among the Python-only
# files); make soak explores every schedule of at most two preemptions and 200 more at three.
SAMPLES = {
    "rot-vs-run-from-task-local-copy": 2,
    "uploaded-zombie-vs-recovery-sweep": 2,
    "completer-vs-recoverer": 2,
    "zombie-vs-recover-with-sweep": 2,
    "two-completers": 2,
    "completer-vs-prune-vs-sweep": 2,
    "retried-step-vs-recoverer": 2,
    "run-vs-savepoint": 2,
    "fenced-completer-vs-recoverer-vs-savepoint": 2,
    "savepoints-to-one-target-vs-run": 2,
    "bootstrap-vs-savepoint-one-target": 2,
    "skip-vs-run": 2,
    "follow-vs-recoverer": 2,
    "airflow-zombie-vs-recover-task": 2,
    "zombie-vs-recoverer-on-one-host": 2,
    "fallback-run-vs-savepoint": 2,
    "local-copy-run-vs-fallback-recovery": 2,
    # The same races with the output a Delta table: the table commit is a step of each actor.
    "completer-vs-recoverer-delta": 2,
    "two-completers-delta": 2,
    "zombie-vs-recover-with-sweep-delta": 2,
    "retried-step-vs-recoverer-delta": 2,
    "completer-vs-recoverer-iceberg": 2,
    "zombie-vs-recover-with-sweep-iceberg": 2,
    "rollback-vs-run": 2,
    "rollback-vs-recoverer": 2,
    # prune's input cleanup (a reader of the job directory; it writes the input and the archive)
    # beside the rollback's race with a run: it must never take a batch the rollback replays.
    "rollback-vs-run-vs-input-cleanup": 2,
    # An erase rewrites every retained checkpoint under new ids while a run commits and retention subsumes.
    "erase-vs-run-vs-retention": 2,
}


def record(report: Report, mode: str, seconds: float, record_property: Any) -> None:
    out = ROOT / "build" / "interleavings"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{report.scenario}-{mode}.json").write_text(json.dumps({
        "scenario": report.scenario, "mode": mode, "how": report.how, "actors": report.steps,
        "schedules": report.explored, "violations": len(report.violations), "seconds": round(seconds, 1),
    }, indent=1))
    record_property("interleavings", {"scenario": report.scenario, "mode": mode, "schedules": report.explored,
                                      "violations": len(report.violations), "seconds": round(seconds, 1),
                                      "line": report.line()})


def failure(report: Report) -> str:
    first = report.violations[0]
    return (f"{report.line()}\nfirst: {first.violations}\nactors ended: {first.errors}\n"
            f"schedule: {describe(first.schedule, 4000)}")


def test_every_scenario_is_checked_in_make_test():
    assert set(EXHAUSTIVE) | set(SAMPLES) == set(SCENARIOS)


@pytest.fixture(scope="module")
def checker_of(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Checker]:
    """The unpatched checker of a scenario, made once for the module's tests (a test that patches
    the code under test makes its own, so that the steps it may preempt are the patched code's)."""
    made: dict[str, Checker] = {}

    def checker(name: str) -> Checker:
        if name not in made:
            made[name] = Checker(SCENARIOS[name], tmp_path_factory.mktemp(name))
        return made[name]

    return checker


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_no_interleaving_of_the_actors_breaks_an_invariant(name: str, checker_of: Callable[[str], Checker],
                                                           record_property: Any):
    started = time.monotonic()
    checker = checker_of(name)
    if name in EXHAUSTIVE:
        report, mode = checker.explore(bound=EXHAUSTIVE[name]), f"bound{EXHAUSTIVE[name]}"
    else:
        report, mode = checker.sample(SAMPLES[name], seed=SEED, bound=2), "sample2"
    record(report, mode, time.monotonic() - started, record_property)
    assert len(report.steps) >= 2, report.steps
    if name in EXHAUSTIVE:
        assert report.explored >= max(report.steps.values()), "a switch was tried at every step of an actor"
    assert not report.violations, failure(report)


# --- the review's schedules, kept -------------------------------------------------------------------


@pytest.fixture
def savepoint_checker(checker_of: Callable[[str], Checker]) -> Checker:
    return checker_of("run-vs-savepoint")


def test_a_savepoint_that_copies_while_the_run_commits_is_taken_again_of_the_new_latest(savepoint_checker: Checker):
    """Item 4 of the fifth review: the savepoint reads chk-1 as the latest and starts copying;
    the run commits chk-2 (and subsumes chk-1); the copy of chk-1 was committed as chk-3 above it
    and batch 2 was replayed. Now its id is chk-2, the run's: it loses and is taken of chk-2."""
    outcome = savepoint_checker.run(legs(("savepoint", "write"), ("run", None), ("savepoint", None)))
    assert outcome.violations == [] and outcome.errors == {}, (outcome.violations, outcome.errors)
    saved = outcome.results["savepoint"]
    assert isinstance(saved, SavepointResult)
    assert (saved.source_checkpoint, saved.metadata.checkpoint_id) == (2, 3)


def test_a_savepoint_of_a_checkpoint_whose_writer_is_still_committing_keeps_its_output(savepoint_checker: Checker):
    """The second face of item 4: the run commits chk-2's `_metadata`; the savepoint of chk-2
    lands as chk-3 before the run's own checks after its commit, which took the newer savepoint
    for a newer checkpoint and withdrew chk-2: its batch's output was never made visible."""
    made = {"commit": False}

    def choose(enabled: tuple[str, ...], previous: str | None, index: int, steps: dict[str, tuple[str, str]]) -> str:
        if "run" in enabled and not made["commit"]:
            made["commit"] = steps["run"][0] == "create" and steps["run"][1].endswith("chk-2/_metadata")
            return "run"
        return "savepoint" if "savepoint" in enabled else default_choice(enabled, previous)

    outcome = savepoint_checker.run(choose)
    assert made["commit"] and outcome.violations == [] and outcome.errors == {}, (outcome.violations, outcome.errors)


def test_a_bootstrap_that_loses_its_target_to_a_savepoint_takes_none_of_the_savepoints_files(
        checker_of: Callable[[str], Checker]):
    """Found by the checker once both were actors: `bootstrap --to T` and `savepoint --to T` both
    found T absent; the savepoint committed T/chk-1 first, and the bootstrap, failing its own
    commit, removed every file in T, the savepoint's with them. Now both claim T by one exclusive
    create before writing anything: the second writer stops there."""
    checker = checker_of("bootstrap-vs-savepoint-one-target")
    outcome = checker.run(legs(("bootstrap", "_claim.json"), ("savepoint", None), ("bootstrap", None)))
    assert outcome.violations == [], outcome.violations
    assert isinstance(outcome.results["savepoint"], SavepointResult)
    assert "claimed by another writer" in outcome.errors["bootstrap"]


# --- not vacuous: the losses, put back, are found -------------------------------------------------


def test_the_checker_finds_n1_in_the_abort_as_it_was(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Before the fix an abort that lost the claim decided "another writer's" from a listing, so a
    completer's own `_metadata` landing during that listing made it discard the staged output."""
    def listing_only(storage: object, attempt: attempt_module.PendingAttempt) -> bool:
        return max(storage.completed_checkpoint_ids(), default=0) >= attempt.checkpoint_id  # type: ignore[attr-defined]

    monkeypatch.setattr(attempt_module, "_overtaken", listing_only)
    report = Checker(SCENARIOS["claimed-completer-vs-recovery-abort"], tmp_path).explore(bound=2)
    assert report.violations, report.line()
    assert any("not exactly once" in v for o in report.violations for v in o.violations)
    assert any("SinkOutputLost" in e for o in report.violations for e in o.errors.values())


def test_the_checker_finds_n2_in_the_sweep_as_it_was(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Before the fix recovery swept without fencing the failed run: its zombie committed over
    the swept files and subsumed the only good checkpoint. Found at one preemption."""
    monkeypatch.setattr(maintenance_module, "fence", lambda *args, **kwargs: {})
    report = Checker(SCENARIOS["uploaded-zombie-vs-recovery-sweep"], tmp_path).explore(bound=1, until_found=True)
    assert report.violations, report.line()
    assert any("lost files" in v for o in report.violations for v in o.violations)


_PENDING = re.compile(r"chk-([1-9][0-9]*)-.*\.json")


def test_the_checker_finds_item_4_with_the_savepoint_id_as_it_was(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Before the fix a savepoint into the job directory took an id above every `chk-N` and
    pending attempt it listed: a run's chk-2 committed below it, and the copy of chk-1 became
    the latest. Found at one preemption."""
    def next_free_id(dest: Any, meta: Any, *, into_job: bool) -> int:
        if not into_job:
            return int(meta.checkpoint_id)
        pending = [m.group(1) for f in dest.walk("_pending") if (m := _PENDING.fullmatch(posixpath.basename(f.path)))]
        return max([*dest.checkpoint_dirs(), *map(int, pending)], default=0) + 1

    monkeypatch.setattr(savepoint_module, "_savepoint_id", next_free_id)
    report = Checker(SCENARIOS["run-vs-savepoint"], tmp_path).explore(bound=1, until_found=True)
    assert report.violations, report.line()
    assert any("repeated" in v for o in report.violations for v in o.violations)


def test_the_checker_finds_item_7_with_retention_as_it_was(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Before the fix retention checked presence and size only: the run that restored chk-2 from
    its task-local copy reused the flipped file in chk-3 and subsumed chk-1, the only retained
    checkpoint without it. Found with no preemption at all."""
    monkeypatch.setattr(CheckpointCoordinator, "_keep_fallback_from_damaged_reuse",
                        lambda self, newest, doomed: (doomed, None))
    report = Checker(SCENARIOS["rot-vs-run-from-task-local-copy"], tmp_path).explore(bound=0)
    assert report.violations, report.line()
    assert any("cannot go on" in v for o in report.violations for v in o.violations)


def test_the_checker_finds_a_history_record_written_before_the_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The history is written by the completer after its commit stood (DESIGN rule 14). A completer
    that wrote its record before committing would leave, when it loses the race for chk-N, a record
    of another writer's checkpoint under its own attempt."""
    real = attempt_module._acknowledge_and_commit

    def record_first(storage: Any, coordinator: Any, attempt: Any, *rest: Any) -> Any:
        write_record(storage, {"checkpoint_id": attempt.checkpoint_id, "attempt_id": attempt.attempt_id},
                     previous=attempt.base)
        return real(storage, coordinator, attempt, *rest)

    monkeypatch.setattr(attempt_module, "_acknowledge_and_commit", record_first)
    report = Checker(SCENARIOS["two-completers"], tmp_path).sample(20, seed=SEED, bound=2, until_found=True)
    assert report.violations, report.line()
    assert any("history record of chk-2 names attempt" in v for o in report.violations for v in o.violations)


def test_a_run_committing_over_a_checkpoint_a_rollback_retired_withdraws_and_without_the_check_loses_a_batch(
        checker_of: Callable[[str], Checker], monkeypatch: pytest.MonkeyPatch):
    """The run restored chk-2 and counted the job's checkpoints for its commit of chk-3; the
    rollback to chk-1 retires chk-2 and lists the job a last time; then the run commits. Its
    re-check of its base (chk-2's `_metadata`, gone) withdraws chk-3 and the run goes on from
    chk-1. Without that re-check chk-3 stands on the retired state, and chk-2's batch, its output
    undone, is never written again (found by the checker)."""
    checker = checker_of("rollback-vs-run")
    schedule = (("run", "create"), ("rollback", "job/chk-*", 5), ("run", None), ("rollback", None))
    outcome = checker.run(legs(*schedule))
    assert outcome.violations == [] and outcome.errors == {}, (outcome.violations, outcome.errors)
    assert [report.checkpoint_id for report in outcome.results["run"]] == [3]  # its batch again, from chk-1

    monkeypatch.setattr(CheckpointCoordinator, "_withdraw_if_base_retired", lambda self, meta, base: None)
    lost = checker.run(legs(*schedule))
    assert any("not exactly once" in v and "missing" in v for v in lost.violations), lost.violations


# --- make soak ------------------------------------------------------------------------------------


@pytest.mark.soak
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_soak_every_schedule_at_two_preemptions_and_a_sample_at_three(name: str, tmp_path: Path,
                                                                      record_property: Any):
    started = time.monotonic()
    checker = Checker(SCENARIOS[name], tmp_path)
    report = checker.explore(bound=max(2, SOAK_BOUND.get(name, 0), EXHAUSTIVE.get(name, 0)), limit=1_500)
    how = report.how
    checker.sample(report.explored + 200, seed=SEED, bound=3, report=report)
    report.how = f"{how}; then {report.how}"
    record(report, "soak", time.monotonic() - started, record_property)
    assert not report.violations, failure(report)

