"""Metrics with Flink's names (`sparkpoint.checkpoint.metrics`): made from checkpoints without
Spark, printed by `sparkpoint metrics`, sent over OTLP to a receiver that decodes them, and, after
a real run, pushed to a real Pushgateway that a real Prometheus scrapes (its HTTP API returns them)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
from contextlib import redirect_stdout
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sparkpoint.checkpoint.metrics import METRICS, PipelineMetrics, metrics_of_checkpoints
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.cli import main
from tests.support.backends import write_checkpoints
from tests.support.helpers import ROOT
from tests.support.prometheus import prometheus_and_pushgateway


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _checkpoints(tmp_path: Path) -> CheckpointStorage:
    storage = CheckpointStorage(f"file://{tmp_path}/ckpt", "meters")
    write_checkpoints(storage, tmp_path / "local", 3, retained=2)
    return storage


def test_metrics_of_retained_checkpoints_have_flinks_figures(tmp_path: Path):
    storage = _checkpoints(tmp_path)
    listing = CompletedCheckpointStore(storage).load_all()
    newest = max(listing.checkpoints, key=lambda m: m.checkpoint_id)
    samples = _samples(metrics_of_checkpoints("meters", listing.checkpoints).text())
    op = (("operator", "counts"), ("pipeline", "meters"))
    assert samples[("sparkpoint_completed_checkpoints_total", (("pipeline", "meters"),))] == 3
    assert samples[("sparkpoint_last_checkpoint_full_size_bytes", op)] == sum(f.size for f in newest.files())
    assert samples[("sparkpoint_last_checkpoint_size_bytes", op)] == sum(
        f.size for f in newest.files() if f.created_by == newest.checkpoint_id)
    assert {m.name for m in METRICS} >= {"sparkpoint_last_checkpoint_duration_seconds",
                                         "sparkpoint_failed_checkpoints_total", "sparkpoint_storage_requests_total"}


def test_a_failed_checkpoint_is_counted():
    metrics = PipelineMetrics("meters")
    metrics.checkpoint_failed()
    metrics.checkpoint_failed()
    assert _samples(metrics.text())[("sparkpoint_failed_checkpoints_total", (("pipeline", "meters"),))] == 2


def test_sparkpoint_metrics_prints_prometheus_text(tmp_path: Path):
    _checkpoints(tmp_path)
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["metrics", "--checkpoints", f"file://{tmp_path}/ckpt", "--job-id", "meters"]) == 0
    assert "# TYPE sparkpoint_completed_checkpoints_total counter" in out.getvalue()
    assert _samples(out.getvalue())[("sparkpoint_completed_checkpoints_total", (("pipeline", "meters"),))] == 3


def test_metrics_reach_an_otlp_collector(tmp_path: Path):
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

    received: list[bytes] = []

    class Collector(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            received.append(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        storage = _checkpoints(tmp_path)
        metrics = metrics_of_checkpoints("meters", CompletedCheckpointStore(storage).load_all().checkpoints)
        metrics.export_otlp(f"http://127.0.0.1:{server.server_address[1]}/v1/metrics")
    finally:
        server.shutdown()
        server.server_close()
    request = ExportMetricsServiceRequest.FromString(received[0])
    sent = {m.name: m for rm in request.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    completed = sent["sparkpoint_completed_checkpoints_total"]
    assert completed.sum.is_monotonic and completed.sum.data_points[0].as_double == 3
    assert "sparkpoint_last_checkpoint_full_size_bytes" in sent


PIPELINE = '''
import pandas as pd
from sparkpoint import KeyedOperator, Pipeline, StructCodec

WATTS = StructCodec[tuple[float]]("<d")


def peak(batch, state):
    top = state.value_state("peak", WATTS)
    highest = batch.groupby("panel")["watts"].max()
    keys = [str(k) for k in highest.index]
    top.put_many((k, (max(float(h), old[0] if old else 0.0),)) for k, h, old in zip(keys, highest, top.get_many(keys)))


def export(state):
    return pd.DataFrame([(k.decode(), v[0]) for k, v in state.value_state("peak", WATTS).items()],
                        columns=["panel", "watts"])


panel_peaks = KeyedOperator("panel_peaks", key="panel", key_type="string", columns=("watts",), process=peak,
                            export=export)
solar = Pipeline("solar", [panel_peaks], input_url="unused", checkpoints_url="unused", event_time="at")
'''


@pytest.mark.spark
def test_after_a_run_prometheus_returns_its_metrics_from_the_pushgateway(tmp_path: Path):
    (tmp_path / "solar_pipeline.py").write_text(PIPELINE)
    (tmp_path / "in").mkdir()
    at = pd.Timestamp("2026-06-01T12:00:00Z")
    for i in range(2):
        pd.DataFrame({"panel": [f"p{j % 9}" for j in range(200)], "watts": [float(j) for j in range(200)],
                      "at": [at + pd.Timedelta(minutes=i * 10 + j % 7) for j in range(200)]}
                     ).to_parquet(tmp_path / "in" / f"b-{i}.parquet")
    with prometheus_and_pushgateway(tmp_path / "monitoring") as monitoring:
        done = subprocess.run(
            [sys.executable, "-m", "sparkpoint.cli", "run", "--pipeline", "solar_pipeline:solar",
             "--input", str(tmp_path / "in"), "--checkpoints", f"file://{tmp_path}/ckpt",
             "--local-dir", str(tmp_path / "local"), "--master", "local[2]", "--json",
             "--conf", f"metrics_pushgateway={monitoring.pushgateway}"],
            capture_output=True, text=True, timeout=600, cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"})
        assert done.returncode == 0, done.stderr[-3000:]
        reports = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        assert [r["checkpoint_id"] for r in reports] == [1, 2]
        completed = monitoring.wait_for('sparkpoint_completed_checkpoints_total{pipeline="solar"}')
        size = monitoring.wait_for('sparkpoint_last_checkpoint_full_size_bytes{pipeline="solar",'
                                   'operator="panel_peaks"}')
        records = monitoring.wait_for('sparkpoint_records_in_total{pipeline="solar",operator="panel_peaks"}')
        puts = monitoring.wait_for('sparkpoint_storage_requests_total{pipeline="solar",operation="PUT",'
                                   'traffic="checkpoint"}')
        lag = monitoring.wait_for('sparkpoint_watermark_lag_seconds{pipeline="solar"}')
        duration = monitoring.wait_for('sparkpoint_last_checkpoint_duration_seconds{pipeline="solar"}')
    assert float(completed[0]["value"][1]) == 2
    assert float(size[0]["value"][1]) == reports[-1]["state_size"]
    assert float(records[0]["value"][1]) == 400
    retained = CompletedCheckpointStore(CheckpointStorage(f"file://{tmp_path}/ckpt", "solar")).load_all().checkpoints
    assert sorted(m.checkpoint_id for m in retained) == [1, 2]  # the PUTs each `_metadata` counted up to its commit
    assert float(puts[0]["value"][1]) == sum(m.stats.ledger.requests["PUT"] for m in retained if m.stats.ledger) > 0
    assert float(lag[0]["value"][1]) > 0 and float(duration[0]["value"][1]) > 0


def test_the_monitoring_page_lists_every_metric_beside_flinks_name():
    page = (ROOT / "docs" / "monitoring.md").read_text()
    for m in METRICS:
        assert f"`{m.name}`" in page, f"docs/monitoring.md lacks {m.name}"
