"""End to end through the real webserver and daemon, on an instance without sparkpoint's pool
config: the UI's "Materialize all" over GraphQL, an injected failure healed by the recovery
sensor's run, exactly-once state and output; a second pipeline of its own operators in the same
code location, run by its input sensor when files land (one run per file, none beside a run in
flight, a run launched by hand included), failed and healed by its own recovery while more files
land, every file committed exactly once, the sample pipeline untouched.

Then the UI those runs left, rendered by headless Chromium (Debian `chromium`) on the same
webserver: the asset graph shows the SSTable assets feeding the checkpoint asset, the checkpoint
asset's page shows `checkpoint_id` and the size metadata (each byte count beside a readable size),
and its Plots view plots them; input assets are observed; a failure armed for the input sensor's
next run fails that run, whose page links its recovery run. Screenshots go to `build/`."""

from __future__ import annotations

import base64
import json
import re
import time
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from deltalake import DeltaTable

from sparkpoint.assets.metadata import readable_size
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.cli import main
from sparkpoint.ops.instance import POOL_YAML
from sparkpoint.pipeline.maintenance import registry_counts
from tests.support import oracle
from tests.support.browser import BUILD, DevTools, chromium, render, text_of
from tests.support.dagster_server import (
    INJECT_TAG,
    OVERTAKEN_TAG,
    POOL_WARNING,
    RECOVERS_TAG,
    DagsterServer,
    land_clicks,
)

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


def assert_clicks_exact(server: DagsterServer) -> None:
    """The `clicks` pipeline's state equals a recomputation over every file landed for it."""
    import sys

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


# --- the UI, rendered by headless Chromium on the same webserver ----------------------------------

GRAPH = "/assets/sparkpoint/checkpoint?view=lineage&lineageScope=upstream"
LINEAGE = "/asset-groups"
CHECKPOINT = "/assets/sparkpoint/checkpoint"

def test_asset_graph_and_checkpoint_page_render_in_headless_chromium(dagster_server: DagsterServer,
                                                                      tmp_path: Path) -> None:
    chromium()  # fails with what to install when it is missing
    server = dagster_server
    server.ensure_checkpoint()
    server.gql("mutation { setNuxSeen }")  # the first-visit "Join the Dagster community" modal
    BUILD.mkdir(exist_ok=True)

    graph = text_of(render(server.url + GRAPH, tmp_path / "p1", screenshot=BUILD / "dagster-asset-graph.png"))
    for name in ("user_totals", "item_reach", "checkpoint"):  # the checkpoint's upstream lineage
        assert name in graph, f"{name} not on the asset graph: {graph[:1500]}"
    lineage = text_of(render(server.url + LINEAGE, tmp_path / "p2", screenshot=BUILD / "dagster-lineage.png"))
    assert "Global asset lineage" in lineage, lineage[:1500]
    assert "sparkpoint" in lineage and "clicks" in lineage, f"both pipelines' groups: {lineage[:1500]}"

    page = text_of(render(server.url + CHECKPOINT, tmp_path / "p3", screenshot=BUILD / "dagster-checkpoint.png"))
    latest = max(server.checkpoint_ids())
    assert re.search(rf"checkpoint_id\s+.*?{latest}\b", page), page[:2000]
    for key in ("summary", "state_size_bytes", "checkpointed_size_bytes", "incremental_ratio", "registry_files"):
        assert key in page, f"{key} not on the checkpoint page: {page[:2000]}"

    # The metadata's Plots view is a button (no URL): click it through the DevTools protocol.
    browser = DevTools(tmp_path / "p4")
    try:
        browser.call("Page.enable")
        browser.call("Page.navigate", url=server.url + CHECKPOINT)
        browser.wait("document.body && document.body.innerText.includes('checkpoint_id')", "the metadata table")
        clicked = browser.evaluate(
            "(() => { const b = [...document.querySelectorAll('button')].find(b => b.innerText.trim() === 'Plots');"
            " if (b) { b.click(); return true; } return false; })()"
        )
        assert clicked, "no Plots button on the checkpoint page"
        # One plot per numeric key, each with its title and a drawn chart.
        keys = json.dumps(["checkpoint_id", "state_size_bytes", "checkpointed_size_bytes"])
        browser.wait(f"document.querySelectorAll('canvas, svg.recharts-surface').length >= 4 && "
                     f"{keys}.every(k => document.body.innerText.includes(k))", "the metadata plots")
        time.sleep(1)
        shot = browser.call("Page.captureScreenshot", format="png")
        (BUILD / "dagster-checkpoint-plots.png").write_bytes(base64.b64decode(shot["data"]))
    finally:
        browser.close()


def arm_failure(server: DagsterServer, sensor: str, point: str) -> None:
    """The documented one step: set the input sensor's cursor with `dagster sensor cursor`. A tick
    the daemon was running at that moment writes its own cursor over it (Dagster's cursor, whoever
    sets it): the next tick says whether the sensor is armed, and the step is taken again if not."""
    armed = f"(armed: the next run gets {INJECT_TAG}={point})"
    for _ in range(3):
        server.dagster("sensor", "cursor", sensor, "--set", json.dumps({"inject_failure": point}))
        set_at = time.time()
        tick = server.wait_for(
            f"a tick of {sensor} after its cursor was set",
            lambda since=set_at: next((t for t in server.ticks(sensor) if t["timestamp"] > since), None), timeout=60)
        if armed in (tick["skipReason"] or ""):
            return
    raise AssertionError(f"{sensor} never said {armed!r}; its ticks: {server.ticks(sensor)}")


def new_run(server: DagsterServer, known: set[str], job: str) -> dict[str, Any] | None:
    return next((r for r in server.runs() if r["jobName"] == job and r["runId"] not in known), None)


CLICKS_JOBS = ("clicks_checkpoint", "clicks_recover")


@pytest.mark.timeout(1200)  # five Spark runs one after another, on a loaded machine
def test_files_landing_on_a_second_pipeline_commit_once_each_one_run_at_a_time_through_a_failure_and_its_recovery(
        dagster_server: DagsterServer, tmp_path: Path) -> None:
    """The example's `clicks` pipeline (its own operators, columns user/page/clicked_at) beside the
    sample, on an instance without sparkpoint's pool config (issues 34 and 37). A run launched by
    hand before its file lands: the input sensor sees it in flight and waits for it. A failure
    armed in one step for the input sensor's next run fails that run only; files landing while it
    is recovered start one run each, after the recovery: every file committed exactly once, no two
    runs of the pipeline at once, none lost a race, the sample pipeline untouched, and the code
    location said once, at load, that the instance gives the pipeline's pool no limit. Then the UI:
    the failed run's page links its recovery run, one click away; the input assets are observed;
    the checkpoint's sizes read as sizes. Screenshots go to `build/`."""
    chromium()
    server = dagster_server
    server.gql("mutation { setNuxSeen }")
    server.ensure_checkpoint()  # the sample pipeline's, whose input sensor is stopped: its run observes the input
    BUILD.mkdir(exist_ok=True)
    assert server.sensor("clicks_input_sensor")["sensorState"]["status"] == "RUNNING"
    sample = CheckpointStorage(server.checkpoints_url, JOB)
    sample_before = sample.completed_checkpoint_ids()
    base = server.root / ".sparkpoint" / "clicks"
    into = base / "input"
    into.mkdir(parents=True, exist_ok=True)

    by_hand = server.launch_job("clicks_checkpoint")
    land_clicks(into, 1)
    assert server.wait_run(by_hand)["status"] == "SUCCESS", server.log_tail()

    # 9. Arm a failure for the next run of the running input sensor, land a batch: that run fails.
    arm_failure(server, "clicks_input_sensor", "after-upload")
    known = {r["runId"] for r in server.runs()}
    land_clicks(into, 1)
    first = server.wait_for("the input sensor's run", lambda: new_run(server, known, "clicks_checkpoint"), timeout=120)
    failed = server.wait_run(first["runId"])
    assert failed["status"] == "FAILURE", f"{failed}\n{server.log_tail()}"
    assert {"key": INJECT_TAG, "value": "after-upload"} in failed["tags"]
    land_clicks(into, 2)  # while the failure is being recovered
    files = [f"clicks-{i:06d}.parquet" for i in range(4)]
    seen = server.wait_recovered(CLICKS_JOBS, (base / "checkpoints").as_uri(), "clicks", files, failed["runId"])

    # No run failed but the armed one; its own recovery only, green; none lost a race.
    assert [r["runId"] for r in seen if r["status"] != "SUCCESS"] == [failed["runId"]], seen
    (recovery,) = [r for r in seen if r["tags"].get(RECOVERS_TAG) == failed["runId"]]
    assert [r["jobName"] for r in server.runs({RECOVERS_TAG: failed["runId"]})] == ["clicks_recover"], \
        "its own recovery only: the sample's recovery stayed out of it"
    assert not [r for r in seen if OVERTAKEN_TAG in r["tags"]], "no run was overtaken: none ran beside another"
    assert [r["runId"] for r in seen if INJECT_TAG in r["tags"]] == [failed["runId"]], \
        "the armed failure went to one run only"
    spans = sorted((r["startTime"], r["endTime"], r["runId"]) for r in seen if r["startTime"])
    for (_, end, one), (start, _, other) in zip(spans, spans[1:]):
        assert end <= start, f"runs {one} and {other} of the pipeline ran at once"
    # One run per landed file, none for the file the run launched by hand took.
    landed = sorted(r["tags"]["sparkpoint/landed"] for r in seen if r["jobName"] == "clicks_checkpoint"
                    and r["runId"] != by_hand)
    assert landed == files[1:], seen
    after = next(r for r in seen if r["jobName"] == "clicks_checkpoint")  # the newest
    assert after["tags"]["sparkpoint/landed"] == files[-1] and after["status"] == "SUCCESS", after

    # Every batch committed exactly once: one checkpoint materialization each, in order, its sink
    # output once, the state equal to a recomputation over every file; the sample untouched.
    mats = sorted(server.materializations("checkpoint", "clicks"), key=lambda m: m["metadata"]["checkpoint_id"])
    assert [m["metadata"]["checkpoint_id"] for m in mats] == [1, 2, 3, 4], mats
    assert [f for m in mats for f in m["metadata"]["batch"]] == files
    events = [pd.read_parquet(into / f) for f in files]
    output = pd.read_parquet(base / "output")
    assert sorted(output["checkpoint_id"].unique()) == [1, 2, 3, 4]
    for cid, batch in enumerate(events, start=1):
        upto = pd.concat(events[:cid], ignore_index=True).groupby("user").size()
        rows = output[output["checkpoint_id"] == cid]
        assert dict(zip(rows["user"], rows["clicks"])) == upto[sorted(batch["user"].unique())].to_dict(), cid
    assert sample.completed_checkpoint_ids() == sample_before, "the sample pipeline got no checkpoint from it"
    log = server.log.read_text(errors="replace")
    assert log.count(POOL_WARNING) == 1, server.log_tail(200)
    assert f"add to {server.home}/dagster.yaml:\n{POOL_YAML}" in log

    browser = DevTools(tmp_path / "p5")
    try:
        browser.call("Page.enable")
        # 8. The failed run's page links its recovery run; one click opens it.
        browser.call("Page.navigate", url=f"{server.url}/runs/{failed['runId']}")
        link = f"a[href='/runs/{recovery['runId']}']"
        browser.wait(f"document.querySelector(\"{link}\") !== null", "the link to the recovery run")
        assert "recovery_run" in browser.evaluate("document.body.innerText")
        time.sleep(1)
        shot = browser.call("Page.captureScreenshot", format="png")
        (BUILD / "dagster-failed-run-recovery-link.png").write_bytes(base64.b64decode(shot["data"]))
        browser.evaluate(f"document.querySelector(\"{link}\").click()")
        browser.wait(f"location.pathname === '/runs/{recovery['runId']}' && "
                     "document.body.innerText.includes('clicks_recover')", "the recovery run's page")

        # 7. The checkpoint's byte counts stay numbers; beside each, the size as a person reads it.
        (latest,) = [m for m in mats if m["runId"] == after["runId"]]
        sizes = latest["metadata"]
        assert sizes["state_size"] == readable_size(sizes["state_size_bytes"]), sizes
        assert sizes["checkpointed_size"] == readable_size(sizes["checkpointed_size_bytes"]), sizes
        browser.call("Page.navigate", url=f"{server.url}/assets/clicks/checkpoint")
        browser.wait("document.body.innerText.includes('checkpointed_size_bytes')", "the metadata table")
        page = browser.evaluate("document.body.innerText")
        for key in ("state_size", "checkpointed_size"):
            shown = re.search(rf"^{key}\s+\S[^\n]*\s+(.+)$", page, flags=re.M)
            assert shown and shown.group(1).strip() == sizes[key], f"{key}: {page[:3000]}"
            assert re.search(rf"^{key}_bytes\s+\S[^\n]*\s+{sizes[key + '_bytes']}$", page, flags=re.M), page[:3000]
        browser.evaluate("[...document.querySelectorAll('td')].find(td => td.innerText.trim() === 'state_size_bytes')"
                         ".scrollIntoView({block: 'center'})")
        time.sleep(1)
        shot = browser.call("Page.captureScreenshot", format="png")
        (BUILD / "dagster-readable-sizes.png").write_bytes(base64.b64decode(shot["data"]))
    finally:
        browser.close()

    # 6. Neither pipeline's input asset is "Never observed": the sensor's ticks and the runs observe
    # them. Once the sensor saw the last batch consumed, the state read all there is: in sync.
    def seen_consumed() -> bool:  # the newest observation is the sensor's (no run), after the last run
        newest = server.observations("input", "clicks")[0]
        return newest["runId"] == "" and newest["metadata"]["files_pending"] == 0

    server.wait_for("the input sensor's observation after the last run", seen_consumed, timeout=60)
    assert_clicks_exact(server)
    for prefix in ("clicks", "sparkpoint"):
        graph = text_of(render(f"{server.url}/assets/{prefix}/checkpoint?view=lineage&lineageScope=upstream"
                               "&lineageDepth=2", tmp_path / f"p6{prefix}",
                               screenshot=BUILD / f"dagster-{prefix}-input-observed.png"))
        assert "input" in graph and "Observed" in graph, graph[:2000]
        assert "Never observed" not in graph, graph[:2000]
        if prefix == "clicks":
            assert "Unsynced" not in graph, f"the state read what the observation saw: {graph[:2000]}"
