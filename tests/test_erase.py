"""`sparkpoint erase` without Spark: keys erased from every retained checkpoint and savepoint of a
user's job (value with TTL, map, list, reducing, timers), across a rescale, as new checkpoints, with
the proof; the proof failing when an entry is left; a kill -9 at every step and a rerun that
finishes; the fences against a run and another erase."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sparkpoint.checkpoint.crash import CRASH_AT, CRASH_DIR, ERASE_POINTS
from sparkpoint.checkpoint.metadata import metadata_path
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.pipeline.erase import ERASED_FROM, EraseNotVerified, erase_job, output_id, verify_checkpoint
from sparkpoint.pipeline.eraselock import LOCK, EraseRefused, take_lock
from sparkpoint.pipeline.maintenance import verify_all
from sparkpoint.pipeline.runtime import PipelineConfig, PipelineError, starting_point
from sparkpoint.state import erasure
from tests.support import erase_job as job

GONE = ["acct-007", "acct-042"]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The job, built once; each test works on its own copy of the directory."""
    root = tmp_path_factory.mktemp("erase-job")
    job.build_job(CheckpointStorage(f"file://{root}/cp", "accounts-job"), root / "local")
    return root / "cp"


@pytest.fixture
def storage(built: Path, tmp_path: Path) -> CheckpointStorage:
    subprocess.run(["cp", "-a", str(built), str(tmp_path / "cp")], check=True)
    return CheckpointStorage(f"file://{tmp_path}/cp", "accounts-job")


def retained(storage: CheckpointStorage) -> list[tuple[int, str]]:
    return sorted((m.checkpoint_id, m.kind) for m in CompletedCheckpointStore(storage).load_all().checkpoints)


def test_erase_rewrites_every_checkpoint_and_savepoint_as_new_ones_without_the_keys(
        storage: CheckpointStorage, tmp_path: Path):
    before = {cid: job.read_all(storage, cid, tmp_path / "before") for cid, _ in retained(storage)}
    created = {m.checkpoint_id: m.created_at for m in CompletedCheckpointStore(storage).load_all().checkpoints}
    assert retained(storage) == [(1, "checkpoint"), (2, "checkpoint"), (3, "checkpoint"), (4, "savepoint")]
    assert all(before[c]["acct-007"][0] is not None and before[c]["acct-007"][4] for c in before)

    report = erase_job(storage, job.scope(GONE), local_dir=None)

    assert report.verified, report.message
    assert [(c.original_id, c.new_id) for c in report.checkpoints] == [(1, 5), (2, 6), (3, 7), (4, 8)]
    assert retained(storage) == [(5, "checkpoint"), (6, "checkpoint"), (7, "checkpoint"), (8, "savepoint")]
    assert list(report.retired) == [1, 2, 3, 4]
    for old, new in zip((1, 2, 3, 4), (5, 6, 7, 8)):
        after = job.read_all(storage, new, tmp_path / "after")
        for user in job.USERS:
            if user in GONE:  # value (TTL), map, list, reducing, both timer indexes: nothing
                assert after[user] == (None, [], [], None, [], []), user
            else:
                assert after[user] == before[old][user], user
        meta = CompletedCheckpointStore(storage).load(new)
        assert meta.source_offsets[ERASED_FROM]["checkpoint_id"] == old
        assert output_id(meta) == old  # what the sink recorded: the original's id
        assert meta.created_at == created[old]  # the clock TTL'd entries expire against in an export
    # Cost follows the key: only the subtasks whose range holds a key's group were rewritten.
    c3 = next(c for c in report.checkpoints if c.original_id == 3)
    groups = {erasure.key_group_of_raw(k.encode(), job.MAX_P) for k in GONE}
    assert {s.subtask for s in c3.subtasks} == {
        h.subtask for h in CompletedCheckpointStore(storage).load(7).operators[job.OPERATOR].subtasks
        if any(g in h.key_group_range for g in groups)}
    assert len(c3.subtasks) < 3 and all(s.entries_removed > 0 and s.bytes_written > 0 for s in c3.subtasks)
    # Each copy shares the files of the subtasks it did not rewrite, no copy made.
    old3, new7 = report.checkpoints[2], CompletedCheckpointStore(storage).load(7)
    rewritten = {s.subtask for s in old3.subtasks}
    untouched = [h for h in new7.operators[job.OPERATOR].subtasks if h.subtask not in rewritten]
    assert untouched and all(f.created_by <= 3 for h in untouched for f in h.shared)
    assert verify_all(storage).ok, "sparkpoint verify passes after the erase"
    assert not storage.exists(LOCK)
    assert not any(report.keys_digest.encode() in storage.read_bytes(metadata_path(c)) for c in (5, 6, 7, 8))
    assert "VERIFIED" in report.message and report.to_json()["verified"] is True
    assert all(v.files_checked > 0 for v in report.verification)


def test_a_dry_run_counts_and_changes_nothing(storage: CheckpointStorage):
    report = erase_job(storage, job.scope(GONE), dry_run=True)
    assert [c.entries_found > 0 for c in report.checkpoints] == [True] * 4
    assert retained(storage) == [(1, "checkpoint"), (2, "checkpoint"), (3, "checkpoint"), (4, "savepoint")]
    assert "nothing was changed" in report.message


def test_the_proof_fails_on_a_checkpoint_that_holds_a_key(storage: CheckpointStorage, tmp_path: Path):
    meta = CompletedCheckpointStore(storage).load(3)
    proof = verify_checkpoint(storage, meta, job.scope(GONE), tmp_path / "v")
    assert not proof.ok and proof.findings and all(f.path.startswith("shared/") for f in proof.findings)


def test_an_erase_that_leaves_an_entry_is_not_verified_and_keeps_the_originals(
        storage: CheckpointStorage, monkeypatch: pytest.MonkeyPatch):
    real = erasure.delete_entries

    def leave_the_timers(db, found):  # a bug that forgets one index of the timers
        real(db, {cf: keys for cf, keys in found.items() if cf != "__timers__"})

    monkeypatch.setattr(erasure, "delete_entries", leave_the_timers)
    with pytest.raises(EraseNotVerified, match="NOT VERIFIED") as caught:
        erase_job(storage, job.scope(GONE))
    assert any(v.findings for v in caught.value.report.verification)
    assert retained(storage) == [(1, "checkpoint"), (2, "checkpoint"), (3, "checkpoint"), (4, "savepoint")]
    assert verify_all(storage).ok
    assert not storage.exists(LOCK)


def test_a_run_does_not_start_while_an_erase_holds_the_job(storage: CheckpointStorage):
    take_lock(storage, "x" * 64)
    config = PipelineConfig(checkpoints_url=storage.url, job_id=storage.job_id, input_url="file:///nowhere")
    with pytest.raises(PipelineError, match="erase of keys .* holds"):
        starting_point(storage, config)
    with pytest.raises(EraseRefused, match="another erase holds"):  # this process lives: not taken over
        erase_job(storage, job.scope(GONE))


@pytest.mark.parametrize("point", ERASE_POINTS)
def test_a_kill_at_every_step_leaves_whole_checkpoints_and_a_rerun_finishes(
        storage: CheckpointStorage, tmp_path: Path, point: str):
    at = f"{point}:2" if point in ("erase-after-copy", "erase-mid-retire") else point
    env = {**os.environ, CRASH_AT: at, CRASH_DIR: str(tmp_path / "crash"), "PYTHONPATH": os.getcwd()}
    killed = subprocess.run([sys.executable, "-m", "tests.support.erase_job", storage.url, storage.job_id, *GONE],
                            env=env, capture_output=True, text=True, timeout=300, start_new_session=True)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert verify_all(storage).ok, f"after a kill at {point}, a retained checkpoint lacks files"
    assert storage.exists(LOCK)
    report = erase_job(storage, job.scope(GONE))
    assert report.verified, report.message
    if point in ("erase-after-copy", "erase-before-retire"):  # copies of the killed run: compared with the originals
        assert [v.rest_equal for v in report.verification] == [True] * 4
    kept = retained(storage)  # new ids above the originals', in their order (a killed attempt's id is skipped)
    assert [k for _, k in kept] == ["checkpoint"] * 3 + ["savepoint"] and kept[0][0] > 4
    from_ = [CompletedCheckpointStore(storage).load(c).source_offsets[ERASED_FROM]["checkpoint_id"] for c, _ in kept]
    assert from_ == [1, 2, 3, 4]
    after = job.read_all(storage, kept[2][0], tmp_path / "after")
    assert after["acct-007"] == (None, [], [], None, [], []) and after["acct-001"][0] is not None
    assert verify_all(storage).ok and not storage.exists(LOCK)
    assert not storage.exists(metadata_path(3))


@pytest.mark.parametrize("args, message", [
    (["erase", "--checkpoints", "file:///nowhere", "--job-id", "j", "--key", "x"], "erase needs --pipeline"),
    (["erase", "--pipeline", "tests.support.members_pipeline:members", "--operators", "memberships,visits",
      "--key", "x"], "unknown operator uid(s) visits; this pipeline's operators are memberships (keyed by member)"),
    (["erase", "--pipeline", "tests.support.members_pipeline:members", "--keys-from", "/nowhere/keys.txt"],
     "--keys-from /nowhere/keys.txt"),
])
def test_bad_input_is_refused_with_what_to_change(args: list[str], message: str, capsys: pytest.CaptureFixture[str]):
    from sparkpoint.cli import main

    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_a_key_is_parsed_as_its_column_type():
    from sparkpoint.pipeline.erase import parse_key, state_key

    assert parse_key("42", "int64", "user") == 42 and state_key(42) == b"42"
    assert parse_key("ann", None, "user") == "ann" and state_key("ann") == b"ann"
    with pytest.raises(EraseRefused, match="key 'x42' is not of type int64, the type of key column 'user'"):
        parse_key("x42", "int64", "user")


def test_the_key_matcher_takes_every_layout_of_a_key_and_nothing_of_a_longer_key_or_another_group():
    from sparkpoint.state.erasure import ErasedKey, KeyMatcher
    from sparkpoint.state.kinds.base import LEN
    from sparkpoint.state.timers import TIMERS

    gone, longer, elsewhere = ErasedKey(b"u-1", 5), ErasedKey(b"u-10", 5), ErasedKey(b"u-1", 6)
    erased = KeyMatcher([gone])
    clock_time = b"\x00" + (7).to_bytes(8, "big")
    for k in (gone, longer, elsewhere):
        want = k is gone
        assert erased("profile", k.exact(), "value") is want
        assert erased("profile", k.exact(), None) is want
        assert erased("clubs", k.element_prefix() + b"club-1", "map") is want
        assert erased("clubs", k.element_prefix() + b"club-1", None) is want
        assert erased(TIMERS, k.timer_prefix() + clock_time, None) is want
        assert erased(TIMERS, k.prefix + b"t" + clock_time + k.raw, None) is want
    assert not erased("profile", gone.exact(), "map"), "a map entry always has the length field"
    assert not erased("clubs", gone.element_prefix() + b"x", "value"), "a value entry is the key alone"
    assert not erased("clubs", gone.prefix + LEN.pack(99) + b"u-1", "map"), "a length longer than the entry"
    assert not erased(TIMERS, gone.prefix + b"t" + clock_time + b"u-10", None)
