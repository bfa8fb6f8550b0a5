"""End to end through the real webserver and daemon: the UI's "Materialize all" over GraphQL, an
injected failure healed by the recovery sensor's run, exactly-once state and output; a second
pipeline of its own operators in the same code location, run by its input sensor when files land,
failed and healed by its own recovery, the sample pipeline untouched."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from deltalake import DeltaTable

from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.cli import main
from sparkpoint.pipeline.maintenance import registry_counts
from tests.support import oracle
from tests.support.dagster_server import INJECT_TAG, RECOVERS_TAG, DagsterServer, land_clicks

pytestmark = [pytest.mark.spark, pytest.mark.e2e]

JOB = "demo"  # the resources' embedded default job id
METADATA_KEYS = {"checkpoint_id", "summary", "path", "state_size_bytes", "state_size", "checkpointed_size_bytes",
                 "checkpointed_size",
                 "incremental_ratio", "files_new", "files_reused", "files_deleted", "registry_files", "retained",
                 "duration_seconds", "batch", "dagster/row_count", "prune_due",
                 "routing", "input_read", "input_read_bytes", "batch_size", "batch_size_bytes", "read_amplification",
                 "requests", "requests_total", "input_requests", "bytes_up", "bytes_down", "input_bytes",
                 "estimated_cost_usd",
                 "restored_subtasks"}  # and `phase_<phase>_seconds` per phase its subtasks went through


# Where a retained checkpoint precedes it (every committing step reports them, a recovery's too).
SINCE_PREVIOUS = {"previous_checkpoint", "previous_checkpoint_id", "keys_added", "keys_removed", "keys_changed"}


def export(server: DagsterServer, tmp_path: Path, operator: str) -> pd.DataFrame:
    out = tmp_path / f"{operator}.parquet"
    assert main(["state", "--checkpoints", server.checkpoints_url, "--job-id", JOB, "--operator", operator,
                 "--format", "parquet", "--out", str(out)]) == 0
    return pd.read_parquet(out)


def assert_metadata_matches_storage(storage: CheckpointStorage, metadata: dict[str, Any], *,
                                    registry_now: bool) -> None:
    phases = {k for k in metadata if k.startswith("phase_") and k.endswith("_seconds")}
    assert set(metadata) - {"recovered_run", *SINCE_PREVIOUS} - phases == METADATA_KEYS, sorted(metadata)
    cid = metadata["checkpoint_id"]
    assert isinstance(cid, int)
    meta = CompletedCheckpointStore(storage).load(cid)
    assert metadata["path"] == f"{storage.job_url}/{meta.metadata_path}".removeprefix("file://")  # a path value
    assert metadata["state_size_bytes"] == meta.stats.state_size > 0
    assert metadata["checkpointed_size_bytes"] == meta.stats.checkpointed_size > 0
    assert metadata["summary"].startswith(f"chk-{cid}: uploaded ")
    assert metadata["dagster/row_count"] > 0 and metadata["batch"]
    assert metadata["incremental_ratio"] == pytest.approx(meta.stats.checkpointed_size / meta.stats.state_size,
                                                          abs=1e-4)
    assert metadata["files_new"] == meta.stats.files_new
    assert metadata["files_reused"] == meta.stats.files_reused
    assert metadata["files_new"] + metadata["files_reused"] > 0
    assert isinstance(metadata["files_deleted"], int) and metadata["files_deleted"] >= 0
    assert isinstance(metadata["duration_seconds"], float) and metadata["duration_seconds"] > 0
    assert cid in metadata["retained"]
    if registry_now:  # nothing has committed or pruned since
        counts = registry_counts(storage)
        assert metadata["registry_files"] == counts.files
        assert sorted(metadata["retained"]) == sorted(counts.checkpoints)


def test_materialize_fail_and_heal_through_the_webserver_and_daemon(dagster_server: DagsterServer,
                                                                    tmp_path: Path) -> None:
    server = dagster_server
    storage = CheckpointStorage(server.checkpoints_url, JOB)
    sensors = server.sensor("sparkpoint_recovery_sensor")
    assert sensors["sensorState"]["status"] == "RUNNING", "the recovery sensor runs by default"
    before = server.checkpoint_ids()

    # 1. "Materialize all", as the UI does it
    run_id = server.launch_all_assets()
    run = server.wait_run(run_id)
    assert run["status"] == "SUCCESS", f"{run}\n{server.log_tail()}"
    assert run["jobName"] == "__ASSET_JOB"
    mats = [m for m in server.materializations("checkpoint") if m["runId"] == run_id]
    assert len(mats) == 1, mats
    first = mats[0]["metadata"]
    assert first["checkpoint_id"] == max(before, default=0) + 1
    assert_metadata_matches_storage(storage, first, registry_now=True)
    for name in ("user_totals", "item_reach"):
        assert [m for m in server.materializations(name) if m["runId"] == run_id], name

    # 2. an injected failure after the SSTs were uploaded: the run fails, nothing is committed
    failed_id = server.launch_all_assets({INJECT_TAG: "after-upload"})
    failed = server.wait_run(failed_id)
    assert failed["status"] == "FAILURE", f"{failed}\n{server.log_tail()}"
    assert storage.completed_checkpoint_ids()[-1] == first["checkpoint_id"]

    # 3. the daemon's recovery sensor launches a `recover` run that commits a newer checkpoint
    def recovery_runs() -> list[dict[str, Any]]:
        return server.runs({RECOVERS_TAG: failed_id})

    recovery = server.wait_for(f"the recovery run of {failed_id}", recovery_runs, timeout=90,
                               last=lambda: [(r["jobName"], r["status"]) for r in server.runs()[:5]])
    assert len(recovery) == 1 and recovery[0]["jobName"] == "sparkpoint_recover", recovery
    healed = server.wait_run(recovery[0]["runId"])
    assert healed["status"] == "SUCCESS", f"{healed}\n{server.log_tail()}"
    mats = [m for m in server.materializations("checkpoint") if m["runId"] == healed["runId"]]
    assert len(mats) == 1, mats
    newer = mats[0]["metadata"]
    assert newer["checkpoint_id"] == first["checkpoint_id"] + 1
    assert_metadata_matches_storage(storage, newer, registry_now=False)
    assert len(recovery_runs()) == 1, "one recovery run per failed run"

    # 4. exactly-once: the state equals a recomputation over every consumed batch; sink once per batch
    latest = CompletedCheckpointStore(storage).latest()
    assert latest is not None and latest.checkpoint_id == newer["checkpoint_id"]
    input_dir = server.root / ".sparkpoint" / "demo" / "input"
    batches = oracle.read_batches(str(input_dir))
    consumed = latest.source_offsets["source"]["consumed"]
    assert consumed == sorted(p.name for p in input_dir.glob("batch-*.parquet")), consumed
    assert len(batches) == latest.checkpoint_id
    events = pd.concat(batches, ignore_index=True)
    oracle.assert_totals_equal(export(server, tmp_path, "user_totals"), oracle.user_totals(events))
    oracle.assert_reach_equal(export(server, tmp_path, "item_reach"), oracle.item_reach(events))
    output = DeltaTable(str(server.root / ".sparkpoint" / "demo" / "output")).to_pandas()  # the sample's Delta table
    ids = sorted(int(i) for i in output["checkpoint_id"].unique())
    assert ids == list(range(1, latest.checkpoint_id + 1))
    for cid, expected in zip(ids, oracle.sink_rows(batches)):
        oracle.assert_totals_equal(output[output["checkpoint_id"] == cid].drop(columns="checkpoint_id"), expected)

    # 5. every retained checkpoint verifies (present, size, CRC32)
    assert main(["verify", "--checkpoints", server.checkpoints_url, "--job-id", JOB]) == 0


def test_a_second_pipeline_runs_on_landing_and_heals_on_its_own(dagster_server: DagsterServer) -> None:
    """The example's `clicks` pipeline (its own operators, columns user/page/clicked_at) beside the
    sample: files landing start its runs (its input sensor), a failure injected into one of its
    runs is healed by its own recovery sensor and job, and the sample's checkpoints are untouched."""
    import sys

    server = dagster_server
    land = land_clicks
    assert server.sensor("clicks_input_sensor")["sensorState"]["status"] == "RUNNING"
    sample = CheckpointStorage(server.checkpoints_url, JOB)
    sample_before = sample.completed_checkpoint_ids()
    clicks_storage = CheckpointStorage((server.root / ".sparkpoint" / "clicks" / "checkpoints").as_uri(), "clicks")

    land(server.root / ".sparkpoint" / "clicks" / "input", 2)
    server.wait_for("the input sensor's two runs", lambda: len(server.checkpoint_ids("clicks")) >= 2, timeout=240,
                    last=lambda: [(r["jobName"], r["status"]) for r in server.runs()[:5]])
    landed = [server.wait_run(r["runId"]) for r in server.runs() if r["jobName"] == "clicks_checkpoint"]
    assert len(landed) == 2 and all(r["status"] == "SUCCESS" for r in landed), landed
    assert {t["value"] for r in landed for t in r["tags"] if t["key"] == "sparkpoint/landed"} == {
        "clicks-000000.parquet", "clicks-000001.parquet"}, "one run per landed file"
    assert clicks_storage.completed_checkpoint_ids() == [1, 2]

    # A failure injected into a run of clicks (launched at once, before the input sensor's next
    # tick would launch one for the new file): its own recovery heals it.
    land(server.root / ".sparkpoint" / "clicks" / "input", 1)
    failed_id = server.launch_job("clicks_checkpoint", {INJECT_TAG: "after-upload"})
    assert server.wait_run(failed_id)["status"] == "FAILURE"
    recovery = server.wait_for(f"the recovery run of {failed_id}", lambda: server.runs({RECOVERS_TAG: failed_id}),
                               timeout=120, last=lambda: [(r["jobName"], r["status"]) for r in server.runs()[:5]])
    assert [r["jobName"] for r in recovery] == ["clicks_recover"], recovery
    assert server.wait_run(recovery[0]["runId"])["status"] == "SUCCESS"
    for run in server.runs():  # the input sensor's run for the third file, if it got one, has finished too
        server.wait_run(run["runId"])
    assert clicks_storage.completed_checkpoint_ids() == [2, 3]
    assert sample.completed_checkpoint_ids() == sample_before, "the sample pipeline got no checkpoint from it"
    assert not [r for r in server.runs() if r["jobName"].startswith("sparkpoint_")
                and {"key": RECOVERS_TAG, "value": failed_id} in r["tags"]], "the sample's recovery stayed out of it"

    events = pd.concat([pd.read_parquet(p) for p in sorted((server.root / ".sparkpoint" / "clicks" / "input")
                                                           .glob("clicks-*.parquet"))], ignore_index=True)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "clickstream"))
    try:
        from clickstream.pipelines import clicks

        here = clicks.with_(checkpoints_url=str(server.root / ".sparkpoint" / "clicks" / "checkpoints"))
        state = here.read_state("clicks_per_user")
    finally:
        sys.path.pop(0)
    assert dict(zip(state["user"], state["clicks"])) == events.groupby("user").size().to_dict()
