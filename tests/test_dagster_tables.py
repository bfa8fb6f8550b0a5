"""Tables through Dagster (issue 45, item 8), with a user's own operator (`tests.support.ledger_pipeline`'s
`spend`, not the sample's): the output asset's materialization carries the table's own metadata —
the Delta version / Iceberg snapshot id the checkpoint committed, the rows it added as
`dagster/row_count`, the table's schema as `dagster/column_schema`, the table's location — and an
input Delta table is observed with its table version as the data version."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dagster as dg
import pandas as pd
import pytest
from deltalake import DeltaTable as DeltaRs
from deltalake import write_deltalake
from pyiceberg.catalog import load_catalog

from sparkpoint import DeltaTable, IcebergTable, Pipeline
from sparkpoint.factory import pipeline_defs
from sparkpoint.resources import SparkResource
from tests.support.ledger_pipeline import expected_rows, land, spend

pytestmark = pytest.mark.spark

COLUMNS = ["customer", "region", "total", "purchases", "top_store", "checkpoint_id"]


def defs_of(tmp_path: Path, **where: Any) -> Any:
    pipeline = Pipeline("tables", [spend], checkpoints_url=str(tmp_path / "ckpt"), local_dir=str(tmp_path / "local"),
                        parallelism=2, files_per_checkpoint=1, **where)
    # The session fixture's JVM is shared by the whole test session: do not stop it.
    return pipeline_defs(pipeline, resources={"spark": SparkResource(stop_on_teardown=False)})


def output_metadata(defs: Any, instance: dg.DagsterInstance) -> dict[str, Any]:
    """Materialize the next batch; the output asset's metadata (values)."""
    result = dg.materialize([*defs.assets, *defs.checks], resources=defs.resources, instance=instance,
                            selection=dg.AssetSelection.assets(*defs.scope.sstable_keys.values(),
                                                               defs.scope.checkpoint_key).downstream())
    [out] = [e.materialization.metadata for e in result.get_asset_materialization_events()
             if e.materialization.asset_key == defs.scope.output_key]
    return {k: v.value for k, v in out.items()}


def column_names(schema: dg.TableSchema) -> list[str]:
    return [c.name for c in schema.columns]


def test_a_delta_output_materializes_with_the_version_each_checkpoint_committed(spark, tmp_path: Path):
    land(tmp_path / "in", 2)
    want = expected_rows(tmp_path / "in")
    table = tmp_path / "table"
    defs = defs_of(tmp_path, input_url=str(tmp_path / "in"), output=DeltaTable(str(table), partition_by=["region"]))
    [complete] = [a for a in defs.assets if defs.scope.output_key in getattr(a, "keys", ())]
    assert complete.specs_by_key[defs.scope.output_key].kinds == {"delta"}
    instance = dg.DagsterInstance.ephemeral()
    for rows in want:
        out = output_metadata(defs, instance)
        assert out["table_version"] == DeltaRs(str(table)).version(), "the version this checkpoint committed"
        assert out["dagster/row_count"] == out["rows_added"] == len(rows)
        assert sorted(column_names(out["dagster/column_schema"])) == sorted(COLUMNS)
        assert out["location"] == str(table)
    assert [out["table_version"], out["checkpoint_id"]] == [1, 2]


def test_a_delta_input_is_observed_at_its_version_and_an_iceberg_output_carries_its_snapshot(spark, tmp_path: Path):
    land(tmp_path / "in", 2)
    want = expected_rows(tmp_path / "in")
    orders = str(tmp_path / "orders")
    for path in sorted((tmp_path / "in").glob("*.parquet")):  # a table version per batch
        write_deltalake(orders, pd.read_parquet(path), mode="append")
    catalog = {"name": "lake", "uri": f"sqlite:///{tmp_path}/catalog.db", "warehouse": f"file://{tmp_path}/wh"}
    defs = defs_of(tmp_path, input=DeltaTable(orders), output=IcebergTable("shop.spend", catalog=catalog))
    instance = dg.DagsterInstance.ephemeral()
    for rows in want:
        out = output_metadata(defs, instance)
        snapshot = load_catalog(**catalog).load_table("shop.spend").current_snapshot()
        assert snapshot is not None and out["snapshot_id"] == snapshot.snapshot_id
        assert out["dagster/row_count"] == out["rows_added"] == len(rows)
        assert column_names(out["dagster/column_schema"]) == COLUMNS
        assert out["location"] == "iceberg://lake/shop.spend"
    record = instance.get_latest_data_version_record(defs.scope.input_key, is_source=True)
    assert record is not None and record.asset_observation is not None
    assert record.asset_observation.tags["dagster/data_version"] == str(DeltaRs(orders).version()) == "1"
    assert record.asset_observation.metadata["table_version"].value == 1
