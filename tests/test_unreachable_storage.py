"""Storage that stops answering is not storage that lost the files (rule 10): the checks that
decide a fallback raise instead of reporting the checkpoint's files missing."""

from __future__ import annotations

from pathlib import Path

import fsspec
import pytest

from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.errors import StorageError
from sparkpoint.checkpoint.files import stored_size_problems
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.resources import CheckpointStorageResource, ResourceConfigError
from sparkpoint.state.engine.verify import verify_checkpoint
from tests.conftest import s3_options
from tests.support.dagster_setup import init_resource
from tests.support.helpers import FakeSubtask

pytestmark = pytest.mark.s3


def test_a_checkpoint_on_an_endpoint_gone_away_is_unreachable_not_missing(tmp_path: Path):
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    options = {**s3_options(f"http://{host}:{port}"),
               "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1}}
    try:
        fsspec.filesystem("s3", **options).mkdir("bucket")
        storage = CheckpointStorage("s3://bucket/ckpt", "job", options)
        coord = CheckpointCoordinator(storage)
        sub = FakeSubtask(storage, tmp_path / "db")
        sub.write("a")
        sub.write("b")
        pending = coord.trigger(expected={"op": 1})
        coord.acknowledge(pending.checkpoint_id, sub.snapshot(pending.checkpoint_id, ["a", "b"]))
        coord.complete(pending.checkpoint_id)
        (meta,) = CompletedCheckpointStore(storage).load_all().checkpoints
        files = list(meta.restored_files())
        assert stored_size_problems(storage, files) == [], "while the endpoint answers, every file is there"
    finally:
        server.stop()

    gone = CheckpointStorage("s3://bucket/ckpt", "job", options)  # no cached listing
    with pytest.raises(StorageError, match="cannot be reached"):
        stored_size_problems(gone, files)
    with pytest.raises(StorageError, match="cannot be reached"):
        verify_checkpoint(gone, meta, deep=False)


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
        init_resource(resource)
    message = str(caught.value)
    assert "checkpoints_url" in message and "storage_options" in message and "cannot be reached" in message
    with pytest.raises(StorageError, match="cannot be reached"):
        CheckpointStorage("s3://bucket/ckpt", "job", resource.options()).job_dir_exists()
