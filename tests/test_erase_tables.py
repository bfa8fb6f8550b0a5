"""Erasing a key's rows from a Delta table a user's pipeline wrote (`tests.support.ledger_pipeline`,
spending per customer partitioned by region, run in process without Spark): one table version
swaps the files that hold the key for copies without it, the removed files' bytes are gone, the
erase's log entry does not name the key, a rollback afterwards drops the copies, and a kill -9
before any storage step that changes storage of the erase leaves a readable table, before or after, that the next
erase finishes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from deltalake import DeltaTable as Table

from sparkpoint.tables import iceberg
from sparkpoint.tables.sink import SinkError
from sparkpoint.tables.sinks import open_sink
from tests.support.erase_driver import changing_steps
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
    for die_at in changing_steps(json.loads(done.stdout)["steps"]):
        table = tmp_path / f"kill-{die_at}"
        shutil.copytree(pristine, table)
        killed = _erase_in_process(f"delta+file://{table}", die_at)
        assert killed.returncode == -9, (die_at, killed.stderr)
        rows = _rows(table)  # every file the table names is there
        assert rows.equals(before) or rows.equals(_without(before)), f"killed before step {die_at}"
        open_sink(f"delta+file://{table}", JOB).erase_rows("customer", [GONE])  # the next erase, in this process
        assert _rows(table).equals(_without(before)), f"resumed after step {die_at}"
        held = set(Table(str(table)).get_add_actions(flatten=True).column("path").to_pylist())
        on_disk = {p.relative_to(table).as_posix() for p in (table / "sparkpoint-ledger").rglob("*.parquet")}
        leftovers = {p for p in on_disk - held if "/_erase/" not in p}
        for rel in leftovers:  # a copy the killed erase wrote and never committed: no row of the key
            assert GONE not in pd.read_parquet(table / rel)["customer"].tolist(), f"after step {die_at}: {rel}"


# --- Iceberg ------------------------------------------------------------------------------------------

ICEBERG_JOB = "watch-job"


def _catalog(tmp_path: Path) -> dict[str, str]:
    return {"type": "sql", "uri": f"sqlite:///{tmp_path}/catalog.db", "warehouse": f"file://{tmp_path}/wh"}


def _iceberg(tmp_path: Path):  # noqa: ANN202
    return open_sink("iceberg://lake/media.watch_time", ICEBERG_JOB, catalog=_catalog(tmp_path),
                     operators=[("watch_time", "uid-watch-v1")])


def _watched(checkpoint: int, subtask: int) -> pd.DataFrame:
    """A user's operator output (not the sample's): minutes watched per viewer and title."""
    viewers = [f"viewer-{(checkpoint * 3 + subtask + i) % 9}" for i in range(6)]
    return pd.DataFrame({"viewer": viewers, "title": [f"t{i % 4}" for i in range(6)],
                         "minutes": pd.Series([checkpoint * 10 + i for i in range(6)], dtype="int64")})


def _scan(sink) -> pd.DataFrame:  # noqa: ANN001
    table = sink._load()
    frame = table.scan().to_pandas()[["checkpoint_id", "viewer", "title", "minutes"]]
    return frame.sort_values(["checkpoint_id", "viewer", "title", "minutes"]).reset_index(drop=True)


def _iceberg_written(tmp_path: Path, committed: int = 3) -> tuple[object, list[str]]:
    sink = _iceberg(tmp_path)
    for cid in range(1, committed + 2):
        staged = [rel for sub in range(2) for rel in sink.stage(cid, "watch_time", sub, _watched(cid, sub))]
        if cid <= committed:
            sink.commit(cid, staged)
    return sink, staged  # the last checkpoint's files staged, not committed


def test_iceberg_erase_is_one_overwrite_snapshot_and_rollback_drops_the_copies(tmp_path: Path):
    sink, pending = _iceberg_written(tmp_path)
    gone = "viewer-4"
    before, committed = _scan(sink), sink.committed()
    assert (before["viewer"] == gone).sum() > 0
    dry = sink.erase_rows("viewer", [gone], dry_run=True)
    assert dry.rows_removed > (before["viewer"] == gone).sum(), "the staged rows of checkpoint 4 count too"

    erased = sink.erase_rows("viewer", [gone])
    assert erased.rows_removed == dry.rows_removed and erased.version is not None
    after = _scan(sink)
    pd.testing.assert_frame_equal(after, before[before["viewer"] != gone].reset_index(drop=True))
    assert sorted(sink.committed()) == sorted(committed)
    snapshot = sink._load().current_snapshot()
    assert snapshot.snapshot_id == erased.version
    assert gone not in json.dumps(snapshot.summary.additional_properties), "the summary never names the key"

    assert sink.commit(4, pending) == len(pending)
    assert gone not in _scan(sink)["viewer"].tolist(), "checkpoint 4's staged rows were erased before its commit"
    assert sink.rollback(after=1) == [2, 3, 4]
    rows = _scan(sink)
    assert set(rows["checkpoint_id"]) == {1} and gone not in rows["viewer"].tolist()
    with pytest.raises(SinkError, match="no column 'user'.*viewer"):
        sink.erase_rows("user", [gone])


def test_kill_9_before_any_step_of_an_iceberg_erase_leaves_the_snapshot_before_or_after(tmp_path: Path):
    env = {**os.environ, "ERASE_CATALOG": json.dumps(_catalog(tmp_path / "w"))}
    (tmp_path / "w").mkdir()
    sink, _ = _iceberg_written(tmp_path / "w")
    before = _scan(sink)
    erased = before[before["viewer"] != "viewer-4"].reset_index(drop=True)
    shutil.copytree(tmp_path / "w", tmp_path / "pristine")

    def erase(die_at: int = 0) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "tests.support.erase_driver", "iceberg://lake/media.watch_time",
                               ICEBERG_JOB, "viewer", "viewer-4", str(die_at)], capture_output=True, text=True,
                              timeout=120, env=env)

    done = erase()
    assert done.returncode == 0, done.stderr
    for die_at in changing_steps(json.loads(done.stdout)["steps"]):
        shutil.rmtree(tmp_path / "w")
        shutil.copytree(tmp_path / "pristine", tmp_path / "w")
        killed = erase(die_at)
        assert killed.returncode == -9, (die_at, killed.stderr)
        iceberg._catalog.cache_clear()  # its connection pool holds the catalog file copied over
        sink = _iceberg(tmp_path / "w")
        rows = _scan(sink)
        assert rows.equals(before) or rows.equals(erased), f"killed before step {die_at}"
        sink.erase_rows("viewer", ["viewer-4"])  # the next erase, in this process
        assert _scan(sink).equals(erased), f"resumed after step {die_at}"
