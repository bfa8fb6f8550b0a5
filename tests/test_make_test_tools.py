"""`make test` installs (or names, in one line) what it needs besides Python packages before any
test runs: a JVM and Chromium."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_a_missing_browser_is_named_in_one_line_before_any_test_runs(tmp_path: Path):
    bin_dir = tmp_path / "bin"  # a PATH with the shell's tools and a JVM, but no chromium
    bin_dir.mkdir()
    for tool in ("sh", "id", "java"):
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    done = subprocess.run(["sh", str(ROOT / "tools" / "ensure-test-tools")], capture_output=True, text=True,
                          env={**os.environ, "PATH": str(bin_dir), "SPARKPOINT_INSTALL": "never"}, timeout=60)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "chromium" in lines[0] and "apt-get install" in lines[0], done.stderr


def test_make_test_runs_the_check_first():
    dry = subprocess.run(["make", "-n", "test"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    commands = [line for line in dry.stdout.splitlines() if line.strip()]
    check = next(i for i, line in enumerate(commands) if "ensure-test-tools" in line)
    pytest_at = next(i for i, line in enumerate(commands) if "pytest" in line)
    assert check < pytest_at
