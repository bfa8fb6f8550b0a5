"""One run of a pipeline at a time, end to end (issue 37): a real `dagster dev` serving a user's
pipeline (the example project's `clicks`) with its input sensor on, on an instance without
sparkpoint's pool config and on one with it. A run with an injected failure, files landing while
the failure is recovered: every batch is committed exactly once, no two runs of the pipeline run
at once, no run fails for losing a race, the recovery run is green; and the code location said
once, at load, that the instance without the config gives the pipeline's pool no limit.

Both instances are `make soak`'s, each on a `dagster dev` of its own: `make test` makes these checks
without the config on the end-to-end tests' shared server (tests/test_dagster_e2e.py), a run
launched by hand and a failure armed in the input sensor's cursor among them."""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import pytest

from sparkpoint.ops.instance import INSTANCE_YAML
from sparkpoint.spark.warm import stop as stop_warm_spark
from tests.support.dagster_server import (
    INJECT_TAG,
    NO_POOLS,
    OVERTAKEN_TAG,
    POOL_WARNING,
    RECOVERS_TAG,
    DagsterServer,
)

pytestmark = [pytest.mark.spark, pytest.mark.e2e]

REPO = Path(__file__).resolve().parent.parent

def land(into: Path, batches: int) -> list[Path]:
    sys.path.insert(0, str(REPO / "examples" / "clickstream"))
    try:
        from clickstream.land import land as land_clicks
    finally:
        sys.path.pop(0)
    return land_clicks(into, batches)


def read_clicks(checkpoints: Path) -> dict[str, int]:
    sys.path.insert(0, str(REPO / "examples" / "clickstream"))
    try:
        from clickstream.pipelines import clicks

        state = clicks.with_(checkpoints_url=str(checkpoints)).read_state("clicks_per_user")
    finally:
        sys.path.pop(0)
    return dict(zip(state["user"], state["clicks"]))


# A Dagster instance as a user has it (no pool configured), and with the documented pool.
@pytest.mark.soak
@pytest.mark.parametrize("instance_yaml", [NO_POOLS, INSTANCE_YAML],
                         ids=["without-pool-config", "with-pool-config"])
def test_files_landing_while_a_failure_is_recovered_commit_once_each_with_one_run_at_a_time(
        tmp_path: Path, instance_yaml: str):
    warm = tmp_path / "warm-spark"  # its runs attach to one JVM, as `make ui`'s do (not one per run)
    server = DagsterServer(tmp_path, module="tests.support.one_run_location", instance_yaml=instance_yaml,
                           env={"SPARKPOINT_WARM_SPARK": "on", "SPARKPOINT_WARM_SPARK_DIR": str(warm)})
    base = tmp_path / ".sparkpoint" / "clicks"
    files = [f"clicks-{i:06d}.parquet" for i in range(3)]
    try:
        server.start()
        # A run with a failure after its upload, launched by hand before its file lands: the
        # input sensor sees the run in flight and waits for it.
        failed_id = server.launch_job("clicks_checkpoint", {INJECT_TAG: "after-upload"})
        land(base / "input", 1)
        assert server.wait_run(failed_id, timeout=120)["status"] == "FAILURE"
        land(base / "input", 2)  # while the failure is being recovered

        seen = server.wait_recovered(("clicks_checkpoint", "clicks_recover"), (base / "checkpoints").as_uri(),
                                     "clicks", files, failed_id)
        mats = sorted(server.materializations("checkpoint", "clicks"), key=lambda m: m["metadata"]["checkpoint_id"])
    finally:
        server.stop()
        stop_warm_spark(directory=warm)

    # No run failed but the injected one; the recovery run is green; none lost a race.
    assert [r["runId"] for r in seen if r["status"] != "SUCCESS"] == [failed_id], seen
    recovery = [r for r in seen if r["tags"].get(RECOVERS_TAG) == failed_id]
    assert [(r["jobName"], r["status"]) for r in recovery] == [("clicks_recover", "SUCCESS")], recovery
    assert not [r for r in seen if OVERTAKEN_TAG in r["tags"]], "no run was overtaken: none ran beside another"
    # One run of the pipeline at a time, whatever the instance's config.
    spans = sorted((r["startTime"], r["endTime"], r["runId"]) for r in seen if r["startTime"])
    for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
        assert end <= start, f"runs {first} and {second} of the pipeline ran at once"

    # Every batch committed exactly once: one checkpoint materialization each, in order, its
    # sink output once, the state equal to a recomputation over every file.
    assert [m["metadata"]["checkpoint_id"] for m in mats] == [1, 2, 3], mats
    assert [f for m in mats for f in m["metadata"]["batch"]] == files
    events = [pd.read_parquet(base / "input" / f) for f in files]
    everything = pd.concat(events, ignore_index=True)
    assert read_clicks(base / "checkpoints") == everything.groupby("user").size().to_dict()
    output = pd.read_parquet(base / "output")
    assert sorted(output["checkpoint_id"].unique()) == [1, 2, 3]
    for cid, batch in enumerate(events, start=1):
        upto = pd.concat(events[:cid], ignore_index=True).groupby("user").size()
        rows = output[output["checkpoint_id"] == cid]
        assert dict(zip(rows["user"], rows["clicks"])) == upto[sorted(batch["user"].unique())].to_dict(), cid

    # Once, when the code location loads; not again when Dagster restarts its code server while
    # it shuts down (seen under load: "Code server process has exited ... Restarting").
    log = server.log.read_text(errors="replace").split("Shutting down Dagster services")[0]
    assert log.count(POOL_WARNING) == (1 if instance_yaml == NO_POOLS else 0), server.log_tail(200)
    if instance_yaml == NO_POOLS:
        assert f"add to {server.home}/dagster.yaml:\nconcurrency:\n  pools:\n    granularity: run\n" in log
