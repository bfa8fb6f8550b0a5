"""Each (operator, subtask) runs in a Spark task of its own, also when the batch is one input file."""

from __future__ import annotations

from pathlib import Path

import pytest

from sparkpoint.spark.partitioning import partition_keys, spark_hash_long, spark_partition_of
from sparkpoint.spark.runtime import StatefulPipeline, spark_job_group
from tests.test_pipeline import config, make_input

pytestmark = pytest.mark.spark

VALUES = [0, 1, -1, 7, 42, 2**31 - 1, 2**31, -(2**31), 2**32 + 5, 2**63 - 1, -(2**63), 123456789012345]


def test_our_murmur3_is_sparks_hash_and_keys_cover_every_partition(spark):
    from pyspark.sql import functions as F

    frame = spark.createDataFrame([(v,) for v in VALUES], "v long")
    assert [r[0] for r in frame.select(F.hash("v")).collect()] == [spark_hash_long(v) for v in VALUES]
    for groups in (1, 2, 6, 8, 17, 64):
        keys = partition_keys(groups)
        assert sorted(spark_partition_of(k, groups) for k in keys) == list(range(groups))
    # And Spark agrees: repartitioning by the keys puts exactly one in each partition.
    keys = partition_keys(8)
    by_key = spark.createDataFrame([(k,) for k in keys], "k long").repartition(8, "k")
    assert sorted(len(p) for p in by_key.rdd.glom().collect()) == [1] * 8


def test_one_input_file_still_runs_one_task_per_subtask(spark, tmp_path: Path):
    make_input(tmp_path, batches=1)
    StatefulPipeline(spark, config(tmp_path, parallelism=3)).run()
    tracker = spark.sparkContext.statusTracker()
    jobs = tracker.getJobIdsForGroup(spark_job_group("job", 1))  # adaptive execution: a job per stage
    assert jobs, "checkpoint 1's Spark jobs carry its job group"
    last_stage = max(s for j in jobs for s in tracker.getJobInfo(j).stageIds)
    # The last stage runs the subtasks: 2 operators x 3 subtasks, one task each.
    assert tracker.getStageInfo(last_stage).numTasks == 6
    assert spark.sparkContext.getLocalProperty("spark.jobGroup.id") is None, "the job group is not left behind"
