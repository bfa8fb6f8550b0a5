"""The defects an adversarial review found in the engine (issue 8), each pinned by the scenario
that reproduced it: glob characters, links out of the job directory, two coordinators, flipped
bytes and hostile `_metadata`, failed deletes after a commit, the registry's created-by."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.errors import DeletionBlocked, MetadataError, PathEscapesJobDirectory, UnknownSharedState
from sparkpoint.checkpoint.metadata import content_checksum, metadata_path
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.checkpoint.sweep import sweep_orphans
from sparkpoint.cli import main
from sparkpoint.state.backend import RocksDBStateBackend, restore_with_fallback, take_checkpoint
from sparkpoint.state.codecs import StructCodec
from sparkpoint.state.keygroups import key_group_for
from sparkpoint.state.verify import verify_checkpoint
from tests.support.helpers import FakeSubtask

COUNT = StructCodec[tuple[int]]("<q")


def write_checkpoints(storage: CheckpointStorage, local: Path, rounds: int, *, retained: int = 2) -> dict[str, int]:
    """`rounds` checkpoints of a real two-subtask RocksDB state; returns the expected content."""
    coord = CheckpointCoordinator(storage, num_retained=retained)
    backends = [RocksDBStateBackend(storage, "counts", i, parallelism=2, max_parallelism=16, local_dir=local)
                for i in range(2)]
    model: dict[str, int] = {}
    rng = random.Random(7)
    for b in backends:
        b.restore(None)
    for _ in range(rounds):
        keys = sorted({f"k{rng.randrange(400):04d}" for _ in range(150)})
        for k in keys:
            model[k] = model.get(k, 0) + 1
        for b in backends:
            state = b.value_state("count", COUNT)
            state.put_many((k, (model[k],)) for k in keys if key_group_for(k, 16) in b.key_group_range)
        take_checkpoint(coord, backends)
    for b in backends:
        b.close()
    return model


def restored(storage: CheckpointStorage, local: Path, checkpoint_id: int | None = None) -> dict[str, int]:
    store = CompletedCheckpointStore(storage)
    meta = store.load(checkpoint_id or store.checkpoint_ids()[0])
    out: dict[str, int] = {}
    for i in range(2):
        with RocksDBStateBackend(storage, "counts", i, parallelism=2, max_parallelism=16, local_dir=local,
                                 local_recovery=False) as b:
            b.restore(meta)
            out.update({k.decode(): v[0] for k, v in b.value_state("count", COUNT).items()})
    return out


def resign(raw: dict) -> bytes:
    """A hostile `_metadata` with a checksum that matches, so validation must name the field."""
    raw["checksum"] = content_checksum(raw)
    return json.dumps(raw).encode()


# --- 1. glob characters in the checkpoints directory -----------------------------------------


def test_glob_characters_in_the_checkpoints_directory_are_plain_characters(tmp_path: Path, capsys):
    url = f"file://{tmp_path}/ck[prod]"
    storage = CheckpointStorage(url, "job")
    model = write_checkpoints(storage, tmp_path / "local", 3)
    # a sibling the pattern `ck[prod]` would match as a glob must not be seen or touched
    decoy = CheckpointStorage(f"file://{tmp_path}/ckp", "job")
    write_checkpoints(decoy, tmp_path / "decoy-local", 1)
    decoy_files = sorted(p for p in (tmp_path / "ckp").rglob("*") if p.is_file())

    assert CompletedCheckpointStore(storage).checkpoint_ids() == [3, 2]
    assert main(["list", "--checkpoints", url, "--job-id", "job", "--json"]) == 0
    assert [c["checkpoint_id"] for c in json.loads(capsys.readouterr().out)["checkpoints"]] == [3, 2]
    assert main(["gc", "--checkpoints", url, "--job-id", "job", "--grace", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["orphans"] == []
    assert main(["verify", "--checkpoints", url, "--job-id", "job"]) == 0
    assert restored(storage, tmp_path / "r") == model
    assert sorted(p for p in (tmp_path / "ckp").rglob("*") if p.is_file()) == decoy_files


# --- 3. two coordinators on one job directory ---------------------------------------------------


def test_second_coordinator_cannot_reuse_a_file_the_first_one_deleted(local_storage: CheckpointStorage, tmp_path: Path):
    """A completes 2 and deletes an SST of 1; B, resumed from 1, must not commit 3 reusing it."""
    storage = local_storage
    a = CheckpointCoordinator(storage, num_retained=1)
    sa = FakeSubtask(storage, tmp_path / "a")
    sa.write("000007.sst")
    sa.write("000008.sst")
    p1 = a.trigger(expected={"op": 1}).checkpoint_id
    a.acknowledge(p1, sa.snapshot(p1, ["000007.sst"]))
    a.complete(p1)
    sa.confirm(p1)
    reused = sa.confirmed["000007.sst"].path

    b = CheckpointCoordinator(storage, num_retained=1)  # resumed from 1: its registry knows `reused`
    sb = FakeSubtask(storage, tmp_path / "b")
    sb.confirmed = dict(sa.confirmed)

    p2 = a.trigger(expected={"op": 1}).checkpoint_id
    a.acknowledge(p2, sa.snapshot(p2, ["000008.sst"]))
    a.complete(p2)  # subsumes 1: `reused` is deleted
    assert not storage.exists(reused)

    p3 = b.trigger(expected={"op": 1}).checkpoint_id  # next_id None: the highest known + 1
    b.acknowledge(p3, sb.snapshot(p3, ["000007.sst"]))
    with pytest.raises(UnknownSharedState, match="re-upload"):
        b.complete(p3)
    store = CompletedCheckpointStore(storage)
    assert store.checkpoint_ids() == [2], "A's good checkpoint survives, B's never commits"
    assert verify_checkpoint(storage, store.load(2)) == []


class CommitHook(CheckpointStorage):
    """Runs `before_commit` once, right before `_metadata` is created: another writer acts there."""

    before_commit = None

    def commit_exclusive(self, rel: str, data: bytes) -> None:
        hook, type(self).before_commit = type(self).before_commit, None
        if hook:
            hook()
        super().commit_exclusive(rel, data)


def test_file_deleted_by_another_writer_between_check_and_commit_withdraws_the_checkpoint(tmp_path: Path):
    url = f"file://{tmp_path}/ck"
    storage = CommitHook(url, "job")
    a = CheckpointCoordinator(CheckpointStorage(url, "job"), num_retained=1)
    sa = FakeSubtask(a.storage, tmp_path / "a")
    sa.write("000007.sst")
    sa.write("000008.sst")
    p1 = a.trigger(expected={"op": 1}).checkpoint_id
    a.acknowledge(p1, sa.snapshot(p1, ["000007.sst"]))
    a.complete(p1)
    sa.confirm(p1)

    b = CheckpointCoordinator(storage, num_retained=1)
    sb = FakeSubtask(storage, tmp_path / "b")
    sb.confirmed = dict(sa.confirmed)
    p3 = b.trigger(expected={"op": 1}, checkpoint_id=3).checkpoint_id
    b.acknowledge(p3, sb.snapshot(p3, ["000007.sst"]))

    def a_completes_2() -> None:
        p2 = a.trigger(expected={"op": 1}, checkpoint_id=2).checkpoint_id
        a.acknowledge(p2, sa.snapshot(p2, ["000008.sst"]))
        a.complete(p2)

    CommitHook.before_commit = a_completes_2
    with pytest.raises(UnknownSharedState, match="withdrawn"):
        b.complete(p3)
    store = CompletedCheckpointStore(storage)
    assert store.checkpoint_ids() == [2]
    assert verify_checkpoint(storage, store.load(2)) == []


# --- 4. links out of the job directory ---------------------------------------------------------


def test_sweep_verify_and_retention_never_follow_a_link_out_of_the_job_directory(tmp_path: Path, capsys):
    url = f"file://{tmp_path}/ck"
    storage = CheckpointStorage(url, "job")
    write_checkpoints(storage, tmp_path / "local", 2)
    outside = tmp_path / "precious"
    (outside / "counts" / "0").mkdir(parents=True)
    (outside / "counts" / "0" / "data.bin").write_bytes(b"keep me")
    (outside / "old.sst").write_bytes(b"keep me too")
    old = 1_000_000_000
    for p in outside.rglob("*"):
        os.utime(p, (old, old))
    job = tmp_path / "ck" / "job"
    os.symlink(outside, job / "chk-9")  # a chk-N that is a link
    os.symlink(outside / "old.sst", job / "shared" / "counts" / "0" / "linked.sst")  # a file link

    report = sweep_orphans(storage, grace_seconds=0, dry_run=True)
    assert sorted(f.path for f in report.symlinks) == ["chk-9", "shared/counts/0/linked.sst"]
    assert not [f for f in report.orphans if f.symlink]
    # chk-9 counts as an unreadable checkpoint: deletion stops until someone looks
    with pytest.raises(DeletionBlocked, match="chk-9"):
        sweep_orphans(storage, grace_seconds=0)
    assert main(["gc", "--checkpoints", url, "--job-id", "job", "--grace", "0"]) == 2
    assert "symbolic link" in capsys.readouterr().err
    assert (outside / "counts" / "0" / "data.bin").read_bytes() == b"keep me"
    assert (outside / "old.sst").read_bytes() == b"keep me too"

    # a link in place of a file a checkpoint lists: verify reports it, never reads through it
    os.unlink(job / "chk-9")
    meta = CompletedCheckpointStore(storage).load(2)
    victim = next(f for f in meta.files() if f.path.startswith("shared/"))
    (job / victim.path).unlink()
    os.symlink(outside / "old.sst", job / victim.path)
    problems = verify_checkpoint(storage, meta)
    assert [p.path for p in problems] == [victim.path] and "symbolic link" in problems[0].problem
    with pytest.raises(PathEscapesJobDirectory):
        storage.read_bytes(victim.path)
    # retention of the checkpoint listing it does not delete through the link either
    write_checkpoints(CheckpointStorage(url, "job"), tmp_path / "local", 1, retained=1)
    assert (outside / "old.sst").read_bytes() == b"keep me too"


# --- 6. a flipped letter in _metadata, operator sets, key-group coverage -----------------------


def test_a_flipped_letter_in_metadata_is_detected_everywhere(tmp_path: Path, capsys):
    url = f"file://{tmp_path}/ck"
    storage = CheckpointStorage(url, "job")
    write_checkpoints(storage, tmp_path / "local", 2)
    path = tmp_path / "ck" / "job" / "chk-2" / "_metadata"
    text = path.read_text()
    assert '"counts"' in text
    path.write_text(text.replace('"counts"', '"countz"', 1))  # still valid JSON
    with pytest.raises(MetadataError, match="checksum"):
        CompletedCheckpointStore(storage).load(2)
    assert main(["verify", "--checkpoints", url, "--job-id", "job"]) == 1
    assert "checksum" in capsys.readouterr().out
    # restoring: the flipped checkpoint is unreadable, so nothing restores it from empty state
    assert CompletedCheckpointStore(storage).load_all().ids == [1]


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda raw: raw["operators"]["counts"].update(subtasks=[]), "has no subtask"),
        (lambda raw: raw["operators"]["counts"]["subtasks"].pop(), "does not cover key groups"),
        (lambda raw: raw["operators"]["counts"]["subtasks"][1]["key_group_range"].update(start=5), "overlaps"),
        (lambda raw: raw.update(operators={}), "`operators` is empty"),
    ],
)
def test_metadata_that_would_restore_part_of_the_state_is_refused(tmp_path: Path, mutate, field):
    storage = CheckpointStorage(f"file://{tmp_path}/ck", "job")
    write_checkpoints(storage, tmp_path / "local", 1)
    path = tmp_path / "ck" / "job" / "chk-1" / "_metadata"
    raw = json.loads(path.read_bytes())
    mutate(raw)
    path.write_bytes(resign(raw))
    with pytest.raises(MetadataError, match=field):
        CompletedCheckpointStore(storage).load(1)


def test_restoring_a_checkpoint_without_the_backends_operator_is_an_error(tmp_path: Path):
    from sparkpoint.checkpoint.errors import OperatorStateMismatch

    storage = CheckpointStorage(f"file://{tmp_path}/ck", "job")
    write_checkpoints(storage, tmp_path / "local", 1)
    meta = CompletedCheckpointStore(storage).load(1)
    with RocksDBStateBackend(storage, "other", 0, parallelism=1, max_parallelism=16, local_dir=tmp_path / "l") as b:
        with pytest.raises(OperatorStateMismatch, match="other"):
            b.restore(meta)
        assert b.restore(meta, allow_missing=True).source == "empty"


# --- 8. malformed _metadata: a MetadataError naming the field, never a raw exception -----------


def _nested(depth: int) -> object:
    """A marker the test replaces by `depth` nested arrays (json.dumps itself cannot write them)."""
    return f"__NESTED_{depth}__"


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda raw: raw.update(source_offsets=_nested(300)), "source_offsets"),
        (lambda raw: raw.update(source_offsets=_nested(100_000)), "not valid UTF-8 JSON"),
        (lambda raw: raw["operators"]["counts"]["subtasks"][0]["private"][0].update(local_name="CUR\x00RENT"),
         "local_name"),
        (lambda raw: raw["operators"]["counts"]["subtasks"][0]["private"][0].update(local_name="x" * 300),
         "local_name"),
        (lambda raw: raw["operators"]["counts"]["subtasks"][0]["shared"][0].update(path="shared/counts/0/\ud800.sst"),
         "shared[0].path"),
        (lambda raw: raw.update(job_id="\udcff"), "job_id"),
    ],
)
def test_malformed_metadata_is_a_metadata_error_and_blocks_deletion(tmp_path: Path, mutate, field, capsys):
    url = f"file://{tmp_path}/ck"
    storage = CheckpointStorage(url, "job")
    write_checkpoints(storage, tmp_path / "local", 2)
    path = tmp_path / "ck" / "job" / "chk-1" / "_metadata"
    raw = json.loads(path.read_bytes())
    mutate(raw)
    data = resign(raw)
    if isinstance(raw["source_offsets"], str) and raw["source_offsets"].startswith("__NESTED_"):
        depth = int(raw["source_offsets"].split("_")[3])
        data = data.replace(f'"{raw["source_offsets"]}"'.encode(), b"[" * depth + b"1" + b"]" * depth)
    path.write_bytes(data)
    with pytest.raises(MetadataError, match=field.replace("[", r"\[").replace("]", r"\]")) as err:
        CompletedCheckpointStore(storage).load(1)
    assert "chk-1/_metadata" in str(err.value)
    listing = CompletedCheckpointStore(storage).load_all()
    assert listing.ids == [2] and list(listing.unreadable) == [1]
    coord = CheckpointCoordinator(storage)  # starts, and counts the bad one as blocking deletion
    assert coord.registry.deletion_blocked
    with pytest.raises(DeletionBlocked):
        sweep_orphans(storage, grace_seconds=0)
    assert main(["verify", "--checkpoints", url, "--job-id", "job"]) == 1
    assert "chk-1: BAD" in capsys.readouterr().out


# --- 9. a failed delete after the commit does not fail the checkpoint -------------------------


class FlakyDeletes(CheckpointStorage):
    failures = 0

    def delete(self, rels):  # type: ignore[no-untyped-def]
        rels = list(rels)
        if rels and type(self).failures:
            type(self).failures -= 1
            raise OSError("503 Slow Down")
        return super().delete(rels)


def test_subsumption_delete_failing_after_the_commit_leaves_the_checkpoint_complete(tmp_path: Path):
    storage = FlakyDeletes(f"file://{tmp_path}/ck", "job")
    coord = CheckpointCoordinator(storage, num_retained=1)
    sub = FakeSubtask(storage, tmp_path / "db")
    for name in ("a.sst", "b.sst", "c.sst"):
        sub.write(name)
    for names in (["a.sst"], ["b.sst"]):
        cid = coord.trigger(expected={"op": 1}).checkpoint_id
        coord.acknowledge(cid, sub.snapshot(cid, names))
        if cid == 2:
            FlakyDeletes.failures = 1
        done = coord.complete(cid)
        sub.confirm(cid)
    assert done.checkpoint_id == 2 and done.deletion_blocked and "503" in done.deletion_blocked
    assert storage.exists(metadata_path(2))
    cid = coord.trigger(expected={"op": 1}).checkpoint_id
    coord.acknowledge(cid, sub.snapshot(cid, ["c.sst"]))
    done = coord.complete(cid)
    assert done.deletion_blocked is None
    assert CompletedCheckpointStore(storage).checkpoint_ids() == [3]
    sweep = sweep_orphans(storage, grace_seconds=0)
    stored = {f.path for f in storage.walk("shared")} | {f.path for c in storage.checkpoint_dirs()
                                                         for f in storage.walk(f"chk-{c}")}
    assert stored == CompletedCheckpointStore(storage).load(3).paths() | {metadata_path(3)}
    assert sweep.deleted


# --- 10. created-by is the checkpoint that uploaded the file ----------------------------------


def test_registry_created_by_equals_a_recount_after_subsumption(local_storage: CheckpointStorage, tmp_path: Path):
    coord = CheckpointCoordinator(local_storage, num_retained=1)
    sub = FakeSubtask(local_storage, tmp_path / "db")
    sub.write("000007.sst")
    for _ in range(3):
        cid = coord.trigger(expected={"op": 1}).checkpoint_id
        coord.acknowledge(cid, sub.snapshot(cid, ["000007.sst"]))
        coord.complete(cid)
        sub.confirm(cid)
    path = sub.confirmed["000007.sst"].path
    live = coord.registry.entry(path)
    rebuilt = CompletedCheckpointStore(local_storage).rebuild_registry().entry(path)
    assert live is not None and rebuilt is not None
    assert (live.created_by, live.last_used, live.count) == (rebuilt.created_by, rebuilt.last_used, rebuilt.count)
    assert rebuilt.created_by == 1 and rebuilt.last_used == 3


# --- also: a restore that RocksDB refuses falls back like a corrupt file ------------------------


def test_rocksdb_refusing_a_verified_directory_falls_back_per_checkpoint(tmp_path: Path):
    storage = CheckpointStorage(f"file://{tmp_path}/ck", "job")
    write_checkpoints(storage, tmp_path / "local", 2)
    store = CompletedCheckpointStore(storage)
    newest = store.load(2)
    # a MANIFEST RocksDB cannot parse, recorded with its true size and CRC32 (it verifies)
    victim = next(f for h in newest.subtask_handles() for f in h.private if f.local_name.startswith("MANIFEST"))
    garbage = b"this is not a MANIFEST" * 10
    import zlib
    (tmp_path / "ck" / "job" / victim.path).write_bytes(garbage)
    raw = json.loads((tmp_path / "ck" / "job" / "chk-2" / "_metadata").read_bytes())
    for sub in raw["operators"]["counts"]["subtasks"]:
        for f in sub["private"]:
            if f["path"] == victim.path:
                f.update(size=len(garbage), crc32=zlib.crc32(garbage))
    (tmp_path / "ck" / "job" / "chk-2" / "_metadata").write_bytes(resign(raw))
    backends = [RocksDBStateBackend(storage, "counts", i, parallelism=2, max_parallelism=16,
                                    local_dir=tmp_path / "fresh") for i in range(2)]
    results = restore_with_fallback(backends, [store.load(2), store.load(1)])
    assert {r.checkpoint_id for r in results} == {1} and results[0].fell_back_from == (2,)
    for b in backends:
        b.close()


# --- 2. part-file names parse one way only --------------------------------------------------------


def _stage_and_commit(sink, checkpoint_id: int, rows: int = 3) -> None:
    import pandas as pd

    frame = pd.DataFrame({"user_id": [f"u{i}" for i in range(rows)], "count": list(range(rows))})
    staged = sink.stage(checkpoint_id, "user_totals", 0, frame)
    sink.commit(checkpoint_id, [staged])


def test_one_jobs_rollback_never_deletes_another_jobs_output(tmp_path: Path):
    from sparkpoint.spark.sink import ExactlyOnceParquetSink

    out = f"file://{tmp_path}/out[x]"  # and a glob character in the output directory
    etl = ExactlyOnceParquetSink.at(out, "etl")
    dated = ExactlyOnceParquetSink.at(out, "etl-20240101")
    _stage_and_commit(dated, 3)
    _stage_and_commit(etl, 1)
    _stage_and_commit(etl, 123_456_789)  # ids of nine digits and more parse too
    assert sorted(etl.committed()) == [1, 123_456_789]
    assert sorted(dated.committed()) == [3]
    assert etl.rollback(after=0) == [1, 123_456_789]
    assert sorted(dated.committed()) == [3], "job etl took none of job etl-20240101's files"
    assert etl.committed() == {}


def test_staging_of_an_output_directory_with_brackets_touches_no_sibling(tmp_path: Path):
    from sparkpoint.spark.sink import ExactlyOnceParquetSink

    sibling = tmp_path / "outx" / "_staging" / "etl" / "chk-1"
    sibling.mkdir(parents=True)
    (sibling / "keep.parquet").write_bytes(b"not ours")
    sink = ExactlyOnceParquetSink.at(f"file://{tmp_path}/out[x]", "etl")
    _stage_and_commit(sink, 1)
    sink.discard_staging(up_to=5)
    assert (sibling / "keep.parquet").read_bytes() == b"not ours"
    assert sorted(sink.committed()) == [1]


# --- also: the restore hint names only a checkpoint that verifies -----------------------------


def _totals_job(tmp_path: Path) -> tuple[str, CheckpointStorage]:
    from sparkpoint.state.sample import TOTALS

    url = f"file://{tmp_path}/ck"
    storage = CheckpointStorage(url, "job")
    coord = CheckpointCoordinator(storage, num_retained=3)
    backends = [RocksDBStateBackend(storage, "user_totals", i, parallelism=2, local_dir=tmp_path / "l")
                for i in range(2)]
    for b in backends:
        b.restore(None)
    for round_ in range(3):
        for b in backends:
            mine = [k for k in (f"u{i}" for i in range(round_ * 50, round_ * 50 + 50))
                    if key_group_for(k, 128) in b.key_group_range]
            b.value_state("totals", TOTALS).put_many((k, (1, 1.0, 1.0, 1.0, 0)) for k in mine)
        take_checkpoint(coord, backends, full=True)
    for b in backends:
        b.close()
    return url, storage


def _flip(storage: CheckpointStorage, checkpoint_id: int) -> None:
    meta = CompletedCheckpointStore(storage).load(checkpoint_id)
    victim = next(f for f in meta.files() if f.created_by == checkpoint_id and f.local_name.endswith(".sst"))
    data = bytearray(storage.read_bytes(victim.path))
    data[len(data) // 2] ^= 0xFF
    storage.fs.pipe_file(storage.abspath(victim.path), bytes(data))


def test_restore_failure_names_only_a_checkpoint_that_verifies(tmp_path: Path, capsys):
    url, storage = _totals_job(tmp_path)
    _flip(storage, 3)
    _flip(storage, 2)
    args = ["state", "--checkpoints", url, "--job-id", "job", "--operator", "user_totals", "--checkpoint", "3"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "checkpoint 1 verifies: restore it with --checkpoint 1" in err and "--checkpoint 2" not in err
    _flip(storage, 1)
    assert main(args) == 2
    assert "no retained checkpoint older than 3 verifies" in capsys.readouterr().err


class FlakyListing(CheckpointStorage):
    """The `fail_on`-th listing of the checkpoints fails (a 503 right after a commit)."""

    calls = 0
    fail_on = 0

    def completed_checkpoint_ids(self) -> list[int]:
        type(self).calls += 1
        if type(self).calls == type(self).fail_on:
            raise OSError("503 Slow Down")
        return super().completed_checkpoint_ids()


def test_a_listing_error_right_after_the_commit_leaves_the_checkpoint_complete(tmp_path: Path):
    storage = FlakyListing(f"file://{tmp_path}/ck", "job")
    coord = CheckpointCoordinator(storage, num_retained=1)
    sub = FakeSubtask(storage, tmp_path / "db")
    sub.write("a.sst")
    sub.write("b.sst")
    first = coord.trigger(expected={"op": 1}).checkpoint_id
    coord.acknowledge(first, sub.snapshot(first, ["a.sst"]))
    coord.complete(first)
    sub.confirm(first)
    cid = coord.trigger(expected={"op": 1}).checkpoint_id
    coord.acknowledge(cid, sub.snapshot(cid, ["b.sst"]))
    FlakyListing.calls, FlakyListing.fail_on = 0, 2  # the first listing is the check before the commit
    done = coord.complete(cid)
    assert FlakyListing.calls >= 2
    assert done.checkpoint_id == cid and done.deletion_blocked and "503" in done.deletion_blocked
    assert done.subsumed == (), "in doubt about other writers: nothing is subsumed"
    assert CompletedCheckpointStore(storage).checkpoint_ids() == [cid, first]
    assert verify_checkpoint(storage, CompletedCheckpointStore(storage).load(cid)) == []


def test_discarding_staged_files_refuses_names_that_leave_the_staging_directory(tmp_path: Path):
    from sparkpoint.spark.sink import ExactlyOnceParquetSink, SinkError

    precious = tmp_path / "precious.parquet"
    precious.write_bytes(b"keep")
    sink = ExactlyOnceParquetSink.at(f"file://{tmp_path}/out", "etl")
    hostile = ["chk-3/user_totals-00000-0123456789ab.parquet", "../../../precious.parquet"]
    with pytest.raises(SinkError, match="precious"):
        sink.discard_staged(3, hostile)  # e.g. from a tampered _pending/*.json
    assert precious.read_bytes() == b"keep"


def test_a_pending_attempt_whose_id_is_a_path_is_refused():
    from sparkpoint.pipeline.attempt import AttemptError, PendingAttempt

    raw = {"format": "sparkpoint-pending-attempt", "version": 1, "job_id": "job", "checkpoint_id": 3,
           "attempt_id": "x/../../chk-2/_metadata", "expected": {}, "handles": [], "staged": [],
           "source_offsets": {"version": 1, "consumed": []}, "files": [], "subtasks": [], "rows": 0,
           "started_at": 0.0}
    with pytest.raises(AttemptError, match="attempt id"):
        PendingAttempt.from_json(raw)
