"""One Spark stage per checkpoint, one task per subtask index running that subtask of every operator."""

from __future__ import annotations

import uuid
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from sparkpoint.pipeline.driver import StatefulPipeline
from sparkpoint.pipeline.runtime import spark_job_group
from sparkpoint.state.keygroups import (
    arrow_keys,
    key_group_for,
    key_groups_of,
    key_groups_of_strings,
    subtask_for_key,
    subtasks_of,
)
from sparkpoint.state.sample import SAMPLE_OPERATORS
from tests.test_pipeline import config, make_input


def test_vectorized_key_groups_match_the_scalar_mapping():
    rng = np.random.default_rng(7)
    keys: list[str | bytes] = [f"u{i:07d}" for i in rng.integers(0, 10**7, 2000)]
    keys += ["", "ü", "鍵", "a" * 300, "\x00", "k\n"]
    keys += [bytes(rng.integers(0, 256, n, dtype=np.uint8)) for n in range(40)]
    keys.append(bytearray(b"raw"))  # type: ignore[arg-type]
    for max_p, p in ((128, 4), (128, 3), (1, 1), (32768, 7), (4096, 4096)):
        assert key_groups_of(keys, max_p).tolist() == [key_group_for(k, max_p) for k in keys]
        assert subtasks_of(keys, max_p, p).tolist() == [subtask_for_key(k, max_p, p) for k in keys]
    assert subtasks_of([], 128, 4).tolist() == []
    # The same over Arrow buffers: string and binary, sliced, chunked, keys longer than the vector path.
    strings = [k if isinstance(k, str) else k.decode("latin-1") for k in keys[:-1]] + ["x" * 70, "é" * 40]
    arrow = pa.array(strings)
    expected = [key_group_for(k, 128) for k in strings]
    assert key_groups_of_strings(arrow, 128).tolist() == expected
    assert key_groups_of_strings(arrow.cast(pa.large_string()), 128).tolist() == expected
    assert key_groups_of_strings(arrow.slice(5, 100), 128).tolist() == expected[5:105]
    assert key_groups_of_strings(pa.chunked_array([arrow[:7], arrow[7:]]), 128).tolist() == expected
    binary = [bytes(rng.integers(0, 256, n, dtype=np.uint8)) for n in range(0, 90, 3)]
    by_zlib = [key_group_for(b, 4096) for b in binary]
    assert key_groups_of_strings(pa.array(binary, pa.binary()), 4096).tolist() == by_zlib
    assert subtasks_of(arrow, 128, 3).tolist() == [subtask_for_key(k, 128, 3) for k in strings]
    assert key_groups_of_strings(pa.array([], pa.string()), 128).tolist() == []
    with pytest.raises(ValueError, match="null"):
        key_groups_of_strings(pa.array(["a", None]), 128)
    with pytest.raises(TypeError, match="strings or bytes"):
        key_groups_of_strings(pa.array([1, 2]), 128)
    with pytest.raises(ValueError, match="parallelism"):
        subtasks_of(["a"], 128, 129)
    with pytest.raises(TypeError, match="str or bytes"):
        key_groups_of([1], 128)  # type: ignore[list-item]


def test_routing_keys_rows_the_way_the_state_keys_them():
    # The state keys str as UTF-8 and bytes as they are; routing must agree, or the state refuses
    # the rows ("routed to the wrong subtask").
    for column in (
        pd.Series([f"u{i}" for i in range(300)], dtype="string"),
        pd.Series([f"ü{i}" for i in range(300)], dtype=object),
        pd.Series([bytes([i % 256, 7]) + b"k" for i in range(300)], dtype=object),
    ):
        values = column.tolist()
        assert subtasks_of(arrow_keys(column), 128, 4).tolist() == [subtask_for_key(v, 128, 4) for v in values]
    ints = pd.Series(range(300))  # not a state key type: routed by their string form, as before
    assert subtasks_of(arrow_keys(ints), 128, 4).tolist() == [subtask_for_key(str(i), 128, 4) for i in range(300)]


@pytest.mark.spark
def test_a_checkpoint_is_one_stage_with_one_task_per_subtask_index(spark, tmp_path: Path):
    make_input(tmp_path, batches=2)
    job_id = f"plan-{uuid.uuid4().hex[:8]}"  # the session is shared: job groups from other tests differ
    reports = StatefulPipeline(spark, replace(config(tmp_path, parallelism=3), job_id=job_id), SAMPLE_OPERATORS).run()
    assert [len(r.restored) for r in reports] == [6, 6], "2 operators x 3 subtasks each ran and acknowledged"
    tracker = spark.sparkContext.statusTracker()
    for checkpoint_id in (1, 2):
        jobs = tracker.getJobIdsForGroup(spark_job_group(job_id, checkpoint_id))
        assert len(jobs) == 1, f"checkpoint {checkpoint_id} is one Spark job, carrying its job group"
        stages = tracker.getJobInfo(jobs[0]).stageIds
        assert len(stages) == 1, "no routing stage, no shuffle"
        assert tracker.getStageInfo(stages[0]).numTasks == 3
    assert spark.sparkContext.getLocalProperty("spark.jobGroup.id") is None, "the job group is not left behind"
