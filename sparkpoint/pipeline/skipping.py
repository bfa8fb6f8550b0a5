"""`sparkpoint skip`: the explicit way out of `on_bad_file="fail"` for one input file."""

from __future__ import annotations

from sparkpoint.checkpoint.metadata import CheckpointMetadata, skip_problem
from sparkpoint.pipeline.attempt.protocol import complete_attempt, run_spark_half
from sparkpoint.pipeline.badfiles import MANUAL, carried_skips
from sparkpoint.pipeline.driver import StatefulPipeline
from sparkpoint.pipeline.runtime import BatchReport, PipelineError
from sparkpoint.spark.offsets import SourceError


def skip_file(pipeline: StatefulPipeline, name: str, reason: str) -> tuple[BatchReport, CheckpointMetadata]:
    """Commit one checkpoint that consumes input file `name` without processing it, recorded as
    skipped with `reason`: the same protocol as a batch (trigger, every subtask snapshots its
    unchanged state, exclusive `_metadata`, registry, retention, the sink's commit), over no
    input. Without a Spark session the subtasks run in this process (no JVM).

    Raises:
        PipelineError: `name` is not an unconsumed batch file of the input, or `reason` is
            empty, too long or more than one line (the message says which, and what is pending).
    """
    problem = skip_problem(name, MANUAL, reason)
    if problem:
        raise PipelineError(f"cannot skip {name!r}: {problem}")
    start, coordinator = pipeline.begin()
    if start.offsets.includes(name):
        previous = {s.file: s for s in carried_skips(start.metadata)}.get(name)
        how = f"skipped by chk-{previous.checkpoint_id} ({previous.check}: {previous.reason})" if previous \
            else "processed" if name in start.offsets.consumed else \
            f"at or below the floor {start.offsets.floor!r}: processed, or landed late and refused"
        latest = f"chk-{start.metadata.checkpoint_id}" if start.metadata else "the checkpoint it starts from"
        raise PipelineError(f"cannot skip {name!r}: {latest} has consumed it already ({how}); nothing to do")
    pending = pipeline.source.pending(start.offsets)
    if name not in pending:
        others = pipeline.source.listing()[1]
        what = (f"is not a batch file ({pipeline.source.accepted}): the pipeline never reads it" if name in others
                else f"is not in the input {pipeline.source.url}, where this looked (the pipeline's input_url, unless "
                     "--input names another): give the input the failed run read (its error names the file's full "
                     "URL) with --input, and its --checkpoints and --job-id")
        raise PipelineError(f"cannot skip {name!r}: it {what}. Unconsumed batch files: "
                            + (", ".join(pending[:10]) + (f" and {len(pending) - 10} more" if len(pending) > 10
                                                          else "") if pending else "none"))
    try:  # a table's files are consumed in commit order: only the next one can be skipped
        pipeline.source.advance(start.offsets, [name])
    except SourceError as e:
        raise PipelineError(f"cannot skip {name!r}: {e}") from e
    attempt = run_spark_half(pipeline, coordinator, start, [], skip=[(name, reason)])
    return complete_attempt(pipeline, attempt, coordinator=coordinator)
