"""A bare path with a space, `[`, `#`, `%` or non-ASCII is taken literally on every route: a job
written through the Dagster resources is found by the CLI and the notebook API given the same
path, and the files are where the path says (DESIGN rule 11)."""

from __future__ import annotations

import os
from pathlib import Path

import dagster as dg
import pytest

import sparkpoint
from sparkpoint.checkpoint.storage import CheckpointStorage, storage_url
from sparkpoint.cli import main
from sparkpoint.resources import (
    CheckpointRegistryResource,
    CheckpointStorageResource,
    InputResource,
    SparkResource,
    StateBackendResource,
)
from sparkpoint.spark.generate import generate
from tests.support.dagster_setup import ASSET_CHECKS, ASSETS, SCOPE

NAME = "my project [1] #2 100% é"


@pytest.mark.parametrize("location", ["a b", "a[1]", "a#b", "a%20b", "é/ü", "x?*"])
def test_a_bare_path_is_one_directory_on_every_route(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, location: str):
    monkeypatch.chdir(tmp_path)
    url = storage_url(location)
    assert url == "file://" + os.path.join(str(tmp_path), location)
    storage = CheckpointStorage(location, "job")
    storage.write_bytes("probe", b"x")
    assert (tmp_path / location / "job" / "probe").read_bytes() == b"x"
    assert CheckpointStorage(url, "job").read_bytes("probe") == b"x"  # the URL form finds the same file


@pytest.mark.spark
def test_dagster_resources_cli_and_api_agree_on_a_path_with_special_characters(
    spark, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    root = tmp_path / NAME
    root.mkdir()
    monkeypatch.chdir(root)
    generate(str(root / "in"), batches=2, events_per_batch=500, users=50, items=10, seed=3)
    storage = CheckpointStorageResource(checkpoints_url="ckpt", job_id="job")  # bare, relative paths
    resources = SCOPE.keyed({
        "storage": storage, "registry": CheckpointRegistryResource(storage=storage),
        "spark": SparkResource(stop_on_teardown=False),
        "state_backend": StateBackendResource(local_dir="local", parallelism=2),
        "source": InputResource(input_url="in", output_url="out"),
    })
    for _ in range(2):
        assert dg.materialize([*ASSETS, *ASSET_CHECKS], resources=resources,
                              instance=dg.DagsterInstance.ephemeral()).success
    assert sorted(p.name for p in (root / "ckpt" / "job").iterdir() if p.name.startswith("chk-")) == ["chk-1", "chk-2"]
    assert any(p.name.startswith("part-job~") for p in (root / "out").iterdir())
    assert not list(tmp_path.glob("*%*%*")), "nothing was written under a percent-encoded name"
    for given in ("ckpt", str(root / "ckpt"), f"file://{root}/ckpt"):
        assert main(["list", "--checkpoints", given, "--job-id", "job", "--json"]) == 0
        table = sparkpoint.read_state(given, "job", "user_totals")
        assert table["count"].sum() == 1000  # every event of both batches, once
        assert sparkpoint.list_checkpoints(given, "job")["checkpoint_id"].tolist() == [2, 1]
