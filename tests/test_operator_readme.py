"""The README's quick start, executed command by command, so that the guide cannot rot.

Every fenced `sh` block that follows a `<!-- quickstart -->` line in README.md runs, in order, in
one shell in an empty directory, with the Python environment's `bin` first on PATH (where the
`sparkpoint` command is). The run of `sparkpoint run` also shows that Spark's start-up chatter
does not reach the terminal.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.spark
README = Path(__file__).resolve().parent.parent / "README.md"
MARKED_BLOCK = re.compile(r"^<!-- quickstart -->\n```sh\n(.*?)^```", re.M | re.S)
CHATTER = ("WARN", "log4j", "hostname", "incubator", "Setting default log level", "NativeCodeLoader")


def quickstart_commands() -> list[str]:
    blocks = MARKED_BLOCK.findall(README.read_text(encoding="utf-8"))
    assert blocks, "README.md has no block marked <!-- quickstart -->"
    script = "\n".join(blocks).replace("\\\n", " ")
    return [line.strip() for line in script.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_every_quick_start_command_runs(tmp_path: Path):
    commands = quickstart_commands()
    assert any(c.startswith("sparkpoint run") for c in commands)
    # Each command echoes a marker first, so a failure names the command.
    script = "set -eu\n" + "\n".join(f"echo '>>> {c}' >&2\n{c}" for c in commands)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("SPARKPOINT_VERBOSE", None)
    done = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, f"quick start failed:\n{done.stderr[-4000:]}\n{done.stdout[-2000:]}"

    stderr_of_runs = _stderr_of(done.stderr, "sparkpoint run")
    assert stderr_of_runs.strip() == "", f"sparkpoint run is not quiet:\n{stderr_of_runs[:3000]}"
    assert not [w for w in CHATTER if w in done.stdout], done.stdout[:3000]

    assert (tmp_path / "totals.csv").read_text().startswith("user_id,count,")
    assert (tmp_path / "debug" / "user_totals-0" / "CURRENT").is_file()
    listed = json.loads(done.stdout[done.stdout.rindex('{\n "checkpoints"'):])
    assert [(c["checkpoint_id"], c["kind"]) for c in listed["checkpoints"]] == [(2, "savepoint")]
    saved = tmp_path / "savepoints" / "before-upgrade" / "chk-2"
    assert {p.name for p in saved.iterdir()} == {"_metadata", "user_totals", "item_reach"}


def _stderr_of(stderr: str, prefix: str) -> str:
    """What the commands starting with `prefix` wrote to standard error (between the markers)."""
    out, keep = [], False
    for line in stderr.splitlines(keepends=True):
        if line.startswith(">>> "):
            keep = line[4:].startswith(prefix)
            continue
        if keep:
            out.append(line)
    return "".join(out)
