"""What does observing a checkpoint cost? (issue 47: the goal is at most 2% of a checkpoint's time)

A furnace pipeline (tests/support/furnace_pipeline.py: one operator keeping each furnace's peak
temperature, 60,000 keys, batches of 20,000 rows, 2 subtasks) takes checkpoints through the real
driver, its subtasks run in this process (no JVM: Spark's share of a checkpoint would only make the
overhead look smaller), on `file://`. Each variant of `variants()` is a job of its own over the
same batches; the variants take
their checkpoints in turns (round r: one checkpoint of each), so drift of the machine hits all
alike. Per checkpoint: its wall time (the driver's `run` of one batch) and the time spent in
`observe_checkpoint` (the history record, the trace, the lineage events: everything the completer
does for observers), whose share of the checkpoint is the overhead. The phase timings the subtasks
take are on in every variant (they are plain data); their cost is measured apart, per phase.

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.bench_observers           # 30 rounds, ~2 min
    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.bench_observers --quick   # seconds

It prints a table and writes benchmarks/results/observers.json (observers_quick.json with
--quick). Traces go to an OpenTelemetry SDK provider with an in-memory exporter behind a simple
(synchronous) span processor: an upper bound of what a batch processor sending over OTLP costs the
checkpoint. Lineage goes to the client's file transport.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sparkpoint.pipeline.attempt.protocol as protocol
import sparkpoint.pipeline.traces as traces
from sparkpoint.checkpoint.phases import phase, recording
from sparkpoint.pipeline.runtime import PipelineConfig
from tests.support.furnace_pipeline import InProcessPipeline, land, peak_heat

RESULTS = Path(__file__).parent / "results"
GOAL = 0.02  # of a checkpoint's time


@dataclass(frozen=True)
class Variant:
    """One way to run the same job: `settings` on top of the base config."""

    name: str
    settings: dict[str, Any] = field(default_factory=dict)


def variants(root: Path) -> list[Variant]:
    """The variants measured, each a job of its own (add one here to measure it)."""
    return [
        Variant("off", {"history_max_checkpoints": 0}),
        Variant("history", {}),
        Variant("history+traces", {"traces_endpoint": "global"}),
        Variant("history+traces+lineage", {"traces_endpoint": "global",
                                           "lineage_transport": f"file://{root}/lineage.jsonl"}),
    ]


class ObserveClock:
    """Wraps `observe_checkpoint` where the completer calls it: the seconds spent in it, per call."""

    def __init__(self) -> None:
        self.calls: list[float] = []
        self._real = protocol.observe_checkpoint

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        started = time.perf_counter()
        self._real(*args, **kwargs)
        self.calls.append(time.perf_counter() - started)


def phase_cost(n: int = 200_000) -> float:
    """Seconds one timed phase costs a subtask (`with phase(...)` inside `recording()`)."""
    with recording():
        started = time.perf_counter()
        for _ in range(n):
            with phase("process"):
                pass
        return (time.perf_counter() - started) / n


def measure(rounds: int, rows: int, keys: int, root: Path) -> dict[str, Any]:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("bench")
    traces.tracer_for = lambda endpoint: tracer  # type: ignore[assignment]  # the "global" provider, ours
    clock = ObserveClock()
    protocol.observe_checkpoint = clock  # type: ignore[assignment]
    land(root / "in", rounds + 1, rows, keys)
    jobs = {v.name: PipelineConfig(input_url=str(root / "in"), checkpoints_url=f"file://{root}/ckpt",
                                   job_id=v.name.replace("+", "-"), output_url=f"file://{root}/out-{i}",
                                   parallelism=2, max_parallelism=8, local_dir=str(root / f"local-{i}"),
                                   max_batches=1, **v.settings)
            for i, v in enumerate(variants(root))}
    for config in jobs.values():  # the first checkpoint (an empty start, a full upload) is not measured
        InProcessPipeline(None, config, (peak_heat,)).run()
    wall: dict[str, list[float]] = {name: [] for name in jobs}
    observe: dict[str, list[float]] = {name: [] for name in jobs}
    for _ in range(rounds):
        for name, config in jobs.items():
            driver = InProcessPipeline(None, config, (peak_heat,))
            before = len(clock.calls)
            started = time.perf_counter()
            driver.run()
            wall[name].append(time.perf_counter() - started)
            observe[name].append(sum(clock.calls[before:]))
    out = {}
    for name in jobs:
        median_wall, median_observe = statistics.median(wall[name]), statistics.median(observe[name])
        out[name] = {"checkpoint_s": round(median_wall, 4), "observe_s": round(median_observe, 5),
                     "observe_share": round(median_observe / median_wall, 5), "checkpoints": len(wall[name])}
    return {"variants": out, "spans": len(exporter.get_finished_spans()), "phase_us": round(phase_cost() * 1e6, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few rounds of small batches (a smoke run)")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    rounds, rows, keys = (4, 2000, 5000) if args.quick else (args.rounds, 20_000, 60_000)
    with tempfile.TemporaryDirectory(prefix="bench-observability-") as tmp:
        result = measure(rounds, rows, keys, Path(tmp))
    result["args"] = {"rounds": rounds, "rows": rows, "keys": keys, "goal_share": GOAL}
    print(f"\nObserving a checkpoint ({rounds} rounds, batches of {rows} rows over {keys} keys, 2 subtasks, file://; "
          f"medians)\n")
    print(f"{'variant':<26}{'checkpoint':>12}{'observers':>12}{'share':>9}")
    for name, v in result["variants"].items():
        print(f"{name:<26}{v['checkpoint_s'] * 1000:>10.1f}ms{v['observe_s'] * 1000:>10.2f}ms"
              f"{v['observe_share']:>9.2%}")
    print(f"\na timed phase costs {result['phase_us']} µs (about 10 per subtask and checkpoint); "
          f"{result['spans']} spans made; goal: observers <= {GOAL:.0%} of a checkpoint")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / ("observers_quick.json" if args.quick else "observers.json")).write_text(
        json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
