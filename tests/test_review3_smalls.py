"""Issue 22 item 14: each small defect of the third review, pinned."""

from __future__ import annotations

import math
from pathlib import Path

import dagster as dg
import pytest

from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.errors import StorageError
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.sweep import sweep_orphans
from sparkpoint.cli import main
from sparkpoint.resources import (
    DEFAULT_INPUT,
    CheckpointRegistryResource,
    CheckpointStorageResource,
    InputResource,
    ResourceConfigError,
    StateBackendResource,
)
from tests.support.helpers import FakeSubtask


def test_a_metadata_that_is_a_directory_is_bad_input_with_what_to_do(tmp_path: Path, capsys):
    storage = CheckpointStorage(f"file://{tmp_path}/ckpt", "job")
    coord = CheckpointCoordinator(storage)
    sub = FakeSubtask(storage, tmp_path / "db")
    sub.write("s")
    p = coord.trigger(expected={"op": 1})
    coord.acknowledge(p.checkpoint_id, sub.snapshot(p.checkpoint_id, ["s"]))
    coord.complete(p.checkpoint_id)
    (tmp_path / "ckpt" / "job" / "chk-2" / "_metadata").mkdir(parents=True)
    code = main(["inspect", f"file://{tmp_path}/ckpt/job/chk-2"])
    err = capsys.readouterr().err
    assert code == 2 and "is not a file" in err and "move" in err and "Errno 21" not in err


def init(resource: dg.ConfigurableResource) -> None:  # type: ignore[type-arg]
    resource.setup_for_execution(dg.build_init_resource_context())


@pytest.mark.parametrize("value", [32769, 0])
def test_max_parallelism_outside_key_group_bounds_is_refused_at_resource_setup(value: int):
    with pytest.raises(ResourceConfigError, match=r"max_parallelism must be between 1 and 32768"):
        init(StateBackendResource(max_parallelism=value, parallelism=1))


@pytest.mark.parametrize("grace", [math.nan, math.inf, -1.0])
def test_an_orphan_grace_that_is_not_a_finite_number_of_seconds_is_refused(tmp_path: Path, grace: float):
    storage = CheckpointStorageResource(checkpoints_url=f"file://{tmp_path}/ckpt")
    with pytest.raises(ResourceConfigError, match="orphan_grace_seconds must be a finite number"):
        init(CheckpointRegistryResource(storage=storage, orphan_grace_seconds=grace))
    with pytest.raises(ValueError, match="finite number of seconds"):
        sweep_orphans(CheckpointStorage(f"file://{tmp_path}/ckpt", "job"), grace_seconds=grace)
    with pytest.raises(SystemExit):
        main(["gc", "--checkpoints", f"file://{tmp_path}/ckpt", "--job-id", "job", "--grace", str(grace)])


def test_the_storage_error_prefix_is_said_once():
    with pytest.raises(ResourceConfigError) as caught:
        CheckpointStorageResource(storage_options="[1]").open()
    assert str(caught.value).count("checkpoint storage") == 1, caught.value


@pytest.mark.s3
def test_a_dead_s3_endpoint_names_the_resource_and_its_fields():
    dead = '{"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}, ' \
           '"config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1}}'
    resource = CheckpointStorageResource(checkpoints_url="s3://bucket/ckpt", storage_options=dead)
    with pytest.raises(ResourceConfigError) as caught:
        init(resource)
    message = str(caught.value)
    assert "checkpoints_url" in message and "storage_options" in message and "cannot be reached" in message
    with pytest.raises(StorageError, match="cannot be reached"):
        CheckpointStorage("s3://bucket/ckpt", "job", resource.options()).job_dir_exists()


@pytest.mark.parametrize("conf", ["parallelism.default=0", "parallelism=3", "pipeline.max-parallelism=40000"])
def test_parallelism_through_conf_is_checked_like_the_flag(tmp_path: Path, capsys, conf: str):
    (tmp_path / "in").mkdir()
    args = ["run", "--input", str(tmp_path / "in"), "--checkpoints", f"file://{tmp_path}/ckpt", "--job-id", "job"]
    with pytest.raises(SystemExit):  # the flag: refused by the parser
        main([*args, "--parallelism", "0"])
    capsys.readouterr()
    extra = ["--max-parallelism", "2"] if conf == "parallelism=3" else []  # 3 subtasks over 2 key groups
    code = main([*args, *extra, "--conf", conf])
    err = capsys.readouterr().err
    assert code == 2 and "parallelism must be between 1 and" in err, err
    assert not (tmp_path / "ckpt").exists(), "refused before anything was written"


def test_the_demo_never_lands_a_batch_under_a_consumed_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    source = InputResource(sample_stream=True)
    init(source)
    first = source.land_sample_batch()
    second = source.land_sample_batch()
    assert first and second and first.endswith("batch-000000.parquet") and second.endswith("batch-000001.parquet")
    (Path(DEFAULT_INPUT) / "batch-000000.parquet").unlink()  # consumed, then cleaned up by the user
    third = source.land_sample_batch(consumed=["batch-000000.parquet", "batch-000001.parquet"])
    assert third is not None and third.endswith("batch-000002.parquet")
