"""Savepoints into the job's own directory race the job's runs as a writer of that directory
(DESIGN rules 6, 9, 14): a run commits while a savepoint copies, through the storage seam's step
hook, with real RocksDB subtasks and real files (the checker's pipeline, run in this process)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import fsspec
import pandas as pd
import pytest

from sparkpoint.checkpoint.interleave import set_step_hook
from sparkpoint.checkpoint.savepoint import take_savepoint
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.pipeline.runtime import PipelineConfig
from sparkpoint.state.extract import state_table
from tests.support.interleavings import BALANCES, InProcessPipeline, Run, expected, land


class Stop(BaseException):
    """The run dies here, as a kill would leave it (nothing of the run's cleanup runs)."""


def world(tmp_path: Path) -> Run:
    run = Run(tmp_path, f"file://{tmp_path}/store")
    land(run, 3)
    return run


def pipeline(run: Run, *, max_batches: int | None = None, num_retained: int = 2) -> InProcessPipeline:
    config = PipelineConfig(
        input_url=str(run.input), checkpoints_url=run.checkpoints, job_id="job", output_url=run.output,
        num_retained=num_retained, parallelism=2, max_parallelism=8, local_dir=str(run.root / "local"),
        max_batches=max_batches,
    )
    return InProcessPipeline(None, config, (BALANCES,))


@contextmanager
def at_step(op: str, ending: str, act: Callable[[], Any]) -> Iterator[list[Any]]:
    """Run `act` once, the first time a storage step `op` on a path ending in `ending` is made;
    what it returned (or raised) is in the list yielded."""
    done: list[Any] = []

    def hook(step: str, path: str) -> None:
        if not done and step == op and path.endswith(ending):
            done.append(None)
            previous = set_step_hook(None)  # the act's own steps run unhooked
            try:
                done[0] = act()
            finally:
                set_step_hook(previous)

    previous = set_step_hook(hook)
    try:
        yield done
    finally:
        set_step_hook(previous)
    assert done, f"no {op} step on *{ending} was made"


def output_rows(run: Run) -> list[tuple[str, int]]:
    fs = fsspec.filesystem("file")
    root = run.output.removeprefix("file://")
    rows: list[tuple[str, int]] = []
    for path in sorted(fs.ls(root, detail=False)):
        if path.rsplit("/", 1)[-1].startswith("part-job~"):
            frame = pd.read_parquet(path)
            rows += [(str(a), int(b)) for a, b in zip(frame["acct"], frame["balance"])]
    return sorted(rows)


def assert_exactly_once(run: Run) -> None:
    want_rows, want_totals = expected(run)
    got = output_rows(run)
    assert len(got) - len(set(got)) == 0, f"{len(got) - len(set(got))} output rows repeated"
    assert got == want_rows
    _, state = state_table(run.storage(), BALANCES)
    assert dict(zip(state["acct"], state["balance"].astype(int))) == want_totals


def kinds(run: Run) -> list[tuple[int, str]]:
    listing = CompletedCheckpointStore(run.storage()).load_all()
    return [(m.checkpoint_id, m.kind) for m in listing.checkpoints]


def test_a_checkpoint_committed_during_the_copy_is_never_rolled_back(tmp_path: Path):
    """The review's item 4: the savepoint read chk-1 as the latest, a run committed chk-2 while it
    copied, and the copy of chk-1 committed above it became the latest: the next run replayed
    batch 2 and wrote its output twice. Now the savepoint's id is exactly 2, the run holds it, and
    the savepoint is taken again of chk-2."""
    run = world(tmp_path)
    pipeline(run, max_batches=1).run()
    with at_step("read", "chk-1/_metadata", lambda: pipeline(run, max_batches=1).run()) as during:
        saved = take_savepoint(run.storage())
    rest = pipeline(run).run()
    assert_exactly_once(run)
    assert [r.checkpoint_id for r in during[0]] == [2]
    assert (saved.source_checkpoint, saved.metadata.checkpoint_id) == (2, 3)
    assert [r.checkpoint_id for r in rest] == [4]
    assert kinds(run) == [(4, "checkpoint"), (3, "savepoint"), (2, "checkpoint")]


def test_a_checkpoint_subsumed_during_the_copy_makes_the_savepoint_copy_the_new_latest(tmp_path: Path):
    """With one checkpoint retained the run's commit deletes chk-1 and its files under the copy:
    not damage, the job moved on; the savepoint is taken of chk-2."""
    run = world(tmp_path)
    pipeline(run, max_batches=1, num_retained=1).run()
    with at_step("write", ".sst", lambda: pipeline(run, max_batches=1, num_retained=1).run()):
        saved = take_savepoint(run.storage())
    assert (saved.source_checkpoint, saved.metadata.checkpoint_id) == (2, 3)
    assert kinds(run) == [(3, "savepoint"), (2, "checkpoint")]
    pipeline(run, num_retained=1).run()
    assert_exactly_once(run)


def test_a_savepoint_that_takes_the_id_first_makes_the_racing_run_redo_its_batch(tmp_path: Path):
    run = world(tmp_path)
    pipeline(run, max_batches=1).run()
    with at_step("create", "chk-2/_metadata", lambda: take_savepoint(run.storage())) as during:
        reports = pipeline(run, max_batches=1).run()
    assert during[0].metadata.checkpoint_id == 2 and during[0].source_checkpoint == 1
    assert [r.checkpoint_id for r in reports] == [3], "the run lost chk-2 and did its batch again from the savepoint"
    pipeline(run).run()
    assert_exactly_once(run)


def test_a_start_from_a_savepoint_commits_the_output_its_checkpoints_writer_left_staged(tmp_path: Path):
    """The run committed chk-2's `_metadata` and died before its output was visible; the savepoint
    of chk-2 taken in between is the latest: the next start finishes chk-2's output."""
    run = world(tmp_path)
    pipeline(run, max_batches=1).run()

    def savepoint_then_die() -> None:
        take_savepoint(run.storage())
        raise Stop()

    with pytest.raises(Stop), at_step("move", "part-job~00000002~balances~00000.parquet", savepoint_then_die):
        pipeline(run, max_batches=1).run()
    assert kinds(run) == [(3, "savepoint"), (2, "checkpoint"), (1, "checkpoint")]
    pipeline(run).run()
    assert_exactly_once(run)


def test_a_checkpoint_whose_step_is_still_completing_it_is_not_copied_into_the_job_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Until its completing step has forgotten its attempt, a recovery may still withdraw the
    checkpoint (a fenced zombie's); a savepoint of it in the job directory would outlive it."""
    from sparkpoint.checkpoint import savepoint as savepoint_module
    from sparkpoint.checkpoint.errors import SavepointOvertaken
    from sparkpoint.pipeline.attempt import attempt_path, written_by

    monkeypatch.setattr(savepoint_module, "SETTLE_SECONDS", 0.0)
    run = world(tmp_path)
    pipeline(run, max_batches=1).run()
    storage = run.storage()
    meta = CompletedCheckpointStore(storage).load(1)
    attempt = written_by(meta)
    assert attempt is not None
    storage.write_bytes(attempt_path(1, attempt), b"{}")  # its step has not finished with it yet
    root = tmp_path / "store" / "ckpt" / "job"
    before = sorted(str(p) for p in root.rglob("*"))
    with pytest.raises(SavepointOvertaken, match=f"still being completed by attempt {attempt}.*recover job"):
        take_savepoint(storage)
    assert sorted(str(p) for p in root.rglob("*")) == before
    saved = take_savepoint(storage, target=f"file://{tmp_path}/elsewhere/sp")  # out of the job: no race
    assert saved.metadata.checkpoint_id == 1
    storage.delete([attempt_path(1, attempt)])
    assert take_savepoint(storage).metadata.checkpoint_id == 2


def test_a_step_whose_checkpoint_id_a_savepoint_took_is_overtaken_and_its_batch_offered_again(tmp_path: Path):
    from sparkpoint.pipeline.attempt import Overtaken, finish_step_or_overtaken, start_step

    run = world(tmp_path)
    pipeline(run, max_batches=1).run()
    step = pipeline(run)
    attempt = start_step(step, "run-a")  # a Dagster run's SSTable step persisted chk-2
    assert attempt is not None and attempt.checkpoint_id == 2
    assert take_savepoint(run.storage()).metadata.checkpoint_id == 2
    lost = finish_step_or_overtaken(step, ["run-a"])
    assert isinstance(lost, Overtaken) and lost.line("run").startswith("overtaken by the savepoint chk-2; nothing")
    pipeline(run).run()
    assert_exactly_once(run)
