"""The request and byte ledger (`sparkpoint.checkpoint.ledger`) without Spark: prices, the
`_metadata` fields, counting at the seam on file://, and on S3 the ledger equal to what the
server was asked (a counting proxy in front of moto). The run through Spark is in
test_ledger_s3_run.py."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import fsspec
import pytest

from sparkpoint.checkpoint import ledger
from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.errors import MetadataError
from sparkpoint.checkpoint.ledger import Prices, RequestLedger
from sparkpoint.checkpoint.metadata import CheckpointMetadata
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from tests.conftest import s3_options
from tests.support.backends import make_backends, write_checkpoints
from tests.support.counting_proxy import CountingProxy


def test_default_prices_are_s3_standard_and_a_table_replaces_what_it_names():
    usage = RequestLedger({"PUT": 2000, "GET": 10000, "LIST": 1000, "HEAD": 0, "DELETE": 500, "COPY": 0},
                          bytes_up=10**9, bytes_down=2 * 10**9)
    # 3,000 class-A requests at $0.005/1000, 10,000 GETs at $0.0004/1000, 2 GB out at $0.09
    assert Prices().cost(usage) == pytest.approx(0.015 + 0.004 + 0.18)
    assert Prices.parse("PUT=0.01,out_per_gb=0").cost(usage) == pytest.approx(0.02 + 0.005 + 0.004)


@pytest.mark.parametrize("text, says", [("PUT=-1", "a number >= 0"), ("PUT", "NAME=USD"),
                                        ("POSTAGE=1", "none of PUT")])
def test_a_bad_price_table_says_what_to_write(text: str, says: str):
    with pytest.raises(ValueError, match=says):
        Prices.parse(text)


def _metadata_with(tmp_path: Path) -> CheckpointMetadata:
    storage = CheckpointStorage(f"file://{tmp_path}/ckpt", "job")
    write_checkpoints(storage, tmp_path / "local", 1)
    return CompletedCheckpointStore(storage).load(1)


def test_stats_keep_the_ledger_and_older_stats_still_read(tmp_path: Path):
    meta = _metadata_with(tmp_path)
    counted = RequestLedger({"PUT": 7, "GET": 1, "LIST": 2, "HEAD": 3, "DELETE": 0, "COPY": 0}, 900, 40,
                            {"PUT": 0, "GET": 2, "LIST": 1, "HEAD": 0, "DELETE": 0, "COPY": 0}, 5000)
    from dataclasses import replace
    with_ledger = replace(meta, stats=meta.stats.observed(counted, Prices()))
    raw = json.loads(with_ledger.dumps())
    assert raw["stats"]["requests"] == {"PUT": 7, "GET": 1, "LIST": 2, "HEAD": 3, "DELETE": 0, "COPY": 0}
    assert raw["stats"]["input"] == {"requests": {"PUT": 0, "GET": 2, "LIST": 1, "HEAD": 0, "DELETE": 0, "COPY": 0},
                                     "bytes": 5000}
    assert (raw["stats"]["bytes_up"], raw["stats"]["bytes_down"]) == (900, 40)
    again = CheckpointMetadata.loads(with_ledger.dumps())
    assert again.stats.ledger == counted and again.stats.estimated_cost_usd == Prices().cost(counted)
    older = CheckpointMetadata.loads(meta.dumps())  # stats without the ledger's fields
    assert older.stats.ledger is None and "requests" not in json.loads(meta.dumps())["stats"]


def test_a_damaged_ledger_in_stats_is_refused_by_name(tmp_path: Path):
    meta = _metadata_with(tmp_path)
    raw = json.loads(meta.dumps())
    raw["stats"]["requests"] = {"PUT": -1}
    from sparkpoint.checkpoint.metadata import content_checksum
    raw["checksum"] = content_checksum(raw)
    with pytest.raises(MetadataError, match="stats.requests"):
        CheckpointMetadata.loads(json.dumps(raw).encode())


def test_on_file_storage_every_operation_is_counted_at_the_seam(tmp_path: Path):
    storage = CheckpointStorage(f"file://{tmp_path}/ckpt", "job")
    ledger.drain()
    sources = []
    for i in range(3):
        (tmp_path / f"f{i}").write_bytes(b"x" * (100 + i))
        sources.append((str(tmp_path / f"f{i}"), f"shared/op/0/f{i}"))
    storage.upload(sources, checkpoint_id=1)
    storage.write_bytes("chk-1/note", b"hello")
    assert storage.read_bytes("chk-1/note") == b"hello"
    storage.walk("shared")
    storage.exists("chk-1/none")
    storage.delete(["shared/op/0/f0", "shared/op/0/f1"])
    counted = ledger.drain()
    assert dict(counted.requests) == {"PUT": 4, "GET": 1, "LIST": 1, "HEAD": 1, "DELETE": 2, "COPY": 0}
    assert (counted.bytes_up, counted.bytes_down) == (100 + 101 + 102 + 5, 5)


@pytest.mark.s3
def test_on_s3_the_ledger_equals_what_the_server_was_asked(tmp_path: Path, s3_endpoint: str):
    # Checkpoints with retention (uploads, commits, subsumption deletes), then a restore: every
    # request the driver made, counted by botocore's hooks, against a proxy that counts the wire.
    proxy = CountingProxy(s3_endpoint)
    try:
        options = s3_options(proxy.url)
        bucket = "ledger-" + uuid.uuid4().hex[:10]
        fsspec.filesystem("s3", **options).mkdir(bucket)
        storage = CheckpointStorage(f"s3://{bucket}/ckpt", "job", options)
        ledger.drain()
        proxy.take()
        write_checkpoints(storage, tmp_path / "local", 4, retained=2)
        coordinator = CheckpointCoordinator(storage, num_retained=2)
        latest = coordinator.store.load(max(storage.completed_checkpoint_ids()))
        for backend in make_backends(storage, tmp_path / "restored", max_parallelism=16, local_recovery=False):
            backend.restore(latest)
            backend.close()
        counted, asked = ledger.drain(), proxy.take()
    finally:
        proxy.close()
    assert counted.to_json() == asked
    assert counted.requests["DELETE"] > 0 and counted.requests["GET"] > 0 and counted.requests["PUT"] > 0


def test_input_under_a_bucket_root_leaves_the_checkpoints_below_it_checkpoint_traffic():
    bucket = "mixed-" + uuid.uuid4().hex[:8]
    ledger.mark_input(bucket)  # input files land at the bucket's root
    ledger.mark_checkpoints(f"{bucket}/ckpt/job")
    assert ledger.channel_of(f"/{bucket}/b-001.parquet") == ledger.INPUT
    assert ledger.channel_of(f"/{bucket}/ckpt/job/chk-1/_metadata") == ledger.CHECKPOINT
    assert ledger.channel_of("/elsewhere/x") == ledger.CHECKPOINT


def test_the_price_table_and_the_exporters_are_settings_refused_by_name_when_bad():
    from sparkpoint.pipeline.settings import resolve_settings

    assert resolve_settings({"storage_prices": "PUT=0.01"}) == {"storage_prices": "PUT=0.01"}
    assert resolve_settings({"metrics.reporter.promgateway.hostUrl": "http://127.0.0.1:9091"}) == {
        "metrics_pushgateway": "http://127.0.0.1:9091"}
    with pytest.raises(ValueError, match="setting 'storage_prices'.*NAME=USD"):
        resolve_settings({"storage_prices": "PUT:0.01"})
    with pytest.raises(ValueError, match="setting 'metrics_otlp_endpoint'.*http://"):
        resolve_settings({"metrics_otlp_endpoint": "collector:4318"})
