"""Deletes in bulk (`sparkpoint.checkpoint.deletes`): exact keys in DeleteObjects batches of 1,000 on
a real S3 API (moto on 127.0.0.1), the requests counted as the client sends them; keys a batch
refuses tried again one by one and reported with why; one delete per file elsewhere."""

from __future__ import annotations

import uuid
from typing import Any

import fsspec
import pytest
import s3fs

from benchmarks.bench_state_backend import RequestCounter
from sparkpoint.checkpoint import deletes
from sparkpoint.checkpoint.deletes import DeletesFailed, delete_exact
from sparkpoint.checkpoint.storage import CheckpointStorage
from tests.conftest import s3_options

pytestmark = pytest.mark.s3


class RefusingS3(s3fs.S3FileSystem):
    """s3fs whose DeleteObjects refuses some keys (AccessDenied, as S3 reports a key in `Errors`):
    `locked` keys stay refused one by one too, `flaky` ones are deleted when tried alone."""

    locked: set[str] = set()
    flaky: set[str] = set()

    async def _call_s3(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if method != "delete_objects":
            return await super()._call_s3(method, *args, **kwargs)
        refused = self.locked | self.flaky
        request = kwargs["Delete"]
        kept = [o for o in request["Objects"] if o["Key"] not in refused]
        asked = {**kwargs, "Delete": {**request, "Objects": kept}}
        out = await super()._call_s3(method, *args, **asked) if kept else {}
        errors = [{"Key": o["Key"], "Code": "AccessDenied", "Message": "Access Denied"}
                  for o in request["Objects"] if o["Key"] in refused]
        return {**out, "Errors": [*out.get("Errors", []), *errors]}

    async def _rm_file(self, path: str, **kwargs: Any) -> None:
        if self.split_path(path)[1] in self.locked:
            raise PermissionError(f"Access Denied: {path}")
        await super()._rm_file(path, **kwargs)


@pytest.fixture
def bucket(s3_endpoint: str) -> str:
    name = "del-" + uuid.uuid4().hex[:10]
    fsspec.filesystem("s3", **s3_options(s3_endpoint)).mkdir(name)
    return name


def put_files(fs: Any, prefix: str, n: int) -> list[str]:
    paths = [f"{prefix}/shared/op/{i % 3}/{i:05d}.sst" for i in range(n)]
    fs.pipe({p: b"x" for p in paths})
    return paths


@pytest.mark.parametrize(("files", "batch"), [
    (250, 100),  # S3's batch made small: the same code, 10x fewer PUTs to set it up
    pytest.param(2_500, 1_000, marks=pytest.mark.soak),  # S3's own limit
])
def test_a_subsumption_on_s3_sends_one_delete_objects_per_batch_of_keys(s3_endpoint: str, bucket: str, files: int,
                                                                       batch: int, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(deletes, "S3_BATCH", batch)
    storage = CheckpointStorage(f"s3://{bucket}/ckpt", "job", s3_options(s3_endpoint))
    put_files(storage.fs, storage.root, files)
    counter = RequestCounter(storage.fs)

    assert storage.delete(f"shared/op/{i % 3}/{i:05d}.sst" for i in range(files)) == files

    assert counter.take() == {"DeleteObjects": 3}
    assert storage.last_delete is not None and storage.last_delete.requests == 3
    storage.fs.invalidate_cache()
    assert storage.walk("shared") == []


def test_keys_a_batch_refuses_are_tried_alone_and_those_still_refused_are_reported(
        s3_endpoint: str, bucket: str, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(deletes, "S3_BATCH", 100)
    fs = RefusingS3(skip_instance_cache=True, **s3_options(s3_endpoint))
    paths = put_files(fs, f"{bucket}/ckpt/job", 120)
    locked, flaky = paths[7], paths[110]
    RefusingS3.locked, RefusingS3.flaky = {fs.split_path(locked)[1]}, {fs.split_path(flaky)[1]}
    storage = CheckpointStorage(f"s3://{bucket}/ckpt", "job", s3_options(s3_endpoint), filesystem=fs)
    counter = RequestCounter(fs)

    refused = r"1 of 120 files could not be deleted: .*00007\.sst \(PermissionError"
    with pytest.raises(DeletesFailed, match=refused) as e:
        storage.delete(storage.relpath(p) for p in paths)

    report = e.value.report
    assert [f.path for f in report.failed] == [locked] and report.retried == 2 and report.requests == 4
    assert counter.take() == {"DeleteObjects": 2, "DeleteObject": 1}  # the locked key never reached the server
    fs.invalidate_cache()
    assert [f.path for f in storage.walk("shared")] == [storage.relpath(locked)]


def test_elsewhere_a_failing_file_is_reported_and_the_others_deleted():
    fs = fsspec.filesystem("memory")
    root = f"/bulk-{uuid.uuid4().hex[:8]}"
    paths = [f"{root}/{name}" for name in ("a[1]", "b*", "c", "a1")]
    fs.pipe({p: b"x" for p in paths})

    class Refusing:
        def __getattr__(self, name: str) -> Any:
            return getattr(fs, name)

        def rm_file(self, path: str) -> None:
            if path.endswith("/c"):
                raise PermissionError("read-only")
            fs.rm_file(path)

    report = delete_exact(Refusing(), paths[:3])

    assert [(f.path, f.reason) for f in report.failed] == [(f"{root}/c", "PermissionError: read-only")]
    assert sorted(fs.ls(root, detail=False)) == [f"{root}/a1", f"{root}/c"]  # a1: "a[1]" is a name, not a glob
