"""`sparkpoint run --output delta+...` on local Spark, with a user's own pipeline
(`tests.support.ledger_pipeline`: spending per customer, a table partitioned by region).

What a reader of the table sees equals a recomputation from the input: every batch's rows once,
in exactly one table version per checkpoint, the app transaction at the latest checkpoint id,
beside another writer appending to the same table. The guards refuse a table before Spark starts.
Kills at every step of the commit: `test_delta_sink_crashes.py`; S3: `test_delta_sink_s3.py`.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pytest
from deltalake import DeltaTable as Table
from deltalake import write_deltalake

from sparkpoint.cli import EXIT_BAD_INPUT, main
from tests.support.crashkit import assert_finished, assert_storage_settled, run
from tests.support.ledger_pipeline import assert_table_exactly_once, land, ledger_run


def test_a_run_into_a_partitioned_delta_table_equals_a_recomputation_beside_another_writer(tmp_path: Path):
    land(tmp_path / "in", 4)
    stop, appended = threading.Event(), []

    def appender() -> None:  # another writer of the same table, appending all along once it exists
        while not stop.wait(0.05):
            if not Table.is_deltatable(str(tmp_path / "table")):
                continue
            schema = pa.schema(Table(str(tmp_path / "table")).schema().to_arrow())
            walk_in = pa.Table.from_pylist([{"customer": "walk-in", "region": "emea", "total": 1.0, "purchases": 1,
                                             "top_store": "kiosk", "checkpoint_id": None}], schema=schema)
            write_deltalake(str(tmp_path / "table"), walk_in, mode="append")
            appended.append(1)

    thread = threading.Thread(target=appender)
    thread.start()
    try:
        outcome = run(ledger_run(tmp_path), timeout=400)
    finally:
        stop.set()
        thread.join()
    assert_finished(outcome)
    assert appended, "the other writer appended meanwhile"
    assert_table_exactly_once(tmp_path, foreign_rows=len(appended))
    assert_storage_settled(f"file://{tmp_path}/ckpt", "ledger")


def test_the_guards_refuse_a_table_before_spark_starts(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    land(tmp_path / "in", 1)
    flags = ledger_run(tmp_path)[3:]
    table = tmp_path / "table"
    write_deltalake(str(table), pd.DataFrame({"customer": ["x"], "region": ["emea"], "total": [1.0],
                                              "purchases": pd.Series([1], dtype="int32"), "top_store": ["s"],
                                              "checkpoint_id": [0]}), partition_by=["region"],
                    configuration={"delta.setTransactionRetentionDuration": "interval 1 days"})
    assert main(flags) == EXIT_BAD_INPUT
    said = capsys.readouterr().err
    assert "delta.setTransactionRetentionDuration" in said and "'interval 7 days'" in said, said
    assert main([*flags, "--conf", "sink.replay-window=3600"]) == EXIT_BAD_INPUT
    said = capsys.readouterr().err
    assert "purchases (int64; the table has int32)" in said, said
    assert not (tmp_path / "ckpt").exists() and not (table / "sparkpoint-ledger").exists(), "nothing started"
