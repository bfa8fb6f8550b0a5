"""An output named as a table value or a URL reaches the driver the same way from every front end:
`Pipeline(output=...)`, `output_url`, `sparkpoint run --output`, the Dagster resources and the
Airflow operators; each gets the sink its URL names (no Spark here)."""

from __future__ import annotations

from pathlib import Path

import pytest

import sparkpoint
from sparkpoint.cli.parser import build_parser
from sparkpoint.cli.run import run_config
from sparkpoint.pipeline.driver import StatefulPipeline
from sparkpoint.pipeline.runtime import PipelineError
from sparkpoint.tables.delta import DeltaSink
from sparkpoint.tables.parquet import ExactlyOnceParquetSink
from sparkpoint.tables.sinks import open_sink
from tests.support.ledger_pipeline import ledger, spend


def test_a_table_value_and_its_url_make_the_same_config(tmp_path: Path):
    table = sparkpoint.DeltaTable(str(tmp_path / "t"), partition_by="region", storage_options={"timeout": "5s"})
    by_value = sparkpoint.Pipeline("p", [spend], output=table).config()
    assert by_value.output_url == f"delta+file://{tmp_path}/t" == table.uri
    assert (by_value.output_partition_by, by_value.output_options) == (("region",), {"timeout": "5s"})
    by_url = sparkpoint.Pipeline("p", [spend], output_url=f"delta+{tmp_path}/t").config()
    assert by_url.output_url == table.uri and by_url.output_partition_by is None
    moved = sparkpoint.Pipeline("p", [spend], output=table).with_(output_url="delta+s3://lake/t").config()
    assert (moved.output_url, moved.output_partition_by) == ("delta+s3://lake/t", ("region",)), "the value's rest stays"
    plain = sparkpoint.Pipeline("p", [spend], output=sparkpoint.ParquetDirectory(str(tmp_path / "out"))).config()
    assert plain.output_url == f"file://{tmp_path}/out"
    with pytest.raises(PipelineError, match="must be iceberg://<catalog name>/<namespace>.<table>"):
        sparkpoint.Pipeline("p", [spend], output_url="iceberg://nocatalog")


def test_the_driver_opens_the_sink_its_output_names(tmp_path: Path):
    config = ledger.config(input_url=str(tmp_path), checkpoints_url=f"file://{tmp_path}/ckpt",
                           output_url=f"delta+file://{tmp_path}/t")
    sink = StatefulPipeline(None, config, ledger.operators).sink
    assert isinstance(sink, DeltaSink) and sink.partition_by == ("region",)
    assert sink.app_id("spend") == "ledger/spend-by-customer"
    parquet = StatefulPipeline(None, config.with_(output_url=f"file://{tmp_path}/out"), ledger.operators).sink
    assert isinstance(parquet, ExactlyOnceParquetSink)


def test_the_cli_takes_a_delta_url_and_an_iceberg_catalog_by_conf(tmp_path: Path):
    args = build_parser().parse_args([
        "run", "--pipeline", "tests.support.ledger_pipeline:ledger", "--input", str(tmp_path / "in"),
        "--checkpoints", str(tmp_path / "ckpt"), "--output", f"delta+{tmp_path}/t"])
    _, config, _ = run_config(args)
    assert (config.output_url, config.output_partition_by) == (f"delta+file://{tmp_path}/t", ("region",))
    args = build_parser().parse_args([
        "run", "--pipeline", "tests.support.ledger_pipeline:ledger", "--input", str(tmp_path / "in"),
        "--checkpoints", str(tmp_path / "ckpt"), "--output", "iceberg://lake/analytics.spend",
        "--conf", "iceberg.catalog.uri=sqlite:///cat.db", "--conf", "iceberg.catalog.warehouse=file:///w",
        "--conf", "sink.schema-evolution=true"])
    _, config, _ = run_config(args)
    assert config.output_url == "iceberg://lake/analytics.spend"
    assert config.output_catalog == {"uri": "sqlite:///cat.db", "warehouse": "file:///w"}
    assert config.output_schema_evolution is True


def test_dagster_resources_and_airflow_operators_pass_a_delta_url_unchanged(tmp_path: Path):
    from sparkpoint.airflow.operators import PipelineRef
    from sparkpoint.resources import PipelineResources, resources_for

    pipeline = ledger.with_(input_url=str(tmp_path / "in"), checkpoints_url=f"file://{tmp_path}/ckpt")
    resources = resources_for(pipeline)
    assert resources["source"].output_url == pipeline.config().output_url  # type: ignore[attr-defined]
    assert resources["source"].output_url.startswith("delta+file://")  # type: ignore[attr-defined]
    launched = resources["source"].model_copy(update={"output_url": "delta+s3://lake/spend"})
    config = PipelineResources(resources["storage"], resources["registry"], resources["state_backend"],  # type: ignore[arg-type]
                               launched).config(pipeline)  # type: ignore[arg-type]
    assert (config.output_url, config.output_partition_by) == ("delta+s3://lake/spend", ("region",))
    airflow = PipelineRef(pipeline, {"output_url": "delta+s3://lake/spend"}, None).resolved().config()
    assert (airflow.output_url, airflow.output_partition_by) == ("delta+s3://lake/spend", ("region",))


def test_an_iceberg_output_url_opens_the_iceberg_sink_on_the_embedded_catalog(tmp_path, monkeypatch):
    from sparkpoint.tables.iceberg import IcebergSink

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYICEBERG_HOME", str(tmp_path / "no-config"))
    sink = open_sink("iceberg://lake/analytics.spend", "job", operators=[("spend", "spend-v1")])
    assert isinstance(sink, IcebergSink)
    assert (sink.identifier, sink.catalog_name, sink.operators) == ("analytics.spend", "lake", (("spend", "spend-v1"),))
    assert sink.location == f"file://{tmp_path}/.sparkpoint/iceberg/warehouse/analytics/spend"
    assert dict(sink.catalog)["uri"] == f"sqlite:///{tmp_path}/.sparkpoint/iceberg/catalog.db"
