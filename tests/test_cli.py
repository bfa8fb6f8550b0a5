"""The command line without Spark: help, clear errors for bad input, verify, gc, list, state."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.cli import main
from sparkpoint.state.backend import take_checkpoint
from sparkpoint.state.sample import TOTALS
from tests.support.backends import make_backends, owned


@pytest.fixture
def job(tmp_path: Path) -> str:
    """Two checkpoints of a `user_totals` state, written through the core (no Spark needed)."""
    storage = CheckpointStorage(f"file://{tmp_path}/ckpt", "job")
    coord = CheckpointCoordinator(storage, num_retained=2)
    rng = random.Random(0)
    backends = make_backends(storage, tmp_path / "local", operator="user_totals")
    for b in backends:
        b.restore(None)
    for _ in range(2):
        keys = {f"u{rng.randrange(300):04d}" for _ in range(200)}
        for b in backends:
            mine = owned(b, sorted(keys))
            b.value_state("totals", TOTALS).put_many((k, (1, 2.0, 2.0, 2.0, 1_000_000)) for k in mine)
        take_checkpoint(coord, backends)
    for b in backends:
        b.close()
    return f"file://{tmp_path}/ckpt"


@pytest.mark.parametrize("command", ["generate", "run", "state", "verify", "gc", "list", "erase"])
def test_every_command_has_help(command: str, capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    assert "usage: sparkpoint " + command in capsys.readouterr().out


def test_run_with_a_missing_input_directory_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    code = main(["run", "--input", str(tmp_path / "nope"), "--checkpoints", f"file://{tmp_path}/c", "--job-id", "j"])
    assert code == 2
    assert "input directory" in capsys.readouterr().err


@pytest.mark.parametrize("url", ["nosuchproto://x", "s3//missing-colon"])
def test_bad_checkpoint_url_is_a_clear_error(url: str, capsys: pytest.CaptureFixture[str]):
    assert main(["list", "--checkpoints", url, "--job-id", "job"]) == 2
    assert "sparkpoint list: error:" in capsys.readouterr().err


def test_unknown_operator_and_checkpoint_are_named(job: str, capsys: pytest.CaptureFixture[str]):
    assert main(["state", "--checkpoints", job, "--job-id", "job", "--operator", "nope"]) == 2
    assert "unknown operator 'nope'" in capsys.readouterr().err
    assert main(["state", "--checkpoints", job, "--job-id", "job", "--operator", "user_totals",
                 "--checkpoint", "99"]) == 2
    assert "checkpoint 99 does not exist" in capsys.readouterr().err


def test_state_exports_every_subtask_as_one_table(job: str, tmp_path: Path):
    out = tmp_path / "totals.json"
    assert main(["state", "--checkpoints", job, "--job-id", "job", "--operator", "user_totals",
                 "--format", "json", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert rows and set(rows[0]) == {"user_id", "count", "amount_sum", "amount_min", "amount_max", "last_ts"}
    assert [r["user_id"] for r in rows] == sorted({r["user_id"] for r in rows})


def test_verify_names_the_bad_file_and_exits_non_zero(job: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    assert main(["verify", "--checkpoints", job, "--job-id", "job", "--json"]) == 0
    assert all(r["ok"] for r in json.loads(capsys.readouterr().out))
    storage = CheckpointStorage(job, "job")
    victim = next(f for f in CompletedCheckpointStore(storage).load(2).files() if f.local_name.endswith(".sst"))
    data = bytearray(storage.read_bytes(victim.path))
    data[len(data) // 2] ^= 0x10
    storage.fs.pipe_file(storage.abspath(victim.path), bytes(data))
    assert main(["verify", "--checkpoints", job, "--job-id", "job", "--checkpoint", "2"]) == 1
    assert victim.path in capsys.readouterr().out
    assert main(["state", "--checkpoints", job, "--job-id", "job", "--operator", "user_totals"]) == 2
    assert victim.path in capsys.readouterr().err


def test_hostile_metadata_is_refused_by_every_command(job: str, capsys: pytest.CaptureFixture[str]):
    storage = CheckpointStorage(job, "job")
    raw = json.loads(storage.read_bytes("chk-2/_metadata"))
    raw["operators"]["user_totals"]["subtasks"][0]["shared"][0]["path"] = "../../elsewhere/x.sst"
    storage.fs.rm_file(storage.abspath("chk-2/_metadata"))
    storage.write_bytes("chk-2/_metadata", json.dumps(raw).encode())
    assert main(["state", "--checkpoints", job, "--job-id", "job", "--operator", "user_totals"]) == 2
    assert "not a safe path" in capsys.readouterr().err
    assert main(["gc", "--checkpoints", job, "--job-id", "job", "--grace", "0"]) == 2
    assert "chk-2/_metadata" in capsys.readouterr().err
    assert main(["verify", "--checkpoints", job, "--job-id", "job"]) == 1


def test_gc_dry_run_lists_and_gc_deletes_orphans(job: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    storage = CheckpointStorage(job, "job")
    orphan = tmp_path / "orphan.sst"
    orphan.write_bytes(b"left by a killed task")
    storage.put_files([(str(orphan), "shared/user_totals/0/dead.sst")])
    assert main(["gc", "--checkpoints", job, "--job-id", "job", "--grace", "0", "--dry-run", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["orphans"] == ["shared/user_totals/0/dead.sst"]
    assert storage.exists("shared/user_totals/0/dead.sst")
    assert main(["gc", "--checkpoints", job, "--job-id", "job", "--grace", "0"]) == 0
    assert not storage.exists("shared/user_totals/0/dead.sst")
    assert main(["verify", "--checkpoints", job, "--job-id", "job"]) == 0


def test_the_run_line_of_a_big_batch_counts_its_files_and_names_the_first_and_last(tmp_path: Path):
    """`--files-per-checkpoint 1000` made a line of 1,000 names; `--json` keeps every name."""
    from dataclasses import replace

    from tests.support.interleavings import InProcessPipeline
    from tests.support.meters_pipeline import bad, good, meters

    pipeline = meters(tmp_path, files_per_checkpoint=1000, on_bad_file="skip")
    names = [f"r-{i:04d}.parquet" for i in range(12)]
    for name in names[:8]:
        good(tmp_path, name)
    for name in names[8:]:
        bad(tmp_path, name, "not parquet")
    (report,) = InProcessPipeline(None, pipeline.config(), pipeline.operators).run()
    line = report.line()
    assert " batch=8 files r-0000.parquet … r-0007.parquet rows=" in line, line
    assert "r-0003.parquet" not in line and "r-0011.parquet" not in line
    assert "skipped=r-0008.parquet (parquet: " in line and "; and 1 more (inspect lists them)" in line
    assert report.to_json()["batch"] == names[:8] and len(report.to_json()["skipped"]) == 4
    few = replace(report, files=tuple(names[:3]), skipped=())
    assert " batch=r-0000.parquet,r-0001.parquet,r-0002.parquet rows=" in few.line()
