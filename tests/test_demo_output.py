"""`make run`'s printing (issue 34, item 5): the checkpoint table in the same human-readable unit
style as the lines before it (no raw bytes), and a last line that says what to look at next,
whose `sparkpoint list ...` command runs as printed and lists the demo's job. The checkpoints are
taken without Spark, of the clickstream example's operator (not the sample's)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from sparkpoint import Pipeline
from sparkpoint.checkpoint.catalog import readable_size
from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.storage import storage_url
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.sample import land_sample_batch
from sparkpoint.sample import pipeline as sample
from sparkpoint.state.backend import take_checkpoint
from tests.support.backends import make_backend

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples" / "clickstream"))

from clickstream.operators import CLICKS, clicks_per_user  # noqa: E402

SIZE = r"\d+(\.\d)? (B|KiB|MiB|GiB|TiB)"


def test_the_demo_prints_one_unit_style_and_ends_with_what_to_look_at_next(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    from sparkpoint import demo

    monkeypatch.chdir(tmp_path)
    clicks = Pipeline("clicks", [clicks_per_user], job_id="click-job", checkpoints_url=".sparkpoint/ckpt")
    storage = clicks.storage()
    coordinator = CheckpointCoordinator(storage, num_retained=2)
    with make_backend(storage, tmp_path / "w", operator=clicks_per_user.uid) as state:
        state.restore(None)
        for batch, users in enumerate((3000, 200)):  # a first checkpoint of some KiB, a small second one
            state.value_state("clicks", CLICKS).put_many((f"user-{batch}-{i}", (i, i)) for i in range(users))
            take_checkpoint(coordinator, [state],
                            source_offsets={"source": {"version": 1, "consumed": [f"clicks-{batch}.parquet"]},
                                            "sink": []})

    demo._table(storage)
    print(demo.next_steps(clicks))
    lines = capsys.readouterr().out.splitlines()

    header, rows, last = lines[0].split(), [line.split() for line in lines[1:-1]], lines[-1]
    assert header == ["checkpoint", "kind", "state", "uploaded", "files", "batches"]
    metas = {m.checkpoint_id: m for m in CompletedCheckpointStore(storage).load_all().checkpoints}
    assert [int(r[0]) for r in rows] == [2, 1]
    for row in rows:
        meta = metas[int(row[0])]
        state_cell, uploaded_cell = " ".join(row[2:4]), " ".join(row[4:6])
        assert re.fullmatch(SIZE, state_cell) and re.fullmatch(SIZE, uploaded_cell), row
        assert (state_cell, uploaded_cell) == (readable_size(meta.stats.state_size),
                                               readable_size(meta.stats.checkpointed_size))
    assert any("KiB" in " ".join(r) for r in rows), "sizes above 1024 bytes are not printed as raw bytes"

    assert last.startswith("next: ") and "`make ui`" in last
    command = re.search(r"`([^`]*sparkpoint list [^`]*)`", last)
    assert command is not None, last
    argv = shlex.split(command.group(1))
    assert argv[1:] == ["list", "--checkpoints", ".sparkpoint/ckpt", "--job-id", "click-job"]
    listed = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    assert "2 retained checkpoint(s) of click-job" in listed.stdout
    assert "chk-2" in listed.stdout and "chk-1" in listed.stdout


def test_the_demo_never_lands_a_batch_under_a_consumed_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    input_url = storage_url(sample.location("input"))
    first = land_sample_batch(input_url)
    second = land_sample_batch(input_url)
    assert first and second and first.endswith("batch-000000.parquet") and second.endswith("batch-000001.parquet")
    (Path(sample.location("input")) / "batch-000000.parquet").unlink()  # consumed, then cleaned up by the user
    third = land_sample_batch(input_url, consumed=["batch-000000.parquet", "batch-000001.parquet"])
    assert third is not None and third.endswith("batch-000002.parquet")


def test_the_demo_stops_on_an_earlier_demos_parquet_output_and_says_how_to_start_afresh(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from sparkpoint import demo

    monkeypatch.chdir(tmp_path)
    assert demo.earlier_parquet_output() is None, "no output yet"
    output = tmp_path / ".sparkpoint" / "demo" / "output"
    output.mkdir(parents=True)
    (output / "part-demo~00000001~user_totals~00000.parquet").write_bytes(b"PAR1")
    said = demo.earlier_parquet_output()
    assert said is not None and "Delta table" in said and "rm -rf .sparkpoint" in said, said
    (output / "_delta_log").mkdir()
    assert demo.earlier_parquet_output() is None, "a Delta table is the demo's own"
