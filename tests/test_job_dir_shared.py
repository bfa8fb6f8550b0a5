"""Two pipelines in one code location that would write one job directory (the same checkpoints
location and job id) from two concurrency pools are refused, in one line naming both; the same
pipeline built again (a reload), pipelines with their own directories and a location known only at
launch (`EnvVar`) are not."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pandas as pd
import pytest

from sparkpoint import KeyedOperator, Pipeline, StructCodec, build_pipeline_defs
from sparkpoint.pipeline.runtime import PipelineError
from sparkpoint.resources import CheckpointStorageResource

VISITS = StructCodec[tuple[int]]("<q")


def visit(batch: pd.DataFrame, state: object) -> None:
    counts = batch.groupby("visitor").size()
    handle = state.value_state("visits", VISITS)  # type: ignore[attr-defined]
    old = handle.get_many(counts.index.tolist())
    handle.put_many((v, (int(n) + (o[0] if o else 0),)) for v, n, o in zip(counts.index, counts, old))


def export(state: object) -> pd.DataFrame:
    rows = [(k.decode(), v[0]) for k, v in state.value_state("visits", VISITS).items()]  # type: ignore[attr-defined]
    return pd.DataFrame(rows, columns=["visitor", "visits"])


visits = KeyedOperator("visits_per_visitor", key="visitor", process=visit, export=export)


def site(tmp_path: Path, name: str, **given: str) -> Pipeline:
    locations = {"input_url": str(tmp_path / name / "in"), "checkpoints_url": str(tmp_path / "ckpt"),
                 "local_dir": str(tmp_path / name / "local")}
    return Pipeline(name, [visits], **{**locations, **given})  # type: ignore[arg-type]


def test_two_pipelines_writing_one_job_directory_are_refused_naming_both(tmp_path: Path):
    with pytest.raises(PipelineError) as refused:
        dg.Definitions.merge(build_pipeline_defs(site(tmp_path, "shop", job_id="web")),
                             build_pipeline_defs(site(tmp_path, "blog", job_id="web")))
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"pipelines 'shop' and 'blog' both write job 'web' under file://{tmp_path}/ckpt: ")
    assert "another job_id or checkpoints_url" in message


def test_a_job_directory_given_through_the_storage_resource_counts(tmp_path: Path):
    shop = build_pipeline_defs(site(tmp_path, "shop2"))  # job id "shop2" by default
    storage = CheckpointStorageResource(checkpoints_url=str(tmp_path / "ckpt"), job_id="shop2")
    with pytest.raises(PipelineError, match="pipelines 'shop2' and 'blog2' both write job 'shop2'"):
        build_pipeline_defs(site(tmp_path, "blog2"), resources={"storage": storage})
    env = CheckpointStorageResource(checkpoints_url=dg.EnvVar("SITE_CKPT"), job_id="shop2")
    assert build_pipeline_defs(site(tmp_path, "blog2"), resources={"storage": env}), "known only at launch"
    assert shop


def test_the_same_pipeline_again_and_pipelines_with_their_own_directories_are_accepted(tmp_path: Path):
    shop = site(tmp_path, "shop3", job_id="web3")
    first = build_pipeline_defs(shop)
    merged = dg.Definitions.merge(first, build_pipeline_defs(site(tmp_path, "blog3")),  # job id blog3
                                  build_pipeline_defs(site(tmp_path, "news3", job_id="web3",
                                                           checkpoints_url=str(tmp_path / "other"))))
    dg.Definitions.validate_loadable(merged)
    assert build_pipeline_defs(shop), "a reload of the code location builds the same pipeline again"
