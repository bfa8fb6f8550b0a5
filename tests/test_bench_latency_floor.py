"""bench_latency's Dagster floor: its code location requests one run per landed file, once, and
imports nothing of sparkpoint (a floor run costs what any Dagster run's does); the summary's
difference and goal. The whole measurement (dagster dev, a Connect server) is the bench's own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest

from benchmarks.bench_latency import floor_summary

REPO = Path(__file__).resolve().parents[1]


def test_the_floor_sensor_requests_one_run_per_landed_file_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from benchmarks.latency_floor_location import DIR_ENV, TAG, floor_sensor

    monkeypatch.setenv(DIR_ENV, str(tmp_path))
    sensor = floor_sensor(3)
    assert sensor.minimum_interval_seconds == 3

    def tick(cursor: str | None) -> tuple[list[str], str | None]:
        result = sensor(dg.build_sensor_context(cursor=cursor))
        assert all(r.tags[TAG] == r.run_key for r in result.run_requests)
        return [r.run_key for r in result.run_requests], result.cursor

    assert tick(None) == ([], None)
    for name in ("batch-000001.parquet", "batch-000000.parquet"):
        (tmp_path / name).write_bytes(b"")
    keys, cursor = tick(None)
    assert keys == ["batch-000000.parquet", "batch-000001.parquet"]
    assert tick(cursor) == ([], cursor)
    (tmp_path / "batch-000002.parquet").write_bytes(b"")
    assert tick(cursor) == (["batch-000002.parquet"], "batch-000002.parquet")


def test_the_floor_location_imports_dagster_alone(tmp_path: Path):
    heavy = ("sparkpoint", "pyspark", "pandas", "pyarrow", "rocksdict")
    probe = ("import sys, json, benchmarks.latency_floor_location as m\n"
             f"heavy = sorted({{n.split('.')[0] for n in sys.modules}} & set({heavy!r}))\n"
             "print(json.dumps([m.defs.resolve_job_def(m.JOB).name, heavy]))")
    env = {**os.environ, "PYTHONPATH": str(REPO), "SPARKPOINT_LATENCY_FLOOR_DIR": str(tmp_path),
           "SPARKPOINT_LATENCY_FLOOR_INTERVAL": "1"}
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == ["latency_floor_job", []]


def test_the_summary_sets_ours_against_the_floor():
    floor = [{"materialized_s": t, "sensor_s": 1.0, "queue_and_launch_s": 2.0, "run_s": 0.5} for t in (4.0, 5.0, 9.0)]
    ours = [{"committed_s": t, "materialized_s": t + 1, "sensor_s": 1.0, "queue_and_launch_s": 3.0, "run_s": 2.0,
             "run_to_commit_s": 1.5}
            for t in (4.5, 5.5, 10.5)]
    summary = floor_summary(floor, ours)
    assert summary["ours_committed_minus_floor_s"] == {"median": pytest.approx(0.5), "p95": pytest.approx(1.5)}
    assert summary["ours_materialized_minus_floor_s"] == {"median": pytest.approx(1.5), "p95": pytest.approx(2.5)}
    assert summary["goal_met"] is False  # 1.5 s over the floor at the p95
    assert floor_summary(floor, [{**r, "committed_s": r["committed_s"] - 0.6} for r in ours])["goal_met"] is True
