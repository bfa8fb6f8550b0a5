"""`sparkpoint run --follow` (issue 35, part 2): one Spark session checkpoints each batch as it lands;
exactly once under kill -9 at random moments and under Ctrl-C (one line, exit 130, a rerun resumes
exactly); files that land faster than `--checkpoint-interval` share a checkpoint; a file still
being copied is waited for; a poll does not re-list what it has seen (S3: only names after the
newest one). A user's own pipeline (`tests.support.follow_pipeline`), real Spark, real files, real S3 API."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import fsspec
import pandas as pd
import pytest

from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.cli import main
from sparkpoint.pipeline.driver import StatefulPipeline
from sparkpoint.pipeline.follow import FollowOptions, follow
from sparkpoint.spark.offsets import SourceOffsets
from sparkpoint.spark.source import BadInputFile, ParquetDirectorySource
from tests.conftest import s3_options
from tests.support import follow_pipeline as rain
from tests.support.crashkit import assert_storage_settled
from tests.support.waiting import wait_for

ROOT = Path(__file__).resolve().parent.parent


def command(tmp_path: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "sparkpoint.cli", "run", "--pipeline", "tests.support.follow_pipeline:rain",
            "--input", str(tmp_path / "in"), "--checkpoints", str(tmp_path / "ckpt"), "--output",
            str(tmp_path / "out"), "--local-dir", str(tmp_path / "local"), "--master", "local[2]", "--follow",
            "--poll-interval", "0.05", *extra]


def start(tmp_path: Path, *extra: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(command(tmp_path, *extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)


class Lander:
    """Lands batch after batch every `every` seconds, from a thread, until stopped."""

    def __init__(self, tmp_path: Path, first: int, every: float):
        self.tmp_path, self.next, self.every = tmp_path, first, every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            rain.land(self.tmp_path, self.next)
            self.next += 1

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.next


def read_lines_until(proc: subprocess.Popen[str], prefix: str, count: int) -> list[str]:
    assert proc.stdout is not None
    lines, seen = [], 0
    for line in proc.stdout:
        lines.append(line)
        seen += line.startswith(prefix)
        if seen == count:
            return lines
    raise AssertionError(f"the run ended before {count} lines starting {prefix!r}: {lines}")


def finish(spark: Any, tmp_path: Path) -> list[tuple[str, ...]]:
    """A last follow run, in this process on the shared Spark, that stops once nothing is pending:
    it takes what is left; the files of each checkpoint it made. (A new driver resuming from
    storage and the task-local directory the killed run left; the rerun of a CLI run after a
    Ctrl-C is the same resume, so it needs no JVM of its own.)"""
    pipeline = StatefulPipeline(spark, rain.rain_in(tmp_path).config(), (rain.rain_per_station,))
    return [c.files for c in follow(pipeline, FollowOptions(poll_seconds=0.05, idle_seconds=1.5))]


def state(tmp_path: Path) -> pd.DataFrame:
    out = tmp_path / "state.parquet"
    assert main(["state", "--pipeline", "tests.support.follow_pipeline:rain", "--checkpoints", str(tmp_path / "ckpt"),
                 "--job-id", "rain", "--operator", "rain_per_station", "--format", "parquet", "--out", str(out)]) == 0
    return pd.read_parquet(out)


def assert_exactly_once(tmp_path: Path) -> None:
    batches = rain.landed(tmp_path)
    latest = CompletedCheckpointStore(rain.rain_in(tmp_path).storage()).latest()
    assert latest is not None
    # Past 256 files (a slow start lets the lander land that many) the offsets keep a floor and the
    # names above it: `includes` reads either form. State and output below say "once".
    offsets = SourceOffsets.from_json(latest.source_offsets["source"])
    landed = sorted(p.name for p in (tmp_path / "in").glob("rain-*.parquet"))
    assert [name for name in landed if not offsets.includes(name)] == [], "every landed file consumed"
    rain.assert_state(state(tmp_path), batches)
    rain.assert_output(pd.read_parquet(tmp_path / "out"), batches)


@pytest.mark.spark
@pytest.mark.parametrize("kills", [1, pytest.param(3, marks=pytest.mark.soak)])  # one kill in make test
def test_follow_is_exactly_once_when_killed_at_random_moments(spark, tmp_path: Path, kills: int):
    rng = random.Random(35)
    (tmp_path / "in").mkdir()
    landed = 0
    for kill in range(kills):
        proc = start(tmp_path)
        lander = Lander(tmp_path, landed, every=0.25)
        try:
            read_lines_until(proc, "chk-", 1)
            time.sleep(rng.uniform(0.2, 2.5))  # anywhere in a batch: uploading, committing, between batches
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(60)
        finally:
            landed = lander.stop()
            proc.kill()
        assert proc.returncode == -signal.SIGKILL, f"kill {kill}"
    assert finish(spark, tmp_path), "the last run took the files landed after the kill"
    assert_exactly_once(tmp_path)
    assert assert_storage_settled(f"file://{tmp_path}/ckpt", "rain") >= 1


@pytest.mark.spark
def test_one_ctrl_c_stops_follow_in_one_line_and_a_rerun_resumes_exactly(spark, tmp_path: Path):
    (tmp_path / "in").mkdir()
    rain.land(tmp_path, 0)
    proc = start(tmp_path)
    lander = Lander(tmp_path, 1, every=0.3)
    try:
        out = read_lines_until(proc, "chk-", 3)
        sent = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        rest, err = proc.communicate(timeout=60)
        stopped = time.monotonic() - sent
    finally:
        lander.stop()
        proc.kill()
    assert proc.returncode == 130, (out, rest, err)
    assert stopped < 15
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "interrupted; last committed checkpoint: chk-" in lines[0], err
    assert "Traceback" not in err
    finish(spark, tmp_path)
    assert_exactly_once(tmp_path)


@pytest.mark.spark
def test_files_that_land_faster_than_the_interval_share_a_checkpoint(spark, tmp_path: Path):
    pipeline = StatefulPipeline(spark, rain.rain_in(tmp_path).config(), (rain.rain_per_station,))
    rain.land(tmp_path, 0)
    storage = rain.rain_in(tmp_path).storage()

    def land_fast() -> None:  # eight files, 0.15 s apart, once the first checkpoint is committed
        wait_for(storage.completed_checkpoint_ids, 300, 0.05, "a first checkpoint")
        for i in range(1, 9):
            time.sleep(0.15)
            rain.land(tmp_path, i)

    landing = threading.Thread(target=land_fast, daemon=True)
    landing.start()
    options = FollowOptions(checkpoint_interval=1.0, poll_seconds=0.05, idle_seconds=2.0)
    made = [c.files for c in follow(pipeline, options)]
    landing.join()
    assert made[0] == ("rain-00000.parquet",), "a file landing when no checkpoint ran lately is taken at once"
    assert 3 <= len(made) <= 5 and max(len(files) for files in made) >= 3, made
    taken = [f for files in made for f in files]
    assert taken == sorted(p.name for p in (tmp_path / "in").glob("rain-*.parquet")), "each once, in landing order"
    rain.assert_state(state(tmp_path), rain.landed(tmp_path))


@pytest.mark.spark
def test_a_file_still_being_copied_is_waited_for_and_one_that_stays_bad_fails(spark, tmp_path: Path):
    pipeline = StatefulPipeline(spark, rain.rain_in(tmp_path).config(max_batches=2), (rain.rain_per_station,))
    (tmp_path / "in").mkdir(exist_ok=True)
    whole = tmp_path / "whole.parquet"
    rain.land(tmp_path, 0)
    os.rename(tmp_path / "in" / "rain-00000.parquet", whole)
    copying = tmp_path / "in" / "rain-00000.parquet"
    data = whole.read_bytes()
    copying.write_bytes(data[: len(data) // 2])  # half copied: no footer yet

    def finish_copy() -> None:
        time.sleep(0.8)
        with open(copying, "ab") as f:
            f.write(data[len(data) // 2:])

    threading.Thread(target=finish_copy, daemon=True).start()
    options = FollowOptions(poll_seconds=0.05, settle_seconds=3.0, idle_seconds=4.0)
    made = [c.files for c in follow(pipeline, options)]
    assert made == [("rain-00000.parquet",)], "the copy was waited for, then taken whole"

    (tmp_path / "in" / "rain-00001.parquet").write_text("not parquet, and it stays so")
    started = time.monotonic()
    with pytest.raises(BadInputFile, match="rain-00001.parquet"):
        list(follow(pipeline, FollowOptions(poll_seconds=0.05, settle_seconds=1.0)))
    assert time.monotonic() - started >= 1.0, "failed only once it had settled"


def test_a_poll_on_s3_lists_only_the_names_after_the_newest_it_has_seen(s3_endpoint: str):
    options = s3_options(s3_endpoint)
    fs = fsspec.filesystem("s3", **options)
    bucket = f"follow-{random.Random().randrange(10**9)}"
    fs.mkdir(bucket)
    for i in range(300):
        fs.pipe(f"{bucket}/in/b-{i:04d}.parquet", b"x")
    fs.pipe(f"{bucket}/in/_copying.parquet", b"x")
    source = ParquetDirectorySource(f"s3://{bucket}/in", options)
    watch = source.watch(full_listing_seconds=60.0)
    listed: list[int] = []
    call = source.fs.call_s3

    def counting(method: str, *args: Any, **kwargs: Any) -> Any:
        page = call(method, *args, **kwargs)
        if method == "list_objects_v2":
            listed.append(len(page.get("Contents", [])))
        return page

    source.fs.call_s3 = counting  # type: ignore[method-assign]
    assert len(watch.poll(now=1000.0)) == 300, "the first poll lists the directory whole"
    for i in (300, 301):
        fs.pipe(f"{bucket}/in/b-{i:04d}.parquet", b"x")
    fs.pipe(f"{bucket}/in/b-0000-late.parquet", b"x")  # lands late under a name sorting before the newest
    listed.clear()
    assert watch.poll(now=1001.0) == ["b-0300.parquet", "b-0301.parquet"]
    assert sum(listed) == 2, f"a poll read only the new names, whatever the directory holds: {listed}"
    assert watch.poll(now=1002.0) == []
    assert watch.poll(now=1061.0) == ["b-0000-late.parquet"], "the periodic full listing finds a late name"
    assert watch.listings == {"full": 2, "after": 2, "stat": 0}


def test_a_poll_of_a_local_directory_that_did_not_change_lists_nothing(tmp_path: Path):
    (tmp_path / "in").mkdir()
    for i in range(3):
        (tmp_path / "in" / f"b-{i}.parquet").write_bytes(b"x")
    past = time.time() - 30
    os.utime(tmp_path / "in", (past, past))
    watch = ParquetDirectorySource(str(tmp_path / "in")).watch()
    assert len(watch.poll()) == 3
    assert watch.poll() == [] and watch.poll() == []
    assert watch.listings["full"] == 1 and watch.listings["stat"] == 2, "an unchanged directory is not listed"
    (tmp_path / "in" / "b-3.parquet").write_bytes(b"x")
    assert watch.poll() == ["b-3.parquet"]
