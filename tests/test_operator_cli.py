"""The operator's commands without Spark: list, inspect, registry, restore, savepoint, the pandas
API, and their errors on bad input. Checkpoints are written through the core (real RocksDB,
changelog on, so checkpoints hold changelog chains); each `--json` is checked against the
`_metadata` files on storage."""

from __future__ import annotations

import json
import random
import shutil
import uuid
from pathlib import Path

import fsspec
import pandas as pd
import pytest
from rocksdict import AccessType, Options, Rdict

import sparkpoint
import sparkpoint.checkpoint
from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.cli import main
from sparkpoint.state.backend import take_checkpoint
from sparkpoint.state.engine.changelog import ChangelogOptions, is_changelog
from sparkpoint.state.keygroups import key_group_for
from sparkpoint.state.sample import TOTALS
from tests.conftest import s3_options
from tests.support.backends import make_backends, owned

JOB = "job"


class Job:
    """A job of `user_totals` at parallelism 2 whose checkpoints are taken through the core."""

    def __init__(self, root: Path, retain: int = 2, url: str | None = None, options: dict[str, object] | None = None):
        self.root = root
        self.url = url or f"file://{root}/ckpt"
        self.options = options or {}
        self.storage = CheckpointStorage(self.url, JOB, self.options)
        self.coordinator = CheckpointCoordinator(self.storage, num_retained=retain)
        self.rng = random.Random(7)
        self.backends = make_backends(self.storage, root / "local", operator="user_totals",
                                      changelog=ChangelogOptions(enabled=True))
        for b in self.backends:
            b.restore(None)

    def checkpoint(self, n: int = 1) -> None:
        for _ in range(n):
            keys = {f"u{self.rng.randrange(400):04d}" for _ in range(150)}
            value = (self.rng.randrange(1, 9), 2.0, 1.0, 3.0, 1_000_000)
            for b in self.backends:
                mine = owned(b, sorted(keys))
                b.value_state("totals", TOTALS).put_many((k, value) for k in mine)
            take_checkpoint(self.coordinator, self.backends)

    def close(self) -> None:
        for b in self.backends:
            b.close()

    def store(self) -> CompletedCheckpointStore:
        return CompletedCheckpointStore(self.storage)


def closed_job(root: Path, checkpoints: int) -> Job:
    """A job with this many checkpoints taken (two retained), its backends closed: read it, do not extend it."""
    j = Job(root)
    j.checkpoint(checkpoints)
    j.close()
    return j


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Job:
    return closed_job(tmp_path_factory.mktemp("operator"), 3)


@pytest.fixture
def fresh_job(tmp_path: Path) -> Job:
    j = Job(tmp_path, retain=2)
    j.checkpoint(2)
    return j


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def cli_json(capsys: pytest.CaptureFixture[str], *args: str) -> object:
    code, out, err = cli(capsys, *args, "--json")
    assert code == 0, err
    return json.loads(out)


def job_args(j: Job, job_id: str = JOB) -> list[str]:
    return ["--checkpoints", j.url, "--job-id", job_id]


def files_of(info: object) -> list[dict[str, object]]:
    """Every file of an `inspect --json`, shared and private."""
    assert isinstance(info, dict)
    return [f for op in info["operators"].values() for s in op["subtasks"] for g in ("shared", "private")
            for f in s[g]]


def tree(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


# --- list, inspect, registry -------------------------------------------------------------------


def test_list_json_is_every_retained_checkpoint_as_on_storage(job: Job, capsys: pytest.CaptureFixture[str]):
    listed = cli_json(capsys, "list", *job_args(job))
    assert isinstance(listed, dict)
    metas = job.store().load_all().checkpoints
    assert [r["checkpoint_id"] for r in listed["checkpoints"]] == [m.checkpoint_id for m in metas] == [3, 2]
    for row, meta in zip(listed["checkpoints"], metas):
        assert row["kind"] == meta.kind == "checkpoint"
        assert row["created_at"] == meta.created_at
        assert row["state_size"] == sum(f.size for f in meta.files()) == meta.stats.state_size
        assert row["checkpointed_size"] == sum(f.size for f in meta.files() if f.created_by == meta.checkpoint_id)
        assert row["files"] == len(meta.paths())
        assert row["restored_from"] is None and row["operators"] == {"user_totals": 2}
    assert listed["unreadable"] == {}
    code, out, _ = cli(capsys, "list", *job_args(job))
    assert code == 0 and "chk-3" in out and "chk-2" in out and "checkpointed size" in out


@pytest.mark.parametrize("suffix", ["/chk-3", "/chk-3/", "/chk-3/_metadata"])
def test_inspect_json_shows_subtasks_key_groups_and_the_creator_of_every_file(
    job: Job, suffix: str, capsys: pytest.CaptureFixture[str]
):
    info = cli_json(capsys, "inspect", f"{job.url}/{JOB}{suffix}")
    assert isinstance(info, dict)
    meta = job.store().load(3)
    assert info["checkpoint_id"] == 3 and info["path"] == f"{job.storage.job_url}/chk-3/_metadata"
    subtasks = info["operators"]["user_totals"]["subtasks"]
    assert [s["key_group_range"] for s in subtasks] == [{"start": 0, "end": 63}, {"start": 64, "end": 127}]
    raw = json.loads(job.storage.read_bytes("chk-3/_metadata"))["operators"]["user_totals"]["subtasks"]
    for shown, stored in zip(subtasks, raw):
        for group in ("shared", "private"):
            assert [{k: v for k, v in f.items() if k != "kind"} for f in shown[group]] == stored[group]
    for f in files_of(info):
        assert job.storage.info(f["path"]).size == f["size"]
    assert {(f["path"], f["size"], f["created_by"]) for f in files_of(info)} == {
        (f.path, f.size, f.created_by) for f in meta.files()}
    creators = {f["created_by"] for f in files_of(info) if f["kind"] == "changelog"}
    assert creators == {2, 3}, "the chain's files were created by the checkpoints that wrote them"
    assert all(f["created_by"] == 1 for f in files_of(info) if f["kind"] == "rocksdb")


def test_inspect_reads_a_metadata_file_outside_any_job_layout(job: Job, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]):
    copy = tmp_path / "copied-metadata"
    copy.write_bytes(job.storage.read_bytes("chk-2/_metadata"))
    info = cli_json(capsys, "inspect", str(copy))
    assert isinstance(info, dict) and info["checkpoint_id"] == 2 and info["path"].endswith("copied-metadata")
    code, out, _ = cli(capsys, "inspect", str(copy))
    assert code == 0 and "0..63" in out and "64..127" in out and "changelog-000000000002" in out


def test_registry_json_counts_references_as_the_retained_metadata_say(job: Job, capsys: pytest.CaptureFixture[str]):
    reg = cli_json(capsys, "registry", *job_args(job))
    assert isinstance(reg, dict)
    metas = job.store().load_all().checkpoints
    expected: dict[str, list[int]] = {}
    for m in metas:
        for path in m.paths() | {m.metadata_path}:
            expected.setdefault(path, []).append(m.checkpoint_id)
    rows = {r["path"]: r for r in reg["files"]}
    assert set(rows) == set(expected)
    created = {f.path: f.created_by for m in metas for f in m.files()}
    for path, users in expected.items():
        r = rows[path]
        assert r["count"] == len(users) and r["last_used"] == max(users) and r["owned"] is True
        assert r["created_by"] == created.get(path, min(users))
        assert r["size"] == job.storage.info(path).size
    shared_by_both = [p for p, users in expected.items() if len(users) == 2]
    assert shared_by_both and all(p.startswith("shared/") for p in shared_by_both)
    totals = reg["totals"]
    assert totals["checkpoints"] == [3, 2] and totals["files"] == len(expected)
    assert totals["references"] == sum(len(u) for u in expected.values())
    assert totals["bytes"] == sum(r["size"] for r in reg["files"]) and totals["deletion_blocked"] == []


def test_pandas_api_shows_the_same_data_as_the_cli(job: Job, capsys: pytest.CaptureFixture[str], tmp_path: Path):
    listed = cli_json(capsys, "list", *job_args(job))
    frame = sparkpoint.list_checkpoints(job.url, JOB)
    assert isinstance(listed, dict) and frame.to_dict("records") == listed["checkpoints"]

    reg = cli_json(capsys, "registry", *job_args(job))
    table = sparkpoint.registry(job.url, JOB, storage_options={})
    assert isinstance(reg, dict) and table.to_dict("records") == reg["files"]
    assert table.attrs["totals"] == reg["totals"]

    out = tmp_path / "state.parquet"
    code, _, err = cli(capsys, "state", *job_args(job), "--operator", "user_totals", "--checkpoint", "2",
                       "--format", "parquet", "--out", str(out))
    assert code == 0, err
    state = sparkpoint.read_state(job.url, JOB, "user_totals", checkpoint=2)
    pd.testing.assert_frame_equal(state, pd.read_parquet(out))
    latest = sparkpoint.read_state(job.url, JOB, "user_totals")
    assert len(latest) >= len(state) > 0


# --- restore -----------------------------------------------------------------------------------


def test_restore_writes_a_verified_directory_rocksdict_opens(job: Job, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]):
    target = tmp_path / "debug" / "sub1"
    info = cli_json(capsys, "restore", *job_args(job), "--operator", "user_totals", "--subtask", "1",
                    "--to", str(target), "--checkpoint", "2")
    assert isinstance(info, dict) and info["checkpoint_id"] == 2
    assert info["key_group_range"] == {"start": 64, "end": 127}
    expected = sparkpoint.read_state(job.url, JOB, "user_totals", checkpoint=2)
    mine = sorted(k for k in expected["user_id"] if key_group_for(k, 128) >= 64)
    db = Rdict(str(target), options=Options(raw_mode=True), access_type=AccessType.read_only(),
               column_families={"totals": Options(raw_mode=True)})
    try:
        keys = sorted(k[2:].decode() for k in db.get_column_family("totals").keys())  # noqa: SIM118
    finally:
        db.close()
    assert keys == mine and info["states"] == {"totals": len(mine)}
    assert [p.name for p in (tmp_path / "debug").iterdir()] == ["sub1"], "no scratch directory is left"


# --- savepoints --------------------------------------------------------------------------------


def test_savepoint_in_the_job_directory_is_self_contained_and_survives_retention(
    fresh_job: Job, capsys: pytest.CaptureFixture[str]
):
    j = fresh_job
    before = sparkpoint.read_state(j.url, JOB, "user_totals")
    sp = cli_json(capsys, "savepoint", *job_args(j))
    assert isinstance(sp, dict) and (sp["checkpoint_id"], sp["kind"], sp["from_checkpoint"]) == (3, "savepoint", 2)
    meta = j.store().load(3)
    assert meta.is_savepoint and all(p.startswith("chk-3/") for p in meta.paths())
    assert any(is_changelog(f.local_name) for f in meta.files()), "the changelog chain is copied with the rest"
    for b in j.backends:  # the job restarts from the latest, the savepoint; retention keeps two checkpoints
        b.restore(j.store().load(3))
    j.checkpoint(3)
    j.close()
    listed = sparkpoint.list_checkpoints(j.url, JOB)
    assert list(zip(listed["checkpoint_id"], listed["kind"])) == [(6, "checkpoint"), (5, "checkpoint"),
                                                                  (3, "savepoint")]
    assert main(["verify", *job_args(j)]) == 0
    pd.testing.assert_frame_equal(sparkpoint.read_state(j.url, JOB, "user_totals", checkpoint=3), before)


def test_savepoint_elsewhere_survives_the_deletion_of_the_job(fresh_job: Job, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]):
    j = fresh_job
    j.close()
    before = sparkpoint.read_state(j.url, JOB, "user_totals", checkpoint=1)
    target = f"file://{tmp_path}/savepoints/sp-1"
    sp = cli_json(capsys, "savepoint", *job_args(j), "--from-checkpoint", "1", "--to", target)
    assert isinstance(sp, dict) and sp["savepoint"] == f"{target}/chk-1"
    shutil.rmtree(tmp_path / "ckpt")
    code, out, err = cli(capsys, "verify", "--checkpoints", f"file://{tmp_path}/savepoints", "--job-id", "sp-1")
    assert code == 0, out + err
    after = sparkpoint.read_state(f"file://{tmp_path}/savepoints", "sp-1", "user_totals")
    pd.testing.assert_frame_equal(after, before)
    info = cli_json(capsys, "inspect", sp["savepoint"])
    assert isinstance(info, dict) and info["kind"] == "savepoint"
    assert files_of(info) and all(f["path"].startswith("chk-1/") for f in files_of(info))


# --- errors on bad input: a specific message, exit 2, nothing written ------------------------------


def _corrupt_metadata(j: Job) -> None:
    j.storage.fs.pipe_file(j.storage.abspath("chk-2/_metadata"), b'{"format": "sparkpoint-checkpoint", "vers')


@pytest.mark.parametrize(
    "args, message",
    [
        (["list", "--checkpoints", "{url}", "--job-id", "nojob"], "no job directory"),
        (["registry", "--checkpoints", "{url}", "--job-id", "nojob"], "no job directory"),
        (["savepoint", "--checkpoints", "{url}", "--job-id", "nojob"], "no job directory"),
        (["restore", "--checkpoints", "{url}", "--job-id", "nojob", "--operator", "user_totals", "--subtask", "0",
          "--to", "{tmp}/out"], "no job directory"),
        (["inspect", "{url}/nojob/chk-1"], "no job directory"),
        (["inspect", "{url}/job/chk-9"], "checkpoint 9 does not exist"),
        (["list", "--checkpoints", "fiel://{tmp}/ckpt", "--job-id", "job"], "Protocol not known: fiel"),
        (["inspect", "fiel://{tmp}/ckpt/job/chk-1"], "Protocol not known: fiel"),
        (["savepoint", "--checkpoints", "{url}", "--job-id", "job", "--to", "fiel://{tmp}/sp"],
         "Protocol not known: fiel"),
        (["restore", "--checkpoints", "{url}", "--job-id", "job", "--operator", "nope", "--subtask", "0",
          "--to", "{tmp}/out"], "has no operator 'nope'; it has: user_totals"),
        (["state", "--checkpoints", "{url}", "--job-id", "job", "--operator", "nope"], "unknown operator 'nope'"),
        (["restore", "--checkpoints", "{url}", "--job-id", "job", "--operator", "user_totals", "--subtask", "2",
          "--to", "{tmp}/out"], "has subtasks 0..1 of user_totals, not 2"),
        (["restore", "--checkpoints", "{url}", "--job-id", "job", "--operator", "user_totals", "--subtask", "0",
          "--to", "{tmp}/local"], "exists already"),
        (["savepoint", "--checkpoints", "{url}", "--job-id", "job", "--to", "{url}/job"], "exists already"),
        (["savepoint", "--checkpoints", "{url}", "--job-id", "job", "--from-checkpoint", "1"],
         "cannot go into the job directory"),
    ],
)
def test_bad_input_gets_a_specific_error_and_writes_nothing(
    fresh_job: Job, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
):
    j = fresh_job
    j.close()
    before = tree(j.root)
    filled = [a.format(url=j.url, tmp=j.root) for a in args]
    code, out, err = cli(capsys, *filled)
    assert code == 2 and message in err, err
    assert f"sparkpoint {filled[0]}: error:" in err
    assert tree(j.root) == before


def test_malformed_metadata_is_named_by_inspect_list_and_registry(fresh_job: Job, capsys: pytest.CaptureFixture[str]):
    j = fresh_job
    j.close()
    _corrupt_metadata(j)
    before = tree(j.root)
    code, _, err = cli(capsys, "inspect", f"{j.url}/{JOB}/chk-2")
    assert code == 2 and "chk-2/_metadata is not valid UTF-8 JSON" in err
    listed = cli_json(capsys, "list", *job_args(j))
    assert isinstance(listed, dict) and "2" in listed["unreadable"]
    assert [r["checkpoint_id"] for r in listed["checkpoints"]] == [1]
    reg = cli_json(capsys, "registry", *job_args(j))
    assert isinstance(reg, dict) and reg["totals"]["deletion_blocked"]
    with pytest.raises(sparkpoint.checkpoint.MetadataError, match="chk-2/_metadata"):
        sparkpoint.list_checkpoints(j.url, JOB)
    assert tree(j.root) == before


def test_savepoint_of_a_damaged_checkpoint_fails_and_leaves_nothing(fresh_job: Job, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]):
    j = fresh_job
    j.close()
    victim = next(f for f in j.store().load(2).files() if f.local_name.endswith(".sst"))
    data = bytearray(j.storage.read_bytes(victim.path))
    data[len(data) // 2] ^= 0x01
    j.storage.fs.pipe_file(j.storage.abspath(victim.path), bytes(data))
    before = tree(j.root)
    code, _, err = cli(capsys, "savepoint", *job_args(j), "--to", f"file://{tmp_path}/sp")
    assert code == 2 and victim.path in err and "CRC32" in err
    assert not (tmp_path / "sp").exists()
    code, _, err = cli(capsys, "savepoint", *job_args(j))
    assert code == 2 and victim.path in err
    assert tree(j.root) == before and j.store().checkpoint_ids() == [2, 1]


@pytest.mark.s3
def test_object_store_through_storage_options(s3_endpoint: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    options = s3_options(s3_endpoint)
    bucket = "b" + uuid.uuid4().hex[:12]
    fsspec.filesystem("s3", **options).mkdir(bucket)
    j = Job(tmp_path, url=f"s3://{bucket}/checkpoints", options=options)
    j.checkpoint(2)
    j.close()
    flag = ["--storage-options", json.dumps(options)]
    listed = cli_json(capsys, "list", *job_args(j), *flag)
    frame = sparkpoint.list_checkpoints(j.url, JOB, storage_options=options)
    assert isinstance(listed, dict) and frame.to_dict("records") == listed["checkpoints"] and len(frame) == 2
    assert sparkpoint.registry(j.url, JOB, storage_options=options)["count"].max() == 2
    sp = cli_json(capsys, "savepoint", *job_args(j), *flag, "--to", f"s3://{bucket}/savepoints/sp-1")
    assert isinstance(sp, dict) and sp["savepoint"] == f"s3://{bucket}/savepoints/sp-1/chk-2"
    info = cli_json(capsys, "inspect", sp["savepoint"], *flag)
    assert isinstance(info, dict) and info["kind"] == "savepoint"
    pd.testing.assert_frame_equal(
        sparkpoint.read_state(f"s3://{bucket}/savepoints", "sp-1", "user_totals", storage_options=options),
        sparkpoint.read_state(j.url, JOB, "user_totals", storage_options=options),
    )


@pytest.mark.parametrize("command", ["list", "inspect", "registry", "restore", "savepoint"])
def test_every_operator_command_has_help(command: str, capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert f"usage: sparkpoint {command}" in out and "--verbose" in out


def test_savepoint_in_the_job_directory_takes_the_id_after_the_latest_even_beside_a_pending_attempt(
    fresh_job: Job, capsys: pytest.CaptureFixture[str]
):
    """The attempt races the savepoint for chk-3 by exclusive create: an id above it would let the
    savepoint (a copy of chk-2) become the latest over the attempt's chk-3 and roll the job back."""
    j = fresh_job
    j.close()
    j.storage.write_bytes("_pending/chk-3-0123456789ab.json", b"{}")  # a Dagster step's attempt at chk-3
    sp = cli_json(capsys, "savepoint", *job_args(j))
    assert isinstance(sp, dict) and sp["checkpoint_id"] == 3 and j.store().checkpoint_ids() == [3, 2, 1]
