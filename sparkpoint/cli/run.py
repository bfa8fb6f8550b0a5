"""`run` (and `run --follow`), `skip`, and `generate`, which writes the sample input a run reads.

`run` checks everything it can before Spark starts (the restore plan, the first batch's files, the
operators against the checkpoint), then takes batches, one checkpoint each, printing a line per
checkpoint; Ctrl-C (or SIGTERM while following) abandons the batch in flight and exits 130 (143).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sparkpoint.checkpoint.errors import OperatorStateMismatch
from sparkpoint.checkpoint.progress import ProgressFn
from sparkpoint.checkpoint.storage import storage_url
from sparkpoint.cli.common import (
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    UsageError,
    key_value,
    pipeline_of,
    storage_options,
)
from sparkpoint.cli.output import print_json, progress_bar
from sparkpoint.pipeline.settings import flagged
from sparkpoint.tables.conf import split_catalog_conf

if TYPE_CHECKING:
    from sparkpoint.pipeline.driver import StatefulPipeline
    from sparkpoint.pipeline.follow import FollowOptions
    from sparkpoint.pipeline.runtime import PipelineConfig
    from sparkpoint.pipeline.spec import Pipeline


def cmd_generate(args: argparse.Namespace) -> int:
    from sparkpoint.spark.generate import generate

    files = generate(
        args.out, batches=args.batches, events_per_batch=args.events_per_batch, users=args.users,
        items=args.items, seed=args.seed, first=args.first, storage_options=storage_options(args.storage_options),
    )
    if args.json:
        print_json({"files": files})
    else:
        print(f"wrote {len(files)} batches of {args.events_per_batch} events to {args.out}")
    return 0


def run_config(args: argparse.Namespace) -> tuple[Pipeline, PipelineConfig, str | None]:
    """(the pipeline, its settings with the flags and `--conf` on top, the Spark Connect URL) of
    `run` and `skip`: a flag wins over `--conf`, which wins over the pipeline's own setting."""
    from sparkpoint.pipeline.settings import resolve_settings

    catalog, conf = split_catalog_conf(dict(key_value(c) for c in args.conf))
    remote = getattr(args, "remote", None) or conf.pop("spark.remote", None) or os.environ.get("SPARK_REMOTE") or None
    settings = resolve_settings(conf)
    pipeline_spec = pipeline_of(args)
    if pipeline_spec is None:
        missing = [flag for flag, value in (("--input", args.input), ("--checkpoints", args.checkpoints),
                                            ("--job-id", args.job_id)) if not value]
        if missing:
            raise UsageError(f"{', '.join(missing)} required (or --pipeline MODULE:ATTR, which names them)")
        pipeline_spec = _sample_pipeline()
    if "checkpoints_dir" in settings:
        settings["checkpoints_url"] = settings.pop("checkpoints_dir")
    chosen = {**settings, **_flags_given(args)}
    for key in ("input_url", "checkpoints_url"):
        if chosen.get(key):
            chosen[key] = storage_url(chosen[key])
    if chosen.get("output_url"):
        chosen["output_url"] = _output_url(chosen["output_url"])
    if catalog:  # on top of the pipeline's own Iceberg catalog properties
        chosen["output_catalog"] = {**pipeline_spec.config().output_catalog, **catalog}
    chosen.update(_input_table(pipeline_spec, chosen.get("input_url"), catalog))
    return pipeline_spec, pipeline_spec.config(**chosen), remote


def _input_table(pipeline: Pipeline, given: str | None, catalog: dict[str, str]) -> dict[str, Any]:
    """The `input_table` (and its URI as `input_url`) an `--input` URL names (`delta+...`,
    `iceberg://...` with the `--conf iceberg.catalog.*` properties; a directory: none), or the
    pipeline's own Iceberg input with those properties on top."""
    from sparkpoint.tables.spec import DeltaTable, IcebergTable, table_of

    if given:
        table = table_of(given, catalog=catalog)
        if isinstance(table, (DeltaTable, IcebergTable)):
            return {"input_table": table, "input_url": table.uri}
        return {"input_table": None}
    if catalog and isinstance(pipeline.input, IcebergTable):
        return {"input_table": IcebergTable(pipeline.input.identifier, catalog={**pipeline.input.catalog, **catalog})}
    return {}


def _output_url(given: str) -> str:
    """`--output` as a URL: a table's `delta+...`/`iceberg://...`, a directory's fsspec URL."""
    from sparkpoint.tables.spec import TableSpecError, table_url

    try:
        return table_url(given)
    except TableSpecError as e:
        raise UsageError(f"--output: {e}") from e


def _flags_given(args: argparse.Namespace) -> dict[str, Any]:
    """The settings the flags of `run` or `skip` set, by the setting's name."""
    dest = {"input_url": "input", "checkpoints_url": "checkpoints", "job_id": "job_id", "output_url": "output",
            "max_batches": "max_batches", "local_dir": "local_dir",
            **{setting.name: setting.flag.dest for setting in flagged() if setting.flag}}
    flags = {setting: getattr(args, name, None) for setting, name in dest.items()}
    if args.storage_options:
        options = storage_options(args.storage_options)
        flags.update(storage_options=options, input_options=options)
    return {k: v for k, v in flags.items() if v is not None}


def _sample_pipeline() -> Pipeline:
    """What `run` and `skip` run without `--pipeline` (the documented default): the sample
    pipeline's operators, at the locations the flags give, without its output."""
    from sparkpoint.sample import pipeline

    return pipeline.with_(local_dir=".sparkpoint/local", output_url=None, output=None)


def cmd_run(args: argparse.Namespace) -> int:
    from sparkpoint.spark.source import BadInputFile

    try:
        return _run(args)
    except BadInputFile as e:  # the way on names this run's pipeline and the input it read
        from sparkpoint.pipeline.badfiles import bad_file_message

        raise bad_file_message(e.file, e.check, e.reason, skip_how=_skip_command(args, e.file)) from e


def _skip_command(args: argparse.Namespace, file: str) -> str:
    """The `sparkpoint skip` of `file` with the pipeline, locations and settings this run was
    given (storage options by reference only: they may hold credentials)."""
    from sparkpoint.pipeline.badfiles import skip_command

    flags = [(flag, str(getattr(args, dest))) for flag, dest in (
        ("--pipeline", "pipeline"), ("--input", "input"), ("--checkpoints", "checkpoints"), ("--job-id", "job_id"),
        ("--output", "output"), ("--local-dir", "local_dir"), ("--parallelism", "parallelism"))
        if getattr(args, dest, None) is not None]
    flags += [("--conf", c) for c in args.conf if not c.startswith("spark.")]
    said = skip_command(file, flags)
    return said + (" with this run's --storage-options" if args.storage_options else "")


def _run(args: argparse.Namespace) -> int:
    from sparkpoint.spark.session import interrupted, session_key, spark_session

    follow = _follow_options(args)
    pipeline, remote = _checked_before_spark(args, follow)
    terminated = _stop_on_sigterm() if follow is not None else None
    # On Spark Connect (the warm local Spark by default) the runs of one job and code share a
    # server session, whose Python workers stay warm between runs.
    pipeline.spark = spark_session(args.master, verbose=args.verbose, remote=remote,
                                   share=session_key(pipeline.config.job_id, pipeline.operators))
    try:
        reports = _take_batches(args, pipeline, follow)
    except BaseException as e:
        if not isinstance(e, KeyboardInterrupt) and not interrupted():
            pipeline.spark.stop()
            raise
        return _interrupted(pipeline, terminated)
    pipeline.spark.stop()
    return _finished(args, pipeline, follow, reports)


def _checked_before_spark(args: argparse.Namespace, follow: FollowOptions | None) -> tuple[StatefulPipeline,
                                                                                           str | None]:
    """The run's pipeline driver (and Spark Connect URL) once everything that needs no Spark is
    checked: input and storage, the restore plan, the first batch's files, the operators."""
    from sparkpoint.pipeline.driver import StatefulPipeline

    pipeline_spec, config, remote = run_config(args)
    pipeline = StatefulPipeline(None, config, pipeline_spec.operators)  # checks input and storage before Spark
    _say_restore_plan(args, pipeline)
    if follow is None:
        # Every check of the first batch's files, from their footers, before Spark (a bad file under
        # on_bad_file="fail" stops here: nothing started, nothing uploaded); the batch reuses them.
        # A failing file that may still be landing ends the batch before it (`next_batch`).
        # (Following, the loop waits for such a file to settle.)
        pipeline.check_batch(pipeline.next_batch())
    pipeline.check_start()  # the operators and their states' schemas against the checkpoint, before Spark
    return pipeline, remote


def _say_restore_plan(args: argparse.Namespace, pipeline: StatefulPipeline) -> None:
    """What the restore will do, from `_metadata` alone: a refused restore stops here, nothing written."""
    plan = pipeline.restore_plan()
    if plan is None:
        return
    if not plan.ok:
        raise OperatorStateMismatch(plan.refusal(op.name for op in pipeline.operators))
    said = sys.stderr if args.json else sys.stdout
    print(f"sparkpoint run: {plan.decision()}", file=said, flush=True)
    if plan.rescaling():  # a parallelism the user set that differs from the checkpoint's
        print(plan.rescaling(), file=said, flush=True)


def _take_batches(args: argparse.Namespace, pipeline: StatefulPipeline, follow: FollowOptions | None) -> list[Any]:
    """The run's checkpoints (following: until stopped), each printed as it completes."""
    with progress_bar(args, "checkpoints uploaded") as progress:
        show = _shower(args, progress)
        if follow is None:
            return pipeline.run(on_checkpoint=show, tick=args.tick)
        from sparkpoint.pipeline.follow import follow as follow_input

        reports = []
        for done in follow_input(pipeline, follow):
            show(done.report)
            reports.append(done.report)
        return reports


def _shower(args: argparse.Namespace, progress: ProgressFn | None) -> Callable[[Any], None]:
    """Prints a checkpoint's line (or JSON) and moves the bar by the bytes its subtasks uploaded."""
    uploaded = 0

    def show(report: Any) -> None:
        nonlocal uploaded
        print(json.dumps(report.to_json()) if args.json else report.line(), flush=True)
        uploaded += report.checkpointed_size
        if progress is not None:
            progress(uploaded, 0)

    return show


def _interrupted(pipeline: StatefulPipeline, terminated: _Terminated | None) -> int:
    """After Ctrl-C or SIGTERM: Spark stopped, one line on what is committed, exit 130 or 143."""
    from sparkpoint.pipeline.maintenance import interruption_summary
    from sparkpoint.spark.session import stop_quietly

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C does not break the clean-up
    if terminated is not None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    stop_quietly(pipeline.spark)
    how = "terminated (SIGTERM)" if terminated is not None and terminated else "interrupted"
    print(f"sparkpoint run: {interruption_summary(pipeline.storage).replace('interrupted', how, 1)}",
          file=sys.stderr)
    return EXIT_TERMINATED if terminated else EXIT_INTERRUPTED


def _finished(args: argparse.Namespace, pipeline: StatefulPipeline, follow: FollowOptions | None,
              reports: list[Any]) -> int:
    """The closing lines of a run that ended by itself."""
    if follow is not None:
        if not args.json:
            print(f"sparkpoint run: following stopped after {len(reports)} checkpoint{'s' * (len(reports) != 1)}",
                  file=sys.stderr)
        _requests_after_last_checkpoint(args)
        return 0
    if not reports and not args.json:  # a file that may still be landing was warned of above
        print("no batch taken: the next unconsumed file may still be being written" if pipeline.waiting_for
              else "no unconsumed batch: nothing to do")
    empty = pipeline.source.nothing_to_read()
    if empty:
        print(f"sparkpoint run: warning: {empty}", file=sys.stderr)
    if pipeline.config.input_cleanup != "keep":
        from sparkpoint.pipeline.cleanup import InputCleanup, clean_input

        cleaned = clean_input(pipeline.storage, InputCleanup.of(pipeline.config))
        print(f"sparkpoint run: {cleaned.message}", file=sys.stderr if args.json else sys.stdout)
    _requests_after_last_checkpoint(args)
    return 0


def _requests_after_last_checkpoint(args: argparse.Namespace) -> None:
    """The storage requests no checkpoint's ledger holds: those after the last one (looking for
    another batch), so that the run's requests add up: with `--json` on standard error, as JSON;
    otherwise logged (shown with --verbose), keeping the run's terminal quiet."""
    from sparkpoint.checkpoint import ledger

    left = ledger.drain()
    if not (left.total or sum(left.input_requests.values())):
        return
    if args.json:
        print(f"sparkpoint run: requests after the last checkpoint: {json.dumps(left.to_json())}", file=sys.stderr)
    else:
        logging.getLogger("sparkpoint").info("requests after the last checkpoint: %s input=%s", left.line(),
                                             dict(left.input_requests))


def _follow_options(args: argparse.Namespace) -> FollowOptions | None:
    """The `--follow` settings (None without `--follow`), checked before anything starts."""
    following = {"--checkpoint-interval": args.checkpoint_interval, "--poll-interval": args.poll_interval,
                 "--idle-seconds": args.idle_seconds}
    if not args.follow:
        given = [flag for flag, value in following.items() if value is not None]
        if given:
            raise UsageError(f"{', '.join(given)} only apply with --follow")
        return None
    if args.tick:
        raise UsageError("--tick and --follow do not go together: --follow waits for input instead of making a "
                         "checkpoint of no input")
    from sparkpoint.pipeline.follow import POLL_SECONDS, FollowOptions, check_follow_options

    options = FollowOptions(
        checkpoint_interval=args.checkpoint_interval or 0.0,
        poll_seconds=args.poll_interval if args.poll_interval is not None else POLL_SECONDS,
        idle_seconds=args.idle_seconds,
    )
    problems = check_follow_options(options)
    if problems:
        raise UsageError("; ".join(problems))
    return options


class _Terminated:
    """Whether SIGTERM stopped the run (truthy once it arrived)."""

    def __init__(self) -> None:
        self.arrived = False

    def __bool__(self) -> bool:
        return self.arrived


def _stop_on_sigterm() -> _Terminated:
    """SIGTERM (a service manager, `kill`, a container stopping) stops `run --follow` as a Ctrl-C
    does: the batch in flight is abandoned, one line is said, the exit status is 143."""
    from sparkpoint.spark.session import request_interrupt

    terminated = _Terminated()

    def on_term(signum: int, frame: object) -> None:
        terminated.arrived = True
        request_interrupt()
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    return terminated


def cmd_skip(args: argparse.Namespace) -> int:
    """Consume one unconsumed input file without processing it, recorded as skipped with the
    reason: one checkpoint through the same protocol as a batch, its subtasks run here (no JVM)."""
    from sparkpoint.pipeline.driver import StatefulPipeline
    from sparkpoint.pipeline.skipping import skip_file

    pipeline_spec, config, _ = run_config(args)
    pipeline = StatefulPipeline(None, config, pipeline_spec.operators)
    pipeline.check_start()  # the operators and their states against the checkpoint, as `run` does first
    report, _ = skip_file(pipeline, args.file, args.reason)
    if args.json:
        print_json(report.to_json())
    else:
        print(report.line())
        print(f"{args.file} is consumed as skipped; `sparkpoint run` goes on with the next file")
    return 0
