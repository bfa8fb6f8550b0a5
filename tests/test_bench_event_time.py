"""The event-time benchmarks' smoke variants run end to end (--quick) and write sane figures:
bounded state under an event-time TTL, and sessions with timers against Spark's
transformWithStateInPandas. Timings are never asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.spark, pytest.mark.soak]  # 5 minutes of Spark: `make soak` runs them
REPO = Path(__file__).resolve().parents[1]


def run_quick(module: str, out: Path, *args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", module, "--quick", "--out", str(out), *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(next(out.glob("*_quick.json")).read_text())


def test_ttl_benchmark_quick_keeps_the_ttl_state_below_the_state_without(tmp_path: Path):
    results = run_quick("benchmarks.bench_ttl_bounded", tmp_path)
    runs = {variant: r[0] for variant, r in results["runs"].items()}
    assert set(runs) == {"ttl", "no-ttl", "ttl/files", "no-ttl/files"}
    for variant, batches in runs.items():
        assert [b["batch"] for b in batches] == list(range(1, 13)), variant
        assert all(b["state_size"] > 0 and b["checkpointed_size"] > 0 for b in batches), variant
        assert batches[0]["entries"] == 500, variant
    for ttl, no_ttl in (("ttl", "no-ttl"), ("ttl/files", "no-ttl/files")):
        # keys last written 10 batches of event time ago expire by batch 12; without a TTL they stay
        assert sum(b["expired_removed"] for b in runs[ttl]) > 0
        assert runs[ttl][-1]["entries"] < runs[no_ttl][-1]["entries"]
        assert sum(b["expired_removed"] for b in runs[no_ttl]) == 0


def test_timers_benchmark_quick_closes_the_same_sessions_as_spark_and_pandas(tmp_path: Path):
    results = run_quick("benchmarks.bench_timers_vs_spark", tmp_path)
    agreement = results["agreement"]
    assert agreement["sparkpoint"] == agreement["spark"] == agreement["both"] > 0
    assert agreement["sparkpoint = recomputation"] == agreement["spark = recomputation"] == 1
    assert results["timers"]["fired"] == agreement["sparkpoint"]
    summary = results["summary"]
    assert set(summary) == {"sparkpoint/sessions", "sparkpoint/appends", "spark/tws"}
    for label, s in summary.items():
        assert s["events_per_s_median"] > 0 and s["bytes_per_checkpoint_median"] > 0, label
    run = results["runs"][0]
    assert [b["rows"] for b in run["sparkpoint/sessions"]["batches"]] == results["config"]["events_per_batch"]
    assert sum(b["late_rows"] for b in run["sparkpoint/sessions"]["batches"]) == 0
