"""The Iceberg sink, driven as the tasks and the driver drive it (no Spark): pandas frames of a
user's own operator staged per subtask, committed per checkpoint into a pyiceberg SQL catalog on
SQLite, with other writers of the same table beside it."""

from __future__ import annotations

import pickle
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import date, datetime, timedelta
from pathlib import Path
from typing import Any

import fsspec
import pandas as pd
import pyarrow as pa
import pytest
from pyiceberg.catalog import Catalog, load_catalog
from pyiceberg.partitioning import PartitionField, PartitionSpec
from pyiceberg.schema import Schema
from pyiceberg.table import Table
from pyiceberg.transforms import BucketTransform, DayTransform, IdentityTransform
from pyiceberg.types import DoubleType, IntegerType, LongType, NestedField, StringType, TimestampType

from sparkpoint.checkpoint.interleave import set_step_hook
from sparkpoint.tables.iceberg import (
    CHECKPOINT,
    JOB,
    OPERATOR,
    IcebergSchemaMismatch,
    IcebergSink,
    IcebergSinkFenced,
    IcebergStagedFileLost,
    check_schema,
    evolve_schema,
    output_facts,
    prepare_table,
    table_storage,
)
from sparkpoint.tables.sink import SinkError
from sparkpoint.tables.spec import IcebergTable
from tests.conftest import s3_options

OPERATORS = {"session_stats": "uid-sessions-v2", "page_reach": "uid-reach-v1"}
TABLE = "web.session_stats"


def catalog_props(tmp_path: Path) -> dict[str, str]:
    return {"name": "lake", "type": "sql", "uri": f"sqlite:///{tmp_path}/catalog.db", "warehouse": f"file://{tmp_path}/wh"}


def open_sink(tmp_path: Path, job: str = "sessions-job", identifier: str = TABLE, **catalog: str) -> IcebergSink:
    return IcebergSink.at(IcebergTable(identifier, catalog={**catalog_props(tmp_path), **catalog}), job, OPERATORS)


def the_catalog(tmp_path: Path) -> Catalog:
    props = catalog_props(tmp_path)
    return load_catalog(props.pop("name"), **props)


def sessions(checkpoint: int, subtask: int, n: int = 4) -> pd.DataFrame:
    """A user's operator output: sessions with their clicks, duration and last click (not the sample's columns)."""
    return pd.DataFrame({
        "session_id": [f"s{checkpoint}-{subtask}-{i}" for i in range(n)],
        "country": [["fr", "de", "jp"][i % 3] for i in range(n)],
        "clicks": pd.Series([i + 10 * checkpoint for i in range(n)], dtype="int64"),
        "duration_s": [1.5 * i for i in range(n)],
        "last_click": pd.to_datetime([f"2024-03-0{1 + i % 2} 10:00:00.123456789" for i in range(n)]),
    })


def stage_checkpoint(sink: IcebergSink, checkpoint: int, subtasks: int = 2) -> tuple[list[str], pd.DataFrame]:
    staged, frames = [], []
    for subtask in range(subtasks):
        rows = sessions(checkpoint, subtask)
        staged += sink.stage(checkpoint, "session_stats", subtask, rows)
        frames.append(rows.assign(checkpoint_id=checkpoint))
    return staged, pd.concat(frames, ignore_index=True)


def table_rows(table: Table) -> pd.DataFrame:
    return table.refresh().scan().to_pandas()


def ours(table: Table, job: str = "sessions-job") -> list[int]:
    """Checkpoint ids of the job's snapshots on the current branch, oldest first."""
    ids = []
    snapshot = table.refresh().current_snapshot()
    while snapshot is not None:
        summary = snapshot.summary.additional_properties if snapshot.summary else {}
        if summary.get(JOB) == job and CHECKPOINT in summary:
            ids.append(int(summary[CHECKPOINT]))
        snapshot = table.snapshot_by_id(snapshot.parent_snapshot_id) if snapshot.parent_snapshot_id else None
    return ids[::-1]


def by_session(frame: pd.DataFrame) -> pd.DataFrame:
    columns = ["session_id", "country", "clicks", "duration_s", "checkpoint_id"]
    return frame[columns].sort_values("session_id").reset_index(drop=True)


def foreign_rows(tag: str, n: int = 3) -> pa.Table:
    """Rows another writer of the table appends (no checkpoint id)."""
    return pa.table({
        "session_id": pa.array([f"{tag}-{i}" for i in range(n)], pa.large_string()),
        "country": pa.array(["us"] * n, pa.large_string()),
        "clicks": pa.array([1] * n, pa.int64()),
        "duration_s": pa.array([0.5] * n, pa.float64()),
        "last_click": pa.array([pd.Timestamp("2024-01-01")] * n, pa.timestamp("us")),
        "checkpoint_id": pa.array([None] * n, pa.int64()),
    })


@contextmanager
def before_table_commit(sink: IcebergSink, action: Callable[[], None]) -> Iterator[None]:
    """Run `action` once, right before the sink's first table commit (after it read the table)."""
    done: list[bool] = []

    def hook(op: str, path: str) -> None:
        if op == "create" and path.startswith(sink.url + "#") and not done:
            done.append(True)
            action()

    previous = set_step_hook(hook)
    try:
        yield
    finally:
        set_step_hook(previous)


def test_commit_makes_exactly_the_staged_rows_visible_with_the_flink_summary(tmp_path: Path) -> None:
    sink = open_sink(tmp_path)
    staged, expected = stage_checkpoint(sink, 1)

    assert sink.commit(1, staged) == 2

    table = the_catalog(tmp_path).load_table(TABLE)
    pd.testing.assert_frame_equal(by_session(table_rows(table)), by_session(expected))
    summary = table.current_snapshot().summary
    assert summary[JOB] == "sessions-job" and summary[CHECKPOINT] == "1"
    assert summary[OPERATOR] == "uid-reach-v1,uid-sessions-v2"
    current = table.current_snapshot().snapshot_id
    assert table.snapshot_by_name("sparkpoint-sessions-job-chk-1").snapshot_id == current
    assert table.snapshot_by_name("sparkpoint-sessions-job-latest").snapshot_id == current
    assert table_rows(table)["last_click"].iloc[0].microsecond == 123456  # nanoseconds cut to Iceberg's microseconds
    assert sorted(sink.committed()) == [1]
    assert sorted(sink.committed()[1]) == sorted(f"{sink.prefix}/{name}" for name in staged)
    facts = output_facts(sink, 1, staged)
    assert (facts["files"], facts["rows"], facts["snapshot_id"]) == (2, 8, current)
    assert facts["columns"]["clicks"] == "long" and facts["unreadable"] == []


def test_one_snapshot_per_checkpoint_with_rows_none_without(tmp_path: Path) -> None:
    sink = open_sink(tmp_path)
    for checkpoint in (1, 2, 3, 4):
        if checkpoint == 3:
            staged = sink.stage(3, "session_stats", 0, sessions(3, 0, n=0))
        else:
            staged = stage_checkpoint(sink, checkpoint)[0]
        sink.commit(checkpoint, staged)

    table = the_catalog(tmp_path).load_table(TABLE)
    assert ours(table) == [1, 2, 4]
    assert len(table.snapshots()) == 3
    assert sorted(table_rows(table)["checkpoint_id"].unique()) == [1, 2, 4]


def test_a_repeated_resumed_or_second_process_commit_adds_nothing(tmp_path: Path) -> None:
    sink = open_sink(tmp_path)
    staged, expected = stage_checkpoint(sink, 7)
    sink.commit(7, staged)

    assert sink.commit(7, staged) == 0
    assert sink.commit(7, staged, resuming=True) == 0
    second_process = pickle.loads(pickle.dumps(open_sink(tmp_path)))
    assert second_process.commit(7, staged) == 0

    table = the_catalog(tmp_path).load_table(TABLE)
    assert ours(table) == [7]
    pd.testing.assert_frame_equal(by_session(table_rows(table)), by_session(expected))


def test_staged_files_gone_are_lost_output_unless_a_resumed_commit_finished_before(tmp_path: Path) -> None:
    sink = open_sink(tmp_path)
    staged = stage_checkpoint(sink, 1)[0]
    fs, root = fsspec.core.url_to_fs(sink.prefix)
    fs.rm(f"{root}/chk-1", recursive=True)

    assert sink.commit(1, staged, resuming=True) == 0
    with pytest.raises(IcebergStagedFileLost, match=r"checkpoint 1 is committed with staged output .*chk-1/session_"):
        sink.commit(1, staged)
    assert sink.committed() == {}


def test_a_checkpoint_older_than_the_tables_newest_is_fenced(tmp_path: Path) -> None:
    sink = open_sink(tmp_path)
    sink.commit(5, stage_checkpoint(sink, 5)[0])
    zombie_staged = stage_checkpoint(sink, 4)[0]

    with pytest.raises(IcebergSinkFenced, match=r"checkpoint 4 of job sessions-job is older than checkpoint 5"):
        sink.commit(4, zombie_staged)

    table = the_catalog(tmp_path).load_table(TABLE)
    assert ours(table) == [5]
    assert set(table_rows(table)["checkpoint_id"]) == {5}


def test_tags_keep_the_newest_checkpoints_and_the_record_survives_snapshot_expiry(tmp_path: Path) -> None:
    sink = replace(open_sink(tmp_path), checkpoint_tags=2)
    staged = {}
    for checkpoint in (1, 2, 3, 4):
        staged[checkpoint] = stage_checkpoint(sink, checkpoint)[0]
        sink.commit(checkpoint, staged[checkpoint])
    table = the_catalog(tmp_path).load_table(TABLE)
    table.append(foreign_rows("etl"))

    table.maintenance.expire_snapshots().older_than(datetime.now() + timedelta(seconds=1)).commit()

    table = the_catalog(tmp_path).load_table(TABLE)
    assert sorted(name for name in table.metadata.refs if name != "main") == [
        "sparkpoint-sessions-job-chk-3", "sparkpoint-sessions-job-chk-4", "sparkpoint-sessions-job-latest"]
    assert len(table.snapshots()) == 3  # the tagged ones and the current one: 1 and 2 expired
    assert sink.commit(4, staged[4]) == 0
    assert sink.commit(1, staged[1], resuming=True) == 0  # expired, but older than the newest it records
    with pytest.raises(IcebergSinkFenced):
        sink.commit(2, staged[2])
    assert len(table_rows(table)) == 4 * 8 + 3


def test_another_job_writing_the_same_table_is_not_a_fence(tmp_path: Path) -> None:
    mine, theirs = open_sink(tmp_path), open_sink(tmp_path, job="sessions-job-2024")
    theirs.commit(9, stage_checkpoint(theirs, 9)[0])

    assert mine.commit(3, stage_checkpoint(mine, 3)[0]) == 2
    assert sorted(mine.committed()) == [3] and sorted(theirs.committed()) == [9]


def test_a_second_completer_committing_the_same_checkpoint_first_wins_alone(tmp_path: Path) -> None:
    sink = open_sink(tmp_path)
    sink.commit(1, stage_checkpoint(sink, 1)[0])
    staged, _ = stage_checkpoint(sink, 2)
    other = open_sink(tmp_path)

    with before_table_commit(sink, lambda: other.commit(2, staged)):
        assert sink.commit(2, staged) == 0  # lost the race, read the table again: checkpoint 2 is there

    table = the_catalog(tmp_path).load_table(TABLE)
    assert ours(table) == [1, 2]
    assert (table_rows(table)["checkpoint_id"] == 2).sum() == 8


def test_a_commit_that_lost_to_an_unrelated_writer_is_retried(tmp_path: Path) -> None:
    sink = open_sink(tmp_path)
    sink.commit(1, stage_checkpoint(sink, 1)[0])
    staged, _ = stage_checkpoint(sink, 2)
    foreign = the_catalog(tmp_path).load_table(TABLE)

    with before_table_commit(sink, lambda: foreign.append(foreign_rows("etl"))):
        assert sink.commit(2, staged) == 2

    table = the_catalog(tmp_path).load_table(TABLE)
    assert ours(table) == [1, 2]
    assert [s.summary.get(CHECKPOINT) for s in table.snapshots()] == ["1", None, "2"]
    assert len(table_rows(table)) == 16 + 3


def test_a_concurrent_appender_neither_fails_our_commits_nor_loses_or_doubles_rows(tmp_path: Path) -> None:
    sink = open_sink(tmp_path)
    staged, expected = stage_checkpoint(sink, 1)
    sink.commit(1, staged)
    frames, appended, stop = [expected], [], threading.Event()

    def appender() -> None:
        table = the_catalog(tmp_path).load_table(TABLE)
        while not stop.wait(0.02):  # a busy writer: about as many commits as ours, in between them
            table.append(foreign_rows(f"etl{len(appended)}"))
            appended.append(1)

    thread = threading.Thread(target=appender)
    thread.start()
    try:
        for checkpoint in range(2, 9):
            staged, rows = stage_checkpoint(sink, checkpoint)
            assert sink.commit(checkpoint, staged) == 2
            frames.append(rows)
    finally:
        stop.set()
        thread.join()

    table = the_catalog(tmp_path).load_table(TABLE)
    rows = table_rows(table)
    assert ours(table) == list(range(1, 9))
    mine = rows[rows["checkpoint_id"].notna()].astype({"checkpoint_id": "int64"})
    pd.testing.assert_frame_equal(by_session(mine), by_session(pd.concat(frames, ignore_index=True)))
    assert appended and (rows["checkpoint_id"].isna()).sum() == 3 * len(appended)


def test_drop_and_rollback_remove_exactly_our_files_and_keep_foreign_rows(tmp_path: Path) -> None:
    sink = open_sink(tmp_path)
    foreign = None
    for checkpoint in (1, 2, 3, 4):
        sink.commit(checkpoint, stage_checkpoint(sink, checkpoint)[0])
        foreign = foreign or the_catalog(tmp_path).load_table(TABLE)
        foreign.append(foreign_rows(f"etl{checkpoint}"))

    assert sink.drop([2, 99]) == [2]
    assert sink.rollback(after=3) == [4]
    assert sink.rollback(after=3) == []

    table = the_catalog(tmp_path).load_table(TABLE)
    rows = table_rows(table)
    assert sorted(rows["checkpoint_id"].dropna().unique()) == [1, 3]
    assert (rows["checkpoint_id"].isna()).sum() == 12  # every foreign row stays
    assert sorted(sink.committed()) == [1, 3]
    deletes = [s for s in table.snapshots() if s.summary.operation.value == "delete"]
    assert [d.summary["sparkpoint.dropped-checkpoints"] for d in deletes] == ["2", "4"]
    assert all(d.summary[CHECKPOINT] is None for d in deletes)
    # The table still records 4: its zombie adds nothing; the replay goes on with new ids.
    assert sink.commit(4, stage_checkpoint(sink, 4)[0]) == 0
    assert sink.commit(5, stage_checkpoint(sink, 5)[0]) == 2
    assert sorted(sink.committed()) == [1, 3, 5]


def test_discard_staging_deletes_only_files_the_table_never_took(tmp_path: Path) -> None:
    sink = open_sink(tmp_path)
    committed, _ = stage_checkpoint(sink, 1)
    sink.commit(1, committed)
    other_attempt = sink.stage(1, "session_stats", 0, sessions(1, 0))  # a second attempt at 1, never committed
    abandoned = stage_checkpoint(sink, 2)[0]
    live_writer = stage_checkpoint(sink, 3)[0]
    fs, root = fsspec.core.url_to_fs(sink.prefix)

    sink.discard_staged(1, committed + other_attempt)  # an abort of the other attempt: committed files stay
    sink.discard_staging(up_to=2)

    present = {name for name in committed + other_attempt + abandoned + live_writer if fs.exists(f"{root}/{name}")}
    assert present == set(committed + live_writer)
    table = the_catalog(tmp_path).load_table(TABLE)
    assert len(table_rows(table)) == 8  # every committed file still reads


def test_a_partitioned_table_gets_a_file_per_partition_value(tmp_path: Path) -> None:
    catalog = the_catalog(tmp_path)
    catalog.create_namespace("web")
    schema = Schema(
        NestedField(1, "session_id", StringType()), NestedField(2, "country", StringType()),
        NestedField(3, "clicks", LongType()), NestedField(4, "duration_s", DoubleType()),
        NestedField(5, "last_click", TimestampType()), NestedField(6, "checkpoint_id", LongType()))
    spec = PartitionSpec(PartitionField(2, 1000, IdentityTransform(), "country"),
                         PartitionField(5, 1001, DayTransform(), "last_click_day"))
    catalog.create_table(TABLE, schema, partition_spec=spec)
    sink = open_sink(tmp_path)

    rows = pd.concat([sessions(1, 0, n=12), sessions(1, 1, n=1).assign(country=None)], ignore_index=True)
    staged = sink.stage(1, "session_stats", 0, rows)
    assert len(staged) == 7  # 3 countries x 2 days, and no country
    sink.commit(1, staged)

    table = catalog.load_table(TABLE)
    files = table.inspect.files().to_pylist()
    assert {(f["partition"]["country"], f["partition"]["last_click_day"]) for f in files} == {
        (country, date(2024, 3, day)) for country in ("fr", "de", "jp") for day in (1, 2)} | {(None, date(2024, 3, 1))}
    france = table.scan(row_filter="country == 'fr'").to_pandas()
    assert len(france) == 4 and set(france["country"]) == {"fr"}
    assert len(table_rows(table)) == 13


def test_a_partitioning_add_files_cannot_take_is_refused_at_open(tmp_path: Path) -> None:
    catalog = the_catalog(tmp_path)
    catalog.create_namespace("web")
    catalog.create_table(TABLE, Schema(NestedField(1, "session_id", StringType())),
                         partition_spec=PartitionSpec(PartitionField(1, 1000, BucketTransform(8), "sid_bucket")))

    with pytest.raises(IcebergSchemaMismatch, match=r"partitioned by bucket\[8\]\(session_id\)"):
        open_sink(tmp_path)


def test_the_schema_guard_names_columns_and_types_and_evolves_on_request(tmp_path: Path) -> None:
    catalog = the_catalog(tmp_path)
    catalog.create_namespace("web")
    catalog.create_table(TABLE, Schema(
        NestedField(1, "session_id", StringType(), required=True), NestedField(2, "clicks", IntegerType()),
        NestedField(3, "owner", StringType(), required=True)))
    sink = open_sink(tmp_path)
    output = pa.schema([("session_id", pa.string()), ("clicks", pa.int64()), ("duration_s", pa.float64())])

    problems = check_schema(sink, output)

    assert "column 'clicks' is long in the output but int in the table" in problems
    assert "column 'duration_s' (double) is not in the table" in problems
    assert "column 'checkpoint_id' (long) is not in the table" in problems
    assert "the table's required column 'owner' (string) is not among the output columns" in problems
    narrower = pa.schema([("session_id", pa.string()), ("clicks", pa.int16()), ("owner", pa.string())])
    # the sink's own column: the table must take it too
    assert check_schema(sink, narrower) == ["column 'checkpoint_id' (long) is not in the table"]

    with pytest.raises(IcebergSchemaMismatch, match=r"column 'session_id' is long in the output but string"):
        evolve_schema(sink, pa.schema([("session_id", pa.int64())]))
    catalog.load_table(TABLE).update_schema().make_column_optional("owner").commit()
    evolved = evolve_schema(sink, output)

    assert check_schema(evolved, output) == []
    assert str(catalog.load_table(TABLE).schema().find_field("clicks").field_type) == "long"
    rows = pd.DataFrame({"session_id": ["a", "b"], "clicks": pd.Series([1, 2], dtype="int32"),
                         "duration_s": [0.5, 1.0]})
    evolved.commit(1, evolved.stage(1, "session_stats", 0, rows))
    assert table_rows(catalog.load_table(TABLE))["clicks"].tolist() == [1, 2]


def test_prepare_table_creates_a_missing_table_from_the_output_columns(tmp_path: Path) -> None:
    sink = open_sink(tmp_path)
    columns = pa.Schema.from_pandas(sessions(1, 0), preserve_index=False)

    sink = prepare_table(sink, columns)

    schema = the_catalog(tmp_path).load_table(TABLE).schema()
    assert [(f.name, str(f.field_type)) for f in schema.fields] == [
        ("session_id", "string"), ("country", "string"), ("clicks", "long"), ("duration_s", "double"),
        ("last_click", "timestamp"), ("checkpoint_id", "long")]
    unknown_country = sessions(1, 0).assign(country=None)  # a batch whose column pandas cannot type
    sink.commit(1, sink.stage(1, "session_stats", 0, unknown_country))
    assert table_rows(the_catalog(tmp_path).load_table(TABLE))["country"].isna().all()


def test_prepare_table_refuses_or_evolves_by_the_setting(tmp_path: Path) -> None:
    sink = prepare_table(open_sink(tmp_path), pa.schema([("session_id", pa.string()), ("clicks", pa.int32())]))
    wider = pa.schema([("session_id", pa.string()), ("clicks", pa.int64()), ("country", pa.string())])

    refusal = (r"does not take the output of page_reach, session_stats \(refused before Spark starts\): column "
               r"'clicks' is long in the output but int in the table; column 'country' \(string\) is not in the table")
    with pytest.raises(IcebergSchemaMismatch, match=refusal):
        prepare_table(sink, wider)
    sink = prepare_table(sink, wider, evolve=True)

    assert check_schema(sink, wider) == []
    assert sink.commit(1, sink.stage(1, "session_stats", 0, sessions(1, 0)[["session_id", "clicks", "country"]])) == 1


def test_the_tables_storage_comes_from_its_catalog_else_from_the_pipelines_fsspec_options(tmp_path: Path) -> None:
    endpoint = "http://127.0.0.1:9"
    own = IcebergTable(TABLE, catalog={"uri": "sqlite:///x.db", "s3.endpoint": endpoint, "s3.access-key-id": "k",
                                       "s3.secret-access-key": "s", "s3.region": "eu-west-1"})
    props, options = table_storage(own, None, s3_options("http://elsewhere:1"))
    client = {"endpoint_url": endpoint, "region_name": "eu-west-1"}
    assert options == {"key": "k", "secret": "s", "client_kwargs": client}
    assert props["s3.endpoint"] == endpoint

    plain = IcebergTable(TABLE, catalog={"uri": "sqlite:///x.db"})
    props, options = table_storage(plain, None, s3_options(endpoint))
    assert options == s3_options(endpoint)
    assert (props["s3.endpoint"], props["s3.access-key-id"], props["s3.region"]) == (endpoint, "testing", "us-east-1")


def test_a_required_column_with_nulls_is_refused_in_the_task(tmp_path: Path) -> None:
    catalog = the_catalog(tmp_path)
    catalog.create_namespace("web")
    catalog.create_table(TABLE, Schema(NestedField(1, "session_id", StringType(), required=True),
                                       NestedField(2, "checkpoint_id", LongType())))
    sink = open_sink(tmp_path)

    with pytest.raises(SinkError, match=r"column 'session_id' holds nulls, but it is required"):
        sink.stage(1, "session_stats", 0, pd.DataFrame({"session_id": ["a", None]}))


def test_tasks_stage_without_the_catalog(tmp_path: Path) -> None:
    sink = open_sink(tmp_path)
    in_a_task = replace(pickle.loads(pickle.dumps(sink)), catalog=(("uri", "sqlite:////nonexistent/x.db"),))

    staged = in_a_task.stage(1, "session_stats", 3, sessions(1, 3))

    assert staged and all(name.startswith("chk-1/session_stats-00003-") for name in staged)
    assert len(pickle.dumps(sink)) < 2000
    assert sink.commit(1, staged) == 1


def test_the_embedded_default_catalog_and_a_catalog_named_nowhere(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setenv("PYICEBERG_HOME", str(tmp_path / "no-config"))
    embedded = str(tmp_path / ".sparkpoint" / "iceberg")
    sink = IcebergSink.at(IcebergTable("web.sessions"), "j", OPERATORS, embedded_dir=embedded)
    sink.commit(1, sink.stage(1, "session_stats", 0, sessions(1, 0)))

    table = load_catalog("default", uri=f"sqlite:///{tmp_path}/.sparkpoint/iceberg/catalog.db").load_table("web.sessions")
    assert len(table_rows(table)) == 4
    assert table.location() == f"file://{tmp_path}/.sparkpoint/iceberg/warehouse/web/sessions"
    with pytest.raises(SinkError, match=r"catalog 'nowhere' .* has no properties"):
        IcebergSink.at(IcebergTable("web.sessions", catalog={"name": "nowhere"}), "j", OPERATORS, embedded_dir=None)


@pytest.mark.s3
def test_on_s3_with_the_sqlite_catalog(tmp_path: Path, s3_endpoint: str) -> None:
    bucket = "lake-" + uuid.uuid4().hex[:10]
    fsspec.filesystem("s3", **s3_options(s3_endpoint)).mkdir(bucket)
    table = IcebergTable(TABLE, catalog={"name": "lake", "uri": f"sqlite:///{tmp_path}/catalog.db",
                                         "warehouse": f"s3://{bucket}/wh"})
    sink = IcebergSink.at(table, "sessions-job", OPERATORS, s3_options(s3_endpoint))

    expected = []
    for checkpoint in (1, 2, 3):
        staged, rows = stage_checkpoint(sink, checkpoint)
        sink.commit(checkpoint, staged)
        sink.commit(checkpoint, staged, resuming=True)
        expected.append(rows)
    abandoned = stage_checkpoint(sink, 4)[0]
    assert sink.rollback(after=2) == [3]
    sink.discard_staging(up_to=4)

    loaded = the_s3_catalog(tmp_path, s3_endpoint).load_table(TABLE)
    assert loaded.location() == f"s3://{bucket}/wh/web/session_stats"
    kept = pd.concat(expected[:2], ignore_index=True)
    pd.testing.assert_frame_equal(by_session(table_rows(loaded)), by_session(kept))
    assert ours(loaded) == [1, 2, 3]
    fs = fsspec.filesystem("s3", **s3_options(s3_endpoint))
    assert not any(fs.exists(f"{sink.prefix}/{name}") for name in abandoned)
    assert len(fs.find(f"{sink.prefix}/chk-3")) == 2  # dropped, but its snapshot (and tag) still reads them


def the_s3_catalog(tmp_path: Path, endpoint: str) -> Catalog:
    return load_catalog("lake", uri=f"sqlite:///{tmp_path}/catalog.db", **{
        "s3.endpoint": endpoint, "s3.access-key-id": "testing", "s3.secret-access-key": "testing",
        "s3.region": "us-east-1"})
