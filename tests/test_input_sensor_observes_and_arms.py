"""The input sensor of a user's own pipeline (orders: `customer`, `amount`) observes its input asset
on its ticks (files pending, the next and the newest file), when that changed or once every few
minutes, so `orders/input` is never "Never observed"; a run of the pipeline observes it too (for a
pipeline whose sensor is stopped); and a failure injection armed in its cursor (one step:
`{"inject_failure": "after-upload"}`) goes to its next run only. A cursor it cannot follow stops
it with a message saying how to fix it, and is kept as the user wrote it."""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import pytest

from sparkpoint.assets.metadata import input_data_version
from sparkpoint.resources.scope import INJECT_TAG
from sparkpoint.sensors.landing import OBSERVE_EVERY_SECONDS, InputCursor
from tests.test_input_sensor_retries import Daemon, land, orders

INPUT = dg.AssetKey(["orders", "input"])


def observations(instance: dg.DagsterInstance) -> list[dict[str, object]]:
    """The input asset's observations, oldest first: their metadata and data version."""
    records = instance.fetch_observations(INPUT, limit=100, ascending=True).records
    out = []
    for record in records:
        observation = record.asset_observation
        assert observation is not None
        out.append({**{k: v.value for k, v in observation.metadata.items()},
                    "data_version": observation.tags.get("dagster/data_version"),
                    "description": observation.description})
    return out


def test_the_input_sensor_observes_the_input_asset_when_what_is_pending_changes(tmp_path: Path):
    instance = dg.DagsterInstance.ephemeral()
    daemon = Daemon(instance, orders(tmp_path))
    assert daemon.tick().skip_message == "no batch file waiting"
    (first,) = observations(instance)
    assert first["files_pending"] == 0 and first["newest_file"] == "" and first["data_version"] == "nothing landed"
    assert first["location"] == str(tmp_path / "landing")
    assert first["description"] == "0 batch files pending (seen by orders_input_sensor)"
    daemon.tick()
    assert len(observations(instance)) == 1, "nothing changed: no second observation"

    land(tmp_path, "o0.parquet")
    land(tmp_path, "o1.parquet")
    assert isinstance(daemon.tick(), dg.RunRequest)
    latest = observations(instance)[-1]
    assert (latest["files_pending"], latest["next_file"], latest["newest_file"]) == (2, "o0.parquet", "o1.parquet")
    assert latest["data_version"] == "o1.parquet"
    assert latest["description"] == "2 batch files pending, newest o1.parquet (seen by orders_input_sensor)"
    assert len(observations(instance)) == 2


@pytest.mark.parametrize(("observed", "after", "due"), [
    (None, 0.0, True),  # a first tick (or an earlier version's cursor)
    ([1, "a", "a"], 1.0, False),
    ([1, "a", "a"], OBSERVE_EVERY_SECONDS, True),  # unchanged, but the UI shows when the sensor last looked
    ([2, "a", "b"], 1.0, True),
])
def test_when_a_tick_observes_the_input(observed: list[object] | None, after: float, due: bool):
    cursor = InputCursor(observed=json.dumps(observed) if observed else None, observed_at=1000.0)
    after_tick, reported = cursor.observe(["a"], 1000.0 + after)
    assert reported is due
    assert (after_tick.observed_at == 1000.0 + after) is due
    assert InputCursor.from_cursor(after_tick.to_cursor(), "s") == after_tick


@pytest.mark.parametrize(("pending", "consumed", "version"), [
    (["c.parquet", "d.parquet"], ["a.parquet", "b.parquet"], "d.parquet"),
    ([], ["a.parquet", "b.parquet"], "b.parquet"),  # a checkpoint consumed the newest: the version stays
    ([], [], "nothing landed"),
])
def test_the_input_version_is_the_newest_file_landed(pending: list[str], consumed: list[str], version: str):
    assert input_data_version(pending, lambda: consumed).value == version


def test_a_failure_armed_in_the_cursor_goes_to_the_next_run_only(tmp_path: Path):
    instance = dg.DagsterInstance.ephemeral()
    daemon = Daemon(instance, orders(tmp_path, landing_retry_seconds=0))
    daemon.cursor = '{"inject_failure": "after-upload"}'  # what the user sets: the UI or `dagster sensor cursor`
    waiting = daemon.tick()
    assert waiting.skip_message == ("no batch file waiting (armed: the next run gets "
                                    "sparkpoint/inject-failure=after-upload)")
    land(tmp_path, "o0.parquet")
    request = daemon.tick()
    assert isinstance(request, dg.RunRequest) and request.run_key == "landed-o0.parquet"
    assert request.tags[INJECT_TAG] == "after-upload"
    assert "inject_failure" not in json.loads(str(daemon.cursor)), "spent on this request"
    daemon.launch(request)  # fails (no Spark here): the file is offered again, without the injection
    again = daemon.tick()
    assert isinstance(again, dg.RunRequest) and again.run_key == "landed-o0.parquet-1"
    assert INJECT_TAG not in again.tags


@pytest.mark.parametrize(("cursor", "said"), [
    ('{"inject_failure": "sometime"}', "the cursor arms an unknown failure injection point 'sometime'"),
    ("after-upload", "the cursor 'after-upload' is not a JSON object"),
])
def test_a_cursor_the_sensor_cannot_follow_stops_it_and_says_how_to_fix_it(tmp_path: Path, cursor: str, said: str):
    instance = dg.DagsterInstance.ephemeral()
    daemon = Daemon(instance, orders(tmp_path))
    land(tmp_path, "o0.parquet")
    daemon.cursor = cursor
    skip = daemon.tick()
    assert isinstance(skip, dg.SkipReason) and skip.skip_message.startswith(said), skip.skip_message
    assert ('set the cursor of orders_input_sensor to {"inject_failure": "after-upload"} '
            "(before-upload | after-upload | before-commit), or delete it "
            "(dagster sensor cursor orders_input_sensor --delete)") in str(skip.skip_message)
    assert daemon.cursor == cursor, "kept as the user wrote it"
    assert not instance.get_runs() and not observations(instance), "nothing else happens meanwhile"
    daemon.cursor = None  # deleted
    assert isinstance(daemon.tick(), dg.RunRequest)


@pytest.mark.spark
def test_a_run_observes_the_input_it_reads_when_the_sensor_is_stopped(spark, tmp_path: Path):
    from sparkpoint.resources import SparkResource
    from tests.support.orders_pipeline import land as land_orders
    from tests.support.orders_pipeline import orders as orders_defs

    parts = orders_defs(tmp_path, landing_sensor=False, resources={"spark": SparkResource(stop_on_teardown=False)})
    instance = dg.DagsterInstance.ephemeral()
    land_orders(tmp_path, "o0.parquet")
    land_orders(tmp_path, "o1.parquet")
    result = dg.materialize([*parts.assets, *parts.checks], resources=parts.resources, instance=instance)
    assert result.success
    (seen,) = observations(instance)
    assert (seen["files_pending"], seen["next_file"], seen["newest_file"]) == (2, "o0.parquet", "o1.parquet")
    assert seen["description"] == f"2 batch files pending, newest o1.parquet (seen by run {result.run_id})"
    assert seen["data_version"] == "o1.parquet"
    assert not [e for e in result.all_events if e.event_type_value == "ASSET_OBSERVATION"], \
        "the run's own events say what it made; the observation is the instance's"
