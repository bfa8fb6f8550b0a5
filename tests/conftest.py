"""Shared fixtures: real storage (local files, fsspec memory, a local S3-compatible server)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest

from sparkpoint.checkpoint.storage import CheckpointStorage
from tests.support.dagster_server import dagster_server  # noqa: F401  (session fixture: webserver + daemon)
from tests.support.schedule import longest_first

os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
# The driver JVM's class archive (sparkpoint.spark.classcache) of the test runs: in the project's
# build directory, not the user's cache; every Spark started by a test, in or out of process, uses it.
_JVM_CACHE = Path(__file__).resolve().parent.parent / "build" / "jvm-cache"
os.environ.setdefault("SPARKPOINT_JVM_CACHE", str(_JVM_CACHE) if " " not in str(_JVM_CACHE) else "off")
# A run without `master` starts Spark in its own process (local[2]), as the suite was written for:
# the tests of the warm local Spark (tests/test_warm_spark.py) turn it on with a directory of their own.
os.environ.setdefault("SPARKPOINT_WARM_SPARK", "off")
# Every JVM a test starts compiles with C1 only and collects with the serial GC: they live for
# seconds on small data, where C2's compilations and G1's threads cost more CPU than they save (the
# JVM of a 4-batch `sparkpoint run`: 20.2 CPU-s as users run it, 12.4 with C1, 11.5 with both).
# spark-submit reads this for every driver, in or out of process; tests/support/cluster.py passes it
# on to a standalone cluster's daemons and executors.
os.environ.setdefault("SPARK_SUBMIT_OPTS", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")


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
def _spark_sessions() -> Iterator[list[Any]]:
    sessions: list[Any] = []
    yield sessions
    for session in sessions:
        session.stop()


@pytest.fixture
def spark(_spark_sessions: list[Any]) -> Any:
    """One local Spark session for the in-process pipeline tests (the JVM starts once). Code under
    test may stop the process's session, as the Airflow operators do at the end of their task:
    the next test that asks gets a new one, whatever order the tests run in."""
    from sparkpoint.spark.session import spark_session

    if not _spark_sessions or _spark_sessions[-1].sparkContext._jsc is None:
        _spark_sessions.append(spark_session("local[2]"))
    return _spark_sessions[-1]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest test files first (tests/support/schedule.py): workers of `make test` take them in
    this order (with `--no-loadscope-reorder`)."""
    order = longest_first([item.nodeid for item in items])
    items[:] = [items[i] for i in order]


# --- the interleaving checker's figures, in the terminal summary (also under xdist: a report's
# user properties travel from the worker to the process that prints) ------------------------------

_INTERLEAVINGS: list[dict[str, Any]] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call":
        _INTERLEAVINGS.extend(v for k, v in report.user_properties if k == "interleavings" and isinstance(v, dict))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _INTERLEAVINGS:
        return
    runs = sorted(_INTERLEAVINGS, key=lambda r: (r["mode"], r["scenario"]))
    total = sum(int(r["schedules"]) for r in runs)
    bad = sum(int(r["violations"]) for r in runs)
    terminalreporter.write_sep("-", f"interleaving checker: {total} schedules explored in {len(runs)} scenarios, "
                                    f"{bad} violations")
    for r in runs:
        terminalreporter.write_line(f"{r['line']} [{r['mode']}, {r['seconds']:.0f} s]")
