"""Erasing a key's rows from a pipeline's output (`Sink.erase_rows`), on a real output a user's
pipeline wrote (`tests.support.ledger_pipeline`: spending per customer, run in process without
Spark): the rows of the key leave every part of every checkpoint, every other row stays as it
was, the sink's record of which checkpoint wrote which part holds (rollback drops the rewritten
part), staged rows not yet committed lose it too, and a kill -9 before any storage step that changes storage of the
erase leaves each part either as it was or erased."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest

from sparkpoint.tables.sink import SinkError
from sparkpoint.tables.sinks import open_sink
from tests.support.erase_driver import changing_steps
from tests.support.interleavings import InProcessPipeline
from tests.support.ledger_pipeline import land, ledger

JOB = "ledger"
GONE = "cust-007"


def _written(root: Path, batches: int = 3) -> str:
    """The ledger pipeline's output as a Parquet directory after `batches` checkpoints."""
    land(root / "in", batches)
    config = ledger.config(input_url=str(root / "in"), checkpoints_url=f"file://{root}/ckpt",
                           output_url=str(root / "out"), local_dir=str(root / "local"), num_retained=2)
    InProcessPipeline(None, config, ledger.operators).run()
    return str(root / "out")


def _parts(out: str) -> dict[str, pd.DataFrame]:
    return {p.name: pq.read_table(p).to_pandas() for p in sorted(Path(out).glob("part-*.parquet"))}


def _without(frame: pd.DataFrame, key: str) -> pd.DataFrame:
    return frame[frame["customer"] != key].reset_index(drop=True)


def test_erased_key_leaves_every_part_and_nothing_else_changes(tmp_path: Path):
    out = _written(tmp_path)
    sink = open_sink(out, JOB)
    before, committed = _parts(out), sink.committed()
    holding = {name for name, rows in before.items() if (rows["customer"] == GONE).any()}
    assert holding and len(holding) < len(before), "the key is in some parts, not all"

    dry = sink.erase_rows("customer", [GONE], dry_run=True)
    assert dry.dry_run and dry.rows_removed == sum(int((r["customer"] == GONE).sum()) for r in before.values())
    assert dry.bytes_written == 0 and _parts(out).keys() == before.keys()
    assert all(rows.equals(before[name]) for name, rows in _parts(out).items()), "a dry run changes nothing"

    erased = sink.erase_rows("customer", [GONE])
    assert erased.rows_removed == dry.rows_removed and erased.files_rewritten == len(holding)
    assert erased.files_scanned == len(before) and erased.bytes_written > 0
    assert {Path(old).name for old, _ in erased.rewrites} == holding
    assert sum(n for _, n in erased.by_checkpoint) == erased.rows_removed
    after = _parts(out)
    assert after.keys() == before.keys(), "no part missing, none added"
    for name, rows in after.items():
        assert not (rows["customer"] == GONE).any()
        pd.testing.assert_frame_equal(rows.reset_index(drop=True), _without(before[name], GONE))
    assert sink.committed() == committed, "the same parts by checkpoint"
    assert not list(Path(out).glob("_erase/**/*.parquet")), "no scratch copy left"
    assert json.loads(json.dumps(erased.to_json()))["rows_removed"] == erased.rows_removed
    assert "removed" in erased.message and GONE not in erased.message

    again = sink.erase_rows("customer", [GONE])
    assert (again.rows_removed, again.files_rewritten, again.bytes_written) == (0, 0, 0)

    assert sink.rollback(after=1) == [2, 3]
    assert sorted(sink.committed()) == [1] and all(p.name.split("~")[1] == "00000001" for p in
                                                   Path(out).glob("part-*.parquet"))


def test_staged_rows_not_yet_committed_lose_the_key_before_their_commit(tmp_path: Path):
    out = _written(tmp_path, batches=1)
    sink = open_sink(out, JOB)
    rows = pd.DataFrame({"customer": [GONE, "cust-100", GONE], "total": [1.0, 2.0, 3.0]})
    staged = sink.stage(9, "spend", 0, rows)
    erased = sink.erase_rows("customer", [GONE])
    assert dict(erased.by_checkpoint)[9] == 2
    assert sink.commit(9, staged) == 1
    (part,) = sink.committed(after=8)[9]
    assert pq.read_table(part).column("customer").to_pylist() == ["cust-100"]


def test_a_part_left_without_rows_stays_so_its_checkpoint_still_counts(tmp_path: Path):
    out = _written(tmp_path, batches=1)
    sink = open_sink(out, JOB)
    only = sorted(Path(out).glob("part-*.parquet"))[0]
    keys = pq.read_table(only).column("customer").to_pylist()
    sink.erase_rows("customer", keys)
    assert only.exists() and pq.read_table(only).num_rows == 0
    assert pq.read_table(only).schema.names == pq.read_table(sorted(Path(out).glob("part-*.parquet"))[-1]).schema.names
    assert 1 in sink.committed() and sink.drop([1]) == [1]


def test_a_key_of_another_type_than_the_column_is_refused_with_the_type(tmp_path: Path):
    sink = open_sink(_written(tmp_path, batches=1), JOB)
    with pytest.raises(SinkError, match="purchases.*int64"):
        sink.erase_rows("purchases", ["not-a-number"])
    assert sink.erase_rows("purchases", ["1"], dry_run=True).rows_removed >= 0  # a string of the type is taken


def _erase_in_process(out: str, die_at: int = 0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tests.support.erase_driver", out, JOB, "customer", GONE,
                           str(die_at)], capture_output=True, text=True, timeout=120)


def test_kill_9_before_any_storage_step_leaves_each_part_old_or_erased(tmp_path: Path):
    pristine = _written(tmp_path / "w")
    before = _parts(pristine)
    probe = tmp_path / "probe"
    shutil.copytree(pristine, probe)
    done = _erase_in_process(str(probe))
    assert done.returncode == 0, done.stderr
    ops = json.loads(done.stdout)["steps"]
    assert ops.count("move") == 3, "three parts hold the key"
    for die_at in changing_steps(ops):
        out = tmp_path / f"kill-{die_at}"
        shutil.copytree(pristine, out)
        killed = _erase_in_process(str(out), die_at)
        assert killed.returncode == -9, (die_at, killed.stderr)
        after = _parts(str(out))
        assert after.keys() == before.keys(), f"killed before step {die_at}: a part missing or added"
        for name, rows in after.items():
            old, new = before[name].reset_index(drop=True), _without(before[name], GONE)
            rows = rows.reset_index(drop=True)
            assert rows.equals(old) or rows.equals(new), f"killed before step {die_at}: {name} is neither"
        open_sink(str(out), JOB).erase_rows("customer", [GONE])  # the next erase, in this process
        for name, rows in _parts(str(out)).items():
            assert rows.reset_index(drop=True).equals(_without(before[name], GONE)), f"resumed after {die_at}: {name}"
        assert not list((out / "_erase").rglob("*.parquet")), "the resumed erase removed the killed one's copies"
