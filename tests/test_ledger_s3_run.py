"""`sparkpoint run` on S3 (moto on 127.0.0.1, behind a counting proxy): the request ledger each
checkpoint reports equals what the server was asked, for a run with a materialization (changelog
chains of one), a subsumption (one checkpoint retained) and a restore from S3 onto a lost local
disk; input reads counted apart. The ledger without Spark is test_ledger.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import fsspec
import pandas as pd
import pytest

from sparkpoint.checkpoint.metadata import CheckpointMetadata
from tests.conftest import s3_options
from tests.support.counting_proxy import CountingProxy
from tests.support.helpers import ROOT

pytestmark = [pytest.mark.spark, pytest.mark.s3]

PIPELINE = '''
import pandas as pd
from sparkpoint import KeyedOperator, Pipeline, StructCodec

VIEWS = StructCodec[tuple[int]]("<q")


def count(batch, state):
    views = state.value_state("views", VIEWS)
    sums = batch.groupby("page")["seconds"].count()
    keys = [str(k) for k in sums.index]
    new = [int(n) + (old[0] if old else 0) for n, old in zip(sums, views.get_many(keys))]
    views.put_many((k, (v,)) for k, v in zip(keys, new))


def export(state):
    return pd.DataFrame([(k.decode(), v[0]) for k, v in state.value_state("views", VIEWS).items()],
                        columns=["page", "views"])


page_views = KeyedOperator("page_views", key="page", key_type="string", columns=("seconds",), process=count,
                           export=export)
pages = Pipeline("pages", [page_views], input_url="unused", checkpoints_url="unused")
'''


def _land(fs: Any, bucket: str, name: str, seed: int) -> None:
    rows = pd.DataFrame({"page": [f"/p{(seed * 7 + i) % 40}" for i in range(300)],
                         "seconds": [float(i % 13) for i in range(300)]})
    with fs.open(f"{bucket}/in/{name}", "wb") as f:
        rows.to_parquet(f)


def _run(where: Path, bucket: str, options: dict[str, Any]) -> list[dict[str, Any]]:
    cmd = [sys.executable, "-m", "sparkpoint.cli", "run", "--pipeline", "pages_pipeline:pages",
           "--input", f"s3://{bucket}/in", "--checkpoints", f"s3://{bucket}/ckpt", "--job-id", "pages",
           "--storage-options", json.dumps(options), "--retain", "1", "--parallelism", "2",
           "--conf", "changelog_max_chain=1", "--local-dir", str(where / "local"), "--master", "local[2]", "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=where,
                          env={**os.environ, "PYTHONPATH": f"{where}{os.pathsep}{ROOT}"})
    assert done.returncode == 0, done.stderr[-3000:]
    after = [json.loads(line.split(AFTER, 1)[1]) for line in done.stderr.splitlines() if AFTER in line]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")] + after


AFTER = "requests after the last checkpoint: "


def _sum(reports: list[dict[str, Any]]) -> dict[str, Any]:
    ops = ("PUT", "GET", "LIST", "HEAD", "DELETE", "COPY")
    return {"requests": {op: sum(r["requests"][op] for r in reports) for op in ops},
            "bytes_up": sum(r["bytes_up"] for r in reports), "bytes_down": sum(r["bytes_down"] for r in reports),
            "input": {"requests": {op: sum(r["input"]["requests"][op] for r in reports) for op in ops},
                      "bytes": sum(r["input"]["bytes"] for r in reports)}}


def test_each_runs_ledger_equals_the_requests_the_s3_server_counted(tmp_path: Path, s3_endpoint: str):
    bucket = "pages-" + uuid.uuid4().hex[:10]
    direct = fsspec.filesystem("s3", **s3_options(s3_endpoint))
    direct.mkdir(bucket)
    (tmp_path / "pages_pipeline.py").write_text(PIPELINE)
    proxy = CountingProxy(s3_endpoint, input_prefix=f"{bucket}/in")
    try:
        options = s3_options(proxy.url)
        for i in range(3):
            _land(direct, bucket, f"b-{i:03d}.parquet", i)
        proxy.take()
        first = _run(tmp_path, bucket, options)  # chk-1..3: chains of one materialize; each subsumes the last
        asked_first = proxy.take()
        shutil.rmtree(tmp_path / "local")  # a lost disk: the next run restores from S3
        _land(direct, bucket, "b-003.parquet", 3)
        proxy.take()
        second = _run(tmp_path, bucket, options)
        asked_second = proxy.take()
    finally:
        proxy.close()
    # each run's checkpoints, then what it asked after its last one (looking for another batch)
    assert [r.get("checkpoint_id") for r in first] == [1, 2, 3, None]
    assert [r.get("checkpoint_id") for r in second] == [4, None]
    assert _sum(first) == asked_first
    assert _sum(second) == asked_second
    assert asked_first["requests"]["DELETE"] > 0, "subsumed checkpoints' files were deleted"
    assert asked_first["input"]["requests"]["GET"] >= 3 and asked_first["input"]["bytes"] > 0
    assert "primary" in second[0]["restored"]
    assert second[0]["requests"]["GET"] >= 2 and second[0]["bytes_down"] > 0  # the restore's downloads
    # what `_metadata` records: the requests up to the commit, never more than the run reported
    raw = json.loads(direct.cat_file(f"{bucket}/ckpt/pages/chk-4/_metadata"))
    meta = CheckpointMetadata.loads(json.dumps(raw).encode())
    assert meta.stats.ledger is not None and meta.stats.estimated_cost_usd is not None
    assert all(0 < raw["stats"]["requests"][op] <= second[0]["requests"][op] for op in ("PUT", "GET", "LIST"))
    assert second[0]["estimated_cost_usd"] > 0
    # the restore by phase, recorded beside the ledger (the metrics' restore figures)
    assert raw["stats"]["restore"]["remote_bytes"] > 0 and raw["stats"]["restore"]["download_seconds"] > 0
    assert raw["stats"]["records_in"] == 300 and raw["stats"]["duration_seconds"] > 0
