"""The input sensor of a user's own pipeline (orders: `customer`, `amount`) never stops for good
after a run that did not consume its file (DESIGN rule 12): Dagster launches one run per run key
whatever its outcome, so a file whose run failed, was cancelled or failed in resource setup is
offered again under a new key; a file still being written waits; every skip says what it waits
for. And a failed recovery run says in the UI that nothing recovers it."""

from __future__ import annotations

import os
import socket
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import dagster as dg
import fsspec
import pandas as pd
import pytest

from sparkpoint import KeyedOperator, Pipeline, StructCodec
from sparkpoint.factory import PipelineDefs, pipeline_defs
from sparkpoint.resources import SparkResource
from sparkpoint.resources.scope import FAILED_RUN_TAG
from sparkpoint.sensors import NOT_RECOVERED_TAG
from sparkpoint.sensors.landing import LandedRun, landing_decision, retry_delay
from sparkpoint.spark.settling import FileSeen, settle
from sparkpoint.spark.source import BatchStat, ParquetDirectorySource, _modified

TOTAL = StructCodec[tuple[float]]("<d")
RUN_KEY, SENSOR_NAME = "dagster/run_key", "dagster/sensor_name"


def add(batch: pd.DataFrame, state: object) -> None:
    sums = batch.groupby("customer")["amount"].sum()
    handle = state.value_state("total", TOTAL)  # type: ignore[attr-defined]
    old = handle.get_many(sums.index.tolist())
    handle.put_many((c, (float(s) + (o[0] if o else 0.0),)) for c, s, o in zip(sums.index, sums, old))


def export(state: object) -> pd.DataFrame:
    rows = [(k.decode(), v[0]) for k, v in state.value_state("total", TOTAL).items()]  # type: ignore[attr-defined]
    return pd.DataFrame(rows, columns=["customer", "total"])


spend = KeyedOperator("spend_per_customer", key="customer", columns=("amount",), process=add, export=export)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def orders(tmp_path: Path, **sensor: Any) -> PipelineDefs:
    """The pipeline's definitions; its Spark is a Connect server that is not there, so a run fails
    in resource setup, before any step (one of the failures that used to stop the sensor)."""
    (tmp_path / "landing").mkdir(exist_ok=True)
    pipeline = Pipeline("orders", [spend], input_url=str(tmp_path / "landing"), checkpoints_url=str(tmp_path / "ckpt"),
                        local_dir=str(tmp_path / "local"))
    return pipeline_defs(pipeline, resources={"spark": SparkResource(remote=f"sc://127.0.0.1:{closed_port()}")},
                         **sensor)


def land(tmp_path: Path, name: str, rows: int = 2, age: float | None = 60.0) -> Path:
    """A batch file, by default written a minute ago (settled)."""
    path = tmp_path / "landing" / name
    pd.DataFrame({"customer": [f"c{i}" for i in range(rows)], "amount": [1.5] * rows}).to_parquet(path)
    if age is not None:
        os.utime(path, (time.time() - age, time.time() - age))
    return path


class Daemon:
    """What Dagster's sensor daemon does with a sensor: evaluate it with its cursor, and launch a
    run for a request unless a run of the sensor already has that key."""

    def __init__(self, instance: dg.DagsterInstance, parts: PipelineDefs):
        self.instance, self.parts, self.cursor = instance, parts, None
        self.sensor = parts.sensor("input_sensor")

    def tick(self) -> dg.RunRequest | dg.SkipReason:
        needed = {k: v for k, v in self.parts.resources.items() if k in self.sensor.required_resource_keys}
        with dg.build_sensor_context(instance=self.instance, resources=needed, cursor=self.cursor) as context:
            result = self.sensor(context)
            self.cursor = context.cursor
        assert isinstance(result, (dg.RunRequest, dg.SkipReason)), result
        return result

    def tags(self, request: dg.RunRequest) -> dict[str, str]:
        used = self.instance.get_runs(dg.RunsFilter(tags={RUN_KEY: request.run_key, SENSOR_NAME: self.sensor.name}))
        assert not used, f"Dagster would launch nothing for {request.run_key}: run {used[0].run_id} has that key"
        return {**request.tags, RUN_KEY: str(request.run_key), SENSOR_NAME: self.sensor.name}

    def launch(self, request: dg.RunRequest) -> dg.ExecuteInProcessResult:
        """The run, executed to its end."""
        job = self.parts.definitions().resolve_job_def("orders_checkpoint")
        return job.execute_in_process(instance=self.instance, tags=self.tags(request), raise_on_error=False)

    def start(self, request: dg.RunRequest) -> dg.DagsterRun:
        """The run, in progress."""
        return self.instance.add_run(dg.DagsterRun(job_name="orders_checkpoint", run_id=str(uuid.uuid4()),
                                                   tags=self.tags(request), status=dg.DagsterRunStatus.STARTED))


def test_a_file_whose_run_failed_is_offered_again_under_a_new_key(tmp_path: Path):
    instance = dg.DagsterInstance.ephemeral()
    daemon = Daemon(instance, orders(tmp_path))
    assert daemon.tick().skip_message == "no batch file waiting"
    land(tmp_path, "o0.parquet")
    land(tmp_path, "o1.parquet")
    first = daemon.tick()
    assert isinstance(first, dg.RunRequest) and first.run_key == "landed-o0.parquet"
    failed = daemon.launch(first)
    assert not failed.success, "the run failed in resource setup, before any step"

    waiting = daemon.tick()
    assert isinstance(waiting, dg.SkipReason), "an unchanged file is not run again at once"
    assert waiting.skip_message.startswith(f"1 run of o0.parquet ended without consuming it, the last "
                                           f"{failed.run_id} with FAILURE: offering it again in ")

    land(tmp_path, "o0.parquet", rows=3)  # its writer wrote it again: the cause may be gone
    again = daemon.tick()
    assert isinstance(again, dg.RunRequest) and again.run_key == "landed-o0.parquet-1"
    assert again.tags["sparkpoint/landed"] == "o0.parquet"
    assert again.tags["sparkpoint/landed-size"] == str((tmp_path / "landing" / "o0.parquet").stat().st_size)
    assert not daemon.launch(again).success

    # Without a retry delay: a cancelled run and a run that failed again are followed by new runs.
    daemon = Daemon(instance, orders(tmp_path, landing_retry_seconds=0))  # the same pipeline, built again
    third = daemon.tick()
    assert isinstance(third, dg.RunRequest) and third.run_key == "landed-o0.parquet-2"
    running = daemon.start(third)
    assert daemon.tick().skip_message == f"waiting for run {running.run_id} of o0.parquet (STARTED)"
    instance.report_run_canceled(running)  # from the UI
    fourth = daemon.tick()
    assert isinstance(fourth, dg.RunRequest) and fourth.run_key == "landed-o0.parquet-3"
    daemon.start(fourth)
    assert daemon.tick().skip_message.startswith("waiting for run ")


def test_the_recovery_of_a_failed_run_is_waited_for(tmp_path: Path):
    instance = dg.DagsterInstance.ephemeral()
    daemon = Daemon(instance, orders(tmp_path, landing_retry_seconds=0))
    land(tmp_path, "o0.parquet")
    request = daemon.tick()
    assert isinstance(request, dg.RunRequest)
    failed = daemon.launch(request)
    recovery = instance.add_run(dg.DagsterRun(job_name="orders_recover", run_id=str(uuid.uuid4()),
                                              tags={FAILED_RUN_TAG: failed.run_id},
                                              status=dg.DagsterRunStatus.STARTED))
    assert daemon.tick().skip_message == (f"waiting for recovery run {recovery.run_id} of run {failed.run_id}, "
                                          "which failed on o0.parquet")
    instance.report_run_failed(recovery)  # it did not consume the file either
    again = daemon.tick()
    assert isinstance(again, dg.RunRequest) and again.run_key == "landed-o0.parquet-1"


def test_a_file_still_being_written_waits_until_it_settles(tmp_path: Path):
    # Three seconds: a loaded machine may take a second between a write and the tick that looks.
    daemon = Daemon(dg.DagsterInstance.ephemeral(), orders(tmp_path, landing_settle_seconds=3.0))
    path = land(tmp_path, "o0.parquet", age=None)  # just written
    skip = daemon.tick()
    assert isinstance(skip, dg.SkipReason) and skip.skip_message.startswith("waiting for o0.parquet to settle: ")
    land(tmp_path, "o0.parquet", rows=50, age=None)  # still growing
    assert daemon.tick().skip_message.startswith("waiting for o0.parquet to settle: ")
    os.utime(path, (time.time() + 3600, time.time() + 3600))  # a file server whose clock runs an hour ahead
    assert isinstance(daemon.tick(), dg.SkipReason)
    time.sleep(3.1)  # unchanged across two ticks three seconds apart: the cursor knows
    request = daemon.tick()
    assert isinstance(request, dg.RunRequest) and request.run_key == "landed-o0.parquet"


def test_a_failed_recovery_run_says_that_nothing_recovers_it(tmp_path: Path):
    instance = dg.DagsterInstance.ephemeral()
    parts = orders(tmp_path)
    recover = parts.definitions().resolve_job_def("orders_recover")
    config = {"ops": {"orders_recover_op": {"config": {"failed_run_id": "f00d"}}}}
    failed = recover.execute_in_process(instance=instance, tags={FAILED_RUN_TAG: "f00d"}, run_config=config,
                                        raise_on_error=False)
    assert not failed.success
    skip = parts.sensor("recovery_sensor")(dg.build_sensor_context(instance=instance))
    note = instance.get_run_by_id(failed.run_id).tags[NOT_RECOVERED_TAG]  # shown on the run in the UI
    assert note == ("the recovery of run f00d failed and is not recovered again: fix the cause, then launch "
                    "orders_recover with failed_run_id f00d")
    assert isinstance(skip, dg.SkipReason) and skip.skip_message == f"run {failed.run_id}: {note}"


# --- the decisions, as tables -----------------------------------------------------------------------

STAT = BatchStat(100, 1_000.0)


def ended(run_id: str, status: str, at: float, size: int | None = 100, modified: float | None = 1_000.0,
          attempt: int = 0) -> LandedRun:
    key = "landed-f.parquet" + (f"-{attempt}" if attempt else "")
    return LandedRun(run_id, status, key, at, size, modified)


@pytest.mark.parametrize(("runs", "recoveries", "now", "key", "reason"), [
    ([], {}, 2_000.0, "landed-f.parquet", "f.parquet landed"),
    ([LandedRun("r1", "STARTED", "landed-f.parquet", None)], {}, 2_000.0, None,
     "waiting for run r1 of f.parquet (STARTED)"),
    ([ended("r1", "FAILURE", 2_000.0)], {"r1": "rec"}, 9_000.0, None,
     "waiting for recovery run rec of run r1, which failed on f.parquet"),
    ([ended("r1", "FAILURE", 2_000.0)], {}, 2_010.0, None,
     "1 run of f.parquet ended without consuming it, the last r1 with FAILURE: offering it again in 20 s, "
     "or once it changes"),
    ([ended("r1", "CANCELED", 2_000.0)], {}, 2_030.0, "landed-f.parquet-1",
     "1 run of f.parquet ended without consuming it: offering it again"),
    ([ended("r1", "FAILURE", 2_000.0), ended("r2", "SUCCESS", 2_100.0, attempt=1)], {}, 2_130.0, None,
     "2 runs of f.parquet ended without consuming it, the last r2 with SUCCESS: offering it again in 30 s, "
     "or once it changes"),
    ([ended("r1", "FAILURE", 2_000.0, size=90)], {}, 2_001.0, "landed-f.parquet-1",
     "f.parquet changed since run r1 (FAILURE)"),
    ([ended("r2", "FAILURE", 2_000.0, attempt=1)], {}, 2_100.0, "landed-f.parquet-2",  # r1's run was deleted
     "1 run of f.parquet ended without consuming it: offering it again"),
    ([ended("old", "FAILURE", 2_000.0, size=None, modified=None)], {}, 2_030.0, "landed-f.parquet-1",
     "1 run of f.parquet ended without consuming it: offering it again"),  # a run of an earlier version
])
def test_landing_decisions(runs: list[LandedRun], recoveries: dict[str, str], now: float, key: str | None,
                           reason: str):
    decision = landing_decision("f.parquet", STAT, runs, recoveries, now, retry_seconds=30.0)
    assert (decision.run_key, decision.reason) == (key, reason)


def test_the_retry_delay_doubles_up_to_half_an_hour():
    assert [retry_delay(n, 30.0) for n in (1, 2, 3, 6, 7, 20)] == [30.0, 60.0, 120.0, 960.0, 1800.0, 1800.0]


@pytest.mark.parametrize(("modified", "before_since", "now", "settled"), [
    (1_000.0, None, 1_001.0, False),  # written a second ago
    (1_000.0, None, 1_002.0, True),  # two seconds ago
    (5_000.0, 1_000.0, 1_002.5, True),  # a clock ahead: unchanged since the tick at 1_000
    (None, 1_000.0, 1_001.0, False),  # no modification time: the ticks alone
    (None, 1_000.0, 1_003.0, True),
])
def test_settling(modified: float | None, before_since: float | None, now: float, settled: bool):
    before = FileSeen("f.parquet", 100, modified, before_since) if before_since is not None else None
    seen, waits = settle(before, "f.parquet", BatchStat(100, modified), now, settle_seconds=2.0)
    assert (waits is None) == settled, waits
    assert seen.since == (before_since if before_since is not None else now)
    assert FileSeen.from_cursor(seen.to_cursor()) == seen



def test_a_batch_files_size_and_modification_time_come_from_the_listing_on_any_filesystem(tmp_path: Path):
    (tmp_path / "landing").mkdir()
    path = land(tmp_path, "o0.parquet", age=120.0)
    local = ParquetDirectorySource(str(tmp_path / "landing")).stat("o0.parquet")
    assert local == BatchStat(path.stat().st_size, path.stat().st_mtime)
    fsspec.filesystem("memory").pipe(f"/{tmp_path.name}/o0.parquet", b"PAR1")
    stat = ParquetDirectorySource(f"memory://{tmp_path.name}").stat("o0.parquet")
    assert stat.size == 4 and stat.modified is not None and abs(stat.modified - time.time()) < 60

    s3 = {"size": 4, "LastModified": datetime(2026, 11, 1, tzinfo=UTC)}
    assert _modified(s3) == datetime(2026, 11, 1, tzinfo=UTC).timestamp()
    assert _modified({"updated": "2026-11-01T00:00:00Z"}) == _modified(s3), "GCS"
    assert _modified({"size": 4}) is None, "a filesystem that does not say: the sensor's ticks decide"
