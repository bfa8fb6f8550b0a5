"""The observability benchmark's smoke run (--quick, file:// only, in-process): every variant took
every checkpoint and the baseline is the reference; never checked for speed."""

from __future__ import annotations

from pathlib import Path

from benchmarks import bench_observability


def test_quick_run_times_every_variant_against_the_baseline(tmp_path: Path):
    results = bench_observability.main(["--quick", "--no-s3", "--out", str(tmp_path)])
    rows = results["storages"]["file"]
    assert list(rows) == ["baseline", "ledger", "ledger+metrics"]
    assert all(len(row["seconds"]) == 3 and row["median_seconds"] > 0 for row in rows.values())
    assert rows["baseline"]["overhead_pct"] == 0
    assert (tmp_path / "observability_quick.json").exists()
