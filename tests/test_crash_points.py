"""Named crash points: the run's process group is SIGKILLed exactly there, then resumed.

After every crash and resume: the state (and for `sparkpoint run`, the sink output) equals a
recomputation from the input, every retained checkpoint verifies, and after `gc --grace 0`
storage holds exactly what the retained checkpoints reference.

Two drivers are killed: `tests.support.crash_driver` (the core protocol without Spark: a process starts
in ~1 s, so every point x several seeds fits in `make test`), and `sparkpoint run` on local Spark
(a JVM per run: every point, chained in a seeded order, x 5 seeds in `make soak`; in `make test`
`tests/test_s3_e2e.py` kills it at three points on S3).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

import pytest

from sparkpoint.checkpoint.crash import CRASH_POINTS, TABLE_POINTS, crash_point, parse
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.cli import main
from tests.support import crash_driver
from tests.support.crashkit import (
    assert_died_at,
    assert_finished,
    assert_storage_settled,
    file_job,
    run,
    seeded_chain,
    spark_chain,
)

SOAK_SEEDS = int(os.environ.get("SPARKPOINT_SOAK_SEEDS", "5"))
CORE_POINTS = tuple(p for p in CRASH_POINTS  # the sink's points are Spark's (the table points: test_delta_sink_e2e)
                    if p != "after-metadata-before-sink-commit" and p not in TABLE_POINTS)


def test_crash_point_names_are_checked():
    assert parse("mid-upload:3") == ("mid-upload", 3)
    with pytest.raises(ValueError, match="unknown crash point 'mid-uplaod'"):
        parse("mid-uplaod")
    with pytest.raises(ValueError, match="at least 1"):
        parse("mid-upload:0")
    crash_point("mid-upload")  # not asked for: nothing happens


# --- the core driver ------------------------------------------------------------------------------

CORE_BATCHES = 7


def core_hit(point: str, rng: random.Random) -> int:
    """Which hit to die at, so that a run of CORE_BATCHES batches surely reaches it."""
    per_checkpoint = {"before-metadata": 1, "after-metadata-before-registry": 1}
    if point == "mid-subsumption-deletes":
        return rng.randint(1, CORE_BATCHES - crash_driver.RETAINED)
    if point == "mid-restore":
        return 1
    return rng.randint(1, per_checkpoint.get(point, 2) * (CORE_BATCHES - 2))


def core_scenario(tmp_path: Path, point: str, seed: int) -> dict[str, object]:
    rng = random.Random(f"{point}/{seed}")
    root = tmp_path / f"{point}-{seed}"
    cmd = [sys.executable, "-m", "tests.support.crash_driver", str(root), "--seed", str(seed),
           "--batches", str(CORE_BATCHES)]
    runs = 0
    if point == "mid-restore":  # first leave a subtask ahead of its checkpoint, maybe lose the local disk too
        per_checkpoint = {"after-native-checkpoint": 2, "after-upload": 2, "before-metadata": 1}  # exactly
        prelude = rng.choice(sorted(per_checkpoint))
        at = f"{prelude}:{per_checkpoint[prelude] * rng.randint(1, CORE_BATCHES - 1) + 1}"  # chk-1 completed
        assert_died_at(run(cmd, crash_at=at, crash_dir=tmp_path / f"crash-{point}-{seed}-0", timeout=120), prelude)
        runs += 1
        if rng.random() < 0.5:
            shutil.rmtree(root / "local")
    hit = core_hit(point, rng)
    crashed = run(cmd, crash_at=f"{point}:{hit}", crash_dir=tmp_path / f"crash-{point}-{seed}", timeout=120)
    assert_died_at(crashed, point)
    storage = crash_driver.storage_of(str(root))
    if storage.completed_checkpoint_ids():  # what the crash left: every retained checkpoint verifies
        assert main(["verify", "--checkpoints", storage.url, "--job-id", "job"]) == 0, f"all verify after {point}"
    resumed = run(cmd, timeout=120)
    assert_finished(resumed)
    runs += 2
    store = CompletedCheckpointStore(storage)
    latest = store.load(store.checkpoint_ids()[0])
    assert latest.source_offsets == {"next_batch": CORE_BATCHES}
    assert core_state(storage, latest) == crash_driver.expected_totals(seed, CORE_BATCHES)
    retained = assert_storage_settled(storage.url, "job")
    assert retained == crash_driver.RETAINED
    return {"point": point, "seed": seed, "hit": hit, "runs": runs, "resumed": resumed.stdout.splitlines()[0]}


def core_state(storage, meta) -> dict[str, int]:  # type: ignore[no-untyped-def]
    from sparkpoint.state.extract import operator_states

    with operator_states(storage, meta, crash_driver.OPERATOR) as backends:
        return {k.decode(): v for b in backends for k, v in b.value_state("total", crash_driver.CODEC).items()}


@pytest.mark.parametrize("point", CORE_POINTS)
def test_core_protocol_killed_at_each_point_resumes_exactly(tmp_path: Path, point: str):
    core_scenario(tmp_path, point, seed=1)


@pytest.mark.soak
def test_soak_core_protocol_killed_at_every_point_x_seeds(tmp_path: Path):
    started = time.monotonic()
    rows = [core_scenario(tmp_path, point, seed) for seed in range(1, SOAK_SEEDS + 1) for point in CORE_POINTS]
    report("crash_points_core", rows, started, ["point", "seed", "hit", "runs", "resumed"])


# --- sparkpoint run on local Spark ----------------------------------------------------------------


@pytest.mark.spark
@pytest.mark.soak
def test_soak_sparkpoint_run_killed_at_every_point_x_seeds(tmp_path: Path):
    started = time.monotonic()
    rows = []
    for seed in range(1, SOAK_SEEDS + 1):
        where = tmp_path / f"seed-{seed}"
        chain, lose_local = seeded_chain(seed)
        rows += spark_chain(where, file_job(where), chain, seed, warm_up=True, lose_local_before=lose_local)
    report("crash_points_spark", rows, started, ["seed", "step", "point", "hit", "process", "checkpoints"])


def report(name: str, rows: list[dict[str, object]], started: float, columns: list[str]) -> None:
    """Print the table and write build/soak/<name>.json."""
    seconds = round(time.monotonic() - started, 1)
    points = sorted({str(r["point"]) for r in rows})
    seeds = len({r["seed"] for r in rows})
    summary = {"name": name, "crashes": len(rows), "points": len(points), "seeds": seeds, "failures": 0,
               "seconds": seconds, "runs": rows}
    out = Path("build/soak")
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(summary, indent=1))
    print(f"\n{name}: {len(rows)} crashes at {len(points)} points x {seeds} seeds, 0 failures, {seconds}s")
    print("  ".join(f"{c:>16}" for c in columns))
    for r in rows:
        print("  ".join(f"{str(r[c]):>16}" for c in columns))
