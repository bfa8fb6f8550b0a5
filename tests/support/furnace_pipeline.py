"""A user's own pipeline for the history, trace and lineage tests (issue 47, items 3-5): furnaces
report `furnace` and `celsius`; `peak_heat` keeps each furnace's highest temperature in a
ValueState and emits the peaks a batch raised. `InProcessPipeline` runs its Spark half in the
calling thread (the same subtasks, no JVM) for the tests of the core."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from sparkpoint import KeyedOperator, StructCodec
from sparkpoint.pipeline.driver import StatefulPipeline
from sparkpoint.pipeline.runtime import PipelineConfig
from sparkpoint.spark.tasks import run_slots

PEAK = StructCodec[tuple[float]]("<d")


def raise_peaks(batch: pd.DataFrame, state: Any) -> pd.DataFrame:
    top = batch.groupby("furnace")["celsius"].max()
    keys = [str(k) for k in top.index]
    peaks = state.value_state("peak", PEAK)
    raised = [(k, float(t)) for k, t, old in zip(keys, top.tolist(), peaks.get_many(keys)) if old is None or t > old[0]]
    peaks.put_many((k, (t,)) for k, t in raised)
    return pd.DataFrame(raised, columns=["furnace", "peak"])


def export_peaks(state: Any) -> pd.DataFrame:
    rows = [(k.decode(), v[0]) for k, v in state.value_state("peak", PEAK).items()]
    return pd.DataFrame(rows, columns=["furnace", "peak"])


peak_heat = KeyedOperator("peak_heat", key="furnace", key_type="string", columns=("celsius",), process=raise_peaks,
                          export=export_peaks, emits=True, schema={"furnace": "string", "peak": "float64"})


def land(input_dir: Path, batches: int, rows: int = 40, furnaces: int = 6) -> None:
    """`batches` files b0000.parquet.. of `rows` readings spread over `furnaces` furnaces (each batch
    another stretch of them when they outnumber its rows), hotter each batch."""
    input_dir.mkdir(parents=True, exist_ok=True)
    for b in range(batches):
        pd.DataFrame({"furnace": [f"f{(i * 7919 + b * rows) % furnaces}" for i in range(rows)],
                      "celsius": [900.0 + 10 * b + i % 97 for i in range(rows)]}).to_parquet(
            input_dir / f"b{b:04d}.parquet")


def furnace_config(root: Path, **settings: Any) -> PipelineConfig:
    settings = {"output_url": f"file://{root}/out", "parallelism": 2, "max_parallelism": 8,
                "local_dir": str(root / "local"), **settings}
    return PipelineConfig(input_url=str(root / "in"), checkpoints_url=f"file://{root}/ckpt", job_id="furnaces",
                          **settings)


class InProcessPipeline(StatefulPipeline):
    """The driver with its Spark job's subtasks run in the calling thread (read-all route)."""

    def run_spark(self, spec: Any, urls: list[str], *route: Any) -> list[dict[str, Any]]:
        ids = iter([pd.DataFrame({"id": list(range(spec.parallelism))})])
        return [row for frame in run_slots(spec, urls, ids) for row in frame.to_dict("records")]


def in_memory_tracer() -> tuple[Any, Any]:
    """A tracer whose spans the returned OpenTelemetry SDK in-memory exporter holds."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test"), exporter
