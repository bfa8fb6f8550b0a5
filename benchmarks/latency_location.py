"""The code location `bench_latency` and `bench_warm_spark` serve: one pipeline per workload, built
by the factory as a user's would be, on the Spark the bench names (a Connect server it started, the
warm local Spark, or a Spark of each run's own), with its input,
checkpoints and output under the bench's directory (all from the environment the bench sets)."""

from __future__ import annotations

import os
from pathlib import Path

import dagster as dg

from sparkpoint import build_pipeline_defs
from sparkpoint.pipeline.spec import Pipeline
from sparkpoint.resources import SparkResource
from sparkpoint.state.sample import user_totals

ROOT_ENV, REMOTE_ENV = "SPARKPOINT_LATENCY_ROOT", "SPARKPOINT_LATENCY_REMOTE"
WORKLOADS_ENV = "SPARKPOINT_LATENCY_WORKLOADS"
PARALLELISM, RETAINED = 4, 5


def pipeline_name(workload: str) -> str:
    return "latency_" + workload.replace("-", "_")


def pipeline_of(root: Path, workload: str) -> Pipeline:
    where = root / workload
    return Pipeline(pipeline_name(workload), [user_totals], input_url=str(where / "in"),
                    checkpoints_url=str(where / "checkpoints"), output_url=str(where / "out"),
                    parallelism=PARALLELISM, num_retained=RETAINED)


def spark_resource(spark: str) -> SparkResource:
    """`sc://...`: that Connect server; `local[...]`: a Spark of each run's own; "" or `warm`: the
    default, the warm local Spark."""
    if spark.startswith("sc://"):
        return SparkResource(remote=spark)
    if spark.startswith("local"):
        return SparkResource(master=spark)
    return SparkResource()


def location() -> dg.Definitions:
    root, spark = Path(os.environ[ROOT_ENV]), os.environ.get(REMOTE_ENV, "")
    return dg.Definitions.merge(*(
        build_pipeline_defs(pipeline_of(root, w), resources={"spark": spark_resource(spark)})
        for w in os.environ[WORKLOADS_ENV].split(",")
    ))


defs = location() if ROOT_ENV in os.environ else dg.Definitions()
