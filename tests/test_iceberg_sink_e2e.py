"""`sparkpoint run --output iceberg://<catalog>/<namespace>.<table>` on local Spark, with a user's own
pipeline (`tests.support.ledger_pipeline`: spending per customer), its catalog's properties by
`--conf iceberg.catalog.*` (pyiceberg's SQL catalog on SQLite).

A run is killed with kill -9 right after the table took checkpoint 2 and before anything recorded
it; the next run settles it, and a later run adds batches landed since. What a reader of the table
sees equals a recomputation: every batch's rows once, one snapshot per checkpoint with rows, its
summary naming the job, the operator and the checkpoint. The sink's own races (a zombie, a retried
step, a concurrent appender, drop and rollback): `test_iceberg_sink.py`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
from pyiceberg.catalog import load_catalog

from tests.support.crashkit import assert_died_at, assert_finished, assert_storage_settled, run
from tests.support.ledger_pipeline import PIPELINE, assert_rows_equal, expected_rows, land


def iceberg_run(root: Path) -> list[str]:
    return [sys.executable, "-m", "sparkpoint.cli", "run", "--pipeline", PIPELINE, "--input", str(root / "in"),
            "--checkpoints", f"file://{root}/ckpt", "--output", "iceberg://lake/shop.ledger",
            "--conf", f"iceberg.catalog.uri=sqlite:///{root}/catalog.db",
            "--conf", f"iceberg.catalog.warehouse=file://{root}/warehouse",
            "--local-dir", str(root / "local"), "--master", "local[2]", "--retain", "2"]


def assert_table_exactly_once(root: Path) -> None:
    table = load_catalog("lake", uri=f"sqlite:///{root}/catalog.db",
                         warehouse=f"file://{root}/warehouse").load_table("shop.ledger")
    rows: pd.DataFrame = table.scan().to_arrow().to_pandas()
    want = expected_rows(root / "in")
    ids = sorted(int(c) for c in rows["checkpoint_id"].unique())
    assert len(ids) == len(want), f"checkpoints with rows {ids}, batches {len(want)}"
    for cid, expected in zip(ids, want):
        assert_rows_equal(rows[rows["checkpoint_id"] == cid], expected)
    summaries = [s.summary.additional_properties for s in table.snapshots() if s.summary is not None]
    ours = [p for p in summaries if p.get("sparkpoint.job") == "ledger"]
    assert sorted(int(p["sparkpoint.checkpoint-id"]) for p in ours) == ids, "one snapshot per checkpoint"
    assert {p["sparkpoint.operator"] for p in ours} == {"spend-by-customer"}


def test_a_run_into_an_iceberg_table_killed_after_its_table_commit_resumes_exactly_once(tmp_path: Path):
    land(tmp_path / "in", 3)
    cmd = iceberg_run(tmp_path)
    assert_died_at(run(cmd, crash_at="after-table-commit:2", crash_dir=tmp_path / "crash", timeout=400),
                   "after-table-commit")
    assert_finished(run(cmd, timeout=400))
    land(tmp_path / "in", 2, first=3)
    assert_finished(run(cmd, timeout=400))
    assert_table_exactly_once(tmp_path)
    assert_storage_settled(f"file://{tmp_path}/ckpt", "ledger")
