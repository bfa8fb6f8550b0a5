"""The example `examples/sessions/` end to end on Spark: its `visits` pipeline (sessions in list
state closed by event-time timers, first clicks deduplicated with an event-time TTL) over batches
with late, out-of-order and redelivered clicks. The sink's rows, the state left open (clicks and
the timer of each user, the ids still remembered), each batch's late rows and watermark equal
`tests.support.visits_oracle`'s recomputation: at parallelism 2 then rescaled to 3, after `sparkpoint run`
is killed (SIGKILL) at seeded points, after failures injected at each point of the protocol and
healed by recovery, and through changelog checkpoints materialized in steps, a task-local
recovery and a savepoint restored as a new job."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.cli import main
from sparkpoint.pipeline.attempt import finish_step, start_step, watermark_of
from sparkpoint.pipeline.driver import StatefulPipeline
from sparkpoint.pipeline.maintenance import recover
from sparkpoint.spark.faults import InjectedFailure
from sparkpoint.state.engine import changelog as cl
from sparkpoint.state.eventtime import iso_micros
from tests.support import crashkit
from tests.support.backends import make_backend
from tests.support.visits_oracle import Expected, expected, read_batches

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "sessions"


@pytest.fixture
def example(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The example's modules, imported as a user's project would be."""
    monkeypatch.syspath_prepend(str(EXAMPLE))
    for name in [m for m in sys.modules if m == "sessions" or m.startswith("sessions.")]:
        monkeypatch.delitem(sys.modules, name)
    import sessions.land
    import sessions.operators
    import sessions.pipelines

    yield sessions


def located(example: Any, root: Path, **changes: Any) -> Any:
    """The example's pipeline with its locations under `root`."""
    return example.pipelines.visits.with_(
        input_url=str(root / "in"), checkpoints_url=f"file://{root}/ckpt", output_url=f"file://{root}/out",
        local_dir=str(root / "local"), **changes)


def recomputed(example: Any, input_dir: Path) -> Expected:
    ops = example.operators
    return expected(read_batches(input_dir), lateness_s=example.pipelines.visits.allowed_lateness, gap=ops.GAP,
                    ttl_s=ops.SEEN_FOR.seconds)


def run(spark: Any, pipeline: Any, **overrides: Any) -> list[Any]:
    return StatefulPipeline(spark, pipeline.config(**overrides), pipeline.operators).run()


def sink_rows(out: Path, operator: str, jobs: dict[str, int] | None = None) -> pd.DataFrame:
    """The committed rows of `operator`, with the batch each came with: checkpoint N of a job
    whose first checkpoint took batch b carries batch b + N - first (`jobs`: job -> b - first)."""
    jobs = jobs or {"visits": -1}
    frames = []
    for path in sorted(out.glob(f"part-*~{operator}~*.parquet")):
        job = path.name[len("part-"):].split("~")[0]
        frames.append(pd.read_parquet(path).assign(job=job))
    rows = pd.concat(frames, ignore_index=True)
    rows["batch"] = rows["checkpoint_id"] + rows["job"].map(jobs)
    return rows.drop(columns=["checkpoint_id", "job"])


def same(got: pd.DataFrame, want: pd.DataFrame, by: list[str]) -> None:
    got = got.sort_values(by).reset_index(drop=True)
    want = want.sort_values(by).reset_index(drop=True)
    pd.testing.assert_frame_equal(got.astype({c: object for c in got.select_dtypes(["string", "str"]).columns}),
                                  want.astype({c: object for c in want.select_dtypes(["string", "str"]).columns}),
                                  check_dtype=False)


def assert_sink_exact(out: Path, want: Expected, jobs: dict[str, int] | None = None) -> None:
    """Every closed session and every first click committed once, with the batch that made it."""
    same(sink_rows(out, "sessions", jobs), want.sessions, ["user", "session_start"])
    same(sink_rows(out, "first_clicks", jobs), want.first_clicks, ["event_id", "batch"])
    assert not list(out.glob("_staging/*/chk-*")), "no staged output is left"


def assert_state_exact(pipeline: Any, want: Expected, checkpoint: int | None = None) -> None:
    """The open clicks of each user with their one timer, and the ids the TTL has not expired."""
    same(pipeline.read_state("sessions", checkpoint), want.open_sessions, ["user"])
    same(pipeline.read_state("first_clicks", checkpoint), want.seen, ["event_id"])


def covers_every_case(want: Expected) -> None:
    """The batches exercise what the operators are for (else the test would prove less than it says)."""
    assert sum(want.late_rows) and want.duplicates_dropped and want.reemitted, want
    assert len(want.sessions) and len(want.open_sessions) and len(want.seen) < len(want.first_clicks)


def test_the_guide_quotes_the_example_as_it_is():
    """Every line of the guide's excerpts of the example is a line of its files (so they cannot rot)."""
    from tests.support.docs_text import python_blocks, section

    text = section("pipeline.md", "### Sessions and deduplication on event time (`examples/sessions/`)")
    code = "\n".join(p.read_text() for p in (EXAMPLE / "sessions").glob("*.py")).splitlines()
    quoted = [line for block in python_blocks(text) for line in block.splitlines()]
    assert len(quoted) > 10
    for line in quoted:
        assert line in code, f"docs/pipeline.md quotes a line examples/sessions does not have: {line!r}"


def test_the_operators_on_one_subtask_equal_the_recomputation(tmp_path: Path, example: Any):
    """No Spark: each operator on one subtask over the batches, with the oracle's watermarks."""
    from sparkpoint.checkpoint.storage import CheckpointStorage
    from sparkpoint.state.operators import run_batch

    batches = [example.land.clicks_batch(n, seed=7) for n in range(9)]
    ops = example.operators
    want = expected(batches, lateness_s=120, gap=ops.GAP, ttl_s=ops.SEEN_FOR.seconds)
    covers_every_case(want)
    storage = CheckpointStorage(f"file://{tmp_path}/ckpt", "job")
    for op in (ops.sessions, ops.first_clicks):
        emitted = []
        with make_backend(storage, tmp_path / "local", operator=op.name) as state:
            state.restore(None)
            for n, batch in enumerate(batches):
                if n:
                    batch = batch[batch["clicked_at"] >= pd.Timestamp(want.watermarks[n - 1], unit="us", tz="UTC")]
                out = run_batch(op, state, batch[op.input_columns()].reset_index(drop=True), processing_us=0,
                                watermark_us=want.watermarks[n], event_time=True)
                emitted += [out.assign(batch=n)] if out is not None else []
            exported = op.export(state)
        if op is ops.sessions:
            same(pd.concat(emitted), want.sessions, ["user", "session_start"])
            same(exported, want.open_sessions, ["user"])
        else:
            same(pd.concat(emitted), want.first_clicks, ["event_id", "batch"])
            same(exported, want.seen, ["event_id"])


# --- (a) a plain run, then a rescale ------------------------------------------------------------


@pytest.mark.spark
def test_sessions_and_first_clicks_equal_the_recomputation_at_parallelism_2_then_rescaled_to_3(
        spark: Any, tmp_path: Path, example: Any):
    example.land.land(tmp_path / "in", 5)
    pipeline = located(example, tmp_path, parallelism=2)
    reports = run(spark, pipeline)
    example.land.land(tmp_path / "in", 4)
    rescaled = run(spark, pipeline.with_(parallelism=3))
    assert set(rescaled[0].restored) == {"rescale"} and len(rescaled[0].restored) == 6
    reports += rescaled

    want = recomputed(example, tmp_path / "in")
    covers_every_case(want)
    assert [r.checkpoint_id for r in reports] == list(range(1, 10))
    assert [r.late_rows for r in reports] == want.late_rows
    assert [r.watermark for r in reports] == want.watermarks
    assert [r.to_json()["watermark"] for r in reports] == [iso_micros(w) for w in want.watermarks]
    latest = CompletedCheckpointStore(pipeline.storage()).load(9)
    assert watermark_of(latest) == latest.source_offsets["watermark"] == want.watermarks[-1]
    assert_sink_exact(tmp_path / "out", want)
    assert_state_exact(pipeline, want)


# --- (b) kill -9 at seeded points of `sparkpoint run`, as a user runs it --------------------------

# Crash points hit once per (operator, subtask) and batch (2 x 2 at parallelism 2), and once per
# batch on the driver.
SUBTASK_POINTS = ("after-native-checkpoint", "after-upload")
DRIVER_POINTS = ("before-metadata", "after-metadata-before-registry", "after-metadata-before-sink-commit")


def killed_and_resumed(tmp_path: Path, seed: int) -> None:
    project = tmp_path / "project"
    shutil.copytree(EXAMPLE, project, ignore=shutil.ignore_patterns(".sparkpoint", "__pycache__"))
    env = {"PYTHONPATH": f"{project}:{ROOT}"}
    subprocess.run([sys.executable, "-m", "sessions.land", "--batches", "7", "--seed", str(seed)], cwd=project,
                   env={**env, "PATH": "/usr/bin:/bin"}, check=True, capture_output=True)
    cmd = [sys.executable, "-m", "sparkpoint.cli", "run", "--pipeline", "sessions.pipelines:visits", "--json"]
    rng = random.Random(seed)
    worker, driver = rng.choice(SUBTASK_POINTS), rng.choice(DRIVER_POINTS)
    runs = [(worker, 4 * rng.randint(1, 2) + rng.randint(1, 4)), (driver, rng.randint(1, 2))]
    for i, (point, hit) in enumerate(runs):
        crashed = crashkit.run(cmd, crash_at=f"{point}:{hit}", crash_dir=tmp_path / f"crash-{i}", env=env, cwd=project)
        crashkit.assert_died_at(crashed, point)
    done = crashkit.run([*cmd, "--parallelism", "3"], env=env, cwd=project)
    crashkit.assert_finished(done)
    reports = [json.loads(line) for line in done.stdout.splitlines()]
    assert reports and all(r["restored"] for r in reports)
    assert set(reports[0]["restored"]) == {"rescale"}

    sys.path.insert(0, str(project))
    try:
        from sessions.pipelines import visits

        home = visits.with_(input_url=str(project / ".sparkpoint/visits/input"),
                            checkpoints_url=str(project / ".sparkpoint/visits/checkpoints"))
        input_dir = project / ".sparkpoint" / "visits" / "input"
        from sessions.operators import GAP, SEEN_FOR

        want = expected(read_batches(input_dir), lateness_s=visits.allowed_lateness, gap=GAP, ttl_s=SEEN_FOR.seconds)
        for r in reports:
            batch = int(r["batch"][0].split("-")[1].split(".")[0])
            assert r["late_rows"] == want.late_rows[batch] and r["watermark"] == iso_micros(want.watermarks[batch])
        assert_sink_exact(project / ".sparkpoint" / "visits" / "output", want)
        assert_state_exact(home, want)
    finally:
        sys.path.remove(str(project))
        for name in [m for m in sys.modules if m == "sessions" or m.startswith("sessions.")]:
            del sys.modules[name]
    url = f"file://{project}/.sparkpoint/visits/checkpoints"
    assert crashkit.assert_storage_settled(url, "visits") == 2


@pytest.mark.spark
def test_sessions_and_first_clicks_are_exact_after_sparkpoint_run_is_killed_at_random_points(tmp_path: Path):
    killed_and_resumed(tmp_path, seed=32)


@pytest.mark.soak
@pytest.mark.spark
@pytest.mark.parametrize("seed", range(1, 9))
def test_soak_sessions_and_first_clicks_are_exact_after_kills_at_seeded_points(tmp_path: Path, seed: int):
    killed_and_resumed(tmp_path, seed)


# --- (c) injected failures healed by recovery ---------------------------------------------------


@pytest.mark.spark
def test_failures_injected_at_each_point_are_healed_by_recovery_exactly(spark: Any, tmp_path: Path, example: Any):
    example.land.land(tmp_path / "in", 7)
    pipeline = located(example, tmp_path, parallelism=2)
    run(spark, pipeline, max_batches=1)

    def core(p: Any = pipeline) -> StatefulPipeline:  # a new process for each step, as under an orchestrator
        return StatefulPipeline(spark, p.config(), p.operators)

    for n, point in enumerate(("before-upload", "after-upload", "before-commit")):
        attempt = f"try-{n}"
        with pytest.raises(InjectedFailure):
            if point == "before-commit":
                start_step(core(), attempt)
                finish_step(core(), [attempt], inject_failure=point)
            else:
                start_step(core(), attempt, inject_failure=point)
        healed = recover(core(), failed_attempts=(attempt,), failed_before=time.time())
        assert healed.batch is not None and healed.batch[0].checkpoint_id == n + 2, point
        if point == "before-upload":  # subtask 0 had applied the batch to its working database
            assert "local" in healed.batch[0].restored, healed.batch[0].restored
    run(spark, pipeline.with_(parallelism=3))

    want = recomputed(example, tmp_path / "in")
    assert_sink_exact(tmp_path / "out", want)
    assert_state_exact(pipeline, want)
    assert main(["verify", "--checkpoints", f"file://{tmp_path}/ckpt", "--job-id", "visits"]) == 0


# --- (d) changelog materialized in steps, task-local recovery, a savepoint ----------------------


def kinds(pipeline: Any, checkpoint_id: int) -> str:
    """What checkpoint N uploaded: 'log' (changelog files only), 'staged' (slices of a
    materialization in steps beside the chain), 'switched' (new RocksDB files beside an older
    chain: the switch to a materialization in steps) or 'files' (RocksDB files at once)."""
    meta = CompletedCheckpointStore(pipeline.storage()).load(checkpoint_id)
    handles = list(meta.subtask_handles())
    new = [f for h in handles for f in h.files() if f.created_by == checkpoint_id]
    older_chain = any(cl.is_changelog(f.local_name) and f.created_by < checkpoint_id
                      for h in handles for f in h.files())
    if any(not cl.is_changelog(f.local_name) for f in new):
        return "switched" if older_chain else "files"
    return "staged" if any(h.staged for h in handles) else "log"


@pytest.mark.spark
def test_timers_and_ttl_go_through_materialization_in_steps_task_local_recovery_and_a_savepoint(
        spark: Any, tmp_path: Path, example: Any, capsys: pytest.CaptureFixture[str]):
    example.land.land(tmp_path / "in", 9)
    batches = read_batches(tmp_path / "in")
    pipeline = located(example, tmp_path, parallelism=2, changelog_max_chain=3, changelog_materialize_share=100.0)
    ops = example.operators
    seen = []
    for n in range(7):
        (report,) = run(spark, pipeline, max_batches=1)
        seen.append(kinds(pipeline, report.checkpoint_id))
        want = expected(batches[: n + 1], lateness_s=pipeline.allowed_lateness, gap=ops.GAP, ttl_s=ops.SEEN_FOR.seconds)
        assert_state_exact(pipeline, want, report.checkpoint_id)
        if n == 5:  # a new working database from the task-local copies
            for db in (tmp_path / "local" / "visits").glob("*/*/db"):
                shutil.rmtree(db)
        if n == 6:
            assert set(report.restored) == {"local"}, report.restored
    assert "staged" in seen and "switched" in seen, seen

    capsys.readouterr()
    assert main(["savepoint", "--checkpoints", f"file://{tmp_path}/ckpt", "--job-id", "visits", "--json"]) == 0
    savepoint = json.loads(capsys.readouterr().out)["savepoint"]
    restored = pipeline.with_(job_id="visits-restored", from_checkpoint=savepoint, parallelism=3)
    reports = run(spark, restored)
    assert [r.files for r in reports] == [(f"clicks-{b:06d}.parquet",) for b in (7, 8)]
    assert set(reports[0].restored) == {"rescale"}

    want = recomputed(example, tmp_path / "in")
    assert [r.watermark for r in reports] == want.watermarks[7:]
    assert [r.late_rows for r in reports] == want.late_rows[7:]
    assert_sink_exact(tmp_path / "out", want, jobs={"visits": -1, "visits-restored": 7 - reports[0].checkpoint_id})
    assert_state_exact(restored, want)
