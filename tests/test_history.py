"""Issue 47, items 3-5 on the core (no Spark: the subtasks run in process, `InProcessPipeline`): a
user's pipeline (`peak_heat`) keeps a history that outlives retention and restarts, traces every
checkpoint and restore with nested, timed spans (the SDK's in-memory exporter), and sends
OpenLineage events through the client's file transport. The history's store: records folded into
bounded segments, a torn record and racing compactors tolerated. tests/test_history_spark.py runs
the same through a real Spark."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import sparkpoint
import sparkpoint.checkpoint.history as history_store
import sparkpoint.pipeline.traces as traces
from sparkpoint.checkpoint.history import compact, read_history, record_path, segment_path, write_record
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.cli import main
from sparkpoint.pipeline.history import history_rows
from tests.support.furnace_pipeline import InProcessPipeline, furnace_config, in_memory_tracer, land, peak_heat


@pytest.fixture(scope="module")
def furnaces(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Three checkpoints with traces and lineage on: two by a first driver (num_retained 1), the
    third by a driver on a host with an empty local directory (its subtasks restore from storage)."""
    root = tmp_path_factory.mktemp("furnaces")
    land(root / "in", 3)
    tracer, exporter = in_memory_tracer()
    config = furnace_config(root, num_retained=1, traces_endpoint="global",
                            lineage_transport=f"file://{root}/lineage.jsonl")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(traces, "tracer_for", lambda endpoint: tracer)
        InProcessPipeline(None, config.with_(max_batches=2), (peak_heat,)).run()
        InProcessPipeline(None, config.with_(local_dir=str(root / "other-host")), (peak_heat,)).run()
    return {"root": root, "spans": exporter.get_finished_spans(),
            "storage": CheckpointStorage(config.checkpoints_url, config.job_id)}


def test_the_history_outlives_retention_and_counts_the_restore(furnaces: dict[str, Any], capsys: Any):
    rows, unreadable = history_rows(furnaces["storage"])
    assert unreadable == []
    assert [r["checkpoint_id"] for r in rows] == [1, 2, 3]
    assert [r["retained"] for r in rows] == [False, False, True]  # retention kept one `_metadata`
    assert [r["restored"] for r in rows] == [{}, {}, {"primary": 2}]
    assert all(r["seconds"] > 0 and r["state_size"] > 0 for r in rows)
    assert rows[1]["checkpointed_size"] < rows[0]["checkpointed_size"]  # incremental
    assert rows[2]["phase_seconds"]["download"] > 0
    assert rows[0]["requests"]["PUT"] > 0 and rows[0]["bytes_up"] > 0  # the request ledger, from `_metadata`

    plot = furnaces["root"] / "history.png"
    assert main(["history", "--checkpoints", f"file://{furnaces['root']}/ckpt", "--job-id", "furnaces",
                 "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "chk-3+" in out and "primary×2" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    frame = sparkpoint.history(url=f"file://{furnaces['root']}/ckpt", job_id="furnaces", last=2)
    assert frame["checkpoint_id"].tolist() == [2, 3]


def _spans(furnaces: dict[str, Any]) -> tuple[dict[int, Any], dict[int, list[Any]]]:
    """Each span by its id, and the spans of each trace."""
    by_id = {s.context.span_id: s for s in furnaces["spans"]}
    by_trace: dict[int, list[Any]] = {}
    for s in furnaces["spans"]:
        by_trace.setdefault(s.context.trace_id, []).append(s)
    return by_id, by_trace


def test_every_checkpoint_and_restore_is_one_trace_of_nested_timed_spans(furnaces: dict[str, Any]):
    by_id, by_trace = _spans(furnaces)
    roots = sorted(s.name for s in furnaces["spans"] if s.parent is None)
    assert roots == ["checkpoint furnaces/chk-1", "checkpoint furnaces/chk-2", "checkpoint furnaces/chk-3",
                     "restore furnaces/chk-2"]
    assert len(by_trace) == 4
    for span in furnaces["spans"]:
        assert span.end_time >= span.start_time
        if span.parent is not None:
            parent = by_id[span.parent.span_id]
            assert parent.context.trace_id == span.context.trace_id
            assert parent.start_time <= span.start_time and span.end_time <= parent.end_time, (span.name, parent.name)
    third = next(t for t in by_trace.values() if any(s.name == "checkpoint furnaces/chk-3" for s in t))
    names = {s.name: s for s in third}
    path = []
    span = next(s for s in third if s.name == "upload")
    while span is not None:
        path.append(span.name)
        span = by_id[span.parent.span_id] if span.parent is not None else None
    assert path == ["upload", "snapshot", "subtask peak_heat/0", "operator peak_heat", "checkpoint furnaces/chk-3"] \
        or path == ["upload", "snapshot", "subtask peak_heat/1", "operator peak_heat", "checkpoint furnaces/chk-3"]
    assert {"restore", "download", "process", "timers", "stage", "commit", "sink commit"} <= set(names)
    assert by_id[names["commit"].parent.span_id].name == "checkpoint furnaces/chk-3"
    assert names["checkpoint furnaces/chk-3"].attributes["sparkpoint.checkpoint_id"] == 3
    restore = next(t for t in by_trace.values() if any(s.name == "restore furnaces/chk-2" for s in t))
    assert {s.name for s in restore} == {"restore furnaces/chk-2", "operator peak_heat", "subtask peak_heat/0",
                                         "subtask peak_heat/1", "restore", "download"}


def test_every_checkpoint_sends_a_start_and_a_complete_lineage_event(furnaces: dict[str, Any]):
    events = [json.loads(line) for line in (furnaces["root"] / "lineage.jsonl").read_text().splitlines()]
    assert [e["eventType"] for e in events] == ["START", "COMPLETE"] * 3
    for first, second in zip(events[::2], events[1::2]):
        assert first["run"]["runId"] == second["run"]["runId"]
    assert len({e["run"]["runId"] for e in events}) == 3
    last = events[-1]
    assert last["job"] == {"namespace": "sparkpoint", "name": "furnaces", "facets": last["job"]["facets"]}
    assert last["job"]["facets"]["jobType"]["jobType"] == "CHECKPOINT"
    assert [i["name"] for i in last["inputs"]] == [str(furnaces["root"] / "in" / "b0002.parquet")]
    out = last["outputs"][0]
    assert (out["namespace"], out["name"]) == ("file", str(furnaces["root"] / "out"))
    assert out["outputFacets"]["outputStatistics"]["rowCount"] == 6  # every furnace got hotter
    assert [f["name"] for f in out["facets"]["schema"]["fields"]][:2] == ["furnace", "peak"]
    assert last["run"]["facets"]["sparkpoint_checkpoint"]["checkpointId"] == 3


# --- the history's store ----------------------------------------------------------------------------


def _record(cid: int) -> dict[str, Any]:
    return {"checkpoint_id": cid, "kind": "checkpoint", "seconds": 0.5, "state_size": 100 * cid,
            "checkpointed_size": 10, "attempt_id": f"a{cid}"}


@pytest.fixture
def small_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(history_store, "SEGMENT", 10)


def test_records_fold_into_segments_and_the_oldest_go(small_segments: None):
    storage = CheckpointStorage("memory://history-fold", "job")
    for cid in range(1, 46):
        assert write_record(storage, _record(cid), previous=cid - 1 if cid > 1 else None, keep=25)
    assert not write_record(storage, _record(45), previous=44, keep=25)  # written once: a second completer skips
    names = sorted(f.path.rsplit("/", 1)[1] for f in storage.walk("_history"))
    assert names == ["chk-40.json", "chk-41.json", "chk-42.json", "chk-43.json", "chk-44.json", "chk-45.json",
                     "seg-1.jsonl", "seg-2.jsonl", "seg-3.jsonl"]  # 1-9: older than the newest 25 at chk-40
    history = read_history(storage)
    assert list(history.records) == list(range(10, 46))
    assert history.records[33]["state_size"] == 3300 and history.unreadable == []


def test_a_torn_record_and_a_racing_compactor_lose_nothing_else(small_segments: None):
    storage = CheckpointStorage("memory://history-torn", "job")
    for cid in range(1, 12):
        storage.write_bytes(record_path(cid), json.dumps(_record(cid)).encode() + b"\n")
    storage.write_bytes(record_path(12), b'{"checkpoint_id": 12, "kind": "check')  # torn: a crash mid-write
    compact(storage, newest=12)  # one compactor folds ids 1-9 ...
    storage.write_bytes(record_path(5), json.dumps(_record(5)).encode())  # ... while a late one's listing had it
    compact(storage, newest=12)  # the segment exists: it only deletes what the segment holds
    history = read_history(storage)
    assert list(history.records) == list(range(1, 12))
    assert [why.split(":")[0] for why in history.unreadable] == ["_history/chk-12.json"]
    assert not storage.exists(record_path(5)) and storage.exists(segment_path(0))
    storage.write_bytes("chk-11/_metadata", b"not json")  # and a checkpoint that cannot be read: named too
    rows, unreadable = history_rows(storage)
    assert [r["checkpoint_id"] for r in rows] == list(range(1, 12))
    assert any("chk-11/_metadata" in why for why in unreadable)


def test_a_recorded_request_ledger_is_shown_and_summed(tmp_path: Path, capsys: Any):
    storage = CheckpointStorage(f"file://{tmp_path}/ckpt", "job")
    write_record(storage, {**_record(7), "requests": {"PUT": 12, "GET": 3}, "bytes_up": 4096, "bytes_down": 0,
                           "estimated_cost_usd": 0.0000612}, previous=6)
    assert main(["history", "--checkpoints", f"file://{tmp_path}/ckpt", "--job-id", "job", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["checkpoints"][0]
    assert (row["requests"], row["bytes_up"], row["estimated_cost_usd"]) == ({"PUT": 12, "GET": 3}, 4096, 0.0000612)
    assert main(["history", "--checkpoints", f"file://{tmp_path}/ckpt", "--job-id", "job"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if "chk-7" in line)
    assert "15" in line and "4.0 KiB" in line and "$0.000061" in line


def test_observers_that_fail_never_fail_the_checkpoint_and_off_costs_nothing(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch):
    land(tmp_path / "in", 2)

    def broken(*args: Any) -> Any:
        raise ConnectionRefusedError("no collector at 127.0.0.1:4318")

    monkeypatch.setattr(traces, "tracer_for", broken)
    InProcessPipeline(None, furnace_config(tmp_path, max_batches=1, traces_endpoint="http://127.0.0.1:4318/v1/traces",
                                           lineage_transport=f"file://{tmp_path}/in/b0.parquet/events.jsonl"),
                      (peak_heat,)).run()
    storage = CheckpointStorage(f"file://{tmp_path}/ckpt", "furnaces")
    assert storage.completed_checkpoint_ids() == [1] and list(read_history(storage).records) == [1]
    monkeypatch.setattr(traces, "emit_traces", broken)
    InProcessPipeline(None, furnace_config(tmp_path, history_max_checkpoints=0), (peak_heat,)).run()
    assert storage.completed_checkpoint_ids() == [1, 2] and list(read_history(storage).records) == [1]


def test_bad_observability_settings_are_refused_by_name(tmp_path: Path):
    from sparkpoint.pipeline.runtime import PipelineError

    with pytest.raises(PipelineError, match="lineage_transport must be file:///<path>"):
        InProcessPipeline(None, furnace_config(tmp_path, lineage_transport="kafka://broker"), (peak_heat,))
    with pytest.raises(PipelineError, match="history_max_checkpoints must be a whole number >= 0"):
        InProcessPipeline(None, furnace_config(tmp_path, history_max_checkpoints=-1), (peak_heat,))


def test_lineage_of_tables_names_the_input_version_consumed_and_the_output_version_made(tmp_path: Path):
    import pandas as pd
    from deltalake import write_deltalake

    from sparkpoint import DeltaTable, Pipeline

    for hour in range(2):  # the input table's versions 0 and 1
        write_deltalake(str(tmp_path / "readings"), pd.DataFrame({"furnace": ["f1", "f2"],
                                                                  "celsius": [900.0 + hour, 950.0 + hour]}),
                        mode="append")
    pipeline = Pipeline("furnaces", [peak_heat], input=DeltaTable(str(tmp_path / "readings")),
                        output=DeltaTable(str(tmp_path / "peaks")), checkpoints_url=str(tmp_path / "ckpt"),
                        local_dir=str(tmp_path / "local"), parallelism=2)
    config = pipeline.config(lineage_transport=f"file://{tmp_path}/lineage.jsonl")
    InProcessPipeline(None, config, (peak_heat,)).run()
    events = [json.loads(line) for line in (tmp_path / "lineage.jsonl").read_text().splitlines()]
    completes = [e for e in events if e["eventType"] == "COMPLETE"]
    assert len(completes) == 2  # one checkpoint per input version
    assert [(e["inputs"][0]["name"], e["inputs"][0]["facets"]["version"]["datasetVersion"]) for e in completes] == [
        (str(tmp_path / "readings"), str(v)) for v in range(len(completes))]
    outputs = [e["outputs"][0] for e in completes]
    assert {o["name"] for o in outputs} == {str(tmp_path / "peaks")}
    assert [o["facets"]["version"]["datasetVersion"] for o in outputs] == [str(v) for v in range(len(completes))]
    assert sum(o["outputFacets"]["outputStatistics"]["rowCount"] for o in outputs) == 4  # each hour raised both


def test_the_phases_cross_from_the_spark_half_to_a_completer_in_another_process():
    """A Dagster or Airflow checkpoint step completes in another process: the pending attempt's
    JSON carries each subtask's phases (an older record without them reads as none)."""
    from sparkpoint.pipeline.attempt.record import PendingAttempt, SubtaskRun

    phases = (("restore", -1, 10.0, 10.5), ("download", 0, 10.1, 10.4), ("snapshot", -1, 11.0, 12.0))
    run = SubtaskRun("peak_heat", 0, "primary", 40, 2.0, phases)
    attempt = PendingAttempt(job_id="furnaces", checkpoint_id=3, attempt_id="run-1", expected={"peak_heat": 1},
                             handles=(), staged=(), source_offsets={"version": 1, "consumed": ["b0000.parquet"]},
                             files=("b0000.parquet",), subtasks=(run,), rows=40, started_at=9.0)
    again = PendingAttempt.loads(attempt.dumps())
    assert again.subtasks[0].phases == phases
    raw = json.loads(attempt.dumps())
    del raw["subtasks"][0]["phases"]
    assert PendingAttempt.from_json(raw).subtasks[0].phases == ()
