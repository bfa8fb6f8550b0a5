"""The folders keep DESIGN.md's layers: imports point down only, no circles inside a layer, the
protocol and the backend know no Spark or orchestrator (import-linter's contracts in
pyproject.toml)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINT = str(Path(sys.executable).with_name("lint-imports"))


def lint(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([LINT, "--config", str(root / "pyproject.toml"), "--no-cache"], cwd=root,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(root)})


def test_the_package_keeps_its_layers():
    done = lint(ROOT)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


def test_an_upward_import_or_a_circle_breaks_a_contract(tmp_path: Path):
    shutil.copytree(ROOT / "sparkpoint", tmp_path / "sparkpoint", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    paths = tmp_path / "sparkpoint" / "checkpoint" / "paths.py"
    paths.write_text(paths.read_text() + "\nimport sparkpoint.pipeline.attempt  # noqa\n")
    done = lint(tmp_path)
    assert done.returncode != 0 and "Layers" in done.stdout and "BROKEN" in done.stdout, done.stdout[-3000:]

    paths.write_text(paths.read_text().replace("import sparkpoint.pipeline.attempt  # noqa\n", ""))
    storage = tmp_path / "sparkpoint" / "state" / "codecs.py"  # codecs -> backend -> ... -> codecs
    storage.write_text(storage.read_text() + "\nimport sparkpoint.state.backend  # noqa\n")
    done = lint(tmp_path)
    assert done.returncode != 0 and "No import circles" in done.stdout and "BROKEN" in done.stdout, done.stdout[-3000:]
