"""Issue 47, items 3-5 through a real Spark (local mode): a user's pipeline (`peak_heat`) whose
subtasks run in Spark's Python workers time their phases there and return them with their
results; the driver's completer turns them into the job's history, nested spans (in-memory
exporter) and lineage events (file transport). The rest is on the core: tests/test_history.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import sparkpoint.pipeline.traces as traces
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.pipeline.driver import StatefulPipeline
from sparkpoint.pipeline.history import history_rows
from tests.support.furnace_pipeline import furnace_config, in_memory_tracer, land, peak_heat


@pytest.mark.spark
def test_spark_tasks_phases_become_history_spans_and_lineage(spark: Any, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch):
    land(tmp_path / "in", 2)
    tracer, exporter = in_memory_tracer()
    monkeypatch.setattr(traces, "tracer_for", lambda endpoint: tracer)
    config = furnace_config(tmp_path, traces_endpoint="global", lineage_transport=f"file://{tmp_path}/ol.jsonl")
    StatefulPipeline(spark, config.with_(max_batches=1), (peak_heat,)).run()
    StatefulPipeline(spark, config.with_(local_dir=str(tmp_path / "other-host")), (peak_heat,)).run()

    rows, _ = history_rows(CheckpointStorage(config.checkpoints_url, config.job_id))
    assert [(r["checkpoint_id"], r["restored"]) for r in rows] == [(1, {}), (2, {"primary": 2})]
    assert rows[1]["phase_seconds"]["download"] > 0 and rows[1]["phase_seconds"]["upload"] > 0

    spans = exporter.get_finished_spans()
    by_id = {s.context.span_id: s for s in spans}
    assert sorted(s.name for s in spans if s.parent is None) == [
        "checkpoint furnaces/chk-1", "checkpoint furnaces/chk-2", "restore furnaces/chk-1"]
    for span in spans:  # times taken in the Python workers nest inside the driver's
        if span.parent is not None:
            parent = by_id[span.parent.span_id]
            assert parent.start_time <= span.start_time <= span.end_time <= parent.end_time, (span.name, parent.name)
    processes = [s for s in spans if s.name == "process"]
    assert len(processes) == 4 and {by_id[s.parent.span_id].name for s in processes} == {
        "subtask peak_heat/0", "subtask peak_heat/1"}

    events = [json.loads(line) for line in (tmp_path / "ol.jsonl").read_text().splitlines()]
    assert [(e["eventType"], e["inputs"][0]["name"].rsplit("/", 1)[1]) for e in events] == [
        ("START", "b0000.parquet"), ("COMPLETE", "b0000.parquet"), ("START", "b0001.parquet"),
        ("COMPLETE", "b0001.parquet")]
