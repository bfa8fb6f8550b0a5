"""A RocksDB open refused for a reason of this machine's (here: the open-file limit) is not
corruption (DESIGN rule 10): no fallback to an older checkpoint, every checkpoint kept."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.state.engine.verify import verify_checkpoint

ROOT = Path(__file__).resolve().parent.parent


def script(root: Path, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "tests.support.fd_limited_restore", str(root), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return (done.stdout.strip().splitlines() or [""])[-1]


def test_too_many_open_files_fails_the_restore_without_falling_back(tmp_path: Path):
    script(tmp_path, "write")
    outcome = script(tmp_path, "restore", "4")
    assert outcome.startswith("ERROR LocalStateError"), outcome
    assert "Too many open files" in outcome and "not corruption" in outcome
    storage = CheckpointStorage(f"file://{tmp_path}/ckpt", "job")
    store = CompletedCheckpointStore(storage)
    assert store.checkpoint_ids() == [2, 1], "both checkpoints are kept"
    assert all(verify_checkpoint(storage, m) == [] for m in store.load_all().checkpoints)
    # With room to open its files, the same restore takes the newest checkpoint, as it should.
    assert script(tmp_path, "restore", "64") == "RESTORED 2 fell back from []"
