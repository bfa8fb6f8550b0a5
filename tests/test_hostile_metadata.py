"""Hostile input (issue 11, item 4): Hypothesis mutates a valid `_metadata` (`..` segments,
absolute paths, other jobs' paths, other filesystems' URLs, backslashes, NUL bytes, a link inside
the job directory that points outside, huge or negative sizes, wrong types, unknown versions,
deep nesting) and feeds it to store loading, `verify` (also `--repair`), `list`, `gc`, retention,
restore, `state` export and `inspect`. Each ends in a specific error (a SparkpointError naming
the field) or a clean outcome, and nothing outside the job directory is read, written or deleted.

"Not read" is checked by access times: every file and directory outside the job directory gets
an access time in the past, and the filesystem (mounted `relatime`) moves it on any read or listing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.errors import DeletionBlocked, MetadataError, SparkpointError
from sparkpoint.checkpoint.metadata import content_checksum
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.checkpoint.sweep import sweep_orphans
from sparkpoint.cli import main
from sparkpoint.resources import CheckpointRegistryResource, CheckpointStorageResource, InputResource
from sparkpoint.state.backend import restore_with_fallback, take_checkpoint
from sparkpoint.state.engine.verify import verify_checkpoint
from sparkpoint.state.extract import operator_states
from sparkpoint.state.sample import TOTALS
from tests.support.backends import make_backend, make_backends, owned, write_checkpoints
from tests.support.helpers import FakeSubtask
from tests.support.reliability import scale

PAST = 946_684_800 * 10**9  # 2000-01-01: any read moves a file's access time past its modification time
NAMES_A_FIELD = re.compile(r"field `[^`]+`|not valid UTF-8 JSON|bytes, more than")


def write_job(url: str, job_id: str, local: Path) -> None:
    """Two checkpoints of `user_totals` (the sample operator, so that `sparkpoint state` exports it)."""
    storage = CheckpointStorage(url, job_id)
    coord = CheckpointCoordinator(storage, num_retained=2)
    subtasks = make_backends(storage, local, operator="user_totals", max_parallelism=16)
    for b in subtasks:
        b.restore(None)
    for ts, users in enumerate([[f"u{i}" for i in range(40)], [f"u{i}" for i in range(40, 80)]]):
        for b in subtasks:
            b.value_state("totals", TOTALS).put_many((u, (1, 1.0, 1.0, 1.0, ts)) for u in owned(b, users))
        take_checkpoint(coord, subtasks)
        if ts == 1:
            for b in subtasks:
                b.close()


class World:
    """A job next to a sibling job and sentinels; `reset` puts the job directory back as written."""

    def __init__(self, base: Path):
        self.base = base
        self.url = f"file://{base}/ck"
        self.job = base / "ck" / "job"
        self.local = base / "local"
        write_job(self.url, "job", self.local)
        write_job(self.url, "other", base / "local-other")
        outside = base / "outside"
        outside.mkdir()
        (outside / "secret.sst").write_bytes(b"outside the job directory")
        (base / "ck" / "sentinel.sst").write_bytes(b"next to the job directory")
        os.symlink(outside / "secret.sst", self.job / "shared" / "user_totals" / "0" / "evil.sst")
        self.pristine = base / "pristine"
        shutil.copytree(self.job, self.pristine, symlinks=True)
        self.raw = json.loads((self.job / "chk-2" / "_metadata").read_bytes())
        self.other_file = next((base / "ck" / "other" / "shared").rglob("*.sst")).relative_to(base / "ck")
        self.watched = [base / "ck" / "sentinel.sst", outside, *outside.rglob("*"), base / "ck" / "other",
                        *(base / "ck" / "other").rglob("*"), base / "local-other", *(base / "local-other").rglob("*")]
        for p in self.watched:
            os.utime(p, ns=(PAST, os.lstat(p).st_mtime_ns), follow_symlinks=False)
        self.before = self.snapshot()

    def snapshot(self) -> dict[str, tuple[int, int, int, int]]:
        """stat only (reading would move access times): size, mtime, ctime, atime."""
        out = {}
        for p in self.watched:
            st_ = os.lstat(p)
            out[str(p)] = (st_.st_size, st_.st_mtime_ns, st_.st_ctime_ns, st_.st_atime_ns)
        return out

    def reset(self) -> None:
        for child in self.job.iterdir():
            shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
        shutil.copytree(self.pristine, self.job, symlinks=True, dirs_exist_ok=True)

    def write_metadata(self, data: bytes) -> None:
        (self.job / "chk-2" / "_metadata").write_bytes(data)


# --- hostile values ---------------------------------------------------------------------------------


class Nested:
    """`depth` nested arrays, spliced into the JSON text (json.dumps itself would recurse too deep)."""

    def __init__(self, depth: int):
        self.depth = depth
        self.marker = f"__NESTED_{depth}__"


def hostile_paths(world_other: str) -> st.SearchStrategy[str]:
    return st.one_of(
        st.sampled_from([
            f"../{world_other}", "../sentinel.sst", "../../outside/secret.sst", "/etc/passwd", "/tmp/x.sst",
            "s3://bucket/job/shared/x.sst", "file:///etc/passwd", "memory://ckpt/x", "gs://b/x",
            "shared\\..\\..\\sentinel.sst", "shared/user_totals/0/a\x00b.sst", "shared/../../sentinel.sst",
            "shared/user_totals/0/evil.sst", "~/.ssh/id_rsa", "C:/Windows/x", "shared//x.sst", "./shared/x.sst",
            "shared/x.sst/", "chk-2/_metadata", "chk-1/_metadata", "x" * 5000, "shared/\ud800.sst", "",
            "shared/user_totals/0/" + "y" * 300 + ".sst", "shared/user_totals/0/..", "..",
        ]),
        st.text(alphabet=st.sampled_from("./\\\x00ab~:%"), max_size=16),
    )


def hostile_values(world_other: str) -> st.SearchStrategy[Any]:
    return st.one_of(
        hostile_paths(world_other),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.sampled_from([-1, 0, 2**31, 2**53, 2**53 + 1, 2**63, 2**64, 0xFFFFFFFF + 1]),
        st.none(), st.booleans(), st.floats(allow_nan=True, allow_infinity=True),
        st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
        st.integers(min_value=30, max_value=3000).map(Nested),
    )


VALID_BUT_HOSTILE = ["shared/user_totals/0/evil.sst", "chk-1/_metadata", "chk-2/_metadata", "shared/nothing.sst",
                     "shared/user_totals/1/missing.sst", "sentinel.sst", "other/shared/x.sst"]
FILE_FIELDS = ["path", "local_name", "size", "crc32", "created_by"]
TOP_FIELDS = [("job_id",), ("checkpoint_id",), ("version",), ("format",), ("kind",), ("created_at",),
              ("stats", "state_size"), ("lineage",), ("unowned",), ("source_offsets",),
              ("operators", "user_totals", "max_parallelism"), ("operators", "user_totals", "subtasks"),
              ("operators", "user_totals", "name")]


@st.composite
def mutations(draw: st.DrawFn, world_other: str) -> list[tuple[tuple[Any, ...], Any]]:
    """One to three (location, value) changes of the raw `_metadata`; a third of them change one
    file's path to a path that passes validation but is hostile (a link out, another checkpoint's
    `_metadata`, a file that is not there), so restore, verify, repair and gc get to act on it."""
    if draw(st.integers(0, 2)) == 0:
        where = ("operators", "user_totals", "subtasks", draw(st.integers(0, 1)), "shared", 0, "path")
        return [(where, draw(st.sampled_from(VALID_BUT_HOSTILE)))]
    out = []
    for _ in range(draw(st.integers(1, 3))):
        if draw(st.booleans()):
            where: tuple[Any, ...] = ("operators", "user_totals", "subtasks", draw(st.integers(0, 1)),
                                      draw(st.sampled_from(["shared", "private"])), draw(st.integers(0, 2)),
                                      draw(st.sampled_from(FILE_FIELDS)))
        else:
            where = draw(st.sampled_from(TOP_FIELDS))
        value = draw(hostile_values(world_other))
        if where[-1] == "unowned" and not isinstance(value, Nested) and draw(st.booleans()):
            value = [value]
        out.append((where, value))
    return out


def has(node: Any, key: Any) -> bool:
    if isinstance(node, dict):
        return key in node
    return isinstance(node, list) and isinstance(key, int) and key < len(node)


def apply(raw: dict[str, Any], changes: list[tuple[tuple[Any, ...], Any]]) -> bytes:
    raw = json.loads(json.dumps(raw))
    nested: list[Nested] = []
    for where, value in changes:
        node = raw
        for key in where[:-1]:
            if not has(node, key):
                break
            node = node[key]
        else:
            if isinstance(node, dict) or has(node, where[-1]):
                if isinstance(value, Nested):
                    nested.append(value)
                    value = value.marker
                node[where[-1]] = value
    raw.pop("checksum", None)
    try:
        raw["checksum"] = content_checksum(raw)  # signed again: validation must name the field itself
    except ValueError:  # NaN or a lone surrogate cannot be canonical: left unsigned
        pass
    text = json.dumps(raw)
    for n in nested:
        text = text.replace(f'"{n.marker}"', "[" * n.depth + "1" + "]" * n.depth)
    return text.encode("utf-8", "surrogatepass")


# --- every consumer ---------------------------------------------------------------------------------


def exercise_every_consumer(world: World, capsys: pytest.CaptureFixture[str], work: Path) -> None:
    storage = CheckpointStorage(world.url, "job")
    store = CompletedCheckpointStore(storage)
    try:
        meta = store.load(2)
    except MetadataError as e:
        assert NAMES_A_FIELD.search(str(e)), str(e)
        meta = None
    if meta is not None:
        for problem in verify_checkpoint(storage, meta):
            if problem.path == "shared/user_totals/0/evil.sst":
                assert "symbolic link" in problem.problem
        try:
            with operator_states(storage, meta, "user_totals", work_dir=str(work)):
                pass
        except SparkpointError:
            pass
    job = ["--checkpoints", world.url, "--job-id", "job"]
    for args in (["verify", *job], ["verify", "--shallow", *job], ["list", *job],
                 ["verify", "--repair", "--local-dir", str(world.local), *job],
                 ["state", "--operator", "user_totals", "--checkpoint", "2", *job], ["gc", "--grace", "0", *job]):
        rc = main(args)
        out, err = capsys.readouterr()
        assert rc in (0, 1, 2), (args, rc, err)
        assert "Traceback" not in err
        if rc == 2:
            assert err.startswith(f"sparkpoint {args[0]}: error: "), err
    try:  # retention
        CheckpointCoordinator(storage, num_retained=1).subsume()
    except SparkpointError:
        pass
    listing = store.load_all()
    subtasks = make_backends(storage, work / "restore", operator="user_totals", max_parallelism=16,
                             local_recovery=False)
    try:
        restore_with_fallback(subtasks, listing.checkpoints)
    except SparkpointError:
        pass
    finally:
        for b in subtasks:
            b.close()


def check_hostile_metadata(tmp_path: Path, capsys: pytest.CaptureFixture[str], max_examples: int) -> int:
    world = World(tmp_path / "w")
    examples = 0

    @settings(max_examples=max_examples, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(changes=mutations(str(world.other_file)))
    def one(changes: list[tuple[tuple[Any, ...], Any]]) -> None:
        nonlocal examples
        examples += 1
        world.reset()
        world.write_metadata(apply(world.raw, changes))
        work = tmp_path / "work"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        exercise_every_consumer(world, capsys, work)
        assert world.snapshot() == world.before, "something outside the job directory was read or changed"

    one()
    return examples


def test_hostile_metadata_gets_a_specific_error_and_nothing_outside_the_job_is_touched(tmp_path: Path, capsys):
    assert check_hostile_metadata(tmp_path, capsys, max_examples=40) >= 40


@pytest.mark.soak
@pytest.mark.timeout(6 * 3600)  # the scale comes from the environment
def test_hostile_metadata_soak(tmp_path: Path, capsys):
    from tests.support.reliability import report

    n = check_hostile_metadata(tmp_path, capsys, max_examples=scale("hostile_examples", 1000))
    with capsys.disabled():
        report("hostile_metadata", [{"examples": n, "failures_found": 0}])


def test_a_huge_metadata_file_is_refused_unread(tmp_path: Path, capsys):
    from sparkpoint.checkpoint.store import MAX_METADATA_BYTES

    world = World(tmp_path / "w")
    with open(world.job / "chk-2" / "_metadata", "r+b") as f:
        f.truncate(MAX_METADATA_BYTES + 1)  # sparse: no 64 MB written
    with pytest.raises(MetadataError, match="more than"):
        CompletedCheckpointStore(CheckpointStorage(world.url, "job")).load(2)
    exercise_every_consumer(world, capsys, tmp_path / "work")
    assert world.snapshot() == world.before


def error_text(error: Any) -> str:
    """A Dagster error with its causes (an op's own exception is the cause of Dagster's wrapper)."""
    parts = []
    while error is not None:
        parts.append(error.message)
        error = error.cause
    return " <- ".join(parts)


@pytest.mark.parametrize(
    "path",
    ["shared/user_totals/0/evil.sst", "../other/shared/x.sst", "/etc/passwd", "s3://elsewhere/x.sst",
     "shared\\user_totals\\0\\x.sst", "../../outside/secret.sst"],
)
def test_the_dagster_maintenance_jobs_refuse_hostile_metadata_and_touch_nothing_outside(tmp_path: Path, path: str):
    """verify, prune (retention + sweep), rebuild_registry and savepoint, as Dagster runs them."""

    from tests.support.dagster_setup import JOBS, SCOPE

    world = World(tmp_path / "w")
    raw = json.loads(json.dumps(world.raw))
    raw["operators"]["user_totals"]["subtasks"][0]["shared"][0]["path"] = path
    world.write_metadata(apply(raw, []))
    storage = CheckpointStorageResource(checkpoints_url=world.url, job_id="job")
    resources = SCOPE.keyed({"storage": storage, "registry": CheckpointRegistryResource(
        storage=storage, num_retained=1, orphan_grace_seconds=0),
        "source": InputResource(input_url=str(tmp_path / "in"))})  # prune reads its input_cleanup (keep)
    outcomes = {}
    for job in (JOBS.verify, JOBS.rebuild_registry, JOBS.savepoint, JOBS.prune):
        result = job.execute_in_process(resources=resources, instance=dg.DagsterInstance.ephemeral(),
                                        raise_on_error=False)
        failures = [error_text(e.event_specific_data.error) for e in result.all_events  # type: ignore[union-attr]
                    if e.event_type_value == "STEP_FAILURE"]
        outcomes[job.name.removeprefix("sparkpoint_")] = (result.success, failures)
        if not result.success:  # a specific message, not a crash deep inside
            assert failures and any(w in failures[0] for w in ("chk-2", "symbolic link", "path", "_metadata")), failures
    assert not outcomes["verify"][0], "a checkpoint naming a file outside the job does not verify"
    assert not outcomes["savepoint"][0], "no savepoint is taken of it"
    assert world.snapshot() == world.before, "something outside the job directory was read or changed"


def resign(raw: dict) -> bytes:
    """A hostile `_metadata` with a checksum that matches, so validation must name the field."""
    raw["checksum"] = content_checksum(raw)
    return json.dumps(raw).encode()


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
    with make_backend(storage, tmp_path / "l", operator="other", max_parallelism=16) as b:
        with pytest.raises(OperatorStateMismatch, match="other"):
            b.restore(meta)
        assert b.restore(meta, allow_missing=True).source == "empty"


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
    backends = make_backends(storage, tmp_path / "fresh", max_parallelism=16)
    results = restore_with_fallback(backends, [store.load(2), store.load(1)])
    assert {r.checkpoint_id for r in results} == {1} and results[0].fell_back_from == (2,)
    for b in backends:
        b.close()


def _totals_job(tmp_path: Path) -> tuple[str, CheckpointStorage]:
    from sparkpoint.state.sample import TOTALS

    url = f"file://{tmp_path}/ck"
    storage = CheckpointStorage(url, "job")
    coord = CheckpointCoordinator(storage, num_retained=3)
    backends = make_backends(storage, tmp_path / "l", operator="user_totals")
    for b in backends:
        b.restore(None)
    for round_ in range(3):
        for b in backends:
            mine = owned(b, (f"u{i}" for i in range(round_ * 50, round_ * 50 + 50)))
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


def test_a_metadata_that_is_a_directory_is_bad_input_with_what_to_do(tmp_path: Path, capsys):
    storage = CheckpointStorage(f"file://{tmp_path}/ckpt", "job")
    coord = CheckpointCoordinator(storage)
    sub = FakeSubtask(storage, tmp_path / "db")
    sub.write("s")
    p = coord.trigger(expected={"op": 1})
    coord.acknowledge(p.checkpoint_id, sub.snapshot(p.checkpoint_id, ["s"]))
    coord.complete(p.checkpoint_id)
    (tmp_path / "ckpt" / "job" / "chk-2" / "_metadata").mkdir(parents=True)
    code = main(["inspect", f"file://{tmp_path}/ckpt/job/chk-2"])
    err = capsys.readouterr().err
    assert code == 2 and "is not a file" in err and "move" in err and "Errno 21" not in err
