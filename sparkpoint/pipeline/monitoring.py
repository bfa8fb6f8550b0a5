"""A pipeline's metrics where its operators look (`sparkpoint.checkpoint.metrics`): kept per job
in this process, taken after every completed and failed checkpoint, and exported when a setting
says where (`metrics_pushgateway`, `metrics_otlp_endpoint`). An export that fails is logged: it
never fails a checkpoint."""

from __future__ import annotations

import logging
import threading

from sparkpoint.checkpoint.metadata import CheckpointMetadata
from sparkpoint.checkpoint.metrics import PipelineMetrics
from sparkpoint.pipeline.runtime import PipelineConfig

log = logging.getLogger(__name__)

_LOCK = threading.Lock()
_BY_JOB: dict[str, PipelineMetrics] = {}


def metrics_of(job_id: str) -> PipelineMetrics:
    """This process's metrics of job `job_id` (made on first use)."""
    with _LOCK:
        if job_id not in _BY_JOB:
            _BY_JOB[job_id] = PipelineMetrics(job_id)
        return _BY_JOB[job_id]


def checkpoint_completed(config: PipelineConfig, meta: CheckpointMetadata) -> None:
    metrics = metrics_of(config.job_id)
    metrics.checkpoint_completed(meta)
    export(config, metrics)


def checkpoint_failed(config: PipelineConfig) -> None:
    metrics = metrics_of(config.job_id)
    metrics.checkpoint_failed()
    export(config, metrics)


def export(config: PipelineConfig, metrics: PipelineMetrics) -> None:
    """Push to the Pushgateway and send to the OTLP collector the settings name (none: nothing)."""
    if config.metrics_pushgateway:
        try:
            metrics.push(config.metrics_pushgateway)
        except Exception as e:  # noqa: BLE001  monitoring never fails a checkpoint
            log.warning("metrics of %s not pushed to %s: %s", config.job_id, config.metrics_pushgateway, e)
    if config.metrics_otlp_endpoint:
        try:
            metrics.export_otlp(config.metrics_otlp_endpoint)
        except Exception as e:  # noqa: BLE001
            log.warning("metrics of %s not exported to %s: %s", config.job_id, config.metrics_otlp_endpoint, e)
