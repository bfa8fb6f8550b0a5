"""`build_pipeline_defs` and `PipelineComponent` with a user's own pipeline (clicks: `user`,
`page`, `clicked_at`): every name scoped to the pipeline, two pipelines in one code location,
resources carrying the pipeline's settings, the input asset and the landing sensor, the
component's resolution and its scaffold, a stable code version."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import pandas as pd
import pytest
import yaml

from sparkpoint import BytesCodec, KeyedOperator, Pipeline, PipelineComponent, StructCodec, build_pipeline_defs
from sparkpoint.factory import pipeline_defs
from sparkpoint.pipeline.runtime import PipelineError
from sparkpoint.sample import pipeline as sample
from sparkpoint.spark.settling import SETTLE_SECONDS

ROOT = Path(__file__).resolve().parent.parent
CLICKS = StructCodec[tuple[int]]("<q")
SEEN = BytesCodec()


def count(batch: pd.DataFrame, state: object) -> None:
    counts = batch.groupby("user").size()
    handle = state.value_state("clicks", CLICKS)  # type: ignore[attr-defined]
    old = handle.get_many(counts.index.tolist())
    handle.put_many((u, (int(n) + (o[0] if o else 0),)) for u, n, o in zip(counts.index, counts, old))


def export(state: object) -> pd.DataFrame:
    rows = [(k.decode(), v[0]) for k, v in state.value_state("clicks", CLICKS).items()]  # type: ignore[attr-defined]
    return pd.DataFrame(rows, columns=["user", "clicks"])


def pages(batch: pd.DataFrame, state: object) -> pd.DataFrame:
    pairs = batch[["user", "page"]].drop_duplicates()
    state.map_state("pages", SEEN).put_absent((u, p, b"") for u, p in zip(pairs["user"], pairs["page"]))  # type: ignore[attr-defined]
    return pairs


clicks_per_user = KeyedOperator("clicks_per_user", key="user", process=count, export=export,
                                schema={"user": "string", "clicks": "int64"})
pages_per_user = KeyedOperator("pages_per_user", key="user", columns=("page",), process=pages, export=export,
                               emits=True)


def clicks(tmp_path: Path, **settings: object) -> Pipeline:
    return Pipeline("clicks", [clicks_per_user, pages_per_user], input_url=str(tmp_path / "landing"),
                    checkpoints_url=str(tmp_path / "ckpt"), output_url=str(tmp_path / "out"),
                    local_dir=str(tmp_path / "local"), **settings)  # type: ignore[arg-type]


def all_names(defs: dg.Definitions) -> tuple[set[str], set[str], set[str]]:
    repo = defs.get_repository_def()
    jobs = {j.name for j in repo.get_all_jobs() if not j.name.startswith("__")}
    return jobs, {s.name for s in repo.sensor_defs} | {s.name for s in repo.schedule_defs}, set(defs.resources or {})


def test_every_name_is_scoped_to_the_pipeline(tmp_path: Path):
    defs = build_pipeline_defs(clicks(tmp_path), schedule="*/5 * * * *", owners=["team:web"], tags={"domain": "web"})
    jobs, automations, resources = all_names(defs)
    assert jobs == {f"clicks_{j}" for j in ("checkpoint", "follow", "recover", "prune", "verify", "rebuild_registry",
                                             "savepoint", "skip_file")}
    assert automations == {"clicks_recovery_sensor", "clicks_retention_sensor", "clicks_input_sensor",
                           "clicks_checkpoint_schedule"}
    assert resources == {f"clicks_{r}" for r in ("storage", "registry", "spark", "state_backend", "source")}
    specs = {s.key.to_user_string(): s for s in defs.resolve_all_asset_specs()}
    assert set(specs) == {"clicks/clicks_per_user", "clicks/pages_per_user", "clicks/checkpoint", "clicks/input",
                          "clicks/output"}
    assert specs["clicks/clicks_per_user"].owners == ["team:web"]
    assert specs["clicks/checkpoint"].tags.get("domain") == "web"
    assert {s.group_name for s in specs.values()} == {"clicks"}
    schema = specs["clicks/clicks_per_user"].metadata["dagster/column_schema"]
    assert [(c.name, c.type) for c in schema.columns] == [("user", "string"), ("clicks", "int64")]
    assert specs["clicks/clicks_per_user"].deps[0].asset_key == dg.AssetKey(["clicks", "input"])
    assert specs["clicks/output"].deps[0].asset_key == dg.AssetKey(["clicks", "checkpoint"])
    assert specs["clicks/checkpoint"].code_version == clicks(tmp_path).code_version()

    prefixed = build_pipeline_defs(clicks(tmp_path), key_prefix=["web", "clicks"], group_name="web")
    keys = {s.key.to_user_string() for s in prefixed.resolve_all_asset_specs()}
    assert "web/clicks/checkpoint" in keys and "web/clicks/clicks_per_user" in keys


def test_two_pipelines_merge_into_one_location_and_validate(tmp_path: Path):
    merged = dg.Definitions.merge(build_pipeline_defs(clicks(tmp_path)), build_pipeline_defs(sample))
    dg.Definitions.validate_loadable(merged)
    jobs, automations, resources = all_names(merged)
    assert {"clicks_recover", "sparkpoint_recover"} <= jobs
    assert {"clicks_recovery_sensor", "sparkpoint_recovery_sensor"} <= automations
    assert len(resources) == 10
    ours = merged.resolve_job_def("clicks_recover").required_resource_keys - {"io_manager"}
    theirs = merged.resolve_job_def("sparkpoint_recover").required_resource_keys - {"io_manager"}
    assert ours and theirs and ours.isdisjoint(theirs)


def test_a_name_dagster_cannot_take_is_refused_with_what_to_do(tmp_path: Path):
    with pytest.raises(PipelineError, match="rename the pipeline"):
        build_pipeline_defs(clicks(tmp_path).with_(name="web-clicks"))
    with pytest.raises(ValueError, match="unknown role"):
        build_pipeline_defs(clicks(tmp_path), resources={"sparks": object()})  # type: ignore[dict-item]


def test_the_resources_carry_the_pipelines_own_settings(tmp_path: Path):
    pipeline = clicks(tmp_path, num_retained=5, parallelism=3, max_parallelism=64, changelog=False,
                      storage_options={"anon": True})
    by_key = pipeline_defs(pipeline).resources
    storage, registry = by_key["clicks_storage"], by_key["clicks_registry"]
    assert (storage.checkpoints_url, storage.job_id, storage.storage_options) == (
        str(tmp_path / "ckpt"), "clicks", '{"anon": true}')
    assert registry.num_retained == 5
    backend = by_key["clicks_state_backend"]
    assert (backend.parallelism, backend.max_parallelism, backend.changelog) == (3, 64, False)
    assert by_key["clicks_source"].input_url == str(tmp_path / "landing")


def test_the_input_asset_and_the_landing_sensor_follow_the_files(tmp_path: Path):
    pipeline = clicks(tmp_path)
    parts = pipeline_defs(pipeline)
    (tmp_path / "landing").mkdir()
    sensor = parts.sensor("input_sensor")
    assert sensor.default_status == dg.DefaultSensorStatus.RUNNING
    needed = {k: v for k, v in parts.resources.items() if k in sensor.required_resource_keys}
    assert "clicks_spark" not in needed, "the sensor starts no Spark"
    with dg.build_sensor_context(resources=needed) as context:
        assert isinstance(sensor(context), dg.SkipReason)
    for i in range(2):
        pd.DataFrame({"user": ["a", "b"], "page": ["/x", "/y"],
                      "clicked_at": pd.Timestamp("2026-11-01", tz="UTC")}
                     ).to_parquet(tmp_path / "landing" / f"c{i}.parquet")
        os.utime(tmp_path / "landing" / f"c{i}.parquet", (0, time.time() - 60))  # settled: written a minute ago
    (tmp_path / "landing" / "_SUCCESS").write_text("")
    with dg.build_sensor_context(resources=needed, instance=dg.DagsterInstance.ephemeral()) as context:
        request = sensor(context)  # (it asks the instance for the file's earlier runs)
    assert isinstance(request, dg.RunRequest) and request.run_key == "landed-c0.parquet"

    from dagster._core.definitions.observe import observe  # Dagster 1.13 exports no public `observe`

    observed = observe([parts.assets[0]], resources=needed)
    (event,) = observed.get_asset_observation_events()
    meta = {k: v.value for k, v in event.asset_observation_data.asset_observation.metadata.items()}
    assert meta["files_pending"] == 2 and meta["newest_file"] == "c1.parquet"

    stopped = pipeline_defs(pipeline, landing_sensor=False).sensor("input_sensor")
    assert stopped.default_status == dg.DefaultSensorStatus.STOPPED


def test_the_component_builds_the_pipeline_it_declares(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    module = tmp_path / "my_clicks.py"
    module.write_text(
        "from tests.test_factory import clicks_per_user, pages_per_user\n"
        "from sparkpoint import Pipeline\n"
        "clicks = Pipeline('clicks', [clicks_per_user, pages_per_user])\n"
        "not_a_pipeline = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    referenced = PipelineComponent(pipeline="my_clicks:clicks", checkpoints_url="s3://bucket/ckpt",
                                   settings={"state.checkpoints.num-retained": "4", "parallelism.default": 3})
    built = referenced.resolve_pipeline()
    assert (built.name, built.checkpoints_url, built.num_retained, built.parallelism) == ("clicks", "s3://bucket/ckpt",
                                                                                        4, 3)
    inline = PipelineComponent(name="pages", operators=["tests.test_factory:pages_per_user"]).resolve_pipeline()
    assert inline.name == "pages" and [op.name for op in inline.operators] == ["pages_per_user"]

    for bad, message in ((PipelineComponent(pipeline="my_clicks:not_a_pipeline"), "not a sparkpoint.Pipeline"),
                         (PipelineComponent(pipeline="my_clicks:nothing"), "has no 'nothing'"),
                         (PipelineComponent(name="x"), "give `pipeline: MODULE:ATTR`, or `name` and `operators`"),
                         (PipelineComponent(name="x", operators=["my_clicks:clicks"]),
                          "not a sparkpoint.KeyedOperator"),
                         (PipelineComponent(pipeline="my_clicks:clicks", settings={"state.nope": 1}),
                          "unknown setting 'state.nope'")):
        with pytest.raises(PipelineError, match=message):
            bad.resolve_pipeline()


def test_dg_lists_and_scaffolds_the_component(tmp_path: Path):
    project = tmp_path / "clickstream"
    shutil.copytree(ROOT / "examples" / "clickstream", project, ignore=shutil.ignore_patterns(".sparkpoint",
                                                                                              "__pycache__"))
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PYTHONPATH": f"{project}{os.pathsep}{ROOT}", "VIRTUAL_ENV": str(bin_dir.parent),
           "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    listed = subprocess.run([str(bin_dir / "dg"), "list", "components"], cwd=project, env=env, capture_output=True,
                            text=True, timeout=300)
    assert "sparkpoint.PipelineComponent" in listed.stdout, listed.stdout + listed.stderr
    done = subprocess.run([str(bin_dir / "dg"), "scaffold", "defs", "sparkpoint.PipelineComponent", "sessions"],
                          cwd=project, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    scaffolded = (project / "clickstream" / "defs" / "sessions" / "defs.yaml").read_text()
    assert "type: sparkpoint.PipelineComponent" in scaffolded
    assert "attributes: {}" not in scaffolded

    # What the user fills in: the pipeline, where the project keeps it; every other field commented
    # out with an example, each said once.
    raw = yaml.safe_load(scaffolded)
    assert raw["attributes"] == {"pipeline": "clickstream.pipelines:sessions"}
    fields = set(PipelineComponent.model_fields)
    commented = [line.strip()[2:] for line in scaffolded.splitlines() if line.strip().startswith("# ")]
    named = [line.split(":", 1)[0] for line in commented if line.split(":", 1)[0] in fields]
    assert sorted(named) == sorted(fields - {"pipeline"}), named
    # Uncommented (the inline form instead of `pipeline`), it is a valid component: every example is.
    def uncomment(line: str) -> str:
        rest = line.removeprefix("  # ")
        return "  " + rest if rest != line and (rest.split(":", 1)[0] in fields or rest.startswith("  ")) else line

    uncommented = "\n".join(uncomment(line) for line in scaffolded.splitlines() if not line.startswith("  pipeline:"))
    attributes = yaml.safe_load(uncommented)["attributes"]
    assert set(attributes) == fields - {"pipeline"}, sorted(attributes)
    PipelineComponent.model_validate(attributes)
    assert attributes["landing_settle_seconds"] == SETTLE_SECONDS and attributes["tick"] is False

    # Before the pipeline exists, the project's check names what is missing; once it does, it loads.
    check = [str(bin_dir / "dg"), "check", "defs"]
    home = {"DAGSTER_HOME": str(tmp_path / "home")}
    (tmp_path / "home").mkdir()
    missing = subprocess.run(check, cwd=project, env={**env, **home}, capture_output=True, text=True, timeout=300)
    assert missing.returncode != 0
    assert "'clickstream.pipelines:sessions': module 'clickstream.pipelines' has no 'sessions'" in (
        missing.stdout + missing.stderr), missing.stdout + missing.stderr
    with open(project / "clickstream" / "pipelines.py", "a") as f:
        f.write("\nfrom clickstream.operators import pages_per_user\n\n"
                "sessions = Pipeline('sessions', [pages_per_user])\n")
    loaded = subprocess.run(check, cwd=project, env={**env, **home}, capture_output=True, text=True, timeout=300)
    assert loaded.returncode == 0, loaded.stdout + loaded.stderr

    # `--pipeline` writes the given reference in.
    done = subprocess.run([str(bin_dir / "dg"), "scaffold", "defs", "sparkpoint.PipelineComponent", "visits",
                           "--pipeline", "clickstream.more:visits"], cwd=project, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    visits = yaml.safe_load((project / "clickstream" / "defs" / "visits" / "defs.yaml").read_text())
    assert visits["attributes"] == {"pipeline": "clickstream.more:visits"}


def test_the_code_version_is_stable_across_processes_and_follows_the_code():
    here = sample.code_version()
    code = "from sparkpoint.sample import pipeline; print(pipeline.code_version())"
    there = subprocess.run([sys.executable, "-c", code],
                           capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)
    assert there.stdout.strip() == here
    changed = KeyedOperator("clicks_per_user", key="user", process=pages, export=export)
    assert Pipeline("c", [clicks_per_user]).code_version() != Pipeline("c", [changed]).code_version()
