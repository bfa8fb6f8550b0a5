"""RocksDB's memory settings: parsed from our names and Flink's key, carried to every subtask."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import dagster as dg
import pytest

from sparkpoint.cli import main
from sparkpoint.pipeline.driver import StatefulPipeline
from sparkpoint.pipeline.settings import parse_megabytes, resolve_settings
from sparkpoint.resources import PipelineResources, ResourceConfigError, StateBackendResource
from sparkpoint.sample import pipeline as sample
from sparkpoint.state.engine.rocksdb import RocksDBOptions
from sparkpoint.state.sample import SAMPLE_OPERATORS
from tests.support.dagster_setup import by_role
from tests.test_pipeline import config, make_input


@pytest.mark.parametrize(("text", "mb"), [("256", 256), ("64mb", 64), ("1gb", 1024), ("1 GB", 1024),
                                          ("2048kb", 2), ("1t", 1 << 20)])
def test_sizes_read_as_whole_megabytes(text: str, mb: int):
    assert parse_megabytes(text) == mb


@pytest.mark.parametrize(("text", "message"), [("0", "at least 1"), ("512kb", "whole megabytes"),
                                               ("lots", "such as 256mb"), ("-5mb", "such as 256mb"),
                                               ("268435456", "give the unit")])
def test_a_size_that_is_not_whole_megabytes_is_refused_with_the_reason(text: str, message: str):
    with pytest.raises(ValueError, match=message):
        parse_megabytes(text)


def test_flink_key_and_our_names_become_one_rocksdb_options():
    settings = resolve_settings({"state.backend.rocksdb.block.cache-size": "64mb",
                                 "rocksdb_cache_index_and_filter_blocks": "false", "changelog": "true"})
    assert settings == {"changelog": True,
                        "rocksdb": RocksDBOptions(block_cache_mb=64, cache_index_and_filter_blocks=False)}
    assert "rocksdb" not in resolve_settings({"changelog": "false"})  # the defaults stay
    with pytest.raises(ValueError, match="between 1 and 1048576"):  # refused here, not in a Spark task
        resolve_settings({"state.backend.rocksdb.block.cache-size": "2tb"})
    with pytest.raises(ValueError, match="state.backend.rocksdb.block.cache-size"):
        resolve_settings({"state.backend.rocksdb.block.cache-size": "big"})


def test_the_least_sst_file_size_is_a_setting_and_a_bad_one_is_refused_when_resolved():
    assert resolve_settings({"rocksdb_min_file_mb": "8"}) == {"rocksdb": RocksDBOptions(min_file_mb=8.0)}
    with pytest.raises(ValueError, match="min_file_mb must be above 0 and at most 64"):
        resolve_settings({"rocksdb_min_file_mb": "100"})


def test_run_refuses_a_bad_cache_size_before_starting_spark(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    make_input(tmp_path, batches=1)
    code = main(["run", "--input", str(tmp_path / "in"), "--checkpoints", f"file://{tmp_path}/c", "--job-id", "j",
                 "--conf", "state.backend.rocksdb.block.cache-size=0"])
    assert code == 2
    assert "block.cache-size" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_the_state_backend_resource_carries_the_cache_size(tmp_path: Path):
    make_input(tmp_path, batches=1)
    res = by_role(tmp_path)
    res["state_backend"] = StateBackendResource(local_dir=str(tmp_path / "local"), rocksdb_block_cache_mb=32)
    pipeline = PipelineResources(res["storage"], res["registry"], res["state_backend"], res["source"]).driver(sample)
    assert pipeline.config.rocksdb == RocksDBOptions(block_cache_mb=32)
    with pytest.raises(ResourceConfigError, match="block_cache_mb must be between 1 and"):
        StateBackendResource(rocksdb_block_cache_mb=0).setup_for_execution(dg.build_init_resource_context())


@pytest.mark.spark
def test_the_settings_reach_rocksdb_in_the_spark_tasks(spark, tmp_path: Path):
    make_input(tmp_path, batches=1)
    off = replace(config(tmp_path, parallelism=2), **resolve_settings({"rocksdb_cache_index_and_filter_blocks": "no"}))
    assert [r.checkpoint_id for r in StatefulPipeline(spark, off, SAMPLE_OPERATORS).run()] == [1]
    written = sorted((tmp_path / "local").glob("job/*/*/db/OPTIONS-*"))
    assert len(written) >= 4  # two operators x two subtasks
    for options_file in written:  # what RocksDB itself recorded for the open
        text = options_file.read_text()
        assert "cache_index_and_filter_blocks=false" in text and "cache_index_and_filter_blocks=true" not in text
