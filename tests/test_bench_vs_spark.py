"""The side-by-side benchmark against Spark's RocksDB state store runs end to end (--quick).

It runs in its own process (it starts and stops its own Spark session, and cold restarts start
more). The figures are checked for sense, never for speed: every system processed every batch,
uploaded something, and its upload/state, state and checkpoint directory are plausible.

`make test` runs `--quick`'s one workload (fixed-10pct: a fixed key set, the workload the profile
and the cold restart use); `make soak` runs the same checks over all three (the 1% and growing
workloads differ only in the data generated, which the same checks read).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.bench_vs_spark import OURS_VARIANTS, QUICK_WORKLOAD, systems

pytestmark = pytest.mark.spark
REPO = Path(__file__).resolve().parents[1]
EVERY_WORKLOAD = {"fixed-1pct", "fixed-10pct", "growing"}


def run_quick(out: Path, *args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_vs_spark", "--quick", "--out", str(out), *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=540,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "amplif." in proc.stdout  # the tables were printed
    assert (out / "vs_spark_quick.png").stat().st_size > 10_000
    return json.loads((out / "vs_spark_quick.json").read_text())


@pytest.fixture(scope="module")
def quick_results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    results = run_quick(tmp_path_factory.mktemp("vs_spark"))
    assert set(results["workloads"]) == {QUICK_WORKLOAD}
    return results


def test_every_system_processed_every_batch_of_every_workload(quick_results: dict) -> None:
    labels = {s.label for s in systems(OURS_VARIANTS)}
    assert {"ours/both", "ours/user_totals", "spark/changelog-off", "spark/changelog-on"} <= labels
    for name, workload in quick_results["workloads"].items():
        assert set(workload["systems"]) == labels, name
        for label, system in workload["systems"].items():
            assert [b["batch"] for b in system["batches"]] == [0, 1, 2], (name, label)
            assert [b["events"] for b in system["batches"]] == workload["events"], (name, label)


def test_uploads_state_and_checkpoint_directory_are_plausible(quick_results: dict) -> None:
    for name, workload in quick_results["workloads"].items():
        for label, system in workload["systems"].items():
            where = f"{name} {label}"
            batches, summary = system["batches"], system["summary"]
            assert all(b["uploaded_bytes"] > 0 and b["uploaded_files"] > 0 for b in batches), where
            # The first checkpoint uploads its whole state (+ a few bytes of logs for Spark).
            assert 0.95 <= batches[0]["upload_over_state"] <= 1.1, where
            assert all(0 < b["upload_over_state"] <= 3 for b in batches[1:]), where
            assert 0 < summary["upload_over_state_median"] <= summary["upload_over_state_max"] <= 3, where
            # The latest checkpoint's files are all in the directory, with older retained ones.
            assert summary["ckpt_bytes_final"] >= summary["state_bytes_final"] > 0, where
            assert summary["ckpt_files_final"] > 0, where
            assert summary["events_per_s"] > 0 and summary["batch_s_median"] > 0, where
            assert all(0 < a < 1000 for a in summary["amplification"].values()), where
            assert set(summary["amplification"]) == set(system["operators"]), where


def test_ours_uploads_match_what_the_engine_reports(quick_results: dict) -> None:
    for workload in quick_results["workloads"].values():
        for label, system in workload["systems"].items():
            if system["kind"] != "ours":
                continue
            for b in system["batches"]:
                # The listing sees the engine's uploads plus chk-N/_metadata, which it writes after.
                assert 0 < b["uploaded_bytes"] - b["engine_checkpointed_size"] < 64 * 1024, label
                assert sum(op["uploaded"] for op in b["operators"].values()) == b["engine_checkpointed_size"], label
            assert system["batches"][-1]["restored"] == ["working"], label


def test_spark_used_rocksdb_and_holds_every_user(quick_results: dict) -> None:
    for name, workload in quick_results["workloads"].items():
        for label, system in workload["systems"].items():
            if system["kind"] != "spark":
                continue
            last = system["batches"][-1]
            assert last["operators"]["user_totals"]["state"] > 0, (name, label)  # state/ is not empty
            assert last["spark_progress"]["numRowsTotal"] == workload["entries"][-1]["user_totals"], (name, label)
            assert "rocksdbPutCount" in last["spark_progress"]["customMetrics"], (name, label)
            assert (last["changelog_files"] > 0) == system["changelog"], (name, label)
            assert last["zip_files"] > 0 or system["changelog"], (name, label)


def test_cold_restarts_and_profile_are_reported(quick_results: dict) -> None:
    first = next(iter(quick_results["workloads"].values()))
    restarted = {label: s["restart"] for label, s in first["systems"].items() if "restart" in s}
    assert restarted, "no cold restart measured"
    for label, r in restarted.items():
        assert r["total_s"] > r["session_s"] > 0, label
        if first["systems"][label]["kind"] == "ours":
            assert r["restored"] == ["primary"], label  # a fresh local directory: from checkpoint storage
    [profile] = quick_results["profile"]
    functions = {f["function"]: f for f in profile["worker_functions"]}
    assert functions["run_subtask"]["calls"] > 0 and functions["run_subtask"]["seconds_per_batch"] > 0
    assert functions["snapshot"]["calls"] > 0
    assert profile["phases_s"]["run_spark (driver: plan, Spark job, collect)"] > 0


@pytest.mark.soak
def test_soak_the_quick_run_over_every_workload(tmp_path: Path) -> None:
    results = run_quick(tmp_path, "--workloads", ",".join(sorted(EVERY_WORKLOAD)))
    assert set(results["workloads"]) == EVERY_WORKLOAD
    for check in (test_every_system_processed_every_batch_of_every_workload,
                  test_uploads_state_and_checkpoint_directory_are_plausible,
                  test_ours_uploads_match_what_the_engine_reports, test_spark_used_rocksdb_and_holds_every_user,
                  test_cold_restarts_and_profile_are_reported):
        check(results)
