"""The Delta sink on a real delta-rs table, without Spark: one table version per checkpoint with
rows, committed exactly once through retries, races, zombies and other writers of the table; the
job's files by checkpoint (drop, rollback, staging cleanup); the guards before Spark starts.

Rows are a user's own: account balances by branch (not the sample's user totals)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable as Table
from deltalake import write_deltalake

from sparkpoint.checkpoint.interleave import set_step_hook
from sparkpoint.tables.delta import DeltaSink
from sparkpoint.tables.delta_parts import SinkRetentionTooShort, interval_seconds
from sparkpoint.tables.sink import SinkError, SinkFenced, SinkSchemaMismatch
from sparkpoint.tables.sinks import open_sink

OPERATORS = [("balances", "balances-v1"), ("audit", "audit")]
DECLARED = {"balances": [("account", "string"), ("branch", "string"), ("balance", "float64"), ("moves", "int64")]}


def rows(n: int, start: int = 0, branches: tuple[str, ...] = ("north", "south")) -> pd.DataFrame:
    return pd.DataFrame({"account": [f"acct-{i:04d}" for i in range(start, start + n)],
                         "branch": [branches[i % len(branches)] for i in range(start, start + n)],
                         "balance": [100.0 + i for i in range(start, start + n)],
                         "moves": [i % 5 for i in range(start, start + n)]})


def sink_at(path: Path, **kwargs: Any) -> DeltaSink:
    sink = open_sink(f"delta+file://{path}", "ledger", operators=OPERATORS, **kwargs)
    assert isinstance(sink, DeltaSink)
    return sink


def stage(sink: DeltaSink, checkpoint_id: int, frame: pd.DataFrame, subtasks: int = 2) -> list[str]:
    tasks = sink.for_tasks()
    staged: list[str] = []
    for i in range(subtasks):
        staged += tasks.stage(checkpoint_id, "balances", i, frame.iloc[i::subtasks])
    return sorted(staged)


def commits(path: Path) -> list[dict[str, Any]]:
    """The table's commits that carry a sparkpoint checkpoint id, oldest first."""
    return [h for h in reversed(Table(str(path)).history()) if "sparkpoint.checkpoint-id" in h]


def test_each_checkpoint_is_one_version_with_its_app_transaction_and_stats(tmp_path: Path):
    sink = sink_at(tmp_path / "t")
    for cid in (1, 2, 3):
        staged = stage(sink, cid, rows(10, start=10 * cid))
        assert sink.commit(cid, staged) == 2
        assert sink.commit(cid, staged) == 0, "a retried step commits nothing"
        assert sink.commit(cid, staged, resuming=True) == 0, "nor does a start settling it"
    table = Table(str(tmp_path / "t"))
    assert table.version() == 2, "three checkpoints, three versions (0, 1, 2)"
    assert table.transaction_version("ledger/balances-v1") == 3, "app id is the job and the operator's uid"
    assert [(c["sparkpoint.checkpoint-id"], c["sparkpoint.job"], c["sparkpoint.operator"]) for c in commits(
        tmp_path / "t")] == [(1, "ledger", "balances"), (2, "ledger", "balances"), (3, "ledger", "balances")]
    got = table.to_pyarrow_table().to_pandas()
    assert sorted(got["account"]) == [f"acct-{i:04d}" for i in range(10, 40)]
    assert got.groupby("checkpoint_id").size().to_dict() == {1: 10, 2: 10, 3: 10}
    stats = pa.table(table.get_add_actions(flatten=True)).to_pylist()
    assert {s["num_records"] for s in stats} == {5} and all(s["min.balance"] <= s["max.balance"] for s in stats)
    assert sink.commit(4, []) == 0 and Table(str(tmp_path / "t")).version() == 2, "no rows: no version"


def test_facts_name_the_version_each_checkpoint_made_beside_another_writers_and_the_tables_columns(tmp_path: Path):
    sink = sink_at(tmp_path / "t")
    staged = {cid: stage(sink, cid, rows(6, start=10 * cid)) for cid in (1, 2)}
    sink.commit(1, staged[1])
    write_deltalake(str(tmp_path / "t"), pd.DataFrame({"account": ["walk-in"], "branch": ["east"], "balance": [1.0],
                                                       "moves": [1], "checkpoint_id": [7]}), mode="append")
    sink.commit(2, staged[2])
    facts = {cid: sink.facts(cid, staged[cid]) for cid in (1, 2)}
    assert [facts[1]["version"], facts[2]["version"]] == [0, 2], "version 1 is the other writer's"
    assert facts[2]["rows"] == 6 and facts[2]["files"] == 2
    assert list(facts[2]["columns"]) == ["account", "branch", "balance", "moves", "checkpoint_id"]
    assert sink.facts(3, [])["version"] is None, "no rows: no version"


def test_a_writer_the_table_has_moved_past_is_fenced(tmp_path: Path):
    sink = sink_at(tmp_path / "t")
    sink.commit(1, stage(sink, 1, rows(4)))
    sink.commit(2, stage(sink, 2, rows(4, start=4)))
    zombie = stage(sink, 1, rows(3, start=100))  # an old attempt at checkpoint 1, still running
    with pytest.raises(SinkFenced, match=r"records checkpoint 2 of job ledger \(ledger/balances-v1=2\).*fenced"):
        sink.commit(1, zombie)
    other_two = stage(sink, 2, rows(3, start=200))  # another writer's checkpoint 2
    with pytest.raises(SinkFenced):
        sink.commit(2, other_two)
    assert Table(str(tmp_path / "t")).version() == 1, "nothing committed"
    assert not set(zombie) & {p for ps in sink.committed().values() for p in ps}


def test_two_committers_racing_for_one_checkpoint_make_one_version(tmp_path: Path):
    """A completer and a start settling the same checkpoint: the second reads the table before
    the first commits; delta-rs refuses its commit (the app transaction conflicts), it reads again
    and finds the checkpoint committed."""
    sink = sink_at(tmp_path / "t")
    sink.commit(1, stage(sink, 1, rows(4)))
    staged = stage(sink, 2, rows(6, start=4))
    raced: list[int] = []
    entered = threading.Event()

    def hook(op: str, path: str) -> None:
        if op == "create" and path.endswith("/_delta_log") and not entered.is_set():
            entered.set()
            raced.append(sink.commit(2, staged))  # the other committer wins meanwhile

    previous = set_step_hook(hook)
    try:
        assert sink.commit(2, staged) == 0, "the loser finds it committed"
    finally:
        set_step_hook(previous)
    assert raced == [2]
    assert [c["sparkpoint.checkpoint-id"] for c in commits(tmp_path / "t")] == [1, 2]
    assert Table(str(tmp_path / "t")).to_pyarrow_table().num_rows == 10


def test_an_unrelated_appender_never_fails_nor_doubles_a_commit(tmp_path: Path):
    sink = sink_at(tmp_path / "t")
    sink.commit(1, stage(sink, 1, rows(5)))
    schema = Table(str(tmp_path / "t")).schema().to_arrow()
    foreign = pa.table({"account": ["manual"], "branch": ["west"], "balance": [1.0], "moves": [0],
                        "checkpoint_id": pa.array([None], pa.int64())}, schema=pa.schema(schema))
    stop, appended = threading.Event(), []

    def appender() -> None:
        while not stop.is_set():
            write_deltalake(str(tmp_path / "t"), foreign, mode="append")
            appended.append(1)

    def hook(op: str, path: str) -> None:  # and one append right between our read and our commit
        if op == "create" and path.endswith("/_delta_log") and threading.current_thread() is not thread:
            write_deltalake(str(tmp_path / "t"), foreign, mode="append")
            appended.append(1)

    thread = threading.Thread(target=appender)
    thread.start()
    previous = set_step_hook(hook)
    try:
        for cid in range(2, 8):
            staged = stage(sink, cid, rows(5, start=5 * cid))
            assert sink.commit(cid, staged) == 2
    finally:
        set_step_hook(previous)
        stop.set()
        thread.join()
    table = Table(str(tmp_path / "t"))
    got = table.to_pyarrow_table().to_pandas()
    ours = got[got["checkpoint_id"].notna()]
    assert ours.groupby("checkpoint_id").size().to_dict() == {cid: 5 for cid in range(1, 8)}
    assert (got["account"] == "manual").sum() == len(appended) and len(appended) >= 6
    assert [c["sparkpoint.checkpoint-id"] for c in commits(tmp_path / "t")] == list(range(1, 8))
    assert table.transaction_version("ledger/balances-v1") == 7


def test_a_partitioned_table_gets_a_file_per_partition_without_the_partition_column(tmp_path: Path):
    sink = sink_at(tmp_path / "t", partition_by=["branch"])
    frame = rows(9, branches=("north", "south", "east"))
    frame.loc[0, "branch"] = None
    staged = stage(sink, 1, frame, subtasks=1)
    assert len(staged) == 4, "north, south, east and the null branch"
    sink.commit(1, staged)
    table = Table(str(tmp_path / "t"))
    assert table.metadata().partition_columns == ["branch"]
    actions = pa.table(table.get_add_actions(flatten=True)).to_pylist()
    assert sorted(str(a["partition.branch"]) for a in actions) == ["None", "east", "north", "south"]
    for action in actions:
        stored = pq.read_schema(tmp_path / "t" / action["path"])
        assert "branch" not in stored.names, "Delta keeps partition values in the log, not the file"
    got = table.to_pyarrow_table().to_pandas().sort_values("account").reset_index(drop=True)
    pd.testing.assert_series_equal(got["branch"], frame["branch"].astype(got["branch"].dtype), check_names=False)
    later = stage(sink, 2, rows(3, start=50, branches=("south",)), subtasks=1)
    assert len(later) == 1
    sink.commit(2, later)
    assert Table(str(tmp_path / "t")).to_pyarrow_table().num_rows == 12


def test_dropping_checkpoints_removes_their_files_in_one_version_and_staging_of_losers_goes(tmp_path: Path):
    sink = sink_at(tmp_path / "t")
    for cid in (1, 2, 3):
        sink.commit(cid, stage(sink, cid, rows(4, start=4 * cid)))
    loser = stage(sink, 1, rows(2, start=900))  # an attempt at 1 that lost: never committed
    ahead = stage(sink, 5, rows(2, start=950))  # a killed run's checkpoint above every recorded one
    before = Table(str(tmp_path / "t")).version()
    assert sink.rollback(after=1) == [2, 3]
    table = Table(str(tmp_path / "t"))
    assert table.version() == before + 1, "one version removes both checkpoints"
    assert set(table.to_pyarrow_table().to_pandas()["checkpoint_id"]) == {1}
    table.load_as_version(before)
    assert table.to_pyarrow_table().num_rows == 12, "the older version still reads (time travel)"
    sink.discard_staging(up_to=5)
    left = {p.relative_to(tmp_path / "t").as_posix()
            for p in (tmp_path / "t" / "sparkpoint-ledger").rglob("*.parquet")}
    assert not set(loser) & left and not set(ahead) & left, "files no commit named are deleted"
    assert Table(str(tmp_path / "t")).to_pyarrow_table().num_rows == 4, "the table still reads"
    dropped = [p for p in left if "/chk-2/" in p or "/chk-3/" in p]
    assert len(dropped) == 4, "a rolled-back checkpoint's files stay for time travel (VACUUM's)"
    assert len([p for p in left if "/chk-1/" in p]) == 2, "a committed checkpoint's own files stay"


def test_an_aborted_attempts_staged_files_go_but_never_committed_ones(tmp_path: Path):
    sink = sink_at(tmp_path / "t")
    committed = stage(sink, 1, rows(4))
    sink.commit(1, committed)
    aborted = stage(sink, 2, rows(4, start=10))
    sink.discard_staged(2, aborted)
    sink.discard_staged(1, committed)  # a confused abort of a committed checkpoint: kept
    assert all((tmp_path / "t" / rel).exists() for rel in committed)
    assert not any((tmp_path / "t" / rel).exists() for rel in aborted)
    with pytest.raises(SinkError, match="is not a staged file of checkpoint 2"):
        sink.discard_staged(2, ["../../etc/passwd"])


def test_a_table_that_forgets_app_transactions_too_soon_is_refused_with_the_number_to_change(tmp_path: Path):
    sink = sink_at(tmp_path / "t")
    sink.commit(1, stage(sink, 1, rows(2)))
    Table(str(tmp_path / "t")).alter.set_table_properties({"delta.setTransactionRetentionDuration": "interval 2 days"})
    with pytest.raises(SinkRetentionTooShort, match=r"after interval 2 days .*7 days .*'interval 7 days'"):
        sink.check_start(DECLARED)
    sink_at(tmp_path / "t", replay_window=36 * 3600.0).check_start(DECLARED)  # a window it covers
    assert interval_seconds("interval 1 week") == 7 * 86400 and interval_seconds("3 hours") == 3 * 3600
    assert interval_seconds("forever") is None


def test_a_table_that_cannot_take_the_declared_columns_is_refused_naming_them(tmp_path: Path):
    path = tmp_path / "t"
    write_deltalake(str(path), pa.table({"account": ["x"], "branch": ["y"], "balance": pa.array([1], pa.int32()),
                                         "checkpoint_id": pa.array([0], pa.int64())}))
    sink = sink_at(path)
    with pytest.raises(SinkSchemaMismatch, match=r"balance \(double; the table has int32\)"):
        sink.check_start(DECLARED)
    path2 = tmp_path / "t2"
    write_deltalake(str(path2), pa.table({"account": ["x"], "branch": ["y"], "balance": [1.0],
                                          "checkpoint_id": pa.array([0], pa.int64())}))
    with pytest.raises(SinkSchemaMismatch, match=r"lacks: moves \(int64\).*output_schema_evolution"):
        sink_at(path2).check_start(DECLARED)
    sink_at(path2, evolve_schema=True).check_start(DECLARED)
    assert "moves" in Table(str(path2)).schema().to_arrow().names, "the sink added the column"
    evolved = sink_at(path2, evolve_schema=True)
    evolved.commit(1, stage(evolved, 1, rows(2)))
    assert Table(str(path2)).to_pyarrow_table().num_rows == 3
    partitioned = tmp_path / "t3"
    write_deltalake(str(partitioned), pa.table({"region": ["x"], "balance": [1.0]}), partition_by=["region"])
    with pytest.raises(SinkSchemaMismatch, match="emits no column region, which the Delta table .* partitioned by"):
        sink_at(partitioned, evolve_schema=True).check_start(DECLARED)


def test_rows_that_do_not_fit_the_table_fail_the_task_before_any_commit(tmp_path: Path):
    sink = sink_at(tmp_path / "t")
    sink.commit(1, stage(sink, 1, rows(2)))
    tasks = sink.for_tasks()
    with pytest.raises(SinkSchemaMismatch, match=r"lacks: note \(.*string\)"):
        tasks.stage(2, "balances", 0, rows(2).assign(note="x"))
    with pytest.raises(SinkSchemaMismatch, match=r"balance \(.*string; the table has double\)"):
        tasks.stage(2, "balances", 0, rows(2).assign(balance="lots"))
    widened = tasks.stage(2, "balances", 0, rows(2).assign(moves=pd.Series([1, 2], dtype="int32")))
    assert sink.commit(2, widened) == 1, "an int32 column goes into the table's int64 column"


def test_staged_names_carry_no_path_outside_the_jobs_prefix(tmp_path: Path):
    sink = sink_at(tmp_path / "t")
    staged = stage(sink, 7, rows(2), subtasks=1)
    assert [s.split("/")[:2] for s in staged] == [["sparkpoint-ledger", "chk-7"]]
    assert b"pandas" not in (pq.read_schema(tmp_path / "t" / staged[0]).metadata or {})
    with pytest.raises(SinkError):
        sink.commit(8, staged)  # another checkpoint's names
