"""Consumed input cleaned up (`input_cleanup = keep | archive:<url> | delete`), on the core without
Spark: checkpoints committed by the real coordinator with directory offsets, a real input directory,
`prune` (and the `sparkpoint prune` command) applying the policy. The Spark run is in
tests/test_input_cleanup_spark.py."""

from __future__ import annotations

import sys
import time
import zlib
from pathlib import Path

import fsspec
import pytest

from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.savepoint import take_savepoint
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.pipeline.attempt import PendingAttempt, save_attempt
from sparkpoint.pipeline.cleanup import InputCleanup, InputCleanupRefused, clean_input, cleanable
from sparkpoint.pipeline.maintenance import prune
from sparkpoint.pipeline.rollback import rollback_job
from sparkpoint.pipeline.settings import BY_NAME, resolve_settings
from sparkpoint.spark.offsets import SourceOffsets
from tests.support.crashkit import assert_died_at, assert_finished, run
from tests.support.helpers import FakeSubtask

HOSTILE = ("-rf.parquet", "a[1].parquet", "*.parquet", "b?.parquet", "c d#%é.parquet")


def land(directory: Path, names: list[str]) -> dict[str, bytes]:
    """Input files with distinct bytes; their contents by name."""
    directory.mkdir(parents=True, exist_ok=True)
    out = {}
    for i, name in enumerate(names):
        out[name] = f"{name}:{i}:".encode() * (50 + i)
        (directory / name).write_bytes(out[name])
    return out


def commit(coord: CheckpointCoordinator, sub: FakeSubtask, consumed: list[str]) -> int:
    """One checkpoint whose source offsets have consumed `consumed`, in that order."""
    pending = coord.trigger(expected={sub.operator: 1})
    sub.write(f"{pending.checkpoint_id}.sst")
    coord.acknowledge(pending.checkpoint_id, sub.snapshot(pending.checkpoint_id, [f"{pending.checkpoint_id}.sst"]))
    coord.complete(pending.checkpoint_id, source_offsets={"source": SourceOffsets(tuple(consumed)).to_json()})
    sub.confirm(pending.checkpoint_id)
    return pending.checkpoint_id


@pytest.fixture
def job(tmp_path: Path) -> tuple[CheckpointStorage, CheckpointCoordinator, FakeSubtask]:
    storage = CheckpointStorage(f"file://{tmp_path}/ckpt", "job")
    return storage, CheckpointCoordinator(storage, num_retained=2), FakeSubtask(storage, tmp_path / "work")


def left(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir() if p.is_file()}


# --- the decision, a table of cases ----------------------------------------------------------------

@pytest.mark.parametrize(("retained", "pending", "expected"), [
    ([], [], []),  # nothing retained: nothing is known to be consumed
    ([["a", "b"]], [], ["a", "b"]),
    ([["a", "b", "c"], ["a", "b"]], [], ["a", "b"]),  # an older retained one (or a savepoint) has not read c
    ([["a", "b", "c"], ["a", "b", "c", "d"]], ["b"], ["a", "c"]),  # b is a pending attempt's
    ([["a[1]", "*"]], [], ["*", "a[1]"]),  # names, not patterns: "a1" is not "a[1]"
])
def test_only_files_every_retained_checkpoint_consumed_and_no_pending_attempt_holds(retained, pending, expected):
    names = ["a", "a1", "b", "c", "d", "e", "*", "a[1]"]
    assert cleanable(names, [SourceOffsets(tuple(r)) for r in retained], pending) == expected


def test_a_file_under_the_floor_is_taken_only_if_it_landed_before_the_oldest_retained_checkpoint():
    """Bounded offsets close every name at or below their floor: a file consumed long ago and one
    that landed late under the floor (refused, never read) look alike by name. The late one
    landed after the oldest retained checkpoint was made; it is kept, evidence of what was refused."""
    retained = [SourceOffsets(("f-0300",), floor="f-0200", bounded=True),
                SourceOffsets(("f-0400",), floor="f-0300", bounded=True)]
    names = ["f-0100", "f-0150-late", "f-0300", "f-0400", "f-0500"]
    landed = {"f-0100": 1_000.0, "f-0150-late": 9_000.0, "f-0300": 2_000.0, "f-0400": 3_000.0, "f-0500": 9_500.0}
    assert cleanable(names, retained, [], landed, oldest=5_000.0) == ["f-0100", "f-0300"]
    assert cleanable(names, retained, []) == ["f-0300"]  # without the times only what the offsets name


def test_the_setting_parses_keep_delete_and_an_archive_url_and_refuses_anything_else():
    assert resolve_settings({"input_cleanup": "DELETE"}) == {"input_cleanup": "delete"}
    assert resolve_settings({"input_cleanup": "archive:/data/arch"}) == {"input_cleanup": "archive:file:///data/arch"}
    assert resolve_settings({"input_cleanup": "archive:s3://b/a"}) == {"input_cleanup": "archive:s3://b/a"}
    for bad in ("trash", "archive:", "archive", "delete:x"):
        with pytest.raises(ValueError, match="keep, delete or archive:<url>"):
            resolve_settings({"input_cleanup": bad})
    assert BY_NAME["input_cleanup"].default == "keep"


# --- prune --------------------------------------------------------------------------------------

def test_delete_never_touches_a_file_a_retained_checkpoint_or_savepoint_could_replay(job, tmp_path: Path):
    storage, coord, sub = job
    inbox = tmp_path / "in"
    land(inbox, ["a.parquet", "b.parquet", "c.parquet", "d.parquet", "e.parquet"])
    commit(coord, sub, ["a.parquet"])
    commit(coord, sub, ["a.parquet", "b.parquet"])
    take_savepoint(storage, checkpoint_id=2)  # a savepoint in the job directory: retained, it has read a and b
    commit(coord, sub, ["a.parquet", "b.parquet", "c.parquet"])
    commit(coord, sub, ["a.parquet", "b.parquet", "c.parquet", "d.parquet"])

    report = prune(storage, num_retained=2, orphan_grace_seconds=3600,
                   input_cleanup=InputCleanup("delete", f"file://{inbox}"))

    assert report.input is not None and report.input.cleaned == ("a.parquet", "b.parquet")
    assert left(inbox) == {"c.parquet", "d.parquet", "e.parquet"}  # c: not the savepoint's; d: not chk-4's; e: new


def test_after_a_rollback_to_an_older_checkpoint_its_replayed_batches_stay(job, tmp_path: Path):
    storage, coord, sub = job
    inbox = tmp_path / "in"
    coord.num_retained = 3
    land(inbox, ["a.parquet", "b.parquet", "c.parquet", "d.parquet"])
    commit(coord, sub, ["a.parquet"])
    commit(coord, sub, ["a.parquet", "b.parquet"])
    commit(coord, sub, ["a.parquet", "b.parquet", "c.parquet"])
    commit(coord, sub, ["a.parquet", "b.parquet", "c.parquet", "d.parquet"])  # chk-1 subsumed: 2, 3, 4 retained

    rollback_job(storage, None, to=2)  # the next run processes c and d again, from chk-2
    report = prune(storage, num_retained=3, input_cleanup=InputCleanup("delete", f"file://{inbox}"))

    assert report.input is not None and report.input.cleaned == ("a.parquet", "b.parquet")
    assert left(inbox) == {"c.parquet", "d.parquet"}


def test_a_file_of_a_pending_attempt_and_an_unreadable_metadata_stop_the_cleanup(job, tmp_path: Path):
    storage, coord, sub = job
    inbox = tmp_path / "in"
    land(inbox, ["a.parquet", "b.parquet"])
    commit(coord, sub, ["a.parquet", "b.parquet"])
    offsets = SourceOffsets(("b.parquet",)).to_json()
    save_attempt(storage, PendingAttempt(job_id="job", checkpoint_id=1, attempt_id="zombie", expected={}, handles=(),
                                         staged=(), source_offsets=offsets, files=("b.parquet",), subtasks=(), rows=0,
                                         started_at=time.time()))
    cleanup = InputCleanup("delete", f"file://{inbox}")
    assert clean_input(storage, cleanup).cleaned == ("a.parquet",)
    assert left(inbox) == {"b.parquet"}

    commit(coord, sub, ["a.parquet", "b.parquet"])
    (Path(storage.root) / "chk-2" / "_metadata").write_bytes(b"{ not json")
    report = clean_input(storage, cleanup)
    assert report.cleaned == () and "chk-2/_metadata cannot be read" in report.blocked
    assert left(inbox) == {"b.parquet"}


def test_hostile_names_are_names_on_delete_and_archive(job, tmp_path: Path):
    storage, coord, sub = job
    inbox, archive = tmp_path / "in", tmp_path / "arch ive[1]"
    contents = land(inbox, [*HOSTILE, "a1.parquet", "bx.parquet", "c.parquet"])  # the globs' neighbours, not consumed
    commit(coord, sub, list(HOSTILE))

    report = clean_input(storage, InputCleanup(f"archive:file://{archive}", f"file://{inbox}"))

    assert sorted(report.cleaned) == sorted(HOSTILE) and not report.failed
    assert left(inbox) == {"a1.parquet", "bx.parquet", "c.parquet"}
    assert {p.name: p.read_bytes() for p in archive.iterdir()} == {n: contents[n] for n in HOSTILE}


def test_archive_keeps_a_file_whose_name_the_archive_holds_with_other_bytes(job, tmp_path: Path):
    storage, coord, sub = job
    inbox, archive = tmp_path / "in", tmp_path / "archive"
    contents = land(inbox, ["a.parquet", "b.parquet"])
    archive.mkdir()
    (archive / "a.parquet").write_bytes(b"another file of that name")
    (archive / "b.parquet.sparkpoint-partial").write_bytes(b"half a cop")  # a copy killed mid-way
    commit(coord, sub, ["a.parquet", "b.parquet"])

    report = clean_input(storage, InputCleanup(f"archive:file://{archive}", f"file://{inbox}"))

    assert report.cleaned == ("b.parquet",)
    assert [f.path for f in report.failed] == ["a.parquet"]
    assert "already holds a different file" in report.failed[0].reason
    assert left(inbox) == {"a.parquet"} and (archive / "a.parquet").read_bytes() == b"another file of that name"
    assert (archive / "b.parquet").read_bytes() == contents["b.parquet"]


def test_a_kill_between_the_archive_copy_and_the_delete_loses_nothing_and_the_next_prune_finishes(
        job, tmp_path: Path):
    storage, coord, sub = job
    inbox, archive = tmp_path / "in", tmp_path / "archive"
    names = ["a.parquet", "b.parquet", "c.parquet", "d.parquet"]
    contents = land(inbox, names)
    commit(coord, sub, names[:3])
    cmd = [sys.executable, "-m", "sparkpoint.cli", "prune", "--checkpoints", f"file://{tmp_path}/ckpt", "--job-id",
           "job", "--input", str(inbox), "--input-cleanup", f"archive:{archive}", "--json"]

    died = run(cmd, crash_at="after-archive-copy:2", crash_dir=tmp_path / "crash", timeout=120)

    assert_died_at(died, "after-archive-copy")
    assert left(inbox) == set(names)  # copied, none deleted yet
    assert {p.name for p in archive.iterdir()} >= {"a.parquet", "b.parquet"}
    finished = run(cmd, timeout=120)
    assert_finished(finished)
    assert left(inbox) == {"d.parquet"}
    held = {p.name: p.read_bytes() for p in archive.iterdir()}
    assert held == {n: contents[n] for n in names[:3]}
    assert all(zlib.crc32(held[n]) == zlib.crc32(contents[n]) for n in held)


def test_a_table_input_refuses_any_cleanup_but_keep(job, tmp_path: Path):
    storage, _, _ = job
    with pytest.raises(InputCleanupRefused, match="input table delta\\+file:///t.*input_cleanup=keep"):
        prune(storage, num_retained=2, input_cleanup=InputCleanup("delete", "delta+file:///t", table=True))
    from sparkpoint.pipeline.runtime import PipelineConfig, PipelineError, validate_config
    from sparkpoint.tables.spec import DeltaTable

    config = PipelineConfig(input_url="delta+file:///t", checkpoints_url="file:///c", job_id="j",
                            input_table=DeltaTable("file:///t"), input_cleanup="delete")
    with pytest.raises(PipelineError, match="cannot apply to input table"):
        validate_config(config)


@pytest.mark.s3
def test_on_s3_hostile_names_are_deleted_in_one_batch_and_nothing_else(job, tmp_path: Path, s3_endpoint: str):
    from tests.conftest import s3_options

    storage, coord, sub = job
    options = s3_options(s3_endpoint)
    fs = fsspec.filesystem("s3", **options)
    bucket = f"in-{time.time_ns()}"
    fs.mkdir(bucket)
    for name in [*HOSTILE, "a1.parquet", "bx.parquet"]:
        fs.pipe_file(f"{bucket}/in/{name}", name.encode())
    commit(coord, sub, list(HOSTILE))

    report = clean_input(storage, InputCleanup("delete", f"s3://{bucket}/in", options))

    assert sorted(report.cleaned) == sorted(HOSTILE) and report.requests == 1
    fs.invalidate_cache()
    assert {p.rsplit("/", 1)[1] for p in fs.ls(f"{bucket}/in")} == {"a1.parquet", "bx.parquet"}


# --- every surface shows the setting ----------------------------------------------------------------

def test_the_cli_the_dagster_resource_and_airflow_take_input_cleanup(tmp_path: Path):
    from sparkpoint.cli import build_parser
    from sparkpoint.resources.backend import InputResource

    parser = build_parser()
    for command in ("run", "prune"):
        args = parser.parse_args([command, "--checkpoints", "c", "--job-id", "j", "--input-cleanup", "delete"])
        assert args.input_cleanup == "delete"
    with pytest.raises(SystemExit):
        parser.parse_args(["prune", "--checkpoints", "c", "--job-id", "j", "--input-cleanup", "bin"])
    assert InputResource.model_fields["input_cleanup"].default == "keep"
    assert InputResource(input_cleanup="archive:s3://b/a").input_cleanup == "archive:s3://b/a"

    pytest.importorskip("airflow")
    from sparkpoint.airflow.operators import SparkpointPruneOperator
    from sparkpoint.sample import pipeline

    task = SparkpointPruneOperator(task_id="prune", pipeline=pipeline, overrides={"input_cleanup": "delete"})
    assert task.resolved().input_cleanup == "delete"


def test_the_dagster_prune_job_cleans_up_as_the_input_resource_says(tmp_path: Path):
    import dagster as dg

    from tests.support.dagster_setup import JOB, SCOPE, prune_job, resources

    storage = CheckpointStorage(f"file://{tmp_path}/ckpt", JOB)
    coord, sub = CheckpointCoordinator(storage, num_retained=2), FakeSubtask(storage, tmp_path / "work")
    land(tmp_path / "in", ["a.parquet", "b.parquet", "c.parquet"])
    commit(coord, sub, ["a.parquet"])
    commit(coord, sub, ["a.parquet", "b.parquet"])
    source = {"input_url": str(tmp_path / "in"), "input_cleanup": "delete"}  # a run config sets every field
    config = {"resources": {SCOPE.resource_key("source"): {"config": source}}}

    result = prune_job.execute_in_process(run_config=config, resources=resources(tmp_path),
                                          instance=dg.DagsterInstance.ephemeral())

    assert result.success
    (event,) = [e for e in result.all_events if e.event_type_value == "STEP_OUTPUT"]
    said = event.event_specific_data.metadata["input_cleanup"].value  # type: ignore[union-attr]
    assert said["cleaned"] == ["a.parquet"], said
    assert left(tmp_path / "in") == {"b.parquet", "c.parquet"}


def test_a_run_that_ends_by_itself_cleans_up_as_its_setting_says(job, tmp_path: Path, capsys):
    from types import SimpleNamespace

    from sparkpoint.cli.run import _finished

    storage, coord, sub = job
    land(tmp_path / "in", ["a.parquet", "b.parquet"])
    commit(coord, sub, ["a.parquet"])
    commit(coord, sub, ["a.parquet", "b.parquet"])
    config = SimpleNamespace(input_cleanup="delete", input_url=f"file://{tmp_path}/in", input_options={},
                             input_table=None)
    driver = SimpleNamespace(config=config, storage=storage, waiting_for=None,
                             source=SimpleNamespace(nothing_to_read=lambda: None))

    assert _finished(SimpleNamespace(json=False), driver, None, ["a report"]) == 0

    assert "1 consumed input files deleted, 1 kept" in capsys.readouterr().out
    assert left(tmp_path / "in") == {"b.parquet"}
