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

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.errors import MetadataError, SparkpointError
from sparkpoint.checkpoint.metadata import content_checksum
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.cli import main
from sparkpoint.state.backend import restore_with_fallback, take_checkpoint
from sparkpoint.state.extract import operator_states
from sparkpoint.state.sample import TOTALS
from sparkpoint.state.verify import verify_checkpoint
from tests.support.backends import make_backends, owned
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
    import dagster as dg

    from sparkpoint.resources import CheckpointRegistryResource, CheckpointStorageResource
    from tests.support.dagster_setup import JOBS, SCOPE

    world = World(tmp_path / "w")
    raw = json.loads(json.dumps(world.raw))
    raw["operators"]["user_totals"]["subtasks"][0]["shared"][0]["path"] = path
    world.write_metadata(apply(raw, []))
    storage = CheckpointStorageResource(checkpoints_url=world.url, job_id="job")
    resources = SCOPE.keyed({"storage": storage, "registry": CheckpointRegistryResource(
        storage=storage, num_retained=1, orphan_grace_seconds=0)})
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
