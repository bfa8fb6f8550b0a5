"""Named crash points: the run's process group is SIGKILLed exactly there, then resumed.

After every crash and resume: the state (and for `sparkpoint run`, the sink output) equals a
recomputation from the input, every retained checkpoint verifies, and after `gc --grace 0`
storage holds exactly what the retained checkpoints reference.

Two drivers are killed: `tests.crash_driver` (the core protocol without Spark: a process starts
in ~1 s, so every point x several seeds fits in `make test`), and `sparkpoint run` on local Spark
(a JVM per run: a short chain of points in `make test`; every point, chained in a seeded order,
x 5 seeds in `make soak`).
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

from sparkpoint.cli import main
from sparkpoint.core import CompletedCheckpointStore
from sparkpoint.core.crash import CRASH_POINTS, crash_point, parse
from sparkpoint.spark.generate import generate
from tests import crash_driver
from tests.crashkit import (
    assert_died_at,
    assert_finished,
    assert_pipeline_result,
    assert_storage_settled,
    run,
    run_command,
)

SOAK_SEEDS = int(os.environ.get("SPARKPOINT_SOAK_SEEDS", "5"))
CORE_POINTS = tuple(p for p in CRASH_POINTS if p != "after-metadata-before-sink-commit")  # that one is Spark's
# Points a process may reach right after a crash that left a subtask's database ahead of its
# checkpoint (so the next start restores a copy, which `mid-restore` needs).
DIRTY = ("after-native-checkpoint", "mid-upload", "after-upload", "before-metadata", "mid-task-local-copy")


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
    cmd = [sys.executable, "-m", "tests.crash_driver", str(root), "--seed", str(seed), "--batches", str(CORE_BATCHES)]
    runs = 0
    if point == "mid-restore":  # first leave a subtask ahead of its checkpoint, maybe lose the local disk too
        prelude = rng.choice(DIRTY)
        at = f"{prelude}:{core_hit(prelude, rng) + 2}"
        assert_died_at(run(cmd, crash_at=at, crash_dir=tmp_path / f"crash-{point}-{seed}-0", timeout=120), prelude)
        runs += 1
        if rng.random() < 0.5:
            shutil.rmtree(root / "local")
    hit = core_hit(point, rng)
    crashed = run(cmd, crash_at=f"{point}:{hit}", crash_dir=tmp_path / f"crash-{point}-{seed}", timeout=120)
    assert_died_at(crashed, point)
    resumed = run(cmd, timeout=120)
    assert_finished(resumed)
    runs += 2
    storage = crash_driver.storage_of(str(root))
    store = CompletedCheckpointStore(storage)
    latest = store.load(store.checkpoint_ids()[0])
    assert latest.source_offsets == {"next_batch": CORE_BATCHES}
    assert core_state(storage, latest) == crash_driver.expected_totals(seed, CORE_BATCHES)
    retained = assert_storage_settled(storage.url, "job")
    assert retained == crash_driver.RETAINED
    return {"point": point, "seed": seed, "hit": hit, "runs": runs, "resumed": resumed.stdout.splitlines()[0]}


def core_state(storage, meta) -> dict[str, int]:  # type: ignore[no-untyped-def]
    from sparkpoint.core.inspect import operator_states

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

# Hits of a point per batch of the sample pipeline (2 operators x 2 subtasks), so `n` stays
# within the first batch a run processes.
SPARK_HITS = {"after-native-checkpoint": 4, "mid-upload": 4, "after-upload": 4, "mid-task-local-copy": 4}


def spark_chain(tmp_path: Path, chain: list[str], seed: int) -> list[dict[str, object]]:
    """Kill `sparkpoint run` at each point of `chain` in turn (each run resumes from the previous
    crash), then let a last run finish, and check everything."""
    rng = random.Random(seed)
    batches = 3 + 2 * len(chain)
    generate(str(tmp_path / "in"), batches=batches, events_per_batch=300, users=60, items=20, seed=seed)
    ckpt, out = f"file://{tmp_path}/ckpt", f"file://{tmp_path}/out"
    cmd = run_command(str(tmp_path / "in"), ckpt, out, tmp_path / "local")
    rows = []
    for i, point in enumerate(chain):
        hit = rng.randint(1, SPARK_HITS.get(point, 1))
        crashed = run(cmd, crash_at=f"{point}:{hit}", crash_dir=tmp_path / f"crash-{i}", timeout=400)
        assert_died_at(crashed, point)
        assert main(["verify", "--checkpoints", ckpt, "--job-id", "job"]) in (0, 2), "verify runs after any crash"
        rows.append({"seed": seed, "step": i, "point": point, "hit": hit, "pid_role": role(crashed.crashed),
                     "checkpoints": len(crashed.completed())})
    assert_finished(run(cmd, timeout=400))
    assert_pipeline_result(str(tmp_path / "in"), ckpt, out, tmp_path)
    assert assert_storage_settled(ckpt, "job") == 2
    return rows


def role(crashed: dict[str, object] | None) -> str:
    """Which process died first: the driver, or one of Spark's Python workers."""
    return "driver" if crashed and crashed["point"] in DRIVER_POINTS else "worker"


DRIVER_POINTS = ("before-metadata", "after-metadata-before-registry", "mid-subsumption-deletes",
                 "after-metadata-before-sink-commit")


def seeded_chain(seed: int) -> list[str]:
    """Every point once, in a seeded order where `mid-restore` follows a point that leaves a
    subtask's database ahead of its checkpoint."""
    rng = random.Random(seed)
    rest = [p for p in CRASH_POINTS if p != "mid-restore"]
    rng.shuffle(rest)
    dirty = [i for i, p in enumerate(rest) if p in DIRTY]
    at = rng.choice(dirty) + 1
    return rest[:at] + ["mid-restore"] + rest[at:]


@pytest.mark.spark
def test_sparkpoint_run_killed_in_a_worker_mid_restore_and_before_the_sink_commit(tmp_path: Path):
    rows = spark_chain(tmp_path, ["mid-upload", "mid-restore", "after-metadata-before-sink-commit"], seed=3)
    assert [r["pid_role"] for r in rows] == ["worker", "worker", "driver"]


@pytest.mark.spark
@pytest.mark.soak
def test_soak_sparkpoint_run_killed_at_every_point_x_seeds(tmp_path: Path):
    started = time.monotonic()
    rows = []
    for seed in range(1, SOAK_SEEDS + 1):
        rows += spark_chain(tmp_path / f"seed-{seed}", seeded_chain(seed), seed)
    report("crash_points_spark", rows, started, ["seed", "step", "point", "hit", "pid_role", "checkpoints"])


def report(name: str, rows: list[dict[str, object]], started: float, columns: list[str]) -> None:
    """Print the table and write build/soak/<name>.json."""
    seconds = round(time.monotonic() - started, 1)
    points = sorted({str(r["point"]) for r in rows})
    summary = {"name": name, "crashes": len(rows), "points": len(points), "seeds": SOAK_SEEDS, "failures": 0,
               "seconds": seconds, "runs": rows}
    out = Path("build/soak")
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(summary, indent=1))
    print(f"\n{name}: {len(rows)} crashes at {len(points)} points x {SOAK_SEEDS} seeds, 0 failures, {seconds}s")
    print("  ".join(f"{c:>16}" for c in columns))
    for r in rows:
        print("  ".join(f"{str(r[c]):>16}" for c in columns))
