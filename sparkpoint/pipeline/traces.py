"""OpenTelemetry traces of a checkpoint and of a restore (`traces_endpoint`; off by default, and then
nothing of `opentelemetry` is imported).

The subtasks time their phases where they run (`sparkpoint.checkpoint.phases`: restore and its
download, process, timers, expire, stage, snapshot and its upload) and return them with their
results; the completer draws the spans on the driver with those start and end times, so the
nesting is exact and nothing is propagated into executors:

    checkpoint <job>/chk-N                      triggered .. completed
      operator <name>                           its subtasks' first start .. last end
        subtask <name>/<i>
          restore > download, process, timers, expire, stage, snapshot > upload
      commit                                    `_metadata`, registry, retention
      sink commit

A batch whose subtasks restored state (from a task-local copy, the primary copy or by rescaling;
not those that went on from their open database) makes a second trace, `restore <job>/chk-K`, with
the restore phases alone.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any

from sparkpoint.checkpoint.metadata import CheckpointMetadata
from sparkpoint.checkpoint.phases import Phase
from sparkpoint.pipeline.history import NO_RESTORE, RunFacts, SubtaskFacts

GLOBAL = "global"  # `traces_endpoint`: the process's own tracer provider


@functools.cache
def tracer_for(endpoint: str) -> Any:
    """The tracer of `endpoint`: the process's provider for `global`, else one provider per
    endpoint and process exporting over OTLP/HTTP in the background (flushed at exit)."""
    from opentelemetry import trace

    if endpoint == GLOBAL:
        return trace.get_tracer("sparkpoint")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": "sparkpoint"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, timeout=5)))
    return provider.get_tracer("sparkpoint")


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def _span(tracer: Any, name: str, parent: Any, start: float, end: float, attributes: dict[str, Any]) -> Any:
    """A span with its own times under `parent` (None: the root of a new trace), ended at once."""
    from opentelemetry import context, trace

    ctx = trace.set_span_in_context(parent) if parent is not None else context.Context()
    span = tracer.start_span(name, context=ctx, start_time=_ns(start), attributes=attributes)
    span.end(end_time=_ns(max(end, start)))
    return span


def _phase_spans(tracer: Any, parent: Any, phases: Sequence[Phase], keep: Iterable[int]) -> None:
    """The phases `keep` (indexes) as spans, each under its parent phase's span (or `parent`)."""
    made: dict[int, Any] = {}
    for i in sorted(keep):
        name, up, start, end = phases[i]
        made[i] = _span(tracer, name, made.get(up, parent), start, end, {})


def _subtree(phases: Sequence[Phase], root: str) -> list[int]:
    """The indexes of every phase named `root` and of the phases nested in them."""
    inside: list[int] = []
    for i, (name, up, _, _) in enumerate(phases):
        if name == root or up in inside:
            inside.append(i)
    return inside


def _operator_spans(tracer: Any, parent: Any, meta: CheckpointMetadata, runs: Sequence[SubtaskFacts],
                    only: str | None) -> None:
    """A span per operator, a span per subtask in it, its phases in that (only those under `only`)."""
    by_operator: dict[str, list[SubtaskFacts]] = {}
    for run in runs:
        if run.phases:
            by_operator.setdefault(run.operator, []).append(run)
    for uid, subtasks in by_operator.items():
        name = meta.operator_name(uid) if uid in meta.operators else uid
        keeps = {s.subtask: (_subtree(s.phases, only) if only else list(range(len(s.phases)))) for s in subtasks}
        timed = [(s, [s.phases[i] for i in keeps[s.subtask]]) for s in subtasks if keeps[s.subtask]]
        if not timed:
            continue
        op_span = _span(tracer, f"operator {name}", parent, min(p[2] for _, ps in timed for p in ps),
                        max(p[3] for _, ps in timed for p in ps), {"sparkpoint.operator": uid,
                                                                   "sparkpoint.parallelism": len(subtasks)})
        for s, ps in timed:
            sub = _span(tracer, f"subtask {name}/{s.subtask}", op_span, min(p[2] for p in ps), max(p[3] for p in ps),
                        {"sparkpoint.subtask": s.subtask, "sparkpoint.restore": s.restore,
                         "sparkpoint.rows": s.rows})
            _phase_spans(tracer, sub, s.phases, keeps[s.subtask])


def emit_traces(endpoint: str, attempt: RunFacts, meta: CheckpointMetadata, ended: float,
                driver_phases: Sequence[Phase] = ()) -> None:
    """The checkpoint's trace, and a restore's when its subtasks restored state."""
    tracer = tracer_for(endpoint)
    job, cid = attempt.job_id, meta.checkpoint_id
    root = _span(tracer, f"checkpoint {job}/chk-{cid}", None, attempt.started_at, ended, {
        "sparkpoint.job_id": job, "sparkpoint.checkpoint_id": cid, "sparkpoint.kind": meta.kind,
        "sparkpoint.state_size": meta.stats.state_size, "sparkpoint.checkpointed_size": meta.stats.checkpointed_size,
        "sparkpoint.files_new": meta.stats.files_new, "sparkpoint.rows": attempt.rows,
        "sparkpoint.input_files": len(attempt.files)})
    _operator_spans(tracer, root, meta, attempt.subtasks, None)
    for name, _, start, end in driver_phases:
        _span(tracer, name, root, start, end, {})
    restoring = [s for s in attempt.subtasks if s.restore not in NO_RESTORE and s.phases]
    if restoring:
        phases = [s.phases[i] for s in restoring for i in _subtree(s.phases, "restore")]
        if phases:
            base = f"chk-{attempt.base}" if attempt.base is not None else "another job's checkpoint"
            restore = _span(tracer, f"restore {job}/{base}", None, min(p[2] for p in phases),
                            max(p[3] for p in phases), {"sparkpoint.job_id": job, "sparkpoint.checkpoint_id": cid,
                                                        "sparkpoint.restored_from": attempt.base or 0})
            _operator_spans(tracer, restore, meta, restoring, "restore")
