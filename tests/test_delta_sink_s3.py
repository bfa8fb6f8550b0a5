"""`sparkpoint run --output delta+s3://...` on local Spark against a moto S3 server, with a user's own
pipeline (`tests.support.ledger_pipeline`): the checkpoints and the table on S3, delta-rs' storage
options made from the run's fsspec options (endpoint, keys, plain HTTP; delta-rs commits with S3's
conditional writes, no locking provider), the table equal to a recomputation."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from sparkpoint.tables.delta_parts import delta_options
from tests.conftest import s3_options
from tests.support.crashkit import assert_finished, assert_storage_settled, run
from tests.support.ledger_pipeline import assert_table_exactly_once, land, ledger_run


@pytest.mark.s3
def test_a_run_into_a_delta_table_on_s3(tmp_path: Path, s3_endpoint: str):
    import fsspec

    options = s3_options(s3_endpoint)
    bucket = "lake-" + uuid.uuid4().hex[:8]
    fsspec.filesystem("s3", **options).mkdir(bucket)
    land(tmp_path / "in", 3)
    table = f"s3://{bucket}/spend"
    cmd = [*ledger_run(tmp_path), "--checkpoints", f"s3://{bucket}/ckpt", "--output", f"delta+{table}",
           "--storage-options", json.dumps(options)]
    assert_finished(run(cmd, timeout=400))
    assert_table_exactly_once(tmp_path, at=table, delta=delta_options(table, options), options=options)
    assert assert_storage_settled(f"s3://{bucket}/ckpt", "ledger", options) == 2
