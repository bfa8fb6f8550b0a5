"""Progress bars on a terminal, none in a pipe: `sparkpoint` run as a real process on a pty."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_operator_cli import JOB, Job, closed_job

BAR = "━"  # what rich draws a progress bar with


def on_a_terminal(cmd: list[str]) -> tuple[int, str]:
    """Run `cmd` with stdin, stdout and stderr on a new pseudo-terminal; its exit code and output."""
    master, slave = pty.openpty()
    env = {**os.environ, "COLUMNS": "120", "TERM": "xterm-256color"}
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return proc.wait(timeout=120), b"".join(chunks).decode("utf-8", "replace")


def in_a_pipe(cmd: list[str]) -> tuple[int, str]:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    return done.returncode, done.stdout + done.stderr


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Job:
    return closed_job(tmp_path_factory.mktemp("terminal"), 2)


def sparkpoint(*args: str) -> list[str]:
    return [sys.executable, "-m", "sparkpoint.cli", *args]


@pytest.mark.parametrize("run", [on_a_terminal, in_a_pipe])
def test_progress_bar_on_a_terminal_only(job: Job, tmp_path: Path, run):
    target = tmp_path / "restored"
    code, out = run(sparkpoint("restore", "--checkpoints", job.url, "--job-id", JOB, "--operator", "user_totals",
                               "--subtask", "0", "--to", str(target)))
    assert code == 0, out
    assert target.is_dir() and "entries" in out
    if run is on_a_terminal:
        assert BAR in out and "restoring user_totals/0" in out
    else:
        assert BAR not in out and "\x1b[" not in out


def test_no_progress_bar_under_json_even_on_a_terminal(job: Job, tmp_path: Path):
    code, out = on_a_terminal(sparkpoint("savepoint", "--checkpoints", job.url, "--job-id", JOB, "--to",
                                         f"file://{tmp_path}/sp", "--json"))
    assert code == 0, out
    assert BAR not in out and '"kind": "savepoint"' in out


def test_savepoint_draws_a_bar_on_a_terminal(job: Job, tmp_path: Path):
    code, out = on_a_terminal(sparkpoint("savepoint", "--checkpoints", job.url, "--job-id", JOB, "--to",
                                         f"file://{tmp_path}/sp"))
    assert code == 0, out
    assert BAR in out and "savepoint" in out
