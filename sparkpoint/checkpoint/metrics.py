"""A pipeline's metrics with Flink's names in Prometheus' conventions (snake case, the unit as a
suffix, `_total` on counters), per pipeline and operator, made from what the checkpoints record.

`PipelineMetrics` holds one Prometheus registry per pipeline: `checkpoint_completed(meta)` sets
the gauges to the checkpoint's figures and adds its counts to the counters, `checkpoint_failed()`
counts a failure. The registry is printed in Prometheus' text format (`text`, what `sparkpoint
metrics` prints), pushed to a Pushgateway (`push`: batch runs end, a scrape would miss them) or
exported to an OpenTelemetry collector over OTLP/HTTP (`export_otlp`).

`METRICS` is the table the docs' Monitoring page shows beside Flink's names.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest, push_to_gateway

from sparkpoint.checkpoint.ledger import OPERATIONS
from sparkpoint.checkpoint.metadata import CheckpointMetadata, state_facts

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Metric:
    """One metric: its name (Prometheus', `sparkpoint_` prefixed), kind, labels beyond
    `pipeline`, Flink's name for it (or the nearest), and what it measures."""

    name: str
    kind: str  # gauge | counter
    labels: tuple[str, ...]
    flink: str
    help: str


METRICS: tuple[Metric, ...] = (
    Metric("sparkpoint_last_checkpoint_duration_seconds", "gauge", (), "lastCheckpointDuration",
           "seconds from the last completed checkpoint's trigger to its commit"),
    Metric("sparkpoint_last_checkpoint_size_bytes", "gauge", ("operator",), "lastCheckpointSize",
           "bytes the last completed checkpoint uploaded (incremental size)"),
    Metric("sparkpoint_last_checkpoint_full_size_bytes", "gauge", ("operator",), "lastCheckpointFullSize",
           "bytes of every file the last completed checkpoint references (full size)"),
    Metric("sparkpoint_completed_checkpoints_total", "counter", (), "numberOfCompletedCheckpoints",
           "checkpoints completed (the latest checkpoint's id: ids count completed checkpoints and savepoints)"),
    Metric("sparkpoint_failed_checkpoints_total", "counter", (), "numberOfFailedCheckpoints",
           "checkpoint attempts that failed or were aborted in this process"),
    Metric("sparkpoint_last_checkpoint_restore_timestamp_seconds", "gauge", (), "lastCheckpointRestoreTimestamp",
           "when the last restore from a task-local copy or stable storage ended (POSIX seconds)"),
    Metric("sparkpoint_last_restore_duration_seconds", "gauge", ("phase",), "restore phases (Flink: spans)",
           "the last restore's seconds by phase: download, open, task_local (the slowest subtask's)"),
    Metric("sparkpoint_last_restore_bytes", "gauge", ("source",), "restoredStateSize",
           "bytes the last restore took from each copy: local (task-local) or remote (stable storage)"),
    Metric("sparkpoint_records_in_total", "counter", ("operator",), "numRecordsIn", "rows the operator read"),
    Metric("sparkpoint_late_records_dropped_total", "counter", (), "numLateRecordsDropped",
           "rows below the watermark their batch started with (dropped unless late='process')"),
    Metric("sparkpoint_watermark_lag_seconds", "gauge", (), "currentInputWatermark (as lag)",
           "seconds between the last checkpoint's commit and its watermark (pipelines with an event time)"),
    Metric("sparkpoint_timers_fired_total", "counter", ("operator",), "timers fired (no Flink metric)",
           "event-time and processing-time timers fired"),
    Metric("sparkpoint_ttl_expired_entries_total", "counter", ("operator",), "TTL cleanup (no Flink metric)",
           "state entries the TTL sweep removed"),
    Metric("sparkpoint_storage_requests_total", "counter", ("operation", "traffic"), "S3 request metrics",
           "storage requests by operation (PUT, GET, LIST, HEAD, DELETE, COPY); traffic: checkpoint or input"),
    Metric("sparkpoint_storage_bytes_total", "counter", ("direction",), "S3 BytesUploaded / BytesDownloaded",
           "bytes sent (up) and received (down) for checkpoints, and read as input (input)"),
)

_PHASES = {"download": "download_seconds", "open": "open_seconds", "task_local": "local_seconds"}


class PipelineMetrics:
    """The metrics of one pipeline (its job id), in a registry of their own."""

    def __init__(self, pipeline: str):
        self.pipeline = pipeline
        self.registry = CollectorRegistry()
        self._m: dict[str, Any] = {}
        for m in METRICS:
            kind = Gauge if m.kind == "gauge" else Counter
            name = m.name.removesuffix("_total") if m.kind == "counter" else m.name
            self._m[m.name] = kind(name, m.help, ("pipeline", *m.labels), registry=self.registry)
        self._completed = 0

    def _of(self, name: str, **labels: str) -> Any:
        return self._m[name].labels(pipeline=self.pipeline, **labels)

    def checkpoint_completed(self, meta: CheckpointMetadata, *, now: float | None = None) -> None:
        """The gauges take `meta`'s figures; the counters add its counts."""
        stats = meta.stats
        if stats.duration_seconds is not None:
            self._of("sparkpoint_last_checkpoint_duration_seconds").set(stats.duration_seconds)
        for uid, op in meta.operators.items():
            files = {f.path: f for h in op.subtasks for f in h.files()}
            self._of("sparkpoint_last_checkpoint_size_bytes", operator=uid).set(
                sum(f.size for f in files.values() if f.created_by == meta.checkpoint_id))
            full = sum(f.size for f in files.values())
            self._of("sparkpoint_last_checkpoint_full_size_bytes", operator=uid).set(full)
            facts = state_facts(op.subtasks)
            self._of("sparkpoint_timers_fired_total", operator=uid).inc(facts.get("timers_fired", 0))
            self._of("sparkpoint_ttl_expired_entries_total", operator=uid).inc(facts.get("expired_removed", 0))
            self._of("sparkpoint_records_in_total", operator=uid).inc(stats.records_in or 0)
        if meta.checkpoint_id > self._completed:
            self._of("sparkpoint_completed_checkpoints_total").inc(meta.checkpoint_id - self._completed)
            self._completed = meta.checkpoint_id
        self._of("sparkpoint_late_records_dropped_total").inc(stats.late_rows or 0)
        watermark = meta.source_offsets.get("watermark") if isinstance(meta.source_offsets, dict) else None
        if isinstance(watermark, int) and not isinstance(watermark, bool):
            self._of("sparkpoint_watermark_lag_seconds").set(
                max(0.0, (now if now is not None else _created(meta)) - watermark / 1e6))
        self._restored(stats.restore, _created(meta) if now is None else now)
        self._requests(meta)

    def _restored(self, restore: Mapping[str, float] | None, when: float) -> None:
        if not restore or not (restore.get("local_bytes") or restore.get("remote_bytes")):
            return  # the working database went on: nothing was restored
        for phase, key in _PHASES.items():
            self._of("sparkpoint_last_restore_duration_seconds", phase=phase).set(restore.get(key, 0.0))
        self._of("sparkpoint_last_restore_bytes", source="local").set(restore.get("local_bytes", 0))
        self._of("sparkpoint_last_restore_bytes", source="remote").set(restore.get("remote_bytes", 0))
        self._of("sparkpoint_last_checkpoint_restore_timestamp_seconds").set(when)

    def _requests(self, meta: CheckpointMetadata) -> None:
        counted = meta.stats.ledger
        if counted is None:
            return
        for op in OPERATIONS:
            self._of("sparkpoint_storage_requests_total", operation=op, traffic="checkpoint").inc(counted.requests[op])
            self._of("sparkpoint_storage_requests_total", operation=op, traffic="input").inc(
                counted.input_requests[op])
        for direction, n in (("up", counted.bytes_up), ("down", counted.bytes_down), ("input", counted.input_bytes)):
            self._of("sparkpoint_storage_bytes_total", direction=direction).inc(n)

    def checkpoint_failed(self) -> None:
        self._of("sparkpoint_failed_checkpoints_total").inc()

    def text(self) -> str:
        """The metrics in Prometheus' text exposition format."""
        return generate_latest(self.registry).decode("utf-8")

    def push(self, gateway: str, *, timeout: float = 10.0) -> None:
        """Replace this pipeline's group on the Pushgateway at `gateway` (job `sparkpoint`,
        grouped by `pipeline`). Raises OSError when the gateway cannot be reached."""
        push_to_gateway(gateway, job="sparkpoint", registry=self.registry, grouping_key={"pipeline": self.pipeline},
                        timeout=timeout)

    def export_otlp(self, endpoint: str, *, timeout: float = 10.0) -> None:
        """Send the metrics once to an OpenTelemetry collector's OTLP/HTTP metrics endpoint."""
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.metrics import CallbackOptions, Observation
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
        from opentelemetry.sdk.resources import Resource

        reader = PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=endpoint, timeout=timeout),
                                               export_interval_millis=3_600_000)
        provider = MeterProvider(metric_readers=[reader],
                                 resource=Resource.create({"service.name": "sparkpoint", "pipeline": self.pipeline}))
        meter = provider.get_meter("sparkpoint")
        for family in self.registry.collect():
            samples = [(s.labels, s.value) for s in family.samples if s.name in (family.name, family.name + "_total")]

            def observe(options: CallbackOptions, samples: list[tuple[dict[str, str], float]] = samples
                        ) -> Iterable[Observation]:
                return [Observation(value, labels) for labels, value in samples]

            if family.type == "counter":
                meter.create_observable_counter(family.name + "_total", [observe], description=family.documentation)
            else:
                meter.create_observable_gauge(family.name, [observe], description=family.documentation)
        try:
            provider.force_flush(timeout_millis=int(timeout * 1000))
        finally:
            provider.shutdown()


def _created(meta: CheckpointMetadata) -> float:
    from datetime import datetime

    try:
        return datetime.fromisoformat(meta.created_at.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return time.time()


def metrics_of_checkpoints(pipeline: str, checkpoints: Iterable[CheckpointMetadata]) -> PipelineMetrics:
    """The metrics as the retained `checkpoints` tell them (oldest first): gauges of the newest,
    counters summed over all (failures are known only to the process that saw them)."""
    metrics = PipelineMetrics(pipeline)
    for meta in sorted(checkpoints, key=lambda m: m.checkpoint_id):
        metrics.checkpoint_completed(meta)
    return metrics
