"""Shared fixtures: real storage (local files, fsspec memory, a local S3-compatible server)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest

from sparkpoint.checkpoint.storage import CheckpointStorage
from tests.dagster_server import dagster_server  # noqa: F401  (session fixture: webserver + daemon)

os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """A moto S3 server bound to loopback only, for the whole session."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    yield endpoint
    server.stop()


def s3_options(endpoint: str) -> dict[str, object]:
    return {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": endpoint}}


def _make_storage(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> CheckpointStorage:
    job = "job-" + uuid.uuid4().hex[:8]
    if kind == "file":
        return CheckpointStorage(f"file://{tmp_path}/checkpoints", job)
    if kind == "memory":
        return CheckpointStorage(f"memory://ckpt-{uuid.uuid4().hex}", job)
    endpoint = request.getfixturevalue("s3_endpoint")
    bucket = "b" + uuid.uuid4().hex[:12]
    fs = fsspec.filesystem("s3", **s3_options(endpoint))
    fs.mkdir(bucket)
    return CheckpointStorage(f"s3://{bucket}/checkpoints", job, s3_options(endpoint))


@pytest.fixture(params=["file", "memory", pytest.param("s3", marks=pytest.mark.s3)])
def any_storage(request: pytest.FixtureRequest, tmp_path: Path) -> CheckpointStorage:
    """One storage test suite for every backend."""
    return _make_storage(request.param, tmp_path, request)


@pytest.fixture(params=["file", "memory"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> CheckpointStorage:
    return _make_storage(request.param, tmp_path, request)


@pytest.fixture
def local_storage(tmp_path: Path) -> CheckpointStorage:
    return CheckpointStorage(f"file://{tmp_path}/checkpoints", "job")


@pytest.fixture(scope="session")
def spark():
    """One local Spark session for every in-process pipeline test (the JVM starts once)."""
    from sparkpoint.spark.session import spark_session

    session = spark_session("local[2]")
    yield session
    session.stop()
