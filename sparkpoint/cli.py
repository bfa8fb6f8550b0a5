"""The `sparkpoint` command: generate, run, skip, state, diff, verify, gc, list, inspect, registry, restore,
savepoint, bootstrap.

Also `check-upgrade`: what restoring a checkpoint into a changed pipeline would do, before running it.
Exit status: 0 fine, 1 `verify` found bad files or `check-upgrade` a restore that would be refused,
2 bad input (the message says what to fix), 3 the work failed while running (e.g. a Spark task
raised; the message names the cause).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from sparkpoint.checkpoint.catalog import existing_store, readable_size
from sparkpoint.checkpoint.errors import OperatorStateMismatch, SparkpointError
from sparkpoint.checkpoint.metadata import CheckpointMetadata, iso_micros
from sparkpoint.checkpoint.progress import ProgressFn
from sparkpoint.checkpoint.storage import CheckpointStorage, storage_url
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.pipeline.settings import BY_NAME, flagged, positive_int, seconds

if TYPE_CHECKING:
    from sparkpoint.pipeline.spec import Pipeline
    from sparkpoint.state.operators import KeyedOperator

EXIT_BAD_FILES = 1
EXIT_REFUSED = 1  # check-upgrade: the restore would be refused
EXIT_BAD_INPUT = 2
EXIT_FAILED = 3
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a Ctrl-C
EXIT_TERMINATED = 143  # 128 + SIGTERM: `run --follow` stopped by SIGTERM


class UsageError(Exception):
    pass


def _storage_options(text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"--storage-options must be a JSON object: {e}") from e
    if not isinstance(value, dict):
        raise UsageError("--storage-options must be a JSON object, e.g. '{\"anon\": false}'")
    return value


def _storage(args: argparse.Namespace) -> CheckpointStorage:
    pipeline = _pipeline(args)
    if pipeline is None:
        if not (args.checkpoints and args.job_id):
            raise UsageError("--checkpoints and --job-id are required (or --pipeline MODULE:ATTR, which names them)")
        return CheckpointStorage(args.checkpoints, args.job_id, _storage_options(args.storage_options))
    checkpoints = args.checkpoints or pipeline.location("checkpoints")
    job_id = args.job_id or pipeline.effective_job_id
    options = _storage_options(args.storage_options) if args.storage_options else dict(pipeline.storage_options)
    return CheckpointStorage(checkpoints, job_id, options)


def _existing_store(args: argparse.Namespace) -> CompletedCheckpointStore:
    return existing_store(_storage(args))


def _checkpoints(store: CompletedCheckpointStore, wanted: int | None) -> list[CheckpointMetadata]:
    if wanted is not None:
        return [store.load(wanted)]
    listing = store.load_all()
    if listing.unreadable:
        raise SparkpointError(
            "; ".join(f"chk-{c}/_metadata cannot be read: {why}" for c, why in sorted(listing.unreadable.items()))
        )
    if not listing.checkpoints:
        raise UsageError(f"{store.storage.job_url} holds no completed checkpoint")
    return listing.checkpoints


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=1, default=str))


def _printed_json(args: argparse.Namespace, data: Any) -> bool:
    """With --json, print `data` as JSON (and the caller prints nothing else)."""
    if args.json:
        _print_json(data)
    return bool(args.json)


# --- terminal output: rich tables, and progress bars on a terminal only ------------------------


def _console(*, stderr: bool = False) -> Any:
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    # In a pipe rich would assume 80 columns and squeeze the tables; a file gets whole lines.
    return Console(file=stream, width=None if stream.isatty() else 200, highlight=False)


def _table(title: str | None, columns: Sequence[str], rows: Sequence[Sequence[Any]], *, right: int = 0) -> None:
    """Print a table; the last `right` columns (numbers) are right-aligned."""
    from rich.table import Table
    from rich.text import Text

    table = Table(header_style="bold")
    for i, name in enumerate(columns):
        table.add_column(name, justify="right" if i >= len(columns) - right else "left", overflow="fold")
    for row in rows:  # as Text: a value with `[` (a file name, a reason) is printed literally, never as markup
        table.add_row(*(Text("" if v is None else str(v)) for v in row))
    console = _console()
    if title:  # above the table, not as its title: a title wider than the table would wrap
        console.print(title, markup=False)
    console.print(table)


def _range(key_groups: dict[str, int]) -> str:
    return f"{key_groups['start']}..{key_groups['end']}"


def _size(n: int | None) -> str:
    return "" if n is None else readable_size(n)


@contextmanager
def _progress(args: argparse.Namespace, what: str) -> Iterator[ProgressFn | None]:
    """A rich progress bar of bytes on standard error when it is a terminal and `--json` is off; else
    None. The function it yields takes (bytes done, bytes in total), total 0 when it is not known."""
    if getattr(args, "json", False) or not sys.stderr.isatty():
        yield None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), console=_console(stderr=True)) as bar:
        task = bar.add_task(what, total=None)

        def update(done: int, total: int) -> None:  # total 0: not known in advance
            bar.update(task, completed=done, total=total or None)

        yield update


# --- commands ------------------------------------------------------------------------------------


MASTER_HELP = ("Spark master URL; default: the warm local Spark (a Spark Connect server on 127.0.0.1 that "
               "sparkpoint starts once and keeps warm; SPARKPOINT_WARM_SPARK=off, or local[2], runs Spark in "
               "this process)")

def cmd_generate(args: argparse.Namespace) -> int:
    from sparkpoint.spark.generate import generate

    files = generate(
        args.out, batches=args.batches, events_per_batch=args.events_per_batch, users=args.users,
        items=args.items, seed=args.seed, first=args.first, storage_options=_storage_options(args.storage_options),
    )
    if args.json:
        _print_json({"files": files})
    else:
        print(f"wrote {len(files)} batches of {args.events_per_batch} events to {args.out}")
    return 0


def _run_config(args: argparse.Namespace) -> tuple[Any, Any, str | None]:
    """(the pipeline, its settings with the flags and `--conf` on top, the Spark Connect URL) of
    `run` and `skip`: a flag wins over `--conf`, which wins over the pipeline's own setting."""
    from sparkpoint.pipeline.settings import resolve_settings

    conf = dict(_key_value(c) for c in args.conf)
    remote = getattr(args, "remote", None) or conf.pop("spark.remote", None) or os.environ.get("SPARK_REMOTE") or None
    settings = resolve_settings(conf)
    pipeline_spec = _pipeline(args)
    if pipeline_spec is None:
        missing = [flag for flag, value in (("--input", args.input), ("--checkpoints", args.checkpoints),
                                            ("--job-id", args.job_id)) if not value]
        if missing:
            raise UsageError(f"{', '.join(missing)} required (or --pipeline MODULE:ATTR, which names them)")
        pipeline_spec = _sample_pipeline()
    flag = {"input_url": "input", "checkpoints_url": "checkpoints", "job_id": "job_id", "output_url": "output",
            "max_batches": "max_batches", "local_dir": "local_dir",
            **{setting.name: setting.flag.dest for setting in flagged() if setting.flag}}
    flags = {setting: getattr(args, name, None) for setting, name in flag.items()}
    if args.storage_options:
        options = _storage_options(args.storage_options)
        flags.update(storage_options=options, input_options=options)
    if "checkpoints_dir" in settings:
        settings["checkpoints_url"] = settings.pop("checkpoints_dir")
    chosen = {**settings, **{k: v for k, v in flags.items() if v is not None}}
    for key in ("input_url", "checkpoints_url", "output_url", "local_dir"):
        if chosen.get(key):
            chosen[key] = storage_url(chosen[key]) if key != "local_dir" else chosen[key]
    return pipeline_spec, pipeline_spec.config(**chosen), remote


def _sample_pipeline() -> Pipeline:
    """What `run` and `skip` run without `--pipeline` (the documented default): the sample
    pipeline's operators, at the locations the flags give, without its output."""
    from sparkpoint.sample import pipeline

    return pipeline.with_(local_dir=".sparkpoint/local", output_url=None)


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
    from sparkpoint.pipeline.driver import StatefulPipeline
    from sparkpoint.spark.session import session_key, spark_session

    follow = _follow_options(args)
    pipeline_spec, config, remote = _run_config(args)
    pipeline = StatefulPipeline(None, config, pipeline_spec.operators)  # checks input and storage before Spark
    plan = pipeline.restore_plan()  # from `_metadata` alone: a refused restore stops here, nothing written
    if plan is not None:
        if not plan.ok:
            raise OperatorStateMismatch(plan.refusal(op.name for op in pipeline.operators))
        said = sys.stderr if args.json else sys.stdout
        print(f"sparkpoint run: {plan.decision()}", file=said, flush=True)
        if plan.rescaling():  # a parallelism the user set that differs from the checkpoint's
            print(plan.rescaling(), file=said, flush=True)
    if follow is None:
        # Every check of the first batch's files, from their footers, before Spark (a bad file under
        # on_bad_file="fail" stops here: nothing started, nothing uploaded); the batch reuses them.
        # A failing file that may still be landing ends the batch before it (`next_batch`).
        # (Following, the loop waits for such a file to settle.)
        pipeline.check_batch(pipeline.next_batch())
    pipeline.check_start()  # the operators and their states' schemas against the checkpoint, before Spark
    terminated = _stop_on_sigterm() if follow is not None else None
    # On Spark Connect (the warm local Spark by default) the runs of one job and code share a
    # server session, whose Python workers stay warm between runs.
    pipeline.spark = spark_session(args.master, verbose=args.verbose, remote=remote,
                                   share=session_key(config.job_id, pipeline.operators))

    uploaded = 0

    def show(report: Any) -> None:
        nonlocal uploaded
        print(json.dumps(report.to_json()) if args.json else report.line(), flush=True)
        uploaded += report.checkpointed_size
        if progress is not None:  # the bytes the subtasks uploaded, checkpoint by checkpoint
            progress(uploaded, 0)

    try:
        with _progress(args, "checkpoints uploaded") as progress:
            if follow is not None:
                from sparkpoint.pipeline.follow import follow as follow_input

                reports = []
                for done in follow_input(pipeline, follow):
                    show(done.report)
                    reports.append(done.report)
            else:
                reports = pipeline.run(on_checkpoint=show, tick=args.tick)
    except BaseException as e:
        from sparkpoint.spark.session import interrupted, stop_quietly

        if not isinstance(e, KeyboardInterrupt) and not interrupted():
            pipeline.spark.stop()
            raise
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C does not break the clean-up
        if terminated is not None:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stop_quietly(pipeline.spark)
        from sparkpoint.pipeline.maintenance import interruption_summary

        how = "terminated (SIGTERM)" if terminated is not None and terminated else "interrupted"
        print(f"sparkpoint run: {interruption_summary(pipeline.storage).replace('interrupted', how, 1)}",
              file=sys.stderr)
        return EXIT_TERMINATED if terminated else EXIT_INTERRUPTED
    pipeline.spark.stop()
    if follow is not None:
        if not args.json:
            print(f"sparkpoint run: following stopped after {len(reports)} checkpoint{'s' * (len(reports) != 1)}",
                  file=sys.stderr)
        return 0
    if not reports and not args.json:  # a file that may still be landing was warned of above
        print("no batch taken: the next unconsumed file may still be being written" if pipeline.waiting_for
              else "no unconsumed batch: nothing to do")
    empty = pipeline.source.nothing_to_read()
    if empty:
        print(f"sparkpoint run: warning: {empty}", file=sys.stderr)
    return 0


def _follow_options(args: argparse.Namespace) -> Any:
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

    pipeline_spec, config, _ = _run_config(args)
    pipeline = StatefulPipeline(None, config, pipeline_spec.operators)
    pipeline.check_start()  # the operators and their states against the checkpoint, as `run` does first
    report, _ = skip_file(pipeline, args.file, args.reason)
    if args.json:
        _print_json(report.to_json())
    else:
        print(report.line())
        print(f"{args.file} is consumed as skipped; `sparkpoint run` goes on with the next file")
    return 0


def cmd_check_upgrade(args: argparse.Namespace) -> int:
    """What restoring a checkpoint into the pipeline given would do, from its `_metadata` alone
    (no Spark, no state file): the same plan `run` makes before it starts."""
    from sparkpoint.pipeline.runtime import load_external_checkpoint, plan_for, restore_plan, validate_config

    pipeline = _given_pipeline(args)
    if args.source and (args.checkpoints or args.job_id):
        raise UsageError("give --from, or --checkpoints and --job-id, not both")
    if bool(args.checkpoints) != bool(args.job_id):
        raise UsageError("--checkpoints and --job-id go together (without them: the pipeline's own job)")
    overrides: dict[str, Any] = {k: v for k, v in {
        "parallelism": args.parallelism, "max_parallelism": args.max_parallelism,
        "allow_non_restored_state": args.allow_non_restored_state or None,
        "allow_new_operators": args.allow_new_operators or None,
        "storage_options": _storage_options(args.storage_options) if args.storage_options else None,
    }.items() if v is not None}
    if args.checkpoints:  # that job's latest checkpoint, as a run with these locations would restore it
        overrides.update(checkpoints_url=storage_url(args.checkpoints), job_id=args.job_id, from_checkpoint=None)
    config = pipeline.config(**overrides)
    validate_config(config)
    plan = (plan_for(load_external_checkpoint(args.source, config.storage_options)[0], config, pipeline.operators)
            if args.source else restore_plan(config, pipeline.operators))
    if plan is None:
        return _printed_plan(args, None, f"{config.checkpoints_url}/{config.job_id} holds no completed checkpoint "
                                         "(and no --from-checkpoint is set): the job starts empty")
    return _printed_plan(args, plan, "\n".join(plan.lines()))


def _printed_plan(args: argparse.Namespace, plan: Any, text: str) -> int:
    if args.json:
        _print_json(plan.to_json() if plan is not None else {"checkpoint_id": None, "ok": True, "operators": [],
                                                             "summary": text})
    else:
        print(text)
    return 0 if plan is None or plan.ok else EXIT_REFUSED


def cmd_state(args: argparse.Namespace) -> int:
    from sparkpoint.api import state_table

    with _progress(args, f"reading {args.operator}") as progress:
        # --raw needs no code: the operator may be gone from the pipeline (removed, renamed).
        pipeline = None if args.raw else _pipeline(args)
        operator = args.operator if args.raw else _operator(pipeline, args.operator)
        meta, table = state_table(_storage(args), operator, args.checkpoint, progress=progress, raw=args.raw)
    if args.raw and args.format != "json":  # one column of mixed values: JSON text for csv and parquet
        table["value"] = [_json_text(v) for v in table["value"]]
        for column in ("key", "user_key"):
            table[column] = [v.hex() if isinstance(v, bytes) else v for v in table[column]]
    if args.format == "parquet":
        if not args.out:
            raise UsageError("--format parquet needs --out FILE")
        table.to_parquet(args.out, index=False)
    elif args.format == "json":
        text = table.to_json(orient="records", date_format="iso", date_unit="us", lines=False)
        _write_text(args.out, text + "\n")
    else:
        _write_text(args.out, table.to_csv(index=False))
    if args.out:
        print(f"chk-{meta.checkpoint_id}: {len(table)} rows of {args.operator} written to {args.out}", file=sys.stderr)
    return 0


def _operator(pipeline: Pipeline | None, name: str) -> KeyedOperator:
    """The operator `name` of the `--pipeline` given, else of the sample pipeline (the commands'
    documented default: `sparkpoint state --checkpoints ... --job-id clicks --operator user_totals`)."""
    if pipeline is not None:
        return pipeline.operator(name)
    from sparkpoint.sample import operator as sample_operator

    return sample_operator(name)


def _json_text(value: Any) -> str:
    """A raw state value as JSON text (bytes as hex, timestamps in ISO 8601)."""
    def plain(v: Any) -> Any:
        if isinstance(v, bytes):
            return v.hex()
        if hasattr(v, "isoformat"):
            return v.isoformat()
        return str(v)

    return json.dumps(value, default=plain, ensure_ascii=False)


def cmd_diff(args: argparse.Namespace) -> int:
    from sparkpoint.state.diff import diff_snapshots, locate

    pipeline = _pipeline(args)
    operator = _operator(pipeline, args.operator)
    needs_job = any(str(ref).strip().removeprefix("chk-").isdigit() for ref in (args.from_, args.to))
    storage = _storage(args) if needs_job or pipeline is not None or args.checkpoints else None
    options = _storage_options(args.storage_options) if args.storage_options else (
        storage.storage_options if storage is not None else None)
    local_dir = args.local_dir or (pipeline.location("local") if pipeline is not None else None)
    result = diff_snapshots(locate(args.from_, storage, options), locate(args.to, storage, options), operator,
                            local_dir=local_dir)
    table, summary = result.table, result.summary()
    if args.json and not args.out:
        records = json.loads(table.to_json(orient="records", date_format="iso", date_unit="us"))
        _print_json({**summary, "rows": records})
        return 0
    fmt = args.format or _format_of(args.out)
    if fmt == "parquet":
        if not args.out:
            raise UsageError("--format parquet needs --out FILE")
        table.to_parquet(args.out, index=False)
    elif fmt == "json":
        _write_text(args.out, table.to_json(orient="records", date_format="iso", date_unit="us") + "\n")
    else:
        _write_text(args.out, table.to_csv(index=False))
    counts = ", ".join(f"{n} {c}" for c, n in summary["changes"].items())
    how = summary["method"] + (f" ({summary['reason']})" if summary["reason"] else "")
    print(f"{operator.name} chk-{result.source.meta.checkpoint_id} -> chk-{result.target.meta.checkpoint_id}: "
          f"{counts}; by {how}; {_size(summary['bytes_read'])} read"
          + (f" to {args.out}" if args.out else ""), file=sys.stderr)
    return 0


def _format_of(path: str | None) -> str:
    suffix = os.path.splitext(path or "")[1].lower()
    return {".parquet": "parquet", ".json": "json"}.get(suffix, "csv")


def cmd_verify(args: argparse.Namespace) -> int:
    from sparkpoint.pipeline.maintenance import verify_checkpoints

    store = _existing_store(args)
    unreadable: dict[int, str] = {}
    if args.checkpoint is None:
        listing = store.load_all()
        checkpoints, unreadable = listing.checkpoints, listing.unreadable
        if not checkpoints and not unreadable:
            raise UsageError(f"{store.storage.job_url} holds no completed checkpoint")
    else:
        checkpoints = [store.load(args.checkpoint)]
    repair = _repair(store, checkpoints, args) if args.repair else None
    report = verify_checkpoints(store.storage, checkpoints, unreadable, deep=not args.shallow)
    if args.json:
        results = report.checkpoints_json()
        _print_json(results if repair is None else {"checkpoints": results, **repair})
    else:
        print("\n".join(report.lines()))
    return 0 if report.ok else EXIT_BAD_FILES


def _repair(store: CompletedCheckpointStore, checkpoints: list[CheckpointMetadata], args: argparse.Namespace) -> Any:
    """`verify --repair`: rewrite bad primary files from good task-local copies, before verifying."""
    from sparkpoint.state.engine.repair import repair_checkpoints

    retained = store.load_all().checkpoints if args.checkpoint is not None else checkpoints
    report = repair_checkpoints(store.storage, args.local_dir, checkpoints, deep=not args.shallow, retained=retained)
    if not args.json:
        for f in report.repaired:
            print(f"repaired {f.path} from the task-local copy {f.source}")
    for message in report.lost:
        print(f"sparkpoint verify: error: {message}", file=sys.stderr)
    return {"repaired": [{"path": f.path, "source": f.source} for f in report.repaired],
            "unrepairable": report.unrepairable, "lost": report.lost}


def cmd_gc(args: argparse.Namespace) -> int:
    from sparkpoint.checkpoint.sweep import sweep_orphans
    from sparkpoint.pipeline.attempt import pending_paths

    storage = _existing_store(args).storage
    # The uploads of attempts still pending (a step between its two halves) are kept, as the
    # Dagster prune keeps them: deleting them would fail that attempt's checkpoint step.
    report = sweep_orphans(storage, grace_seconds=args.grace, dry_run=args.dry_run,
                           pending_paths=pending_paths(storage))
    for link in report.symlinks:
        print(f"warning: {link.path} is a symbolic link; it is neither followed nor deleted", file=sys.stderr)
    if args.json:
        _print_json({"dry_run": args.dry_run, "orphans": [f.path for f in report.orphans],
                     "bytes": report.orphan_bytes, "referenced": report.referenced,
                     "symlinks": [f.path for f in report.symlinks],
                     "young": [f.path for f in report.young], "young_bytes": report.young_bytes})
    else:
        verb = "would delete" if args.dry_run else "deleted"
        for f in report.orphans:
            print(f"{verb} {f.path} ({f.size} bytes)")
        print(f"{verb} {len(report.orphans)} orphan files, {report.orphan_bytes} bytes")
        if report.young:
            print(f"kept {len(report.young)} unreferenced files ({_size(report.young_bytes)}) younger than the grace "
                  f"period ({args.grace:g} s): a running job may still be writing them; with no job of "
                  f"{storage.job_id} running, include them with --grace 0")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from sparkpoint.checkpoint.catalog import checkpoint_rows

    storage = _storage(args)
    rows, unreadable = checkpoint_rows(storage)
    if _printed_json(args, {"checkpoints": rows, "unreadable": unreadable}):
        return 0
    _table(
        f"{len(rows)} retained checkpoint(s) of {storage.job_id}",
        ["id", "kind", "created", "restored from", "skipped input", "state size", "checkpointed size", "files"],
        [[f"chk-{r['checkpoint_id']}", r["kind"], r["created_at"],
          f"{r['restored_from']} ({r['claim_mode']})" if r["restored_from"] else "",
          ", ".join(s["file"] for s in r["skipped_files"]),
          _size(r["state_size"]), _size(r["checkpointed_size"]), r["files"]] for r in rows],
        right=3,
    )
    for r in rows:
        for s in r["skipped_files"]:
            print(f"chk-{r['checkpoint_id']} skipped {s['file']}: {s['check']}: {s['reason']}")
    for cid, why in unreadable.items():
        print(f"chk-{cid} UNREADABLE: {why}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from sparkpoint.checkpoint.catalog import describe_checkpoint, load_checkpoint_at

    info = describe_checkpoint(load_checkpoint_at(args.path, _storage_options(args.storage_options)))
    if _printed_json(args, info):
        return 0
    lineage = f", restored from {info['restored_from']} ({info['claim_mode']})" if info["restored_from"] else ""
    print(f"{info['path']}\n  chk-{info['checkpoint_id']} {info['kind']} of job {info['job_id']}, created "
          f"{info['created_at']}{lineage}\n  state {_size(info['state_size'])}, checkpointed "
          f"{_size(info['checkpointed_size'])}, {info['files']} files ({info['files_new']} new, "
          f"{info['files_reused']} reused)")
    if info["watermark"] is not None:
        print(f"  watermark {info['watermark']}")
    if info["read"] is not None:
        read = info["read"]
        times = f" ({read['bytes_read'] / read['batch_bytes']:.2f}x)" if read["batch_bytes"] else ""
        print(f"  batch routed by {read['routing']}: read {_size(read['bytes_read'])} of "
              f"{_size(read['batch_bytes'])}{times}")
    if info["skipped_files"]:
        _table(f"{len(info['skipped_files'])} input file(s) consumed without being processed (skipped)",
               ["file", "skipped by", "check", "reason"],
               [[s["file"], f"chk-{s['checkpoint_id']}", s["check"], s["reason"]] for s in info["skipped_files"]])
    for uid, op in info["operators"].items():
        name = uid if op["name"] == uid else f"{op['name']} (uid {uid})"
        _table(
            f"operator {name}: parallelism {op['parallelism']}, max parallelism {op['max_parallelism']}",
            ["subtask", "key groups", "files", "size"],
            [[s["subtask"], _range(s["key_group_range"]), len(s["shared"]) + len(s["private"]),
              _size(s["state_size"])] for s in op["subtasks"]],
            right=2,
        )
        if "states" in op:
            earliest = f", earliest {iso_micros(op['timers_earliest'])}" if op["timers_earliest"] is not None else ""
            _table(
                f"operator {name}: {op['entries']} entries; timers pending {op['timers_pending']}{earliest}, fired "
                f"{op['timers_fired']}; expired entries removed {op['expired_removed']} (this checkpoint's batch)",
                ["state", "kind", "TTL", "entries"],
                [[state, fact["kind"], _ttl(fact["ttl"]), fact["entries"]] for state, fact in op["states"].items()],
                right=1,
            )
        _table(
            None, ["subtask", "file", "path", "shared", "created by", "size"],
            [[s["subtask"], f["local_name"], f["path"], "yes" if group == "shared" else "no",
              f"chk-{f['created_by']}", _size(f["size"])]
             for s in op["subtasks"] for group in ("shared", "private") for f in s[group]],
            right=1,
        )
    return 0


def cmd_registry(args: argparse.Namespace) -> int:
    from sparkpoint.checkpoint.catalog import registry_rows

    rows, totals = registry_rows(_storage(args))
    if _printed_json(args, {"files": rows, "totals": totals}):
        return 0
    _table(
        f"shared-state registry of {args.job_id}, rebuilt from checkpoints {totals['checkpoints']}",
        ["path", "kind", "owned", "created by", "last used", "references", "size"],
        [[r["path"], r["kind"], "yes" if r["owned"] else "no (NO_CLAIM)", f"chk-{r['created_by']}",
          f"chk-{r['last_used']}", r["count"], _size(r["size"])] for r in rows],
        right=2,
    )
    print(f"{totals['files']} files ({totals['shared_files']} shared), {_size(totals['bytes'])}, "
          f"{totals['references']} references; owned: {totals['owned_files']} files, {_size(totals['owned_bytes'])}")
    for reason in totals["deletion_blocked"]:
        print(f"deletion blocked: {reason}")
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    from sparkpoint.state.extract import restore_subtask

    store = _existing_store(args)
    meta = _checkpoints(store, args.checkpoint)[0]
    with _progress(args, f"restoring {args.operator}/{args.subtask}") as progress:
        info = restore_subtask(store.storage, meta, args.operator, args.subtask, args.to, progress=progress)
    if _printed_json(args, info):
        return 0
    states = ", ".join(f"{name}: {n} entries" for name, n in info["states"].items()) or "no state"
    print(f"chk-{info['checkpoint_id']} {info['operator']} subtask {info['subtask']} (key groups "
          f"{_range(info['key_group_range'])}): {info['files']} files verified, "
          f"{_size(info['downloaded_bytes'])} -> {info['directory']}\n  {states}\n"
          f"  open it with: Rdict({info['directory']!r}, access_type=AccessType.read_only())")
    return 0


def cmd_savepoint(args: argparse.Namespace) -> int:
    from sparkpoint.checkpoint.savepoint import take_savepoint

    storage = _existing_store(args).storage
    with _progress(args, "savepoint") as progress:
        result = take_savepoint(storage, checkpoint_id=args.from_checkpoint, target=args.to, progress=progress)
    if _printed_json(args, result.to_json()):
        return 0
    print(f"{result.message}\n  start a job from it: sparkpoint run --from-checkpoint {result.url} "
          "--restore-mode CLAIM|NO_CLAIM ...")
    return 0


def _ttl(ttl: dict[str, Any] | None) -> str:
    return "-" if ttl is None else f"{ttl['seconds']:g}s {ttl['clock']} time, {ttl['update']}"


def cmd_bootstrap(args: argparse.Namespace) -> int:
    from sparkpoint.pipeline.bootstrap import plan_bootstrap

    pipeline = _given_pipeline(args)
    options = _storage_options(args.storage_options) if args.storage_options else None
    # Every check that needs no Spark (operator, table, target) before the JVM starts.
    plan = plan_bootstrap(pipeline, args.operator, args.source, args.to, parallelism=args.parallelism,
                          storage_options=options, source_options=options)
    from sparkpoint.spark.session import spark_session, stop_quietly

    spark = spark_session(args.master, verbose=args.verbose)
    try:
        result = plan.run(spark)
    except KeyboardInterrupt:
        stop_quietly(spark)  # the claimed target is removed on the way out (plan.run)
        raise
    except BaseException:
        spark.stop()
        raise
    spark.stop()
    if _printed_json(args, result.to_json()):
        return 0
    # Standard output is the savepoint alone, for `--from-checkpoint "$(sparkpoint bootstrap ...)"`.
    print(result.url)
    print(f"savepoint {result.url}: {result.operator} bootstrapped from {result.rows} rows at parallelism "
          f"{plan.parallelism}, the other operators empty; {result.files} files, {_size(result.bytes)}\n"
          f"  start the job from it: sparkpoint run --pipeline {args.pipeline} --from-checkpoint {result.url}",
          file=sys.stderr)
    return 0


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise UsageError(f"--conf takes KEY=VALUE, got {text!r}")
    return key.strip(), value.strip()


def _write_text(path: str | None, text: str) -> None:
    if path:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)


# --- parser --------------------------------------------------------------------------------------


_seconds, _positive = seconds, positive_int  # a flag's value: as the settings' flags check them


def _job_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pipeline", metavar="MODULE:ATTR",
                   help="your sparkpoint.Pipeline: its operators, locations and settings (flags override them)")
    BY_NAME["checkpoints_dir"].flag.add_to(p)  # type: ignore[union-attr]
    p.add_argument("--job-id", metavar="ID", help="the job's directory under the storage URL; default: the pipeline's")
    p.add_argument("--storage-options", metavar="JSON", help="fsspec storage options as a JSON object")


def _pipeline(args: argparse.Namespace) -> Pipeline | None:
    """The `--pipeline` given (None without one), loaded once."""
    if not getattr(args, "pipeline", None):
        return None
    if not hasattr(args, "_loaded_pipeline"):
        from sparkpoint.pipeline.spec import load_pipeline

        args._loaded_pipeline = load_pipeline(args.pipeline)
    loaded: Pipeline = args._loaded_pipeline
    return loaded


def _given_pipeline(args: argparse.Namespace) -> Pipeline:
    """The `--pipeline` of a command that requires one."""
    pipeline = _pipeline(args)
    if pipeline is None:
        raise UsageError("--pipeline MODULE:ATTR is required")
    return pipeline


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparkpoint", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="show what happens, Spark's and py4j's own logs included")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="write the sample event stream")
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--batches", type=_positive, required=True)
    p.add_argument("--events-per-batch", type=_positive, required=True)
    p.add_argument("--users", type=_positive, required=True)
    p.add_argument("--items", type=_positive, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--first", type=int, default=0, help="index of the first batch (to append more later)")
    p.add_argument("--storage-options", metavar="JSON")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_generate)

    p = sub.add_parser("run", help="process every unconsumed batch, one checkpoint per batch")
    p.add_argument("--input", metavar="DIR", help="directory of Parquet files (fsspec URL); required without "
                   "--pipeline")
    _job_args(p)
    p.add_argument("--output", metavar="URL", help="exactly-once Parquet output of the operators' changed rows")
    p.add_argument("--max-batches", type=_positive)
    p.add_argument("--local-dir", metavar="DIR", help="working RocksDB instances (default .sparkpoint/local, "
                   "with --pipeline .sparkpoint/<name>/local)")
    p.add_argument("--master", metavar="URL", help=MASTER_HELP)
    p.add_argument("--remote", metavar="sc://HOST:PORT",
                   help="attach to a running Spark through Spark Connect instead of starting one "
                        "(also --conf spark.remote=... or SPARK_REMOTE)")
    p.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE",
                   help="a setting, Flink's keys accepted (e.g. state.checkpoints.num-retained=3)")
    for setting in flagged():  # one flag per setting that has one: sparkpoint.pipeline.settings.SETTINGS
        setting.flag.add_to(p)  # type: ignore[union-attr]
    p.add_argument("--tick", action="store_true",
                   help="with no unconsumed batch, one checkpoint of no input: processing time advances, due "
                        "timers fire, TTL state expires")
    p.add_argument("--follow", action="store_true",
                   help="keep one Spark session and watch the input: each landed batch is checkpointed as it "
                        "arrives, until Ctrl-C or SIGTERM (or --max-batches, --idle-seconds)")
    p.add_argument("--checkpoint-interval", type=_seconds, metavar="SECONDS",
                   help="with --follow: start a checkpoint at most every SECONDS; files that land faster go into "
                        "one checkpoint (at most --files-per-checkpoint of them when set above 1, else 1000)")
    p.add_argument("--poll-interval", type=_seconds, metavar="SECONDS",
                   help="with --follow: how often to look for new files while idle (default 0.2)")
    p.add_argument("--idle-seconds", type=_seconds, metavar="SECONDS",
                   help="with --follow: stop once no file has been pending for SECONDS (default: never)")
    p.add_argument("--json", action="store_true", help="one JSON object per checkpoint")
    p.set_defaults(fn=cmd_run)

    p = sub.add_parser("skip", help="consume one unconsumed input file without processing it, recorded as skipped "
                       "with a reason: a checkpoint of no input (no Spark)")
    p.add_argument("file", metavar="FILE", help="the file's name in the input directory (as the run's error names it)")
    p.add_argument("--reason", required=True, metavar="TEXT", help="why it is skipped (one line; kept in _metadata)")
    p.add_argument("--input", metavar="DIR", help="directory of Parquet files (fsspec URL); required without "
                   "--pipeline")
    _job_args(p)
    p.add_argument("--output", metavar="URL", help="the exactly-once output, as the runs write it")
    p.add_argument("--local-dir", metavar="DIR", help="working RocksDB instances, as the runs use them")
    p.add_argument("--parallelism", type=_positive, help="subtasks per operator, as the runs use them")
    p.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE",
                   help="a setting, as `run` takes it (Flink's keys accepted)")
    p.add_argument("--json", action="store_true", help="the checkpoint as one JSON object")
    p.set_defaults(fn=cmd_skip)

    p = sub.add_parser("check-upgrade", help="what restoring a checkpoint into a (new) pipeline would do, per "
                       "operator, from its _metadata alone; exit 1 when the restore would be refused")
    p.add_argument("--pipeline", required=True, metavar="MODULE:ATTR", help="the pipeline to restore into")
    p.add_argument("--from", dest="source", metavar="CHECKPOINT_OR_SAVEPOINT_URL",
                   help="<checkpoints-dir>/<job-id>/chk-<N> (or its _metadata)")
    p.add_argument("--checkpoints", metavar="URL", help="with --job-id: that job's latest checkpoint "
                   "(default without --from: the pipeline's own job, as `run` would restore it)")
    p.add_argument("--job-id", metavar="ID")
    p.add_argument("--storage-options", metavar="JSON", help="fsspec storage options (default: the pipeline's)")
    p.add_argument("--parallelism", type=_positive,
                   help="the new job's (default: the pipeline's, or the checkpoint's when it sets none)")
    p.add_argument("--max-parallelism", type=_positive, help="the new job's (default: the pipeline's)")
    p.add_argument("--allow-non-restored-state", action="store_true",
                   help="as `run`: state of operators the pipeline lacks may be dropped")
    p.add_argument("--allow-new-operators", action="store_true",
                   help="as `run`: operators the checkpoint lacks may start empty")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_check_upgrade)

    p = sub.add_parser("state", help="export an operator's state at a checkpoint as a table")
    _job_args(p)
    p.add_argument("--operator", required=True, metavar="OP")
    p.add_argument("--checkpoint", type=_positive, metavar="N", help="default: the latest")
    p.add_argument("--format", choices=["csv", "parquet", "json"], default="csv")
    p.add_argument("--out", metavar="FILE", help="default: standard output (csv, json)")
    p.add_argument("--raw", action="store_true",
                   help="every state through the codec _metadata recorded, one row per entry; needs no operator "
                        "code (an operator removed or renamed stays readable)")
    p.set_defaults(fn=cmd_state)

    p = sub.add_parser("diff", help="the rows of an operator's state that differ between two snapshots")
    _job_args(p)
    p.add_argument("--operator", required=True, metavar="NAME")
    p.add_argument("--from", required=True, dest="from_", metavar="ID_OR_URL",
                   help="the older snapshot: a checkpoint id of the job, or a checkpoint/savepoint URL (…/chk-<N>)")
    p.add_argument("--to", required=True, metavar="ID_OR_URL", help="the newer snapshot, likewise")
    p.add_argument("--json", action="store_true", help="the summary and the rows as one JSON object")
    p.add_argument("--out", metavar="FILE", help="write the rows to FILE (csv, parquet or json by its extension)")
    p.add_argument("--format", choices=["csv", "parquet", "json"], help="of --out or standard output (default csv)")
    p.add_argument("--local-dir", metavar="DIR",
                   help="the job's local directory: verified task-local copies stand in for downloads")
    p.set_defaults(fn=cmd_diff)

    p = sub.add_parser("verify", help="check every file of the checkpoint(s): present, size, CRC32")
    _job_args(p)
    p.add_argument("--checkpoint", type=_positive, metavar="N", help="default: every retained checkpoint")
    p.add_argument("--shallow", action="store_true", help="check sizes only, do not read the files")
    p.add_argument("--repair", action="store_true",
                   help="rewrite missing or damaged files from task-local copies with the recorded size and CRC32")
    p.add_argument("--local-dir", default=".sparkpoint/local", metavar="DIR",
                   help="the task-local directory of `run` (where --repair looks for copies)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_verify)

    p = sub.add_parser("gc", help="delete files no retained checkpoint references (orphan sweep)")
    _job_args(p)
    p.add_argument("--grace", type=_seconds, default=3600.0, metavar="SECONDS", help="keep younger files")
    p.add_argument("--dry-run", action="store_true", help="list, delete nothing")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_gc)

    p = sub.add_parser("list", help="the job's retained checkpoints, newest first")
    _job_args(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_list)

    p = sub.add_parser("inspect", help="one _metadata: operators, subtasks, key groups, files")
    p.add_argument("path", metavar="PATH", help="<checkpoints-dir>/<job-id>/chk-<N>, or its _metadata (fsspec URL)")
    p.add_argument("--storage-options", metavar="JSON", help="fsspec storage options as a JSON object")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_inspect)

    p = sub.add_parser("registry", help="the shared-state registry rebuilt from the retained checkpoints")
    _job_args(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_registry)

    p = sub.add_parser("restore", help="one subtask's state as a verified RocksDB directory, for debugging")
    _job_args(p)
    p.add_argument("--operator", required=True, metavar="OP")
    p.add_argument("--subtask", required=True, type=int, metavar="I")
    p.add_argument("--to", required=True, metavar="DIR", help="a new local directory")
    p.add_argument("--checkpoint", type=_positive, metavar="N", help="default: the latest")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_restore)

    p = sub.add_parser("savepoint", help="a self-contained copy of a checkpoint, never deleted by retention")
    _job_args(p)
    p.add_argument("--from-checkpoint", type=_positive, metavar="N", help="default: the latest")
    p.add_argument("--to", metavar="URL",
                   help="a new directory for it (default: the job's own directory, as the next checkpoint id)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_savepoint)

    p = sub.add_parser("bootstrap", help="a savepoint holding an operator's initial state, written from a table "
                       "by its bootstrap function (start a job from it with run --from-checkpoint)")
    p.add_argument("--pipeline", required=True, metavar="MODULE:ATTR", help="your sparkpoint.Pipeline")
    p.add_argument("--operator", required=True, metavar="NAME", help="the operator whose bootstrap(table, state) runs")
    p.add_argument("--from", required=True, dest="source", metavar="FILE_OR_DIR",
                   help="the initial table: a Parquet file or a directory of them (fsspec URL)")
    p.add_argument("--to", required=True, metavar="SAVEPOINT_URL", help="a new directory for the savepoint")
    p.add_argument("--parallelism", type=_positive, help="subtasks per operator (default: the pipeline's)")
    p.add_argument("--storage-options", metavar="JSON",
                   help="fsspec options for the table and the target (default: the pipeline's)")
    p.add_argument("--master", metavar="URL", help=MASTER_HELP)
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_bootstrap)

    for command in sub.choices.values():  # `sparkpoint run --verbose` as well as `sparkpoint --verbose run`
        command.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                             help="show what happens, Spark's and py4j's own logs included")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    logging.getLogger("sparkpoint.spark.warm").setLevel(logging.INFO)  # which warm Spark a run attached to
    if args.verbose:
        os.environ["SPARKPOINT_VERBOSE"] = "1"  # also for the processes it starts
    try:
        return int(args.fn(args))
    except KeyboardInterrupt:  # before `run` had anything to report, or in any other command
        print(f"sparkpoint {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `sparkpoint list | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (UsageError, SparkpointError, ValueError, FileNotFoundError) as e:
        print(f"sparkpoint {args.command}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as e:  # e.g. a Spark task's error, which arrives as a long Java/Python trace
        logging.getLogger("sparkpoint").debug("failure", exc_info=True)
        print(f"sparkpoint {args.command}: failed: {_cause(e)}", file=sys.stderr)
        return EXIT_FAILED


def _cause(error: BaseException) -> str:
    """The most telling line of an error: the last 'SomethingError: …' line of its text."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    causes = [line for line in lines if "Error: " in line or "Exception: " in line or "Corrupted: " in line]
    return (causes[-1] if causes else lines[-1] if lines else type(error).__name__)[:2000]


if __name__ == "__main__":
    sys.exit(main())
