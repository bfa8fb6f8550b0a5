"""Erasing a key reads and rewrites its key group's files, not its subtask's, at a parallelism
below the key-group count (item 4 of `sparkpoint erase`), without Spark: a user's operator
(`memberships`: a profile blob, the clubs a member joined, and a renewal timer) at 2 subtasks of
128 key groups; chk-1 compacted, chk-2 with a level-0 flush of a 5% round on top. What the erase
downloads is counted at the storage; the key is gone, the rest identical, `sparkpoint verify`
passes; a placeholder reaching RocksDB makes the erase read the subtask whole, and one reaching
an upload is refused."""

from __future__ import annotations

import random
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest

from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.pipeline.erase import EraseScope, erase_job
from sparkpoint.pipeline.maintenance import verify_all
from sparkpoint.state import erasure
from sparkpoint.state.backend import RocksDBStateBackend, take_checkpoint
from sparkpoint.state.codecs import BytesCodec, JsonCodec
from sparkpoint.state.engine.changelog import ChangelogOptions
from sparkpoint.state.engine.partial import PlaceholderReached
from sparkpoint.state.engine.rocksdb import RocksDBOptions
from sparkpoint.state.keygroups import key_group_for

OPERATOR = "memberships"
MAX_P, P = 128, 2
MEMBERS = [f"member-{i:05d}" for i in range(5000)]
GONE = "member-00042"
RENEWAL = pd.Timestamp("2031-06-01", tz="UTC")
# Files cut at a key group's bytes of this small state (the default floor, 1 MB, is for larger ones)
OPTIONS = RocksDBOptions(min_file_mb=1 / 64)


def _backends(storage: CheckpointStorage, local: Path, changelog: bool = False) -> list[RocksDBStateBackend]:
    return [RocksDBStateBackend(storage, OPERATOR, i, parallelism=P, max_parallelism=MAX_P, local_dir=local,
                                options=OPTIONS, changelog=ChangelogOptions(enabled=changelog)) for i in range(P)]


def _write(b: RocksDBStateBackend, members: list[str], rng: random.Random, round_: int) -> None:
    b.value_state("profile", BytesCodec()).put_many((m, rng.randbytes(400)) for m in members)
    b.map_state("clubs", JsonCodec()).put_many((m, f"club-{j}", round_) for m in members for j in range(3))
    b.timers.register_many([(m, RENEWAL + pd.Timedelta(days=round_)) for m in members])


@pytest.fixture(scope="module", params=["native", "changelog"])
def built(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    """chk-1 a compacted materialization; chk-2 the 5% round on top: a level-0 flush, or (the
    pipelines' default) a changelog file whose chain the erase replays."""
    root = tmp_path_factory.mktemp("erase-groups")
    storage = CheckpointStorage(f"file://{root}/cp", "clubs-job")
    coordinator = CheckpointCoordinator(storage, num_retained=3)
    backends = _backends(storage, root / "local", changelog=request.param == "changelog")
    rng = random.Random(5)
    for b in backends:
        b.restore(None)
    for round_, share in ((1, 1.0), (2, 0.05)):
        for b in backends:
            mine = [m for m in MEMBERS if key_group_for(m, MAX_P) in b.key_group_range
                    and (rng.random() < share or m == GONE)]
            _write(b, mine, rng, round_)
            if round_ == 1:  # a long-running job's state: compacted into files of about a key group
                b.close()
                b.compact()
        take_checkpoint(coordinator, backends)
    for b in backends:
        b.dispose()
    chain = [f.local_name for h in CompletedCheckpointStore(storage).load(2).operators[OPERATOR].subtasks
             for f in h.files() if f.local_name.startswith("changelog-")]
    assert bool(chain) is (request.param == "changelog")
    return root / "cp"


@pytest.fixture
def storage(built: Path, tmp_path: Path) -> CheckpointStorage:
    subprocess.run(["cp", "-a", str(built), str(tmp_path / "cp")], check=True)
    return CheckpointStorage(f"file://{tmp_path}/cp", "clubs-job")


@pytest.fixture
def downloads(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """Bytes of SST files downloaded from the job directory, by path."""
    seen: dict[str, int] = {}
    real = CheckpointStorage.download

    def counting(self: CheckpointStorage, pairs):  # type: ignore[no-untyped-def]
        out = real(self, pairs)
        for (rel, _), (size, _) in zip(pairs, out):
            if rel.endswith(".sst"):
                seen[rel] = seen.get(rel, 0) + size
        return out

    monkeypatch.setattr(CheckpointStorage, "download", counting)
    yield seen


def _scope() -> EraseScope:
    return EraseScope((GONE.encode(),), (OPERATOR,), {})


def _holder(storage: CheckpointStorage, cid: int) -> tuple[int, int]:
    """(the subtask holding GONE in checkpoint `cid`, the bytes of its SST files)."""
    meta = CompletedCheckpointStore(storage).load(cid)
    group = key_group_for(GONE, MAX_P)
    h = next(h for h in meta.operators[OPERATOR].subtasks if group in h.key_group_range)
    return h.subtask, sum(f.size for f in h.files() if f.local_name.endswith(".sst"))


def _read(storage: CheckpointStorage, cid: int, local: Path) -> dict[str, tuple]:
    meta = CompletedCheckpointStore(storage).load(cid)
    out = {}
    for b in _backends(storage, local):
        b.restore(meta)
        profile, clubs = b.value_state("profile", BytesCodec()), b.map_state("clubs", JsonCodec())
        for m in MEMBERS:
            if key_group_for(m, MAX_P) in b.key_group_range:
                out[m] = (profile.get(m), sorted(clubs.entries(m)), b.timers.list(m))
        b.dispose()
    return out


def test_an_erase_reads_and_rewrites_the_key_groups_files_not_the_subtasks(
        storage: CheckpointStorage, tmp_path: Path, downloads: dict[str, int]):
    before = {cid: _read(storage, cid, tmp_path / f"before-{cid}") for cid in (1, 2)}
    holder = {cid: _holder(storage, cid) for cid in (1, 2)}
    assert before[1][GONE][0] is not None and before[2][GONE][2]
    downloads.clear()
    dry = erase_job(storage, _scope(), dry_run=True)  # counts from the key group's files too
    assert [c.entries_found > 0 for c in dry.checkpoints] == [True, True]
    assert 0 < sum(downloads.values()) < 0.3 * sum(state for _, state in holder.values())
    downloads.clear()

    report = erase_job(storage, _scope())

    assert report.verified, report.message
    assert [(c.original_id, c.new_id) for c in report.checkpoints] == [(1, 3), (2, 4)]
    for c in report.checkpoints:
        (s,) = c.subtasks
        subtask, state = holder[c.original_id]
        assert s.subtask == subtask and s.route == erasure.KEY_GROUP_FILES, s.fallback
        assert s.entries_removed > 0 and s.proof is not None and s.proof.files_kept > 0
        # A key group is 1/64 of a subtask here: its files and the level-0 flush, not the subtask.
        share = 0.12 if c.original_id == 1 else 0.35
        assert 0 < s.bytes_read < share * state, (c.original_id, s.bytes_read, state)
        assert 0 < s.bytes_written < share * state
        assert set(s.files_written).isdisjoint(s.files_rewritten)
        json = s.to_json()
        assert json["route"] == "key_group_files" and json["files_kept"] == s.proof.files_kept and json["ranges"]
    erase_reads = sum(b for path, b in downloads.items())
    whole = sum(state for _, state in holder.values())
    assert erase_reads < 0.6 * whole, "erase and proof together read less than the two subtasks once"
    for v in report.verification:
        assert v.rest_equal is not False and v.files_ruled_out > 0 and not v.findings
    for old, new in ((1, 3), (2, 4)):
        after = _read(storage, new, tmp_path / f"after-{new}")
        assert after[GONE] == (None, [], [])
        assert {m: v for m, v in after.items() if m != GONE} == {m: v for m, v in before[old].items() if m != GONE}
    assert verify_all(storage).ok


def test_a_placeholder_reached_by_rocksdb_makes_the_erase_read_the_subtask_whole(
        storage: CheckpointStorage, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    def level0_only(ranges, spans, wanted=None):  # type: ignore[no-untyped-def]  # a bug: the key's files left out
        return {n for n, r in ranges.items() if r.level == 0}

    monkeypatch.setattr(erasure, "closed_over", level0_only)
    report = erase_job(storage, _scope())
    assert report.verified, report.message
    for c in report.checkpoints:
        (s,) = c.subtasks
        assert s.route == erasure.WHOLE and "was not given" in (s.fallback or ""), s.fallback
        assert s.to_json()["fallback"] == s.fallback
    assert _read(storage, 4, tmp_path / "after")[GONE] == (None, [], [])
    assert verify_all(storage).ok


def test_a_placeholder_is_never_uploaded(storage: CheckpointStorage, tmp_path: Path):
    meta = CompletedCheckpointStore(storage).load(1)
    subtask, _ = _holder(storage, 1)
    stored = Path(storage.url.removeprefix("file://")) / "clubs-job"
    files = {p for p in stored.rglob("*") if p.is_file()}
    b = RocksDBStateBackend(storage, OPERATOR, subtask, parallelism=P, max_parallelism=MAX_P,
                            local_dir=tmp_path / "local", local_recovery=False,
                            options=RocksDBOptions(placeholders=True))
    try:
        done = b.restore_partial(meta, lambda ranges: set())
        assert done.placeholders == frozenset(done.ranges) and done.fetched == frozenset()
        with pytest.raises(PlaceholderReached, match="refusing to upload .*placeholder"):
            b.snapshot(9, full=True)  # every file uploaded again: the placeholders among them
    finally:
        b.dispose()
    assert {p for p in stored.rglob("*") if p.is_file()} == files, "nothing was uploaded"


def test_keys_in_several_key_groups_of_a_subtask_are_erased_group_by_group(storage: CheckpointStorage, tmp_path: Path):
    subtask, state = _holder(storage, 1)
    meta = CompletedCheckpointStore(storage).load(1)
    kg = meta.operators[OPERATOR].subtasks[subtask].key_group_range
    groups: dict[int, str] = {}
    for m in MEMBERS:
        g = key_group_for(m, MAX_P)
        if g in kg and len(groups) < 3 and g not in groups and g != key_group_for(GONE, MAX_P):
            groups[g] = m
    keys = [GONE, *groups.values()]
    report = erase_job(storage, EraseScope(tuple(k.encode() for k in keys), (OPERATOR,), {}))
    assert report.verified, report.message
    c1 = next(c for c in report.checkpoints if c.original_id == 1)
    (s,) = [s for s in c1.subtasks if s.subtask == subtask]
    assert s.route == erasure.KEY_GROUP_FILES, s.fallback
    assert s.proof is not None and len(s.proof.spans["profile"]) >= 2, "the groups' ranges apart, not their hull"
    assert s.bytes_read < 0.3 * state and s.bytes_written < 0.3 * state
    after = _read(storage, 3, tmp_path / "after")
    kept = next(m for m in MEMBERS if m not in keys)
    assert all(after[k] == (None, [], []) for k in keys) and after[kept][0] is not None
    assert verify_all(storage).ok
