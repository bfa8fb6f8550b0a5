"""Zombie writers (issue 11, item 5): two coordinators in two processes on one job race for every
checkpoint id. Exactly one commits each id (`_metadata` is created exclusively: a link on a local
disk, a conditional PUT with `If-None-Match: *` on S3), the loser deletes what it uploaded, no
file a retained checkpoint references is ever deleted, and the sink's output stays exactly-once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import fsspec
import pytest

from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.checkpoint.sweep import sweep_orphans
from sparkpoint.state.engine.verify import verify_checkpoint
from tests.conftest import s3_options
from tests.support.backends import make_backends
from tests.support.reliability import counts, report, scale
from tests.support.zombie_writer import batch, model_at

ROOT = Path(__file__).resolve().parent.parent


def race(tmp_path: Path, url: str, options: dict[str, Any], batches: int, seed: int) -> dict[str, Any]:
    (tmp_path / "barrier").mkdir(parents=True)
    (tmp_path / "out").mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "tests.support.zombie_writer", "--checkpoints", url, "--storage-options",
             json.dumps(options), "--local", str(tmp_path / f"local-{name}"), "--name", name, "--batches",
             str(batches), "--barrier", str(tmp_path / "barrier"), "--out", str(tmp_path / "out"), "--seed",
             str(seed)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
        )
        for name in ("live", "zombie")
    }
    outcomes: dict[int, dict[str, str]] = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        for line in out.splitlines():
            r = json.loads(line)
            outcomes.setdefault(r["id"], {})[name] = r["outcome"]
    storage = CheckpointStorage(url, "job", options)
    # Exactly one writer commits each id; the other lost the exclusive create or was declined.
    winners = {n: [w for w, o in outcomes[n].items() if o == "won"] for n in range(1, batches + 1)}
    assert all(len(w) == 1 for w in winners.values()), outcomes
    # The sink: one output per batch, by that batch's winner, with that batch's rows.
    written = sorted(os.listdir(tmp_path / "out"))
    assert written == sorted(f"batch-{n}.json" for n in range(1, batches + 1))
    for n in range(1, batches + 1):
        part = json.loads((tmp_path / "out" / f"batch-{n}.json").read_text())
        model = model_at(n)
        assert part == {"writer": winners[n][0], "rows": {k: model[k] for k in batch(n)}}
    # Retained checkpoints: committed by the winner, whole, and exactly the state after their batch.
    listing = CompletedCheckpointStore(storage).load_all()
    assert not listing.unreadable and listing.ids == [batches, batches - 1]
    for meta in listing.checkpoints:
        assert meta.source_offsets == {"batch": meta.checkpoint_id, "writer": winners[meta.checkpoint_id][0]}
        assert verify_checkpoint(storage, meta) == []
        subtasks = make_backends(storage, tmp_path / f"check-{meta.checkpoint_id}", max_parallelism=16,
                                 local_recovery=False)
        for b in subtasks:
            b.restore(meta)
        assert counts(subtasks) == model_at(meta.checkpoint_id)
        for b in subtasks:
            b.close()
    # The losers cleaned up after themselves: nothing for the sweep, and after it exactly the
    # referenced files are left.
    referenced = {p for m in listing.checkpoints for p in m.references()}
    orphans = sweep_orphans(storage, grace_seconds=0, dry_run=True).orphans
    assert [f.path for f in orphans] == []
    left = {f.path for top in ["shared", *[f"chk-{c}" for c in storage.checkpoint_dirs()]] for f in storage.walk(top)}
    assert left == referenced
    lost = sum(1 for o in outcomes.values() for v in o.values() if v == "lost")
    declined = sum(1 for o in outcomes.values() for v in o.values() if v not in ("won", "lost"))
    wins = {w: sum(1 for v in winners.values() if v == [w]) for w in procs}
    return {"seed": seed, "batches": batches, "wins_live": wins["live"], "wins_zombie": wins["zombie"],
            "lost_exclusive_create": lost, "declined": declined, "failures_found": 0}


def test_two_coordinators_in_two_processes_commit_each_id_once_on_a_local_disk(tmp_path: Path):
    row = race(tmp_path, f"file://{tmp_path}/ck", {}, batches=12, seed=1)
    assert row["wins_live"] and row["wins_zombie"] and row["lost_exclusive_create"]
    report("zombie_writers_quick", [row])


@pytest.mark.s3
def test_two_coordinators_in_two_processes_commit_each_id_once_on_s3(tmp_path: Path, s3_endpoint: str):
    bucket = "zombie-" + uuid.uuid4().hex[:8]
    fsspec.filesystem("s3", **s3_options(s3_endpoint)).mkdir(bucket)
    row = race(tmp_path, f"s3://{bucket}/ck", s3_options(s3_endpoint), batches=6, seed=2)
    assert row["lost_exclusive_create"]


@pytest.mark.soak
@pytest.mark.timeout(6 * 3600)  # the scale comes from the environment
def test_zombie_writers_soak(tmp_path: Path):
    rows = [race(tmp_path / str(seed), f"file://{tmp_path}/{seed}/ck", {}, batches=scale("zombie_batches", 60),
                 seed=seed) for seed in range(scale("zombie_seeds", 5))]
    report("zombie_writers", rows)
