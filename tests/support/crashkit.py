"""Running a process until a named crash point kills it, and checking what it leaves behind."""

from __future__ import annotations

import json
import os
import posixpath
import random
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import pandas as pd

from sparkpoint.checkpoint.crash import CRASH_AT, CRASH_DIR, CRASH_POINTS, TABLE_POINTS
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.checkpoint.sweep import sweep_orphans
from sparkpoint.cli import main
from sparkpoint.spark.generate import generate
from tests.support import oracle


@dataclass(frozen=True)
class Outcome:
    returncode: int
    stdout: str
    stderr: str
    crashed: dict[str, Any] | None  # crashed.json: where the crash point killed the run

    def completed(self) -> list[int]:
        """Checkpoint ids the run printed as completed (`chk-N ...` lines)."""
        return [int(line.split()[0][4:]) for line in self.stdout.splitlines() if line.startswith("chk-")]


def run(cmd: list[str], *, crash_at: str | None = None, crash_dir: Path | None = None, timeout: float = 600,
        env: dict[str, str] | None = None, cwd: Path | None = None) -> Outcome:
    """Run `cmd` in a session of its own (a crash point kills its whole process group); with
    `crash_at` set, a fresh `crash_dir` counts the hits of every process of the run."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SPARKPOINT_CRASH")}
    environ.update(env or {})
    if crash_at:
        assert crash_dir is not None and not crash_dir.exists(), "one fresh crash directory per run"
        environ.update({CRASH_AT: crash_at, CRASH_DIR: str(crash_dir)})
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environ,
                            start_new_session=True, cwd=cwd)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{cmd[:4]}... did not finish in {timeout}s; stderr: {err[-3000:]}") from None
    finally:
        _reap(proc.pid)
    marker = crash_dir / "crashed.json" if crash_dir else None
    crashed = json.loads(marker.read_text()) if marker is not None and marker.exists() else None
    return Outcome(proc.returncode, out, err, crashed)


def _reap(pgid: int) -> None:
    """Whatever of the run's group outlived it (Spark's Python daemon dies with its JVM, mostly)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def assert_died_at(outcome: Outcome, point: str) -> None:
    assert outcome.crashed is not None and outcome.crashed["point"] == point, (
        f"the run should have died at {point}: rc={outcome.returncode}, stderr: {outcome.stderr[-3000:]}"
    )
    assert outcome.returncode == -signal.SIGKILL, f"killed by SIGKILL, got rc={outcome.returncode}"


def assert_finished(outcome: Outcome) -> None:
    assert outcome.returncode == 0 and outcome.crashed is None, outcome.stderr[-3000:]


def job_args(url: str, job_id: str, options: dict[str, Any] | None = None) -> list[str]:
    args = ["--checkpoints", url, "--job-id", job_id]
    return args + (["--storage-options", json.dumps(options)] if options else [])


def assert_storage_settled(url: str, job_id: str, options: dict[str, Any] | None = None) -> int:
    """Every retained checkpoint verifies, and after `gc --grace 0` storage holds exactly the
    files the retained checkpoints reference. Returns how many checkpoints are retained."""
    args = job_args(url, job_id, options)
    assert main(["verify", *args]) == 0, "every retained checkpoint verifies"
    assert main(["gc", *args, "--grace", "0"]) == 0
    storage = CheckpointStorage(url, job_id, options or {})
    listing = CompletedCheckpointStore(storage).load_all()
    assert not listing.unreadable
    referenced = set()
    for meta in listing.checkpoints:
        referenced |= meta.paths() | {meta.metadata_path}
    on_storage = {f.path for f in storage.walk("shared")}
    on_storage |= {f.path for cid in storage.checkpoint_dirs() for f in storage.walk(f"chk-{cid}")}
    assert on_storage == referenced, (
        f"after gc --grace 0 unreferenced: {sorted(on_storage - referenced)[:5]}, missing: "
        f"{sorted(referenced - on_storage)[:5]}"
    )
    assert sweep_orphans(storage, grace_seconds=0, dry_run=True).orphans == ()
    return len(listing.checkpoints)


# --- the sample pipeline (`sparkpoint run`) ------------------------------------------------------


def run_command(input_url: str, ckpt_url: str, output_url: str, local_dir: Path, *, master: str = "local[2]",
                options: dict[str, Any] | None = None, retain: int = 2) -> list[str]:
    return [
        sys.executable, "-m", "sparkpoint.cli", "run", "--input", input_url, *job_args(ckpt_url, "job", options),
        "--retain", str(retain), "--parallelism", "2", "--output", output_url, "--local-dir", str(local_dir),
        "--master", master,
    ]


def run_in_process(spark: Any, command: list[str]) -> list[Any]:
    """What `command` (`python -m sparkpoint.cli run ...`) does, on `spark` in this process: the
    pipeline and settings the CLI resolves from those flags, without a JVM of its own. For a
    resume after a crash of the run's own process, where the CLI's Spark start is not what is
    tested; its reports, one per checkpoint."""
    from sparkpoint.cli.parser import build_parser
    from sparkpoint.cli.run import run_config
    from sparkpoint.pipeline.driver import StatefulPipeline

    argv = command[command.index("sparkpoint.cli") + 1:]
    spec, config, _ = run_config(build_parser().parse_args(argv))
    return StatefulPipeline(spark, config, spec.operators).run()


def assert_pipeline_result(input_dir: str, ckpt_url: str, output_url: str, work: Path,
                           options: dict[str, Any] | None = None) -> None:
    """State and sink output equal what `tests.support.oracle` recomputes from every input batch."""
    batches = oracle.read_batches(input_dir)
    events = pd.concat(batches, ignore_index=True)
    store = CompletedCheckpointStore(CheckpointStorage(ckpt_url, "job", options or {}))
    latest = store.load(store.checkpoint_ids()[0])
    assert len(latest.source_offsets["source"]["consumed"]) == len(batches), "every batch consumed once"
    for operator, expected, check in [
        ("user_totals", oracle.user_totals(events), oracle.assert_totals_equal),
        ("item_reach", oracle.item_reach(events), oracle.assert_reach_equal),
    ]:
        out = work / f"{operator}.parquet"
        assert main(["state", *job_args(ckpt_url, "job", options), "--operator", operator, "--format", "parquet",
                     "--out", str(out)]) == 0
        check(pd.read_parquet(out), expected)
    fs, root = fsspec.core.url_to_fs(output_url, **(options or {}))
    parts = sorted(p for p in fs.ls(root, detail=False) if posixpath.basename(p).startswith("part-"))
    output = pd.concat([pd.read_parquet(fs.open(p, "rb")) for p in parts], ignore_index=True)
    per_checkpoint = [g for _, g in sorted(output.groupby("checkpoint_id"), key=lambda t: t[0])]
    assert len(per_checkpoint) == len(batches), "every batch is in the output exactly once"
    for got, expected in zip(per_checkpoint, oracle.sink_rows(batches)):
        oracle.assert_totals_equal(got, expected)
    staging = f"{root}/_staging/job"
    assert not fs.exists(staging) or not fs.ls(staging, detail=False), "no staged output is left"


# --- chains of crashes of `sparkpoint run` ------------------------------------------------------

# Points a process may reach right after a crash that left a subtask's database ahead of its
# checkpoint (so the next start restores a copy, which `mid-restore` needs).
DIRTY = ("after-native-checkpoint", "mid-upload", "after-upload", "before-metadata", "mid-task-local-copy")
DRIVER_POINTS = ("before-metadata", "after-metadata-before-registry", "mid-subsumption-deletes",
                 "after-metadata-before-sink-commit")
# Hits of a point per batch of the sample pipeline (2 operators x 2 subtasks), so `n` stays
# within the first batch a run processes.
SPARK_HITS = {"after-native-checkpoint": 4, "mid-upload": 4, "after-upload": 4, "mid-task-local-copy": 4}
# Points hit exactly this often in every batch (the others vary with the files a snapshot has).
EXACT_PER_BATCH = {"after-native-checkpoint": 4, "after-upload": 4, "before-metadata": 1,
                   "after-metadata-before-registry": 1, "after-metadata-before-sink-commit": 1}


@dataclass(frozen=True)
class Job:
    """Where a pipeline run reads, checkpoints and writes (input stays local: the oracle reads it)."""

    input_dir: Path
    ckpt_url: str
    output_url: str
    local_dir: Path
    options: dict[str, Any] | None = None


def file_job(root: Path) -> Job:
    return Job(root / "in", f"file://{root}/ckpt", f"file://{root}/out", root / "local")


def spark_chain(tmp_path: Path, job: Job, chain: list[str], seed: int, *, warm_up: bool,
                lose_local_before: tuple[str, ...] = (), lose_local_after: bool = False, first_hit_batch: int = 1,
                master: str = "local[2]") -> list[dict[str, object]]:
    """Kill `sparkpoint run` at each point of `chain` in turn (each run resumes from the previous
    crash), then let a last run finish, and check everything. Each crash comes within the first
    batch or two its run processes; `warm_up` first completes two checkpoints (`mid-restore`
    needs a checkpoint to restore). Before the points in `lose_local_before` (and with
    `lose_local_after`, before the last run) the task-local directory is deleted (a lost disk:
    restores come from checkpoint storage). `first_hit_batch` moves the first crash to that batch
    of a fresh job (for points hit equally often in every batch)."""
    rng = random.Random(seed)
    batches = 3 + 2 * len(chain) + 2 * warm_up
    generate(str(job.input_dir), batches=batches, events_per_batch=300, users=60, items=20, seed=seed)
    cmd = run_command(str(job.input_dir), job.ckpt_url, job.output_url, job.local_dir, master=master,
                      options=job.options)
    if warm_up:
        assert_finished(run([*cmd, "--max-batches", "2"], timeout=400))
    store = CompletedCheckpointStore(CheckpointStorage(job.ckpt_url, "job", job.options or {}))
    rows = []
    for i, point in enumerate(chain):
        if point in lose_local_before:
            shutil.rmtree(job.local_dir, ignore_errors=True)
        hit = rng.randint(1, SPARK_HITS.get(point, 1))
        if i == 0 and first_hit_batch > 1:
            hit += EXACT_PER_BATCH[point] * (first_hit_batch - 1)
        crashed = run(cmd, crash_at=f"{point}:{hit}", crash_dir=tmp_path / f"crash-{i}", timeout=400)
        assert_died_at(crashed, point)
        if store.checkpoint_ids():
            assert main(["verify", *job_args(job.ckpt_url, "job", job.options)]) == 0, f"all verify after {point}"
        rows.append({"seed": seed, "step": i, "point": point, "hit": hit,
                     "process": "driver" if point in DRIVER_POINTS else "worker",
                     "checkpoints": len(crashed.completed()), "lost_local": point in lose_local_before})
    if lose_local_after:
        shutil.rmtree(job.local_dir, ignore_errors=True)
    assert_finished(run(cmd, timeout=400))
    assert_pipeline_result(str(job.input_dir), job.ckpt_url, job.output_url, tmp_path, job.options)
    assert assert_storage_settled(job.ckpt_url, "job", job.options) == 2
    return rows


def seeded_chain(seed: int) -> tuple[list[str], tuple[str, ...]]:
    """Every point once, in a seeded order where `mid-restore` follows a point that leaves a
    subtask's database ahead of its checkpoint; whether the disk is lost before it, seeded too."""
    rng = random.Random(seed)
    rest = [p for p in CRASH_POINTS if p != "mid-restore" and p not in TABLE_POINTS]  # a Parquet output
    rng.shuffle(rest)
    at = rng.choice([i for i, p in enumerate(rest) if p in DIRTY]) + 1
    return rest[:at] + ["mid-restore"] + rest[at:], ("mid-restore",) if rng.random() < 0.5 else ()
