"""The observability benchmark's smoke run (--quick, in a process of its own): every variant took
its checkpoints, the observers' time is measured where they are on and nil where they are off,
spans were made; never checked for speed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_quick_run_measures_each_variant_and_nothing_when_off(tmp_path: Path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_observers", "--quick", "--out", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Observing a checkpoint" in proc.stdout
    result = json.loads((tmp_path / "observers_quick.json").read_text())
    variants = result["variants"]
    assert list(variants) == ["off", "history", "history+traces", "history+traces+lineage"]
    assert all(v["checkpoints"] == result["args"]["rounds"] and v["checkpoint_s"] > 0 for v in variants.values())
    assert variants["off"]["observe_s"] < 0.001
    assert variants["history+traces+lineage"]["observe_s"] > 0 and result["spans"] > 0
