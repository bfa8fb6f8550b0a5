"""The changelog benchmark's smoke variant runs and writes sane figures (no timings asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_changelog_benchmark_quick_writes_every_variant(tmp_path: Path):
    subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_changelog", "--quick", "--out", str(tmp_path)],
        check=True, cwd=Path(__file__).parent.parent, capture_output=True,
    )
    runs = json.loads((tmp_path / "changelog_quick.json").read_text())["runs"]
    assert set(runs) == {f"{c}/{v}" for c in ("0.01", "0.1") for v in
                         ("files", "changelog at once share=2", "changelog share=1", "changelog share=2",
                          "changelog share=4")}
    for r in runs.values():
        assert 0 < r["median"] <= r["max"] <= 1.5 and r["state_bytes"] > 0 and r["dir_over_state"] >= 1
        assert r["dir_over_state_peak"] >= r["dir_over_state"] and len(r["per_checkpoint_bytes"]) == 12
    # the short chain materializes within the run: at once, one checkpoint uploads far above the
    # mean; in steps, the largest upload is well below that (bytes, not timings)
    for churn in ("0.01", "0.1"):
        at_once = runs[f"{churn}/changelog at once share=2"]["max_over_mean_upload"]
        assert at_once > 2 and runs[f"{churn}/changelog share=2"]["max_over_mean_upload"] < 0.8 * at_once
    # a changelog checkpoint uploads about the changed share of the state, far less than all of it
    assert runs["0.01/changelog share=2"]["median"] < 0.05
