"""`sparkpoint rollback`: a job and its output back to a retained checkpoint, with a user's own
operator (watch time per video, tests/support/watch_time.py), not the sample's.

On local Spark through the CLI (subprocesses, Parquet output); the Iceberg table through the same
driver with its Spark half run in process (`InProcessPipeline`) and the Iceberg sink as the tasks
of today's pipeline take a sink (one staged name per subtask: `--output iceberg://` is not wired
into the pipeline yet), with a foreign writer appending to the table in between.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pytest
from pyiceberg.catalog import load_catalog

from sparkpoint.api import read_state
from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.cli import main
from sparkpoint.pipeline.attempt import start_step
from sparkpoint.pipeline.rollback import RollbackRefused, rollback, rollback_job
from sparkpoint.tables.iceberg import CHECKPOINT, JOB, IcebergSink
from sparkpoint.tables.spec import IcebergTable
from tests.support.helpers import cli
from tests.support.interleavings import InProcessPipeline
from tests.support.watch_time import emitted, land_batches, watch_pipeline, watch_time


def storage_of(root: Path) -> CheckpointStorage:
    return CheckpointStorage(str(root / "ckpt"), "views")


def ids(root: Path) -> list[int]:
    return CompletedCheckpointStore(storage_of(root)).checkpoint_ids()


def parquet_output(root: Path) -> list[tuple[str, int]]:
    rows: list[tuple[str, int]] = []
    for path in sorted((root / "out").glob("part-views~*.parquet")):
        frame = pd.read_parquet(path)
        rows += [(str(v), int(s)) for v, s in zip(frame["video"], frame["watched_s"])]
    return sorted(rows)


def state_at(root: Path, checkpoint: int | None = None) -> pd.DataFrame:
    return read_state(str(root / "ckpt"), "views", watch_time, checkpoint=checkpoint)


def every_file(*dirs: Path) -> dict[str, int]:
    return {str(p): p.stat().st_size for d in dirs for p in sorted(d.rglob("*")) if p.is_file()}


# --- on Spark, through the command line -------------------------------------------------------------

MODULE = '''"""views_app: a user's module naming the watch-time pipeline."""
from pathlib import Path

from tests.support.watch_time import watch_pipeline

pipeline = watch_pipeline(Path(__file__).resolve().parent)
'''


@pytest.mark.spark
def test_rollback_on_spark_undoes_the_newer_output_and_the_next_run_replays_it_exactly_once(tmp_path: Path):
    (tmp_path / "views_app.py").write_text(MODULE)
    ref = ("--pipeline", "views_app:pipeline")
    batches = land_batches(tmp_path, 4)
    ran = cli(tmp_path, "run", *ref, java=True)
    assert ran.returncode == 0, ran.stderr
    assert ids(tmp_path) == [4, 3, 2, 1]
    assert parquet_output(tmp_path) == emitted(batches)
    state_2 = state_at(tmp_path, 2)

    before = every_file(tmp_path / "ckpt", tmp_path / "out")
    dry = cli(tmp_path, "rollback", *ref, "--to", "2", "--dry-run")  # no JVM: it needs none
    assert dry.returncode == 0, dry.stderr
    assert "would retire chk-4, chk-3" in dry.stdout
    assert "would undo the output of checkpoints [3, 4]" in dry.stdout
    assert "part-views~00000004~watch_time~00000.parquet" in dry.stdout
    assert "views-002.parquet, views-003.parquet" in dry.stdout
    assert every_file(tmp_path / "ckpt", tmp_path / "out") == before, "a dry run changes nothing"

    done = cli(tmp_path, "rollback", *ref, "--to", "2")
    assert done.returncode == 0, done.stderr
    assert "retired chk-4, chk-3" in done.stdout and "from chk-5 on" in done.stdout
    assert ids(tmp_path) == [2, 1]
    assert parquet_output(tmp_path) == emitted(batches[:2])
    pd.testing.assert_frame_equal(state_at(tmp_path), state_2)

    again = cli(tmp_path, "rollback", *ref, "--to", "2")
    assert again.returncode == 0 and "chk-2 is already the latest checkpoint" in again.stdout, again.stderr
    refused = cli(tmp_path, "rollback", *ref, "--to", "3")
    assert refused.returncode == 2
    assert "chk-3: it is not retained; the retained checkpoints are 1, 2" in refused.stderr

    rerun = cli(tmp_path, "run", *ref, java=True)
    assert rerun.returncode == 0, rerun.stderr
    assert ids(tmp_path) == [6, 5, 2, 1], "the replay's ids are above the retired 3 and 4"
    assert parquet_output(tmp_path) == emitted(batches), "every batch's rows exactly once"
    assert state_at(tmp_path)["watched_s"].sum() == sum(int(b["seconds"].sum()) for b in batches)


# --- an Iceberg table, the driver's Spark half in process -----------------------------------------------


def iceberg_run(root: Path) -> InProcessPipeline:
    """The pipeline writing to an Iceberg table (a SQLite catalog under `root`), its Spark half in process."""
    table = IcebergTable("media.watch_time", catalog={"name": "lake", "type": "sql",
                                                      "uri": f"sqlite:///{root}/catalog.db",
                                                      "warehouse": f"file://{root}/warehouse"})
    spec = watch_pipeline(root, output_url=None).with_(output=table)
    pipeline = InProcessPipeline(None, spec.config(), spec.operators)
    assert isinstance(pipeline.sink, IcebergSink)
    return pipeline


def the_table(root: Path) -> Any:
    return load_catalog("lake", type="sql", uri=f"sqlite:///{root}/catalog.db",
                        warehouse=f"file://{root}/warehouse").load_table("media.watch_time")


def table_rows(root: Path) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(our rows, the foreign writer's rows) of the table."""
    frame = the_table(root).refresh().scan().to_pandas()
    ours = frame[frame["checkpoint_id"].notna()]
    theirs = frame[frame["checkpoint_id"].isna()]
    return (sorted((str(v), int(s)) for v, s in zip(ours["video"], ours["watched_s"])),
            sorted((str(v), int(s)) for v, s in zip(theirs["video"], theirs["watched_s"])))


def test_rollback_of_an_iceberg_table_keeps_a_foreign_writers_rows_and_the_replay_commits_under_new_ids(
        tmp_path: Path):
    batches = land_batches(tmp_path, 4)
    iceberg_run(tmp_path).run()
    assert ids(tmp_path) == [4, 3, 2, 1]
    table = the_table(tmp_path)
    table.append(pa.Table.from_pylist([{"video": "trailer", "watched_s": 99, "checkpoint_id": None}],
                                      schema=table.schema().as_arrow()))  # another writer, since chk-4
    assert table_rows(tmp_path) == (emitted(batches), [("trailer", 99)])
    state_2 = state_at(tmp_path, 2)

    pipeline = iceberg_run(tmp_path)
    head = the_table(tmp_path).refresh().current_snapshot().snapshot_id
    dry = rollback_job(pipeline.storage, pipeline.sink, 2, dry_run=True)
    assert [cid for cid, _ in dry.retired] == [4, 3] and sorted(dry.output) == [3, 4]
    assert all(name.endswith(".parquet") and "/sparkpoint-views/chk-" in name
               for files in dry.output.values() for name in files)
    assert the_table(tmp_path).refresh().current_snapshot().snapshot_id == head and ids(tmp_path) == [4, 3, 2, 1]

    done = rollback_job(pipeline.storage, pipeline.sink, 2)
    assert done.undone == (3, 4) and ids(tmp_path) == [2, 1]
    assert table_rows(tmp_path) == (emitted(batches[:2]), [("trailer", 99)]), "foreign rows stay"
    pd.testing.assert_frame_equal(state_at(tmp_path), state_2)
    last = the_table(tmp_path).refresh().current_snapshot()
    assert last.summary.operation.value == "delete" and last.summary["sparkpoint.dropped-checkpoints"] == "3,4"

    iceberg_run(tmp_path).run()  # a new process: the table holds 3 and 4, so the replay must not reuse them
    assert ids(tmp_path) == [6, 5, 2, 1]
    assert table_rows(tmp_path) == (emitted(batches), [("trailer", 99)]), "every batch's rows exactly once"
    recorded = [int(s.summary[CHECKPOINT]) for s in the_table(tmp_path).refresh().snapshots()
                if s.summary.additional_properties.get(JOB) == "views" and s.summary[CHECKPOINT]]
    assert recorded == [1, 2, 3, 4, 5, 6]


def test_rollback_of_a_delta_table_keeps_a_foreign_writers_rows_and_the_replay_commits_under_new_ids(
        tmp_path: Path):
    from deltalake import DeltaTable as Table
    from deltalake import write_deltalake

    from sparkpoint.tables.delta import DeltaSink
    from sparkpoint.tables.spec import DeltaTable

    def delta_run() -> InProcessPipeline:
        spec = watch_pipeline(tmp_path, output_url=None).with_(output=DeltaTable(str(tmp_path / "table")))
        pipeline = InProcessPipeline(None, spec.config(), spec.operators)
        assert isinstance(pipeline.sink, DeltaSink)
        return pipeline

    def rows() -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
        frame = Table(str(tmp_path / "table")).to_pandas()
        ours, theirs = frame[frame["checkpoint_id"].notna()], frame[frame["checkpoint_id"].isna()]
        return (sorted((str(v), int(s)) for v, s in zip(ours["video"], ours["watched_s"])),
                sorted((str(v), int(s)) for v, s in zip(theirs["video"], theirs["watched_s"])))

    batches = land_batches(tmp_path, 4)
    delta_run().run()
    schema = pa.schema(Table(str(tmp_path / "table")).schema().to_arrow())
    write_deltalake(str(tmp_path / "table"), pa.Table.from_pylist(
        [{"video": "trailer", "watched_s": 99, "checkpoint_id": None}], schema=schema), mode="append")
    version = Table(str(tmp_path / "table")).version()

    done = rollback(watch_pipeline(tmp_path, output_url=None).with_(
        output=DeltaTable(str(tmp_path / "table"))).config(), 2, operators=(watch_time,))
    assert done.undone == (3, 4) and ids(tmp_path) == [2, 1]
    assert Table(str(tmp_path / "table")).version() == version + 1, "one new table version undoes both"
    assert rows() == (emitted(batches[:2]), [("trailer", 99)]), "foreign rows stay"

    delta_run().run()  # a new process: the table recorded 3 and 4, so the replay must not reuse them
    assert ids(tmp_path) == [6, 5, 2, 1]
    assert rows() == (emitted(batches), [("trailer", 99)]), "every batch's rows exactly once"


# --- the ids a new process takes, and the refusals --------------------------------------------------------


def parquet_job(root: Path, batches: int = 4) -> tuple[InProcessPipeline, list[pd.DataFrame]]:
    spec = watch_pipeline(root)
    frames = land_batches(root, batches)
    InProcessPipeline(None, spec.config(), spec.operators).run()
    return InProcessPipeline(None, spec.config(), spec.operators), frames


def test_a_new_process_takes_ids_above_every_retired_one_after_their_directories_are_gone(tmp_path: Path):
    pipeline, _ = parquet_job(tmp_path)
    rollback_job(pipeline.storage, pipeline.sink, 1)
    assert not any((tmp_path / "ckpt" / "views" / f"chk-{cid}").exists() for cid in (2, 3, 4))
    fresh = InProcessPipeline(None, watch_pipeline(tmp_path).config(), (watch_time,))
    start, coordinator = fresh.begin()
    assert start.metadata is not None and start.metadata.checkpoint_id == 1
    assert start.next_id == 5 and coordinator.next_checkpoint_id() == 5
    assert CheckpointCoordinator(storage_of(tmp_path)).next_checkpoint_id() == 5


def test_a_dry_run_changes_nothing_and_says_what_would_go(tmp_path: Path):
    pipeline, _ = parquet_job(tmp_path, 3)
    before = every_file(tmp_path / "ckpt", tmp_path / "out")
    report = rollback(watch_pipeline(tmp_path).config(), 1, dry_run=True)
    assert every_file(tmp_path / "ckpt", tmp_path / "out") == before
    assert report.to_json()["retired"] == [3, 2] and report.replayed == ("views-001.parquet", "views-002.parquet")
    assert report.message.startswith(f"rollback of {pipeline.storage.job_url} to chk-1: would retire chk-3, chk-2")
    assert "chk-3 (checkpoint): 2 output files: part-views~00000003~watch_time~00000.parquet" in "\n".join(
        report.lines())


def test_each_refusal_says_why_and_what_to_do(tmp_path: Path, capsys: Any):
    pipeline, _ = parquet_job(tmp_path, 2)
    storage, sink = pipeline.storage, pipeline.sink
    with pytest.raises(RollbackRefused, match=r"to chk-7: it is not retained; the retained checkpoints are 1, 2 "):
        rollback_job(storage, sink, 7)

    foreign = dataclasses.replace(CompletedCheckpointStore(storage).load(2), job_id="trailers", checkpoint_id=3,
                                  kind="savepoint")
    storage.commit_exclusive("chk-3/_metadata", foreign.dumps())  # another job's savepoint, copied in by hand
    with pytest.raises(RollbackRefused, match=r"to chk-3: it is not a checkpoint of job 'views' \(.*field `job_id` "
                                              r"is 'trailers'.*\)\. A savepoint of another job is started from, not "
                                              r"rolled back to: `sparkpoint run --from-checkpoint .*/views/chk-3`"):
        rollback_job(storage, sink, 3)
    storage.delete(["chk-3/_metadata"])

    report = rollback_job(storage, sink, 2)
    assert report.nothing_to_do and report.message.endswith("chk-2 is already the latest checkpoint of "
                                                            f"{storage.job_url}: nothing to roll back")
    assert main(["rollback", "--checkpoints", str(tmp_path / "ckpt"), "--job-id", "views", "--to", "2"]) == 0
    assert "nothing to roll back" in capsys.readouterr().out

    land_batches(tmp_path, 3)
    assert start_step(pipeline, "run-a") is not None  # an orchestrator's run between its two steps
    with pytest.raises(RollbackRefused, match=r"a run is in progress: attempt run-a of checkpoint 3 is pending "
                                              r"\(.*_pending/chk-3-run-a.json\)\. Let its step finish"):
        rollback_job(storage, sink, 1)
    assert ids(tmp_path) == [2, 1]
    assert main(["rollback", "--checkpoints", str(tmp_path / "ckpt"), "--job-id", "views", "--to", "1"]) == 2
    assert "sparkpoint rollback: error: cannot roll back" in capsys.readouterr().err
