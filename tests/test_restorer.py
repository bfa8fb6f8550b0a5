"""The restorer's decisions, against a fake local state (no RocksDB): which source a subtask's
state comes from (the working database, a verified task-local copy, stable storage), the fallback
from a damaged task-local copy, which old subtasks a rescale merges and which grows into the
database, and which base the next incremental snapshot may build on. Files are real and verified
for real; only the RocksDB steps (`RestoreTarget.install`, `install_rescaled`, ...) are recorded.
The same paths on real RocksDB: tests/test_backend.py, test_local_trust.py, test_corruption.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sparkpoint.checkpoint.errors import CheckpointCorrupted, OperatorStateMismatch, StateBackendError
from sparkpoint.checkpoint.metadata import (
    CheckpointMetadata,
    CheckpointStats,
    KeyGroupRange,
    OperatorState,
    SubtaskStateHandle,
)
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.state.engine.restoring import Restorer
from sparkpoint.state.keygroups import key_group_range

MAX_P = 8


class FakeLocal:
    """A `RestoreTarget` that records the RocksDB steps it is asked for and keeps its marker in memory."""

    def __init__(self, directory: Path, *, subtask: int = 0, parallelism: int = 1):
        self.dir = directory
        self.operator = "counts"
        self.subtask = subtask
        self.key_group_range = key_group_range(MAX_P, parallelism, subtask)
        self.max_parallelism = MAX_P
        self.marker: tuple[int, str] | None = None
        self.steps: list[tuple[str, object]] = []
        self.working_opens = True  # whether the working database opens
        self.refuse_installs_from: set[str] = set()  # kinds of source directory RocksDB refuses ("chk", "download")
        self.kept_copies: set[int] | None = None

    def copy_dir(self, checkpoint_id: int | None) -> Path:
        return self.dir / f"chk-{checkpoint_id}"

    def holds(self, checkpoint_id: int, handle: SubtaskStateHandle, job_url: str) -> bool:
        return self.marker == (checkpoint_id, job_url)

    def write_marker(self, checkpoint_id: int, handle: SubtaskStateHandle, job_url: str) -> None:
        self.marker = (checkpoint_id, job_url)

    def forget_working(self) -> None:
        self.marker = None

    def drop_leftovers(self) -> None:
        pass

    def drop_local_checkpoints(self, *, keep: set[int]) -> None:
        self.kept_copies = keep

    def open_working(self) -> None:
        if not self.working_opens:
            raise StateBackendError("the working database does not open")
        self.steps.append(("open_working", None))

    def create_empty(self) -> None:
        self.steps.append(("create_empty", None))

    def install(self, source: Path, handle: SubtaskStateHandle, checkpoint_id: int) -> None:
        kind = source.name.split("-")[0]
        if kind in self.refuse_installs_from:
            raise CheckpointCorrupted(f"RocksDB refuses {source}")
        self.steps.append(("install", (kind, sorted(p.name for p in source.iterdir()))))

    def install_rescaled(self, sources: list[Path], handles: list[SubtaskStateHandle], checkpoint_id: int) -> None:
        self.steps.append(("install_rescaled", [(h.subtask, sorted(p.name for p in s.iterdir()))
                                                for s, h in zip(sources, handles)]))


def upload_checkpoint(storage: CheckpointStorage, tmp: Path, checkpoint_id: int,
                      parallelism: int) -> CheckpointMetadata:
    """A checkpoint of operator `counts` whose every subtask has real, uploaded files (not RocksDB's)."""
    handles = []
    for subtask in range(parallelism):
        files = tmp / f"files-{checkpoint_id}-{subtask}"
        files.mkdir(parents=True)
        for name, text in (("CURRENT", "MANIFEST-000001\n"), ("MANIFEST-000001", f"manifest {subtask}"),
                           ("000007.sst", f"entries of subtask {subtask}" * 10)):
            (files / name).write_text(text)
        shared = storage.upload([(str(files / "000007.sst"), f"shared/counts/{subtask}/000007.sst")], checkpoint_id)
        private = storage.upload([(str(files / n), f"chk-{checkpoint_id}/counts/{subtask}/{n}")
                                  for n in ("CURRENT", "MANIFEST-000001")], checkpoint_id)
        kg_range = key_group_range(MAX_P, parallelism, subtask)
        handles.append(SubtaskStateHandle("counts", subtask, checkpoint_id, kg_range, MAX_P, tuple(shared),
                                          tuple(private)))
    return CheckpointMetadata("job", checkpoint_id, "checkpoint", "2025-01-01T00:00:00Z", None, CheckpointStats(0, 0),
                              {"counts": OperatorState(MAX_P, tuple(handles))})


def task_local_copy(local: FakeLocal, storage: CheckpointStorage, meta: CheckpointMetadata) -> Path:
    """What a process that snapshotted `meta` leaves behind: chk-N/ holding the subtask's files."""
    copy = local.copy_dir(meta.checkpoint_id)
    copy.mkdir(parents=True)
    for f in meta.operators["counts"].subtasks[local.subtask].files():
        (copy / f.local_name).write_bytes(storage.read_bytes(f.path))
    return copy


@pytest.fixture
def setup(tmp_path: Path, local_storage: CheckpointStorage) -> tuple[CheckpointStorage, CheckpointMetadata, FakeLocal]:
    meta = upload_checkpoint(local_storage, tmp_path / "upload", 3, parallelism=1)
    return local_storage, meta, FakeLocal(tmp_path / "local")


FILES = ["000007.sst", "CURRENT", "MANIFEST-000001"]


def test_a_working_database_that_is_the_checkpoint_is_reopened_as_it_is(setup):
    storage, meta, local = setup
    local.marker = (3, storage.job_url)
    result, base = Restorer(local, storage).restore(meta)
    assert (result.source, result.checkpoint_id, result.downloaded_bytes) == ("working", 3, 0)
    assert local.steps == [("open_working", None)]
    assert base == meta.operators["counts"].subtasks[0]  # CLAIM: the next snapshot builds on it
    assert local.kept_copies == {3}


def test_a_working_database_that_does_not_open_gives_way_to_the_task_local_copy(setup):
    storage, meta, local = setup
    local.marker, local.working_opens = (3, storage.job_url), False
    task_local_copy(local, storage, meta)
    result, _ = Restorer(local, storage).restore(meta)
    assert result.source == "local"
    assert local.steps == [("install", ("chk", FILES))]


def test_a_verified_task_local_copy_is_installed_without_a_download(setup):
    storage, meta, local = setup
    task_local_copy(local, storage, meta)
    result, base = Restorer(local, storage).restore(meta)
    assert (result.source, result.downloaded_bytes, result.problems) == ("local", 0, ())
    assert local.steps == [("install", ("chk", FILES))]
    assert local.marker == (3, storage.job_url) and base is not None
    assert json.loads((local.copy_dir(3) / "fingerprints.json").read_text()).keys() == {"000007.sst"}


def test_a_damaged_task_local_copy_falls_back_to_stable_storage_and_is_replaced(setup):
    storage, meta, local = setup
    copy = task_local_copy(local, storage, meta)
    (copy / "000007.sst").write_bytes(b"torn")
    result, _ = Restorer(local, storage).restore(meta)
    assert result.source == "primary" and result.downloaded_bytes > 0
    assert "000007.sst" in result.problems[0]
    assert local.steps == [("install", ("download", FILES))]
    sst = meta.operators["counts"].subtasks[0].shared[0]
    assert (copy / "000007.sst").read_bytes() == storage.read_bytes(sst.path)  # the copy is the verified download


def test_a_task_local_copy_rocksdb_refuses_falls_back_to_stable_storage(setup):
    storage, meta, local = setup
    task_local_copy(local, storage, meta)
    local.refuse_installs_from = {"chk"}
    result, _ = Restorer(local, storage).restore(meta)
    assert result.source == "primary" and "RocksDB refuses" in result.problems[0]
    assert local.steps == [("install", ("download", FILES))]


def test_without_local_recovery_the_task_local_copy_is_neither_read_nor_kept(setup):
    storage, meta, local = setup
    task_local_copy(local, storage, meta)  # verifies, and is not read
    result, _ = Restorer(local, storage, local_recovery=False).restore(meta)
    assert result.source == "primary" and local.steps == [("install", ("download", FILES))]
    assert local.kept_copies == set()


def test_a_file_missing_from_stable_storage_is_corruption_naming_it(setup):
    storage, meta, local = setup
    sst = meta.operators["counts"].subtasks[0].shared[0]
    storage.delete([sst.path])
    with pytest.raises(CheckpointCorrupted, match="000007.sst") as e:
        Restorer(local, storage).restore(meta)
    assert e.value.path == sst.path and local.steps == []


@pytest.mark.parametrize("claim_mode, foreign, builds_on", [
    ("CLAIM", False, True), ("NO_CLAIM", False, False), ("CLAIM", True, False),
])
def test_the_next_snapshot_builds_on_the_restored_one_only_when_claimed_in_the_same_job(
        setup, tmp_path, claim_mode, foreign, builds_on):
    storage, meta, local = setup
    mine = CheckpointStorage(f"file://{tmp_path}/checkpoints", "other-job") if foreign else storage
    _, base = Restorer(local, mine).restore(meta, claim_mode=claim_mode, source=storage)
    assert (base is not None) is builds_on


def test_an_operator_the_checkpoint_lacks_starts_empty_only_when_allowed(setup):
    storage, meta, local = setup
    local.operator = "new_operator"
    with pytest.raises(OperatorStateMismatch, match="holds no state of operator 'new_operator'"):
        Restorer(local, storage).restore(meta)
    result, base = Restorer(local, storage).restore(meta, allow_missing=True)
    assert (result.source, base, local.steps) == ("empty", None, [("create_empty", None)])


def test_another_max_parallelism_is_refused_before_any_file_is_read(setup):
    storage, meta, local = setup
    local.max_parallelism = 16
    with pytest.raises(OperatorStateMismatch, match="--max-parallelism 8"):
        Restorer(local, storage).restore(meta)
    assert local.steps == []


def test_scaling_in_merges_every_old_subtask_whose_range_overlaps_largest_overlap_first(tmp_path, local_storage):
    meta = upload_checkpoint(local_storage, tmp_path / "upload", 4, parallelism=4)  # 2 key groups each
    local = FakeLocal(tmp_path / "local", subtask=1, parallelism=3)  # key groups 3..5
    assert local.key_group_range == KeyGroupRange(3, 5)
    result, base = Restorer(local, local_storage).restore(meta)
    assert (result.source, result.files, base) == ("rescale", 6, None)  # a fresh incremental history
    [(step, sources)] = local.steps
    assert step == "install_rescaled"
    assert [subtask for subtask, _ in sources] == [2, 1]  # 4..5 overlaps by two, 2..3 by one: 4..5 grows into db/
    assert all(files == FILES for _, files in sources)
    assert local.kept_copies == set()  # a rescaled database is no checkpoint's task-local copy
    assert not list(local.dir.glob("rescale-*"))  # the downloads are gone


def test_the_same_ranges_restore_one_subtask_and_not_a_rescale(tmp_path, local_storage):
    meta = upload_checkpoint(local_storage, tmp_path / "upload", 4, parallelism=2)
    local = FakeLocal(tmp_path / "local", subtask=1, parallelism=2)
    result, base = Restorer(local, local_storage).restore(meta)
    assert result.source == "primary" and base == meta.operators["counts"].subtasks[1]
