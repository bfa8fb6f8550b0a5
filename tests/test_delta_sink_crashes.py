"""kill -9 at every step of a Delta table commit, with a user's own pipeline
(`tests.support.ledger_pipeline`), each run resuming from the previous crash: before delta-rs
commits, right after (the table holds the checkpoint, the committer recorded nothing after it),
before the commit begins at all, and inside a start's settling of a commit a crash cut short (the
recovery that finds a half-done commit). After the last run the table holds every batch's rows
exactly once, in one table version per checkpoint.

The chain runs the product's batch loop without Spark (`tests.support.delta_crash_driver`: a run
starts in about a second); `sparkpoint run` on local Spark is killed right after its table commit
once. delta-rs' commit itself is one log entry created atomically (put-if-absent): a kill inside
it leaves the table either before (`before-table-commit`'s state) or after (`after-table-commit`'s).
"""

from __future__ import annotations

import sys
from pathlib import Path

from tests.support.crashkit import assert_died_at, assert_finished, assert_storage_settled, run
from tests.support.ledger_pipeline import assert_table_exactly_once, land, ledger_run

CHAIN = [  # (point, hit): hits count per run; a start first settles the commit of its checkpoint
    ("before-table-commit", 1),  # chk-1: staged in the table, _metadata written, no table yet
    ("after-table-commit", 2),  # the start commits chk-1, then chk-2's commit lands and it dies
    ("after-metadata-before-sink-commit", 1),  # chk-3 complete, its commit not begun
    ("before-table-commit", 1),  # the next start settles chk-3 and dies inside that commit
    ("after-table-commit", 1),  # the one after lands chk-3's commit and dies right after it
    ("before-table-commit", 2),  # and the next checkpoint's (chk-4) commit, once more
]


def test_kill_9_at_every_step_of_the_table_commit_ends_exactly_once(tmp_path: Path):
    land(tmp_path / "in", 6)
    cmd = [sys.executable, "-m", "tests.support.delta_crash_driver", str(tmp_path)]
    for i, (point, hit) in enumerate(CHAIN):
        assert_died_at(run(cmd, crash_at=f"{point}:{hit}", crash_dir=tmp_path / f"crash-{i}", timeout=120), point)
    assert_finished(run(cmd, timeout=120))
    assert_table_exactly_once(tmp_path)
    assert assert_storage_settled(f"file://{tmp_path}/ckpt", "ledger") == 2


def test_sparkpoint_run_killed_right_after_its_table_commit_resumes_exactly_once(tmp_path: Path):
    land(tmp_path / "in", 3)
    cmd = ledger_run(tmp_path)
    assert_died_at(run(cmd, crash_at="after-table-commit:2", crash_dir=tmp_path / "crash", timeout=400),
                   "after-table-commit")
    assert_finished(run(cmd, timeout=400))
    assert_table_exactly_once(tmp_path)
