"""`sparkpoint erase --report FILE` end to end, in a process of its own, on a user's pipeline whose
output is an Iceberg table (`tests.support.viewing_pipeline`: watch time per viewer, a map and a
value state, pyiceberg's SQL catalog on SQLite; run in process without Spark): the report's
figures per checkpoint are the entries the state held, its output figures the rows and files of
the table, and the rows are gone from the table's current snapshot, every other row as it was."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
from pyiceberg.catalog import load_catalog

import sparkpoint
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.cli import main
from tests.support.interleavings import InProcessPipeline
from tests.support.viewing_pipeline import TABLE, catalog, land, viewing_pipeline

GONE = "viewer-05"
VIEWERS = [f"viewer-{i:02d}" for i in range(16)]


def _snapshot(root: Path) -> tuple[pd.DataFrame, int]:
    """The table's current snapshot: its rows (sorted) and id."""
    props = catalog(root)
    table = load_catalog(props.pop("name"), **props).load_table(TABLE)
    rows = table.scan().to_pandas()[["checkpoint_id", "viewer", "titles", "minutes", "device"]]
    return rows.sort_values(["checkpoint_id", "viewer"]).reset_index(drop=True), table.current_snapshot().snapshot_id


def _entries_of(pipeline: sparkpoint.Pipeline, cid: int, viewer: str) -> int:
    raw = sparkpoint.read_state(pipeline.checkpoints_url, pipeline.name, "watch-by-viewer", cid, raw=True)
    return int((raw["key"].map(lambda k: k.decode() if isinstance(k, bytes) else k) == viewer).sum())


def test_the_erase_command_reports_per_checkpoint_and_per_output_and_the_rows_leave_the_iceberg_table(
        tmp_path: Path):
    pipeline = viewing_pipeline(tmp_path)
    for b in (1, 2, 3):
        land(tmp_path / "in", b, VIEWERS if b != 2 else [v for v in VIEWERS if v != GONE])
    InProcessPipeline(None, pipeline.config(), pipeline.operators).run()
    storage = CheckpointStorage(pipeline.checkpoints_url, pipeline.name)
    assert sorted(m.checkpoint_id for m in CompletedCheckpointStore(storage).load_all().checkpoints) == [1, 2, 3]
    held = {cid: _entries_of(pipeline, cid, GONE) for cid in (1, 2, 3)}
    assert held[1] > 0 and held[3] > held[1], "the key's entries, more after batch 3"
    rows, snapshot = _snapshot(tmp_path)
    assert sorted(rows.loc[rows["viewer"] == GONE, "checkpoint_id"]) == [1, 3], "no row of it from batch 2"

    report_path = tmp_path / "proof" / "erase.json"
    report_path.parent.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "sparkpoint.cli", "erase", "--pipeline", "tests.support.viewing_pipeline:viewing",
         "--key", GONE, "--report", str(report_path)],
        env={**os.environ, "VIEWING_ROOT": str(tmp_path), "PYTHONPATH": os.getcwd()}, capture_output=True,
        text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "VERIFIED" in done.stdout and "output viewer: 2 rows removed" in done.stdout

    text = report_path.read_text()
    report = json.loads(text)
    assert report["verified"] and report["keys"] == 1 and GONE not in text
    assert report["operators"] == ["watch-by-viewer"] and report["output_url"] == f"iceberg://lake/{TABLE}"
    by_original = {c["original"]: c for c in report["checkpoints"]}
    assert [by_original[c]["new"] for c in (1, 2, 3)] == [4, 5, 6] and report["retired"] == [1, 2, 3]
    for cid in (1, 2, 3):
        c = by_original[cid]
        assert c["entries_removed"] == held[cid], cid
        assert c["files_read"] > 0 and c["bytes_read"] > 0 and c["files_rewritten"] > 0 and c["bytes_written"] > 0
        assert [s["subtask"] for s in c["subtasks"]] == [_holder(storage, cid + 3)], "one subtask of two"
    proof = {v["checkpoint_id"]: v for v in report["verification"]}
    assert sorted(proof) == [4, 5, 6] and all(v["ok"] and v["files_checked"] > 0 and v["rest_equal"]
                                              for v in proof.values())

    (output,) = report["output"]
    after, erased_snapshot = _snapshot(tmp_path)
    assert output["column"] == "viewer" and output["rows_removed"] == 2
    assert output["by_checkpoint"] == {"1": 1, "3": 1}
    assert output["files_rewritten"] == len(output["rewrites"]) > 0 and output["bytes_written"] > 0
    assert output["version"] == erased_snapshot != snapshot, "the overwrite snapshot is the current one"
    assert GONE not in set(after["viewer"])
    pd.testing.assert_frame_equal(after, rows[rows["viewer"] != GONE].reset_index(drop=True))

    for cid in (4, 5, 6):
        assert _entries_of(pipeline, cid, GONE) == 0
    assert main(["verify", "--checkpoints", pipeline.checkpoints_url, "--job-id", pipeline.name]) == 0


def _holder(storage: CheckpointStorage, cid: int) -> int:
    from sparkpoint.state.keygroups import key_group_for

    meta = CompletedCheckpointStore(storage).load(cid)
    group = key_group_for(GONE, meta.operators["watch-by-viewer"].max_parallelism)
    (h,) = [h for h in meta.operators["watch-by-viewer"].subtasks if group in h.key_group_range]
    return h.subtask
