"""The example project `examples/clickstream` as a user's project in a test's directory: a copy
(its `.sparkpoint/` lands there), batches landed in it, its `clicks` pipeline's state read back."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd

from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.state.extract import state_table

ROOT = Path(__file__).resolve().parents[2]


def copy_project(root: Path, *, landed: int = 0, into: str = "landing") -> tuple[Path, dict[str, str]]:
    """(the copy, an environment whose Python path finds it and sparkpoint) with `landed` batches
    written to `into` by the project's own `clickstream.land`."""
    project = root / "project"
    shutil.copytree(ROOT / "examples" / "clickstream", project, ignore=shutil.ignore_patterns(".sparkpoint",
                                                                                              "__pycache__"))
    env = {**os.environ, "PYTHONPATH": f"{project}{os.pathsep}{ROOT}"}
    if landed:
        subprocess.run([sys.executable, "-m", "clickstream.land", "--batches", str(landed), "--into", into],
                       cwd=project, env=env, check=True, capture_output=True)
    return project, env


def clicks_state(project: Path) -> tuple[dict[str, int], dict[str, int]]:
    """(clicks per user in the latest checkpoint of `clicks`, clicks per user in every landed file)."""
    sys.path.insert(0, str(project))
    try:
        from clickstream.operators import clicks_per_user

        _, state = state_table(CheckpointStorage(f"file://{project}/.sparkpoint/clicks/checkpoints", "clicks"),
                               clicks_per_user)
    finally:
        sys.path.remove(str(project))
        for name in [m for m in sys.modules if m == "clickstream" or m.startswith("clickstream.")]:
            del sys.modules[name]
    events = pd.concat([pd.read_parquet(p) for p in sorted((project / "landing").glob("*.parquet"))])
    return dict(zip(state["user"], state["clicks"])), events.groupby("user").size().to_dict()
