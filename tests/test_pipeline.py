"""The sample pipeline on local Spark: state and sink against an oracle, rescaling, fallback.

Each test runs as few batches as its check needs (two or three; the zombie's race needs four):
what a batch does is the same at every count, and each batch is a Spark job."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest

from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.cli import main
from sparkpoint.pipeline.driver import StatefulPipeline
from sparkpoint.pipeline.runtime import PipelineConfig
from sparkpoint.spark.generate import generate
from sparkpoint.state.engine.changelog import is_changelog
from sparkpoint.state.sample import SAMPLE_OPERATORS
from tests.support import oracle

pytestmark = pytest.mark.spark


def make_input(tmp_path: Path, batches: int = 4, seed: int = 3) -> str:
    generate(str(tmp_path / "in"), batches=batches, events_per_batch=3000, users=400, items=60, seed=seed)
    return str(tmp_path / "in")


def config(tmp_path: Path, **kw) -> PipelineConfig:
    kw.setdefault("parallelism", 3)
    return PipelineConfig(
        input_url=str(tmp_path / "in"), checkpoints_url=f"file://{tmp_path}/ckpt", job_id="job",
        local_dir=str(tmp_path / "local"), output_url=f"file://{tmp_path}/out", num_retained=2, **kw,
    )


def export(tmp_path: Path, operator: str, checkpoint: int | None = None) -> pd.DataFrame:
    out = tmp_path / f"{operator}-{checkpoint}.parquet"
    args = ["state", "--checkpoints", f"file://{tmp_path}/ckpt", "--job-id", "job", "--operator", operator,
            "--format", "parquet", "--out", str(out)]
    if checkpoint is not None:
        args += ["--checkpoint", str(checkpoint)]
    assert main(args) == 0
    return pd.read_parquet(out)


def test_state_matches_spark_sql_and_sink_holds_each_batch_once(spark, tmp_path: Path):
    input_dir = make_input(tmp_path, batches=3)
    reports = StatefulPipeline(spark, config(tmp_path), SAMPLE_OPERATORS).run()
    assert [r.checkpoint_id for r in reports] == [1, 2, 3]
    assert CompletedCheckpointStore(CheckpointStorage(f"file://{tmp_path}/ckpt", "job")).checkpoint_ids() == [3, 2]

    events = spark.read.parquet(input_dir)
    events.createOrReplaceTempView("events")
    expected_totals = spark.sql(
        "SELECT user_id, count(*) AS count, sum(amount) AS amount_sum, min(amount) AS amount_min, "
        "max(amount) AS amount_max, max(ts) AS last_ts FROM events GROUP BY user_id"
    ).toPandas()
    expected_reach = spark.sql(
        "SELECT item_id, count(*) AS events, count(DISTINCT user_id) AS distinct_users FROM events GROUP BY item_id"
    ).toPandas()
    oracle.assert_totals_equal(export(tmp_path, "user_totals"), expected_totals)
    oracle.assert_reach_equal(export(tmp_path, "item_reach"), expected_reach)

    output = pd.read_parquet(tmp_path / "out")
    expected_sink = oracle.sink_rows(oracle.read_batches(input_dir))
    assert sorted(output["checkpoint_id"].unique()) == [1, 2, 3]
    for cid, expected in zip([1, 2, 3], expected_sink):
        oracle.assert_totals_equal(output[output["checkpoint_id"] == cid], expected)

    # Nothing left to do: a rerun resumes after the last consumed file and writes nothing.
    assert StatefulPipeline(spark, config(tmp_path), SAMPLE_OPERATORS).run() == []
    assert len(pd.read_parquet(tmp_path / "out")) == len(output)


def test_incremental_checkpoints_reuse_files_and_restore_from_the_working_db(spark, tmp_path: Path):
    make_input(tmp_path, batches=2)
    reports = StatefulPipeline(spark, config(tmp_path), SAMPLE_OPERATORS).run()
    assert reports[0].files_reused == 0 and all(r.files_reused > 0 for r in reports[1:])
    assert all(r.checkpointed_size < r.state_size for r in reports[1:])
    assert set(reports[1].restored) == {"working"}, "the next batch reuses each subtask's working database"


def test_rescale_4_then_2_then_3_keeps_exact_state(spark, tmp_path: Path):
    input_dir = make_input(tmp_path, batches=3)
    StatefulPipeline(spark, config(tmp_path, parallelism=4, max_batches=1), SAMPLE_OPERATORS).run()
    rescaled = StatefulPipeline(spark, config(tmp_path, parallelism=2, max_batches=1), SAMPLE_OPERATORS).run()
    assert set(rescaled[0].restored) == {"rescale"}
    reports = StatefulPipeline(spark, config(tmp_path, parallelism=3), SAMPLE_OPERATORS).run()
    assert [r.checkpoint_id for r in reports] == [3]
    assert set(reports[0].restored) == {"rescale"}
    events = pd.concat(oracle.read_batches(input_dir), ignore_index=True)
    oracle.assert_totals_equal(export(tmp_path, "user_totals"), oracle.user_totals(events))
    oracle.assert_reach_equal(export(tmp_path, "item_reach"), oracle.item_reach(events))
    meta = CompletedCheckpointStore(CheckpointStorage(f"file://{tmp_path}/ckpt", "job")).load(3)
    assert {op.parallelism for op in meta.operators.values()} == {3}


def test_corrupt_latest_checkpoint_falls_back_and_replays_exactly_once(spark, tmp_path: Path):
    input_dir = make_input(tmp_path, batches=3)
    StatefulPipeline(spark, config(tmp_path, max_batches=2), SAMPLE_OPERATORS).run()
    storage = CheckpointStorage(f"file://{tmp_path}/ckpt", "job")
    store = CompletedCheckpointStore(storage)
    latest = store.load(2)
    victim = next(
        f for f in latest.files() if f.created_by == 2 and (f.local_name.endswith(".sst") or is_changelog(f.local_name))
    )
    data = bytearray(storage.read_bytes(victim.path))
    data[len(data) // 2] ^= 0xFF
    storage.fs.pipe_file(storage.abspath(victim.path), bytes(data))
    # A new machine: no task-local copies, every subtask restores from stable storage.
    moved = replace(config(tmp_path), local_dir=str(tmp_path / "new-machine"))
    reports = StatefulPipeline(spark, moved, SAMPLE_OPERATORS).run()
    assert [r.files for r in reports] == [("batch-000001.parquet",), ("batch-000002.parquet",)]
    events = pd.concat(oracle.read_batches(input_dir), ignore_index=True)
    oracle.assert_totals_equal(export(tmp_path, "user_totals"), oracle.user_totals(events))
    output = pd.read_parquet(tmp_path / "out")
    expected = oracle.sink_rows(oracle.read_batches(input_dir))
    assert len(output) == sum(len(e) for e in expected), "the batch of the corrupt checkpoint is in the output once"


def test_failed_batch_leaves_nothing_that_breaks_the_rerun(spark, tmp_path: Path):
    from sparkpoint.state.operators import KeyedOperator
    from sparkpoint.state.sample import SAMPLE_OPERATORS, item_reach, user_totals

    input_dir = make_input(tmp_path, batches=3)
    poison = tmp_path / "poison"
    poison.write_text("fail the batch holding event 3000")

    def flaky_process(batch, state):  # the first subtask to see event 3000 fails, after writing state
        changed = user_totals.process(batch, state)
        if poison.exists() and (batch["event_id"] == 3000).any():
            raise RuntimeError("injected failure")
        return changed

    flaky = KeyedOperator("user_totals", "user_id", flaky_process, user_totals.export, ("amount", "ts", "event_id"),
                          emits=True)
    with pytest.raises(Exception, match="injected failure"):
        StatefulPipeline(spark, config(tmp_path), operators=(flaky, item_reach)).run()
    storage = CheckpointStorage(f"file://{tmp_path}/ckpt", "job")
    assert CompletedCheckpointStore(storage).checkpoint_ids() == [1]
    assert sorted(pd.read_parquet(tmp_path / "out")["checkpoint_id"].unique()) == [1], "nothing of the failed batch"

    poison.unlink()
    reports = StatefulPipeline(spark, config(tmp_path), operators=SAMPLE_OPERATORS).run()
    assert [r.files for r in reports] == [("batch-000001.parquet",), ("batch-000002.parquet",)]
    events = pd.concat(oracle.read_batches(input_dir), ignore_index=True)
    oracle.assert_totals_equal(export(tmp_path, "user_totals"), oracle.user_totals(events))
    output = pd.read_parquet(tmp_path / "out")
    assert len(output) == sum(len(e) for e in oracle.sink_rows(oracle.read_batches(input_dir)))
    assert main(["gc", "--checkpoints", f"file://{tmp_path}/ckpt", "--job-id", "job", "--grace", "0"]) == 0
    assert main(["verify", "--checkpoints", f"file://{tmp_path}/ckpt", "--job-id", "job"]) == 0


def test_new_job_started_from_another_jobs_checkpoint_never_touches_its_files(spark, tmp_path: Path):
    input_dir = make_input(tmp_path, batches=3)
    StatefulPipeline(spark, config(tmp_path, max_batches=2), SAMPLE_OPERATORS).run()
    old = CheckpointStorage(f"file://{tmp_path}/ckpt", "job")
    old_files = {f.path: f.size for f in old.walk("shared")}
    forked = replace(
        config(tmp_path), job_id="forked", output_url=None, local_dir=str(tmp_path / "forked-local"),
        from_checkpoint=f"file://{tmp_path}/ckpt/job/chk-2", restore_mode="NO_CLAIM",
    )
    reports = StatefulPipeline(spark, forked, SAMPLE_OPERATORS).run()
    assert [r.files for r in reports] == [("batch-000002.parquet",)]
    assert reports[0].files_reused == 0, "the first checkpoint after a NO_CLAIM restore is full"
    new = CompletedCheckpointStore(CheckpointStorage(f"file://{tmp_path}/ckpt", "forked"))
    lineage = new.load(new.checkpoint_ids()[0]).lineage
    assert lineage is not None and lineage.claim_mode == "NO_CLAIM"
    assert lineage.restored_from.endswith("job/chk-2/_metadata")
    assert {f.path: f.size for f in old.walk("shared")} == old_files, "the old job's files are untouched"
    events = pd.concat(oracle.read_batches(input_dir), ignore_index=True)
    out = tmp_path / "forked.parquet"
    assert main(["state", "--checkpoints", f"file://{tmp_path}/ckpt", "--job-id", "forked", "--operator",
                 "item_reach", "--format", "parquet", "--out", str(out)]) == 0
    oracle.assert_reach_equal(pd.read_parquet(out), oracle.item_reach(events))


@pytest.mark.s3
def test_pipeline_checkpoints_and_output_on_s3(spark, tmp_path: Path, s3_endpoint: str):
    import fsspec

    from tests.conftest import s3_options

    options = s3_options(s3_endpoint)
    fsspec.filesystem("s3", **options).mkdir("pipeline-bucket")
    input_dir = make_input(tmp_path, batches=2)
    cfg = replace(
        config(tmp_path), checkpoints_url="s3://pipeline-bucket/ckpt", output_url="s3://pipeline-bucket/out",
        storage_options=options,
    )
    reports = StatefulPipeline(spark, cfg, SAMPLE_OPERATORS).run()
    assert [r.checkpoint_id for r in reports] == [1, 2]
    storage = CheckpointStorage("s3://pipeline-bucket/ckpt", "job", options)
    assert CompletedCheckpointStore(storage).checkpoint_ids() == [2, 1]
    out = tmp_path / "s3-totals.parquet"
    assert main(["state", "--checkpoints", "s3://pipeline-bucket/ckpt", "--job-id", "job", "--operator",
                 "user_totals", "--format", "parquet", "--out", str(out), "--storage-options",
                 json.dumps(options)]) == 0
    events = pd.concat(oracle.read_batches(input_dir), ignore_index=True)
    oracle.assert_totals_equal(pd.read_parquet(out), oracle.user_totals(events))
    output = pd.read_parquet("s3://pipeline-bucket/out", storage_options=options)
    assert sorted(output["checkpoint_id"].unique()) == [1, 2]


def test_zombie_driver_loses_the_race_and_output_stays_exactly_once(spark, tmp_path: Path):
    input_dir = make_input(tmp_path, batches=4)
    StatefulPipeline(spark, config(tmp_path, max_batches=1), SAMPLE_OPERATORS).run()
    live = StatefulPipeline(spark, config(tmp_path), SAMPLE_OPERATORS).batches()
    zombie = StatefulPipeline(spark, config(tmp_path), SAMPLE_OPERATORS).batches()
    assert next(live).checkpoint_id == 2  # both resumed from chk-1 and want chk-2; the live one wins
    late = next(zombie)  # the zombie's chk-2 is refused; it resumes from the live one's chk-2
    assert late.checkpoint_id == 3 and late.files == ("batch-000002.parquet",)
    after = next(live)  # now this one is behind: its chk-3 loses, it resumes after chk-3
    assert after.checkpoint_id == 4 and after.files == ("batch-000003.parquet",)
    assert list(zombie) == [], "its chk-4 loses too, and then nothing is left to do"
    store = CompletedCheckpointStore(CheckpointStorage(f"file://{tmp_path}/ckpt", "job"))
    assert store.checkpoint_ids() == [4, 3]
    assert len(store.load(4).source_offsets["source"]["consumed"]) == 4
    events = pd.concat(oracle.read_batches(input_dir), ignore_index=True)
    oracle.assert_totals_equal(export(tmp_path, "user_totals"), oracle.user_totals(events))
    output = pd.read_parquet(tmp_path / "out")
    expected = oracle.sink_rows(oracle.read_batches(input_dir))
    assert len(output) == sum(len(e) for e in expected), "every batch is in the output exactly once"
