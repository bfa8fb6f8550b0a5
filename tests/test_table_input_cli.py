"""Input tables through `sparkpoint run` (issue 45, items 5 and 6), with a user's own pipeline
(`tests.support.shop_tables`): an Iceberg table in a SQL catalog on SQLite, named by `--input
iceberg://<catalog>/<namespace>.<table>` and `--conf iceberg.catalog.<property>=...`, read over two
runs equal to a recomputation, then a delete refused naming its snapshot, before Spark starts."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.shop_tables import orders, spend

ROOT = Path(__file__).resolve().parent.parent
MODULE = textwrap.dedent('''
    """shop_job: a user's module naming the pipeline; the input comes with --input."""
    from sparkpoint import Pipeline
    from tests.support.shop_tables import regions_per_customer, spend_per_customer

    shop = Pipeline("shop", [spend_per_customer, regions_per_customer], checkpoints_url="ckpt", local_dir="local",
                    parallelism=2, files_per_checkpoint=2)
''')

pytestmark = pytest.mark.spark


def sparkpoint(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sparkpoint.cli", *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "PYTHONPATH": f"{ROOT}:{tmp_path}"})


def run(tmp_path: Path, table: str, *conf: str) -> subprocess.CompletedProcess[str]:
    flags = [word for c in conf for word in ("--conf", c)]
    return sparkpoint(tmp_path, "run", "--pipeline", "shop_job:shop", "--input", table, "--json", *flags)


def spend_state(tmp_path: Path) -> dict[str, tuple[float, int]]:
    state = sparkpoint(tmp_path, "state", "--pipeline", "shop_job:shop", "--operator", "spend_per_customer",
                       "--format", "json")
    assert state.returncode == 0, state.stderr[-2000:]
    return {r["customer"]: (r["spent"], r["orders"]) for r in json.loads(state.stdout)}


def test_an_iceberg_input_named_on_the_command_line(tmp_path: Path):
    from pyiceberg.catalog import load_catalog

    (tmp_path / "shop_job.py").write_text(MODULE)
    properties = {"type": "sql", "uri": f"sqlite:///{tmp_path}/catalog.db", "warehouse": f"file://{tmp_path}/wh"}
    catalog = load_catalog("lake", **properties)
    catalog.create_namespace("sales")
    table = catalog.create_table("sales.orders", schema=orders(0).schema)
    conf = [f"iceberg.catalog.{k}={v}" for k, v in properties.items()]
    frames = []
    for batch in (0, 1, 2):
        table.append(orders(batch))
        frames.append(orders(batch).to_pandas())
    first = run(tmp_path, "iceberg://lake/sales.orders", *conf)
    assert first.returncode == 0, first.stderr[-3000:]
    assert [len(json.loads(line)["batch"]) for line in first.stdout.splitlines()] == [2, 1]

    table.append(orders(3))
    frames.append(orders(3).to_pandas())
    second = run(tmp_path, "iceberg://lake/sales.orders", *conf)
    assert second.returncode == 0, second.stderr[-3000:]
    assert spend_state(tmp_path) == spend(frames)
    offsets = json.loads((tmp_path / "ckpt" / "shop" / "chk-3" / "_metadata").read_text())["source_offsets"]["source"]
    assert offsets["table"]["snapshot_id"] == table.refresh().current_snapshot().snapshot_id

    table.delete("customer = 'c2'")
    refused = run(tmp_path, "iceberg://lake/sales.orders", *conf)
    assert refused.returncode != 0
    assert re.search(r"snapshot \d+ \((overwrite|delete)\) removes or rewrites rows", refused.stderr), refused.stderr
    assert "--conf source.table.changes=skip" in refused.stderr
    assert "Traceback" not in refused.stderr and not (tmp_path / "ckpt" / "shop" / "chk-4").exists()
