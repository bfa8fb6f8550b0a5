"""No user path ever reaches a globbing call (DESIGN rule 11): a failed savepoint to a target
whose name holds `[`, `*` or `?` removes only what it wrote, never a neighbour the pattern matches."""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path

import fsspec
import pytest

from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.errors import CheckpointCorrupted
from sparkpoint.checkpoint.savepoint import take_savepoint
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.cli import main
from tests.support.backends import COUNT, make_backend, write_checkpoints
from tests.support.helpers import FakeSubtask

PACKAGE = Path(__file__).resolve().parent.parent / "sparkpoint"
# fsspec calls that expand patterns in the paths they are given.
GLOBBING = re.compile(r"\bfs\.(rm|glob|expand_path|find|du|copy|mv|get|put)\(")
# Each allowed call, with why no user path can hold a pattern there.
ALLOWED = {
    # find() lists below one directory with ls() (no expansion): a sink's staging tree, its job's files (erase).
    ("tables/files.py", "files = fs.find(path)"),
}


def test_the_package_calls_no_globbing_fsspec_function_on_a_path():
    found = set()
    for source in PACKAGE.rglob("*.py"):
        rel = source.relative_to(PACKAGE).as_posix()
        if rel.startswith("testing/"):
            continue  # the fault-injecting filesystem wraps every call of the real one
        for line in source.read_text().splitlines():
            code = line.split("#", 1)[0]
            if GLOBBING.search(code) and ("fs." in code or "fs)" in code):
                found.add((rel, code.strip()))
    assert found <= ALLOWED, sorted(found - ALLOWED)


@pytest.mark.parametrize("pattern", ["sp[1]", "sp?", "sp*"])
def test_a_failed_savepoint_to_a_pattern_like_target_leaves_the_neighbour_alone(tmp_path: Path, pattern: str):
    bucket = f"memory://archive-{uuid.uuid4().hex[:8]}"
    storage = CheckpointStorage(f"memory://ckpt-{uuid.uuid4().hex[:8]}", "job")
    coord = CheckpointCoordinator(storage, num_retained=2)
    sub = FakeSubtask(storage, tmp_path / "db")
    sub.write("s1")
    pending = coord.trigger(expected={"op": 1})
    handle = sub.snapshot(pending.checkpoint_id, ["s1"])
    coord.acknowledge(pending.checkpoint_id, handle)
    coord.complete(pending.checkpoint_id)
    good = take_savepoint(storage, target=f"{bucket}/sp1/before-upgrade")
    fs = fsspec.filesystem("memory")
    kept = sorted(fs.find(f"{bucket}/sp1/before-upgrade"))
    assert kept, good

    with fs.open(storage.abspath(handle.shared[0].path), "wb") as f:
        f.write(b"damaged")  # the next savepoint fails on this file, after copying others
    with pytest.raises(CheckpointCorrupted):
        take_savepoint(storage, target=f"{bucket}/{pattern}/before-upgrade")
    assert sorted(fs.find(f"{bucket}/sp1/before-upgrade")) == kept, "the good savepoint is intact"
    assert not [p for p in fs.find(bucket) if f"/{pattern}/" in p], "the failed one left nothing"


def restored(storage: CheckpointStorage, local: Path, checkpoint_id: int | None = None) -> dict[str, int]:
    store = CompletedCheckpointStore(storage)
    meta = store.load(checkpoint_id or store.checkpoint_ids()[0])
    out: dict[str, int] = {}
    for i in range(2):
        with make_backend(storage, local, i, 2, max_parallelism=16, local_recovery=False) as b:
            b.restore(meta)
            out.update({k.decode(): v[0] for k, v in b.value_state("count", COUNT).items()})
    return out


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
