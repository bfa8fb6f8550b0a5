"""The protocol's actors, every interleaving of their storage steps (tests/interleavings.py).

`make test` explores each scenario with every schedule of at most one preemption (two or three
for the ones that start at the race's eve); `make soak` one more everywhere and a seeded random
sample of 1,000 schedules. Each
explore writes its figures to `build/interleavings/<scenario>.json` (the README quotes them).

The checker is shown not to be vacuous: with the abort and the sweep as they were before the
fourth review (N1, N2), the same exploration finds the data loss.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

import sparkpoint.pipeline.attempt as attempt_module
import sparkpoint.pipeline.maintenance as maintenance_module
from tests.interleavings import SCENARIOS, Checker, Report, describe

ROOT = Path(__file__).resolve().parent.parent
# Preemptions explored, all schedules up to this many: the scenarios that start at the race's
# eve (a claim held, uploads made) are small enough for more; whole actors (a recovery that
# re-processes a batch on RocksDB) take 0.1-0.2 s a schedule.
BOUNDS = {
    "claimed-completer-vs-recovery-abort": 3,
    "uploaded-zombie-vs-recovery-sweep": 2,
    "completer-vs-recoverer": 1,
    "zombie-vs-recover-with-sweep": 1,
    "two-completers": 1,
    "completer-vs-prune-vs-sweep": 1,
    "retried-step-vs-recoverer": 1,
}
SOAK_BOUNDS = {name: bound + 1 for name, bound in BOUNDS.items()}


def record(report: Report, mode: str, seconds: float) -> None:
    out = ROOT / "build" / "interleavings"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{report.scenario}-{mode}.json").write_text(json.dumps({
        "scenario": report.scenario, "mode": mode, "actors": report.steps, "interleavings": report.explored,
        "violations": len(report.violations), "seconds": round(seconds, 1),
    }, indent=1))
    print(report.line(), f"[{mode}, {seconds:.0f} s]")


def failure(report: Report) -> str:
    first = report.violations[0]
    return (f"{report.line()}\nfirst: {first.violations}\nactors ended: {first.errors}\n"
            f"schedule: {describe(first.schedule, 4000)}")


@pytest.mark.parametrize("name", sorted(BOUNDS))
def test_no_interleaving_of_the_actors_breaks_an_invariant(name: str, tmp_path: Path):
    started = time.monotonic()
    checker = Checker(SCENARIOS[name], tmp_path)
    report = checker.explore(bound=BOUNDS[name])
    record(report, f"bound{BOUNDS[name]}", time.monotonic() - started)
    assert len(report.steps) >= 2 and all(n >= 2 for n in report.steps.values()), report.steps
    assert report.explored >= max(report.steps.values()), "a switch was tried at every step of an actor"
    assert not report.violations, failure(report)


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
    the swept files and subsumed the only good checkpoint."""
    monkeypatch.setattr(maintenance_module, "fence", lambda *args, **kwargs: {})
    report = Checker(SCENARIOS["uploaded-zombie-vs-recovery-sweep"], tmp_path).explore(bound=2, until_found=True)
    assert report.violations, report.line()
    assert any("lost files" in v for o in report.violations for v in o.violations)


@pytest.mark.soak
@pytest.mark.parametrize("name", sorted(BOUNDS))
def test_soak_one_more_preemption_and_a_random_sample(name: str, tmp_path: Path):
    started = time.monotonic()
    checker = Checker(SCENARIOS[name], tmp_path)
    report = checker.explore(bound=SOAK_BOUNDS[name], limit=20_000)
    checker.sample(1_000, seed=2026, switch=0.15, report=report)
    record(report, "soak", time.monotonic() - started)
    assert not report.violations, failure(report)
