"""Corruption and repair (issue 11, item 3): bit flips, truncation and deletion of SSTs, private
files, changelog files and `_metadata` at fuzzed positions are detected before use, never give an
empty or partial state, and the restore falls back to the newest older checkpoint that verifies.
A bad primary file with a good task-local copy is rewritten from it (restore, `verify --repair`);
a bad file every retained checkpoint needs, with no good copy anywhere, stops with that message.
"""

from __future__ import annotations

import logging
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.errors import CheckpointCorrupted
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.cli import main
from sparkpoint.state.backend import RocksDBStateBackend, restore_with_fallback, take_checkpoint
from sparkpoint.state.engine.changelog import ChangelogOptions
from sparkpoint.state.engine.verify import verify_checkpoint
from tests.support.backends import make_backends
from tests.support.reliability import count_round, counts, report, scale

MAX_P = 16


@dataclass
class Job:
    url: str
    root: Path  # the job directory
    local: Path  # the task-local directory of the run that wrote it
    expected: dict[int, dict[str, int]]  # checkpoint id -> state
    changelog: bool

    def storage(self) -> CheckpointStorage:
        return CheckpointStorage(self.url, "job")


def backends(storage: CheckpointStorage, local: Path, *, changelog: bool = False, **kw) -> list[RocksDBStateBackend]:
    return make_backends(storage, local, max_parallelism=MAX_P,
                         changelog=ChangelogOptions(enabled=changelog, max_chain=3), **kw)


def write_job(base: Path, *, rounds: int, retained: int, changelog: bool = False, compact_at: int = -1) -> Job:
    url = f"file://{base}/ck"
    storage = CheckpointStorage(url, "job")
    coord = CheckpointCoordinator(storage, num_retained=retained)
    subtasks = backends(storage, base / "local", changelog=changelog)
    rng = random.Random(5)
    model: dict[str, int] = {}
    expected = {}
    for b in subtasks:
        b.restore(None)
    for round_ in range(rounds):
        count_round(subtasks, model, sorted({f"k{rng.randrange(500):04d}" for _ in range(120)}))
        for b in subtasks if round_ == compact_at else []:
            b.compact()
        expected[take_checkpoint(coord, subtasks).checkpoint_id] = dict(model)
    for b in subtasks:
        b.close()
    return Job(url, base / "ck" / "job", base / "local", expected, changelog)


def restore_all(storage: CheckpointStorage, local: Path, *, changelog: bool = False, local_recovery: bool = False):
    """restore_with_fallback over the retained checkpoints, newest first -> (checkpoint id, state)."""
    listing = CompletedCheckpointStore(storage).load_all()
    subtasks = backends(storage, local, changelog=changelog, local_recovery=local_recovery)
    try:
        results = restore_with_fallback(subtasks, listing.checkpoints)
        return results, counts(subtasks)
    finally:
        for b in subtasks:
            b.close()


def damage(path: Path, how: str, rng: random.Random) -> str:
    data = path.read_bytes()
    if how == "delete" or not data:
        path.unlink()
        return "delete"
    if how == "truncate":
        path.write_bytes(data[: rng.randrange(len(data))])
        return f"truncate to {path.stat().st_size}"
    pos = rng.randrange(len(data))
    flipped = bytearray(data)
    flipped[pos] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(flipped))
    return f"flip a bit at {pos}"


def kind_of(path: str, name: str) -> str:
    return ("metadata" if name == "_metadata" else "changelog" if name.startswith("changelog-")
            else "sst" if name.endswith(".sst") else "private" if path.startswith("chk-")
            else "shared_manifest_etc")  # with the changelog on, MANIFEST, CURRENT, OPTIONS are shared


def fuzz(jobs: list[Job], tmp_path: Path, cases: int, seed: int) -> dict[str, object]:
    rng = random.Random(seed)
    kinds: dict[str, int] = {}
    fell_back = stopped = repaired = 0
    for case in range(cases):
        job = jobs[case % len(jobs)]
        work = tmp_path / f"case-{case}"
        shutil.copytree(job.root, work / "ck" / "job", symlinks=True)
        storage = CheckpointStorage(f"file://{work}/ck", "job")
        listing = CompletedCheckpointStore(storage).load_all()
        files = sorted({(f.path, f.local_name) for m in listing.checkpoints for f in m.files()})
        files += [(m.metadata_path, "_metadata") for m in listing.checkpoints]
        by_kind: dict[str, list[str]] = {}
        for path, name in files:
            by_kind.setdefault(kind_of(path, name), []).append(path)
        # Every kind of file in turn (which files a job writes varies with RocksDB's timing: a
        # plain random pick over all of them could miss a kind), a random file of that kind.
        kind = sorted(by_kind)[(case // len(jobs)) % len(by_kind)]
        path = rng.choice(by_kind[kind])
        how = damage(work / "ck" / "job" / path, rng.choice(["flip", "truncate", "delete"]), rng)
        kinds[kind] = kinds.get(kind, 0) + 1
        # What must happen: the newest checkpoint not touched by the damage is restored, exactly.
        usable = [m.checkpoint_id for m in listing.checkpoints if path != m.metadata_path and path not in m.paths()]
        needed_by_all = all(path in m.paths() for m in listing.checkpoints)
        context = f"case {case}: {how} of {path} ({kind})"
        for m in listing.checkpoints:  # verify names the file in every checkpoint that lists it
            if path in m.paths():
                assert path in [p.path for p in verify_checkpoint(storage, m)], context
        try:
            results, state = restore_all(storage, work / "local", changelog=job.changelog)
        except CheckpointCorrupted as e:
            assert not usable, f"{context}: {e}"
            if needed_by_all:
                assert path in str(e) and "every retained checkpoint" in str(e), context
            stopped += 1
            continue
        restored = results[0].checkpoint_id
        if not usable or restored != usable[0]:
            # Only a repair may bring back a damaged checkpoint: a local file with exactly the
            # recorded size and CRC32 (e.g. another subtask's identical OPTIONS) was written back.
            meta = next(m for m in listing.checkpoints if m.checkpoint_id == restored)
            assert restored > (usable[0] if usable else 0) and verify_checkpoint(storage, meta) == [], context
            repaired += 1
        assert state == job.expected[restored], context
        fell_back += restored != listing.checkpoints[0].checkpoint_id
        shutil.rmtree(work)
    return {"seed": seed, "cases": cases, **{f"damaged_{k}": v for k, v in sorted(kinds.items())},
            "fell_back": fell_back, "stopped": stopped, "repaired": repaired, "failures_found": 0}


def fuzz_jobs(tmp_path: Path) -> list[Job]:
    return [
        write_job(tmp_path / "files", rounds=4, retained=3, compact_at=2),
        write_job(tmp_path / "log", rounds=5, retained=3, changelog=True),
    ]


def test_fuzzed_damage_is_detected_before_use_and_restore_falls_back_to_one_that_verifies(tmp_path: Path):
    row = fuzz(fuzz_jobs(tmp_path), tmp_path, cases=40, seed=3)
    assert row["fell_back"] and row.get("damaged_changelog") and row.get("damaged_private") and row.get("damaged_sst")
    report("corruption_quick", [row])


@pytest.mark.soak
@pytest.mark.timeout(6 * 3600)  # the scale comes from the environment
def test_corruption_soak(tmp_path: Path):
    jobs = fuzz_jobs(tmp_path)
    report("corruption", [fuzz(jobs, tmp_path / str(s), cases=scale("corruption_cases", 200), seed=s)
                          for s in range(scale("corruption_seeds", 5))])


# --- repair from task-local copies ----------------------------------------------------------------


def shared_sst(storage: CheckpointStorage, checkpoint_id: int, *, created_by: int | None = None):
    meta = CompletedCheckpointStore(storage).load(checkpoint_id)
    return next(f for f in meta.files() if f.local_name.endswith(".sst")
                and (created_by is None or f.created_by == created_by)), meta


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def test_restore_uses_the_task_local_copy_and_rewrites_a_missing_primary_file(tmp_path: Path, caplog):
    job = write_job(tmp_path, rounds=3, retained=2)
    storage = job.storage()
    victim, meta = shared_sst(storage, 3)
    (job.root / victim.path).unlink()
    for marker in job.local.rglob("working.json"):  # a new machine would not have the working db either
        marker.unlink()
    with caplog.at_level(logging.WARNING):
        results, state = restore_all(storage, job.local, local_recovery=True)
    assert [r.source for r in results] == ["local", "local"] and state == job.expected[3]
    assert f"REPAIRED {storage.job_url}/{victim.path}" in caplog.text
    assert verify_checkpoint(storage, meta) == []


def test_restore_repairs_a_damaged_primary_file_from_another_local_copy_before_downloading(tmp_path: Path, caplog):
    job = write_job(tmp_path, rounds=3, retained=2)
    storage = job.storage()
    victim, meta = shared_sst(storage, 3)
    flip(job.root / victim.path)
    subtask = victim.path.split("/")[2]
    local_copy = job.local / "job" / "counts" / subtask / "chk-3"
    next(local_copy.glob("OPTIONS-*")).unlink()  # the task-local copy as a whole fails, the SST in it is good
    for marker in job.local.rglob("working.json"):
        marker.unlink()
    with caplog.at_level(logging.WARNING):
        results, state = restore_all(storage, job.local, local_recovery=True)
    assert results[int(subtask)].source == "primary" and state == job.expected[3]
    assert results[0].fell_back_from == ()
    assert f"REPAIRED {storage.job_url}/{victim.path}" in caplog.text
    assert verify_checkpoint(storage, meta) == []


def test_verify_repair_rewrites_flipped_primary_files_from_the_task_local_copy(tmp_path: Path, capsys, caplog):
    job = write_job(tmp_path, rounds=3, retained=2)
    storage = job.storage()
    victim, _ = shared_sst(storage, 3)
    flip(job.root / victim.path)
    args = ["verify", "--checkpoints", job.url, "--job-id", "job"]
    assert main(args) == 1
    assert victim.path in capsys.readouterr().out
    with caplog.at_level(logging.WARNING):
        assert main([*args, "--repair", "--local-dir", str(job.local)]) == 0
    out = capsys.readouterr().out
    assert f"repaired {victim.path} from the task-local copy" in out and "chk-3: ok" in out
    assert f"REPAIRED {storage.job_url}/{victim.path}" in caplog.text
    assert main(args) == 0


def test_a_bad_file_every_retained_checkpoint_needs_with_no_good_copy_stops_with_that_message(
    tmp_path: Path, capsys
):
    job = write_job(tmp_path, rounds=3, retained=3)  # no compaction: chk-1's SSTs are in all three
    storage = job.storage()
    victim, _ = shared_sst(storage, 3, created_by=1)
    flip(job.root / victim.path)
    shutil.rmtree(job.local)  # no task-local copy anywhere
    with pytest.raises(CheckpointCorrupted) as err:
        restore_all(storage, tmp_path / "elsewhere", local_recovery=True)
    message = str(err.value)
    assert victim.path in message and "every retained checkpoint (chk-3, chk-2, chk-1) needs it" in message
    assert "no good copy exists" in message
    args = ["verify", "--checkpoints", job.url, "--job-id", "job", "--repair", "--local-dir", str(tmp_path / "x")]
    assert main(args) == 1
    err_text = capsys.readouterr().err
    assert victim.path in err_text and "every retained checkpoint" in err_text and "no good copy exists" in err_text
