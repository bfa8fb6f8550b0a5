"""Table sources without Spark (issue 45, items 5 and 6): a Delta or Iceberg table's commits as
batches, the offset a checkpoint records (the version reached, not a list of files), compactions
passed over by themselves, a delete refused / skipped / read as a change feed, a vacuumed table's
message, and the `--input` / `--conf iceberg.catalog.*` forms."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pytest
from deltalake import DeltaTable as DeltaRs
from deltalake import write_deltalake

from sparkpoint.spark.offsets import SourceError, SourceOffsets
from sparkpoint.spark.source import InputNeeds, ParquetDirectorySource
from sparkpoint.spark.tablesource import TableSource, open_source
from sparkpoint.tables.conf import split_catalog_conf
from sparkpoint.tables.source import TableChangeRefused, TableOffset, TableVersionsGone
from sparkpoint.tables.spec import DeltaTable, IcebergTable
from tests.support.shop_tables import orders

NEEDS = InputNeeds(columns={"spend": ("customer", "amount", "region")}, keys={"spend": ("customer", "string")},
                   event_time="ordered_at")


def delta(tmp_path: Path, batches: int = 2, **kwargs: object) -> str:
    url = str(tmp_path / "orders")
    for b in range(batches):
        write_deltalake(url, orders(b), partition_by=["region"], mode="append", **kwargs)  # type: ignore[arg-type]
    return url


def consume(source: TableSource, offsets: SourceOffsets, n: int) -> SourceOffsets:
    return source.advance(offsets, source.pending(offsets)[:n])


def test_directory_offsets_read_as_before_and_table_offsets_round_trip():
    old = {"version": 1, "consumed": ["a.parquet", "b.parquet"]}
    assert SourceOffsets.from_json(old) == SourceOffsets(("a.parquet", "b.parquet"))
    assert SourceOffsets.from_json(old).to_json() == old, "a directory's offsets are written as before"
    table = SourceOffsets((), TableOffset("iceberg", "iceberg://default/ns.t", 123, 2))
    assert table.to_json() == {"version": 2, "consumed": [], "table": {
        "format": "iceberg", "table": "iceberg://default/ns.t", "snapshot_id": 123, "position": 2}}
    assert SourceOffsets.from_json(table.to_json()) == table
    with pytest.raises(SourceError, match="not sparkpoint table offsets"):
        SourceOffsets.from_json({"version": 2, "table": {"format": "hudi", "version": 1}})


def test_a_delta_table_is_read_version_by_version_and_the_offset_does_not_grow(tmp_path: Path):
    source = open_source(DeltaTable(delta(tmp_path, 3)), {})
    assert isinstance(source, TableSource)
    start = SourceOffsets(())
    names = source.pending(start)
    assert len(names) == 6 and all(n.startswith("region=") for n in names), "2 partitions x 3 versions"
    one = source.advance(start, names[:1])
    assert one.table == TableOffset("delta", source.url, 0, 1), "the first file of version 0"
    assert source.pending(one) == names[1:]
    done = consume(source, one, 5)
    assert done.to_json()["table"] == {"format": "delta", "table": source.url, "version": 2}
    assert source.pending(done) == []
    assert not any(n in str(done.to_json()) for n in names), "the offset names the version, not the files"
    with pytest.raises(SourceError, match="consumed in commit order"):
        source.advance(start, names[1:2])


def test_partition_values_reach_the_rows_and_the_checks(tmp_path: Path):
    source = open_source(DeltaTable(delta(tmp_path, 1)), {})
    names = source.pending(SourceOffsets(()))
    verdicts = source.check_files(names, NEEDS)
    assert all(v.ok for v in verdicts), verdicts
    assert all(v.max_event_time is not None for v in verdicts), "the event time comes from the footers"
    rows = pd.concat([source.read(n, ["customer", "amount", "region"]) for n in names], ignore_index=True)
    want = orders(0).to_pandas()
    assert sorted(zip(rows["customer"], rows["amount"], rows["region"])) == \
        sorted(zip(want["customer"], want["amount"], want["region"]))
    columns = source.file_columns(names)
    assert {dict(c)["region"].as_py() for c in columns.values()} == {"north", "south"}
    assert set(columns) == {source.url_of(n) for n in names}


def test_a_compaction_is_passed_over_by_itself(tmp_path: Path):
    url = delta(tmp_path, 2)
    source = open_source(DeltaTable(url), {})
    after = consume(source, SourceOffsets(()), 4)
    DeltaRs(url).optimize.compact()
    write_deltalake(url, orders(2), mode="append")
    assert [source._planned[n].version for n in source.pending(after)] == [3, 3], "version 2 (OPTIMIZE) passed over"


def test_a_delete_is_refused_naming_the_version_skipped_or_read_as_a_change_feed(tmp_path: Path):
    url = delta(tmp_path, 1, configuration={"delta.enableChangeDataFeed": "true"})
    write_deltalake(url, orders(1), mode="append")
    DeltaRs(url).delete("customer = 'c1'")
    write_deltalake(url, orders(3), mode="append")
    refusing = open_source(DeltaTable(url), {})
    before = refusing.pending(SourceOffsets(()))
    assert len(before) == 4, "the appends before the delete are read"
    at_delete = refusing.advance(SourceOffsets(()), before)
    with pytest.raises(TableChangeRefused, match=r"version 2 \(DELETE\) removes or rewrites rows.*"
                                                  r"source.table.changes=skip.*source.table.changes=feed"):
        refusing.pending(at_delete)

    skipping = open_source(DeltaTable(url), {}, changes="skip")
    assert [skipping._planned[n].version for n in skipping.pending(at_delete)] == [3, 3]

    feeding = open_source(DeltaTable(url), {}, changes="feed")
    changes = feeding.pending(at_delete)
    assert changes[0].startswith("_change_data/")
    fed = feeding.read(changes[0], ["customer", "amount", "_change_type", "region"])
    cdf = pa.table(DeltaRs(url).load_cdf(starting_version=2, ending_version=2).read_all()).to_pandas()
    deleted = pd.concat([feeding.read(n) for n in changes if feeding._planned[n].version == 2])
    assert sorted(zip(deleted["customer"], deleted["amount"], deleted["_change_type"])) == \
        sorted(zip(cdf["customer"], cdf["amount"], cdf["_change_type"])), "the change feed load_cdf reads"
    assert set(fed["_change_type"]) == {"delete"}
    appended = feeding.read(changes[-1], ["customer", "_change_type"])
    assert set(appended["_change_type"]) == {"insert"}, "an append read as a feed is inserts"


def test_a_vacuumed_log_fails_with_the_versions_left_and_the_command(tmp_path: Path):
    url = delta(tmp_path, 4)
    source = open_source(DeltaTable(url), {})
    at_one = consume(source, SourceOffsets(()), 2)  # version 0 consumed
    DeltaRs(url).create_checkpoint()  # at version 3; a log clean-up then drops the commits before it
    for v in (0, 1, 2):
        os.remove(Path(url) / "_delta_log" / f"{v:020d}.json")
    fresh = open_source(DeltaTable(url), {})
    with pytest.raises(TableVersionsGone) as gone:
        fresh.pending(at_one)
    said = str(gone.value)
    for part in ("no longer has version 1", "it has versions 3.", "nothing was read",
                 "sparkpoint run --pipeline MODULE:ATTR --conf source.table.resume-from=<version>"):
        assert part in said, said
    resumed = open_source(DeltaTable(url), {}, resume_from=3)
    assert [resumed._planned[n].version for n in resumed.pending(at_one)] == [3, 3]


def test_a_vacuumed_data_file_fails_with_the_versions_left(tmp_path: Path):
    url = delta(tmp_path, 2)
    source = open_source(DeltaTable(url), {})
    names = source.pending(SourceOffsets(()))
    os.remove(Path(url) / names[0])
    with pytest.raises(TableVersionsGone, match=re.escape(f"data file {names[0]} of version 0 is gone")):
        source.check_files(names, NEEDS)


def test_a_job_keeps_its_input_kind(tmp_path: Path):
    (tmp_path / "in").mkdir()
    directory = ParquetDirectorySource(str(tmp_path / "in"))
    table_offsets = SourceOffsets((), TableOffset("delta", "delta+file:///x", 3))
    with pytest.raises(SourceError, match="those of input table delta\\+file:///x .*a job keeps the input"):
        directory.pending(table_offsets)
    table = open_source(DeltaTable(delta(tmp_path, 1)), {})
    with pytest.raises(SourceError, match="a directory's .*this job's input is table"):
        table.pending(SourceOffsets(("a.parquet",)))


def iceberg(tmp_path: Path) -> tuple[IcebergTable, object]:
    from pyiceberg.catalog import load_catalog

    properties = {"type": "sql", "uri": f"sqlite:///{tmp_path}/catalog.db", "warehouse": f"file://{tmp_path}/wh"}
    catalog = load_catalog("shop", **properties)
    catalog.create_namespace("sales")
    table = catalog.create_table("sales.orders", schema=orders(0).schema)
    return IcebergTable("sales.orders", catalog={"name": "shop", **properties}), table


def test_an_iceberg_table_is_read_snapshot_by_snapshot_and_a_delete_is_refused(tmp_path: Path):
    spec, table = iceberg(tmp_path)
    table.append(orders(0))  # type: ignore[attr-defined]
    table.append(orders(1))  # type: ignore[attr-defined]
    source = open_source(spec, {})
    names = source.pending(SourceOffsets(()))
    assert len(names) == 2 and all(n.startswith("file://") for n in names)
    assert all(v.ok for v in source.check_files(names, NEEDS))
    after = source.advance(SourceOffsets(()), names)
    assert after.table is not None and after.table.format == "iceberg"
    assert after.table.version == table.refresh().current_snapshot().snapshot_id  # type: ignore[attr-defined]
    table.delete("customer = 'c1'")  # type: ignore[attr-defined]
    with pytest.raises(TableChangeRefused, match=r"snapshot \d+ \((overwrite|delete)\) removes or rewrites rows"):
        open_source(spec, {}).pending(after)
    assert open_source(spec, {}, changes="skip").pending(after) == []
    with pytest.raises(TableChangeRefused, match="pyiceberg does not give"):
        open_source(spec, {}, changes="feed")


def test_iceberg_catalog_properties_come_from_conf_and_the_input_flag_names_a_table(tmp_path: Path):
    from sparkpoint.cli.run import run_config

    catalog, rest = split_catalog_conf({"iceberg.catalog.uri": "sqlite:///c.db", "parallelism.default": "3"})
    assert (catalog, rest) == ({"uri": "sqlite:///c.db"}, {"parallelism.default": "3"})
    args = argparse.Namespace(
        conf=["iceberg.catalog.uri=sqlite:///c.db", "iceberg.catalog.warehouse=file:///wh",
              "source.table.changes=skip"],
        input="iceberg://lake/sales.orders", checkpoints=str(tmp_path / "ckpt"), job_id="j", output=None,
        max_batches=None, local_dir=None, storage_options=None, pipeline=None)
    _, config, _ = run_config(args)
    assert config.input_table == IcebergTable("sales.orders", catalog={"uri": "sqlite:///c.db",
                                                                       "warehouse": "file:///wh", "name": "lake"})
    assert (config.input_url, config.table_changes) == ("iceberg://lake/sales.orders", "skip")
    args.input, args.conf = "delta+file:///lake/orders", []
    _, config, _ = run_config(args)
    assert config.input_table == DeltaTable("file:///lake/orders")


def test_a_pipeline_takes_a_table_as_input_beside_input_url(tmp_path: Path):
    from sparkpoint import KeyedOperator, Pipeline
    from sparkpoint.pipeline.runtime import PipelineError

    op = KeyedOperator("x", key="k", process=lambda b, s: None, export=lambda s: pd.DataFrame())
    config = Pipeline("p", [op], input=DeltaTable("/lake/orders")).config()
    assert (config.input_table, config.input_url) == (DeltaTable("/lake/orders"), "delta+file:///lake/orders")
    assert Pipeline("p", [op], input="delta+s3://b/t").config().input_table == DeltaTable("s3://b/t")
    table = Pipeline("p", [op], input=IcebergTable("ns.t", catalog={"name": "lake", "uri": "sqlite:///c.db"}))
    assert table.config(input_url="iceberg://lake/ns.t").input_table == table.input, "a resource's same input"
    assert table.config(input_url="/data/in").input_table is None, "a resource's directory instead"
    with pytest.raises(PipelineError, match="input_url .* or input .*not both"):
        Pipeline("p", [op], input_url="in", input=DeltaTable("/lake/orders"))
    with pytest.raises(PipelineError, match="table_changes must be one of fail, skip, feed"):
        Pipeline("p", [op], input=DeltaTable("/lake/orders"), table_changes="ignore")


def test_following_a_table_takes_new_versions_in_commit_order(tmp_path: Path):
    from sparkpoint.pipeline.follow import Inbox
    from sparkpoint.pipeline.runtime import BatchStart

    url = delta(tmp_path, 1)
    source = open_source(DeltaTable(url), {})
    inbox = Inbox(source.watch())
    inbox.sync(BatchStart(None, SourceOffsets(())))
    inbox.poll()
    assert [source._planned[n].version for n in inbox.pending] == [0, 0]
    write_deltalake(url, orders(1), mode="append")
    DeltaRs(url).optimize.compact()
    write_deltalake(url, orders(2), mode="append")
    inbox.poll()
    assert [source._planned[n].version for n in inbox.pending] == [0, 0, 1, 1, 3, 3], "the compaction passed over"
    inbox.poll()
    assert len(inbox.pending) == 6, "a poll adds only what is new"
    DeltaRs(url).delete("customer = 'c1'")
    inbox.poll()  # the refusal waits until the files before it are taken
    inbox.pending.clear()
    with pytest.raises(TableChangeRefused, match=r"version 4 \(DELETE\)"):
        inbox.poll()


def test_sparkpoint_skip_takes_a_tables_next_file_only(tmp_path: Path):
    from sparkpoint.pipeline.driver import StatefulPipeline
    from sparkpoint.pipeline.runtime import PipelineError
    from sparkpoint.pipeline.skipping import skip_file
    from sparkpoint.spark.source import BadInputFile
    from tests.support.shop_tables import shop

    url = str(tmp_path / "orders")
    bad = orders(0).set_column(0, "customer", pa.array([None] * 40, pa.string()))  # null keys
    write_deltalake(url, bad)
    write_deltalake(url, orders(1), mode="append")
    pipeline = shop(tmp_path, DeltaTable(url))
    driver = StatefulPipeline(None, pipeline.config(), pipeline.operators)
    first, second = driver.pending_files()
    with pytest.raises(BadInputFile, match="key column 'customer' has 40 null value"):
        driver.check_batch(driver.next_batch())
    with pytest.raises(PipelineError, match=f"cannot skip {second!r}: .*consumed in commit order.*the next is "
                                            f"{first!r}, of version 0"):
        skip_file(driver, second, "not the next one")
    report, meta = skip_file(driver, first, "null customers")
    assert [s.file for s in report.skipped] == [first]
    assert meta.source_offsets["source"]["table"]["version"] == 0
    assert driver.pending_files() == [second]


def test_a_batch_ends_before_the_file_that_would_pass_the_bytes_bound(tmp_path: Path):
    import numpy as np

    from sparkpoint.pipeline.driver import StatefulPipeline
    from tests.support.shop_tables import shop, spend_per_customer

    url = str(tmp_path / "orders")
    for seed in (1, 2, 3):  # about 0.8 MB each: random doubles do not compress
        values = np.random.default_rng(seed).random(100_000)
        write_deltalake(url, pa.table({"customer": ["c0"] * 100_000, "amount": values}), mode="append")
    pipeline = shop(tmp_path, DeltaTable(url), spend_per_customer, files_per_checkpoint=10)
    assert len(StatefulPipeline(None, pipeline.config(), pipeline.operators).next_batch()) == 3
    bounded = pipeline.with_settings({"max_input_mb_per_checkpoint": "2mb"})
    assert len(StatefulPipeline(None, bounded.config(), bounded.operators).next_batch()) == 2
    tiny = pipeline.with_settings({"max-input-mb-per-checkpoint": "1"})
    assert len(StatefulPipeline(None, tiny.config(), tiny.operators).next_batch()) == 1, "one file whatever its size"
