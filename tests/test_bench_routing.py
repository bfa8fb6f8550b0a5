"""The routing benchmark: how it sorts S3 requests and fits the crossover (tables of cases), and a
smoke run of its S3 and crossover sections (--quick, in a process of its own): the figures make
sense, never checked for speed. The crossover runs at p = 2 only (the S3 section's runs are at
p = 4: read-all's amplification is checked at both); `make bench`'s quick run adds p = 4 to the fit.
The cluster section is left to tests/test_cluster.py's cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.bench_routing import MB, classify, fit_threshold

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("method", "path", "query", "expected"), [
    ("GET", "/input/data/batch-000000.parquet", "", ("input", "GET")),
    ("GET", "/ckpt", "list-type=2&prefix=job%2Fchk-&delimiter=%2F", ("ckpt", "LIST")),
    ("GET", "/ckpt", "", ("ckpt", "LIST")),
    ("GET", "/ckpt", "location", ("ckpt", "OTHER")),
    ("HEAD", "/ckpt/job/chk-3/_metadata", "", ("ckpt", "HEAD")),
    ("HEAD", "/ckpt", "", ("ckpt", "HEAD")),
    ("PUT", "/ckpt/job/shared/a.sst", "", ("ckpt", "PUT")),
    ("PUT", "/ckpt/job/shared/a.sst", "partNumber=2&uploadId=x", ("ckpt", "PUT")),
    ("POST", "/ckpt/job/shared/a.sst", "uploads", ("ckpt", "POST")),
    ("POST", "/ckpt", "delete", ("ckpt", "DELETE")),
    ("DELETE", "/output/job/_staging/x.parquet", "", ("output", "DELETE")),
])
def test_s3_requests_are_sorted_by_bucket_and_kind(method: str, path: str, query: str, expected: tuple[str, str]):
    assert classify(method, path, query) == expected


def point(parallelism: int, batch_mb: float, shuffle_minus_read_all: float) -> dict[str, float]:
    return {"parallelism": parallelism, "batch_bytes": batch_mb * MB, "extra_bytes": (parallelism - 1) * batch_mb * MB,
            "shuffle_minus_read_all_s": shuffle_minus_read_all}


def test_the_fitted_threshold_separates_where_the_shuffle_is_faster():
    points = [point(2, 1, 1.0), point(4, 1, 0.5), point(4, 10, -0.2), point(16, 10, -3.0)]  # extra 1, 3, 30, 150 MB
    fit = fit_threshold(points)
    assert fit["lost_s"] == 0 and fit["misrouted_points"] == 0
    assert fit["range_bytes"] == [3 * MB, 30 * MB]  # any threshold above 3 MB and up to 30 MB
    assert 3 * MB < fit["threshold_bytes"] <= 30 * MB


def test_the_fitted_threshold_loses_the_least_time_when_no_threshold_is_exact():
    # The point at 30 MB is slower on the shuffle, the one at 3 MB faster: routing one of them wrong
    # is unavoidable, and losing 0.1 s beats losing 0.4 s.
    points = [point(2, 1, 1.0), point(4, 1, -0.1), point(4, 10, 0.4), point(16, 10, -3.0)]
    fit = fit_threshold(points)
    assert fit["lost_s"] == pytest.approx(0.1) and fit["misrouted_points"] == 1
    assert fit["range_bytes"] == [30 * MB, 150 * MB]
    assert fit_threshold([point(2, 1, 1.0), point(4, 1, 2.0)])["range_bytes"] == [3 * MB, None]  # never the shuffle


@pytest.mark.spark
@pytest.mark.s3
def test_quick_run_reads_each_batch_once_on_the_shuffle_and_counts_s3_requests(tmp_path: Path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_routing", "--quick", "--only", "s3,crossover", "--parallelisms", "2",
         "--out", str(tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=540,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "fitted SHUFFLE_ABOVE_BYTES" in proc.stdout
    sections = json.loads((tmp_path / "routing_quick.json").read_text())["sections"]
    for name in ("s3", "crossover"):
        for label, run in sections[name]["runs"].items():
            amps = [b["read_amplification"] for b in run["batches"]]
            p = run["parallelism"]
            # quick batches are small files, read whole: read-all reads each once per subtask
            assert amps == ([1.0] * len(amps) if run["system"] == "shuffle" else [float(p)] * len(amps)), label
            assert {b["routing"] for b in run["batches"]} == {run["system"]}, label
    for label, run in sections["s3"]["runs"].items():
        input_gets = run["per_checkpoint"]["input|GET"]
        assert input_gets["requests"] >= 4  # a batch's 4 files, at least once each
        # what S3 served for the input: at least what the tasks counted
        assert input_gets["bytes_out"] >= run["read_amplification_mean"] * run["batch_mb"] * MB * 0.99, label
        assert run["per_checkpoint"]["ckpt|PUT"]["requests"] >= 2, label  # state files and _metadata
    assert sections["crossover"]["fit"]["threshold_bytes"] >= 0
