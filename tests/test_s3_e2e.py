"""`sparkpoint run` end to end on `s3://` (moto in server mode on 127.0.0.1), killed and resumed.

Checkpoints and the exactly-once output live in a bucket; the run is SIGKILLed by a named crash
point in one of Spark's Python workers (in `make soak`: every point, chained), then resumed on a
lost local disk (the state comes back from S3): state and output equal the recomputation, every
retained checkpoint verifies and after `gc --grace 0` the bucket holds exactly the retained checkpoints' files.

Storage faults on S3 (item 2's fault-injecting filesystem) are not exercised here: that wrapper
lives on another branch; moto's server has no fault injection of its own.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import fsspec
import pytest

from tests.conftest import s3_options
from tests.support.crashkit import Job, seeded_chain, spark_chain

pytestmark = [pytest.mark.spark, pytest.mark.s3]


def s3_job(tmp_path: Path, endpoint: str) -> Job:
    options = s3_options(endpoint)
    bucket = "sp-" + uuid.uuid4().hex[:12]
    fsspec.filesystem("s3", **options).mkdir(bucket)
    return Job(tmp_path / "in", f"s3://{bucket}/checkpoints", f"s3://{bucket}/out", tmp_path / "local", options)


def test_run_on_s3_killed_in_a_worker_then_resumed_from_s3_on_a_lost_disk(tmp_path: Path, s3_endpoint: str):
    # Killed in a Spark worker in the second batch (chk-1 is complete, some of chk-2's files are
    # on S3); the resumed run starts on a lost local disk, so its state comes back from S3.
    # (`make soak` chains every point on S3, the sink commit point included.)
    rows = spark_chain(tmp_path, s3_job(tmp_path, s3_endpoint), ["after-upload"], seed=7, warm_up=False,
                       first_hit_batch=2, lose_local_after=True)
    assert [r["process"] for r in rows] == ["worker"]


@pytest.mark.soak
def test_soak_run_on_s3_killed_at_every_point_x_seeds(tmp_path: Path, s3_endpoint: str):
    from tests.test_crash_points import report

    seeds = int(os.environ.get("SPARKPOINT_SOAK_S3_SEEDS", "2"))
    started = time.monotonic()
    rows = []
    for seed in range(1, seeds + 1):
        where = tmp_path / f"seed-{seed}"
        chain, lose_local = seeded_chain(seed)
        rows += spark_chain(where, s3_job(where, s3_endpoint), chain, seed, warm_up=True, lose_local_before=lose_local)
    report("crash_points_s3", rows, started, ["seed", "step", "point", "hit", "process", "checkpoints"])
