"""Erasing a key's rows from a Delta table a user's pipeline wrote (`tests.support.ledger_pipeline`,
spending per customer partitioned by region, run in process without Spark): one table version
swaps the files that hold the key for copies without it, the removed files' bytes are gone, the
erase's log entry does not name the key, a rollback afterwards drops the copies, and a kill -9
before any storage step of the erase leaves a readable table, before or after, that the next
erase finishes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from deltalake import DeltaTable as Table

from sparkpoint.tables.sink import SinkError
from sparkpoint.tables.sinks import open_sink
from tests.support.interleavings import InProcessPipeline
from tests.support.ledger_pipeline import land, ledger

JOB = "ledger"
GONE = "cust-007"
COLUMNS = ["checkpoint_id", "customer", "region", "total", "purchases", "top_store"]


def _delta(root: Path, batches: int = 3) -> str:
    land(root / "in", batches)
    config = ledger.config(input_url=str(root / "in"), checkpoints_url=f"file://{root}/ckpt",
                           output_url=f"delta+file://{root}/table", local_dir=str(root / "local"), num_retained=2)
    InProcessPipeline(None, config, ledger.operators).run()
    return f"delta+file://{root}/table"


def _rows(table: Path) -> pd.DataFrame:
    frame = Table(str(table)).to_pyarrow_table().to_pandas()[COLUMNS]
    return frame.sort_values(["checkpoint_id", "customer"]).reset_index(drop=True)


def _without(frame: pd.DataFrame) -> pd.DataFrame:
    return frame[frame["customer"] != GONE].reset_index(drop=True)


def test_delta_erase_is_one_version_whose_removed_files_are_purged_and_rollback_drops_the_copies(tmp_path: Path):
    url = _delta(tmp_path)
    table = tmp_path / "table"
    sink = open_sink(url, JOB, operators=[("spend", "spend-by-customer")])
    before, version, committed = _rows(table), Table(str(table)).version(), sink.committed()
    assert (before["customer"] == GONE).sum() > 0

    dry = sink.erase_rows("customer", [GONE], dry_run=True)
    assert dry.rows_removed == (before["customer"] == GONE).sum() and Table(str(table)).version() == version

    erased = sink.erase_rows("customer", [GONE])
    assert erased.version == version + 1 and erased.rows_removed == dry.rows_removed
    pd.testing.assert_frame_equal(_rows(table), _without(before))
    assert sorted(sink.committed()) == sorted(committed), "every checkpoint keeps its files"
    assert erased.files_rewritten == len(erased.rewrites) and set(erased.purged) == {old for old, _ in erased.rewrites}
    assert not any((table / old).exists() for old in erased.purged), "the removed files' bytes are gone"
    assert all((table / new).exists() for _, new in erased.rewrites if new)
    entry = (table / "_delta_log" / f"{erased.version:020d}.json").read_text()
    assert GONE not in entry, "the erase's log entry never names the key"
    info = next(json.loads(line)["commitInfo"] for line in entry.splitlines() if "commitInfo" in line)
    assert info["sparkpoint.erase"]["rewrites"] == {old: new or None for old, new in erased.rewrites}

    assert sink.rollback(after=1) == [2, 3]
    assert _rows(table).equals(_without(before[before["checkpoint_id"] == 1]))


def test_delta_erase_refuses_a_column_the_table_lacks(tmp_path: Path):
    sink = open_sink(_delta(tmp_path, batches=1), JOB)
    with pytest.raises(SinkError, match="no column 'user'.*customer"):
        sink.erase_rows("user", [GONE])
    with pytest.raises(SinkError, match="partitioned by it"):
        sink.erase_rows("region", ["emea"])


def _erase_in_process(url: str, die_at: int = 0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tests.support.erase_driver", url, JOB, "customer", GONE,
                           str(die_at)], capture_output=True, text=True, timeout=120)


def test_kill_9_before_any_step_of_a_delta_erase_leaves_the_table_before_or_after(tmp_path: Path):
    _delta(tmp_path / "w")
    pristine = tmp_path / "w" / "table"
    before = _rows(pristine)
    probe = tmp_path / "probe"
    shutil.copytree(pristine, probe)
    done = _erase_in_process(f"delta+file://{probe}")
    assert done.returncode == 0, done.stderr
    steps = json.loads(done.stdout)["steps"]
    for die_at in range(1, steps + 1):
        table = tmp_path / f"kill-{die_at}"
        shutil.copytree(pristine, table)
        killed = _erase_in_process(f"delta+file://{table}", die_at)
        assert killed.returncode == -9, (die_at, killed.stderr)
        rows = _rows(table)  # every file the table names is there
        assert rows.equals(before) or rows.equals(_without(before)), f"killed before step {die_at}"
        resumed = _erase_in_process(f"delta+file://{table}")
        assert resumed.returncode == 0, resumed.stderr
        assert _rows(table).equals(_without(before)), f"resumed after step {die_at}"
        held = set(Table(str(table)).get_add_actions(flatten=True).column("path").to_pylist())
        on_disk = {p.relative_to(table).as_posix() for p in (table / "sparkpoint-ledger").rglob("*.parquet")}
        leftovers = {p for p in on_disk - held if "/_erase/" not in p}
        for rel in leftovers:  # a copy the killed erase wrote and never committed: no row of the key
            assert GONE not in pd.read_parquet(table / rel)["customer"].tolist(), f"after step {die_at}: {rel}"
