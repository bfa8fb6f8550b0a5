"""The example project `examples/clickstream/` end to end: two pipelines of the project's own
operators (one built in Python with `build_pipeline_defs`, one declared in `defs.yaml` through
`sparkpoint.PipelineComponent`) in one code location. `dg check defs` loads it; both materialize
several times; a failure injected into one is healed by its own recovery sensor and job, and the
other is never touched; each pipeline's state equals a recomputation, the sink's rows are
committed exactly once."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pandas as pd
import pytest

from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.ops import RECOVERY_RUN
from sparkpoint.resources import SparkResource
from sparkpoint.resources.scope import FAILED_RUN_TAG, INJECT_TAG, RECOVERED_BY_TAG

pytestmark = pytest.mark.spark
ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "clickstream"


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A copy of the example, as the working directory (its `.sparkpoint/` lands there)."""
    root = tmp_path / "clickstream"
    shutil.copytree(EXAMPLE, root, ignore=shutil.ignore_patterns(".sparkpoint", "__pycache__"))
    monkeypatch.chdir(root)
    monkeypatch.syspath_prepend(str(root))
    for name in [m for m in sys.modules if m == "clickstream" or m.startswith("clickstream.")]:
        monkeypatch.delitem(sys.modules, name)
    # Every test in this process shares one JVM: a run must not stop it (a deployment does).
    monkeypatch.setattr(SparkResource, "teardown_after_execution", lambda self, context: None)
    yield root


def dg_env(project: Path) -> dict[str, str]:
    venv = Path(sys.executable).parent
    return {**os.environ, "PYTHONPATH": f"{project}{os.pathsep}{ROOT}", "VIRTUAL_ENV": str(venv.parent),
            "PATH": f"{venv}{os.pathsep}{os.environ['PATH']}", "DAGSTER_HOME": str(project / ".dagster")}


def test_dg_check_defs_loads_both_pipelines(project: Path):
    (project / ".dagster").mkdir()
    (project / ".dagster" / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    done = subprocess.run([str(Path(sys.executable).parent / "dg"), "check", "defs"], cwd=project, env=dg_env(project),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    listed = subprocess.run([str(Path(sys.executable).parent / "dg"), "list", "defs", "--json"], cwd=project,
                            env=dg_env(project), capture_output=True, text=True, timeout=300)
    assert listed.returncode == 0, listed.stderr
    for name in ("clicks_checkpoint", "clicks_recover", "pages_checkpoint", "pages_recover", "pages_recovery_sensor",
                 "clicks_input_sensor"):
        assert f'"{name}"' in listed.stdout, name


def states(pipeline_name: str, operator: str) -> pd.DataFrame:
    from clickstream.pipelines import clicks

    from sparkpoint import Pipeline
    from sparkpoint.pipeline.spec import load_operator

    if pipeline_name == "clicks":
        return clicks.read_state(operator)
    return Pipeline("pages", [load_operator(f"clickstream.operators:{operator}")]).read_state(operator)


def recompute(events: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    at = pd.to_datetime(events["clicked_at"], utc=True).astype("datetime64[us, UTC]")
    clicks = (events.assign(at=at).groupby("user").agg(clicks=("at", "size"), last_click=("at", "max"))
              .reset_index().sort_values("user").reset_index(drop=True))
    pages = (events.groupby("user")["page"].nunique().rename("distinct_pages").reset_index()
             .sort_values("user").reset_index(drop=True))
    return clicks, pages


def heal(defs: dg.Definitions, instance: dg.DagsterInstance, failed: dg.ExecuteInProcessResult,
         pipeline: str, other: str) -> dg.ExecuteInProcessResult:
    """What the daemon does: each pipeline's recovery sensor sees the failure; only its own acts."""
    def evaluate(name: str) -> object:
        sensor = defs.resolve_sensor_def(f"{name}_recovery_sensor")
        return sensor(dg.build_sensor_context(instance=instance))

    skipped = evaluate(other)
    assert isinstance(skipped, dg.SkipReason) and "none of pipeline" in (skipped.skip_message or ""), skipped
    request = evaluate(pipeline)
    assert isinstance(request, dg.RunRequest), request
    job = defs.resolve_job_def(f"{pipeline}_recover")
    return job.execute_in_process(run_config=request.run_config, tags=request.tags, instance=instance)


def test_two_pipelines_materialize_fail_and_heal_apart(project: Path):
    from clickstream.land import land

    defs = dg.load_from_defs_folder(path_within_project=project / "clickstream")
    instance = dg.DagsterInstance.ephemeral()
    land(".sparkpoint/clicks/input", 4)
    land(".sparkpoint/pages/input", 4)
    clicks_job, pages_job = defs.resolve_job_def("clicks_checkpoint"), defs.resolve_job_def("pages_checkpoint")

    for _ in range(2):
        assert clicks_job.execute_in_process(instance=instance).success
        assert pages_job.execute_in_process(instance=instance).success
    clicks_storage = CheckpointStorage(f"file://{project}/.sparkpoint/clicks/checkpoints", "clicks")
    pages_storage = CheckpointStorage(f"file://{project}/.sparkpoint/pages/checkpoints", "pages")
    assert clicks_storage.completed_checkpoint_ids() == [1, 2]
    assert pages_storage.completed_checkpoint_ids() == [1, 2]

    failed = pages_job.execute_in_process(instance=instance, tags={INJECT_TAG: "after-upload"}, raise_on_error=False)
    assert not failed.success
    clicks_before = sorted(p.relative_to(project) for p in (project / ".sparkpoint" / "clicks").rglob("*"))
    healed = heal(defs, instance, failed, "pages", "clicks")
    assert healed.success
    assert pages_storage.completed_checkpoint_ids() == [1, 2, 3]  # num_retained=3 (defs.yaml's Flink key)
    assert sorted(p.relative_to(project) for p in (project / ".sparkpoint" / "clicks").rglob("*")) == clicks_before, \
        "the pages recovery touched the clicks pipeline's files"
    keys = {e.materialization.asset_key.to_user_string() for e in healed.get_asset_materialization_events()}
    assert keys == {"pages/pages_per_user", "pages/checkpoint"}
    checks = [e.event_specific_data for e in healed.all_events if e.event_type_value == "ASSET_CHECK_EVALUATION"]
    assert {c.check_name for c in checks} == {"checkpoint_verifies", "registry_matches_metadata"}
    assert all(c.passed for c in checks)
    assert healed.dagster_run.tags[FAILED_RUN_TAG] == failed.run_id
    assert instance.get_run_by_id(failed.run_id).tags[RECOVERED_BY_TAG] == healed.run_id
    # the failed run's own log links its recovery run (a run link the UI opens in one click)
    (link,) = [e.dagster_event.engine_event_data.metadata[RECOVERY_RUN]
               for e in instance.all_logs(failed.run_id, of_type=dg.DagsterEventType.ENGINE_EVENT)
               if e.dagster_event and RECOVERY_RUN in e.dagster_event.engine_event_data.metadata]
    assert isinstance(link, dg.DagsterRunMetadataValue) and link.run_id == healed.run_id
    assert instance.get_run_by_id(failed.run_id).status == dg.DagsterRunStatus.FAILURE, "still the failed run"

    for _ in range(2):
        assert clicks_job.execute_in_process(instance=instance).success
    assert pages_job.execute_in_process(instance=instance).success
    assert clicks_storage.completed_checkpoint_ids() == [3, 4]  # num_retained=2
    assert pages_storage.completed_checkpoint_ids() == [2, 3, 4]

    events = pd.concat([pd.read_parquet(p) for p in sorted((project / ".sparkpoint" / "clicks" / "input").iterdir())],
                       ignore_index=True)
    want_clicks, want_pages = recompute(events)  # both inputs got the same four batches
    got_clicks = states("clicks", "clicks_per_user")
    pd.testing.assert_frame_equal(got_clicks.astype({"user": object}), want_clicks.astype({"user": object}),
                                  check_dtype=False)
    got_pages = states("pages", "pages_per_user")
    pd.testing.assert_frame_equal(got_pages.astype({"user": object}), want_pages.astype({"user": object}),
                                  check_dtype=False)

    output = pd.read_parquet(project / ".sparkpoint" / "clicks" / "output")
    assert sorted(output["checkpoint_id"].unique()) == [1, 2, 3, 4], "each checkpoint's rows committed once"
    per_checkpoint = output.groupby("checkpoint_id")["user"].apply(lambda s: s.is_unique)
    assert per_checkpoint.all()
    last = output.sort_values("checkpoint_id").groupby("user").last().reset_index()
    assert dict(zip(last["user"], last["clicks"])) == dict(zip(want_clicks["user"], want_clicks["clicks"]))

    # A launch that sets one field of a resource keeps the pipeline's own values for the others
    # (Dagster fills what a run config leaves out from the resource class's defaults: those must
    # be the pipeline's, not the sample's `.sparkpoint/checkpoints`).
    partial = {"resources": {"clicks_storage": {"config": {"job_id": "clicks"}}}}
    rebuilt = defs.resolve_job_def("clicks_rebuild_registry").execute_in_process(instance=instance, run_config=partial)
    (out,) = [e for e in rebuilt.all_events if e.event_type_value == "STEP_OUTPUT"]
    assert out.event_specific_data.metadata["retained"].value == [4, 3]  # type: ignore[union-attr]

    materialized = instance.fetch_materializations(dg.AssetKey(["clicks", "output"]), limit=10).records
    assert len(materialized) == 4
    meta = materialized[0].asset_materialization.metadata
    assert meta["dagster/row_count"].value > 0
    assert [c.name for c in meta["dagster/column_schema"].value.columns] == ["user", "clicks", "last_click",
                                                                              "checkpoint_id"]
