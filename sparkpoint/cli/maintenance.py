"""`verify` (and `verify --repair`), `gc`, `prune`, `savepoint`, `rollback` and `erase`: the commands that
look after a job's stored checkpoints (and `prune`, after its consumed input)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from sparkpoint.checkpoint.metadata import CheckpointMetadata
from sparkpoint.checkpoint.storage import storage_url
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.cli.common import EXIT_BAD_FILES, UsageError, job_store, pipeline_of, storage_options
from sparkpoint.cli.output import print_json, printed_json, progress_bar
from sparkpoint.pipeline.settings import BY_NAME


def cmd_verify(args: argparse.Namespace) -> int:
    from sparkpoint.pipeline.maintenance import verify_checkpoints

    store = job_store(args)
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
        print_json(results if repair is None else {"checkpoints": results, **repair})
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
    from sparkpoint.pipeline.maintenance import collect_garbage

    report = collect_garbage(job_store(args).storage, grace_seconds=args.grace, dry_run=args.dry_run)
    for warning in report.warnings():
        print(warning, file=sys.stderr)
    if not printed_json(args, report.to_json()):
        print("\n".join(report.lines()))
    return 0


def cmd_prune(args: argparse.Namespace) -> int:
    from sparkpoint.pipeline.cleanup import InputCleanup
    from sparkpoint.pipeline.maintenance import prune

    storage = job_store(args).storage
    pipeline = pipeline_of(args)
    policy = args.input_cleanup or (pipeline.input_cleanup if pipeline is not None else "keep")
    cleanup = None
    if policy != "keep":
        if pipeline is not None:
            config = pipeline.config(**({"input_url": storage_url(args.input)} if args.input else {}))
            cleanup = InputCleanup.of(config.with_(input_cleanup=policy))
        elif args.input:
            cleanup = InputCleanup(policy, storage_url(args.input), storage_options(args.storage_options))
        else:
            raise UsageError(f"--input-cleanup {policy} needs the input: --input URL (or --pipeline MODULE:ATTR)")
    retain = args.retain or (pipeline.num_retained if pipeline is not None else BY_NAME["num_retained"].default)
    report = prune(storage, num_retained=retain, orphan_grace_seconds=args.grace, input_cleanup=cleanup)
    if not printed_json(args, report.to_json()):
        print(report.message)
    return 0


def cmd_savepoint(args: argparse.Namespace) -> int:
    from sparkpoint.checkpoint.savepoint import take_savepoint

    storage = job_store(args).storage
    with progress_bar(args, "savepoint") as progress:
        result = take_savepoint(storage, checkpoint_id=args.from_checkpoint, target=args.to, progress=progress)
    if printed_json(args, result.to_json()):
        return 0
    print(f"{result.message}\n  start a job from it: sparkpoint run --from-checkpoint {result.url} "
          "--restore-mode CLAIM|NO_CLAIM ...")
    return 0


def cmd_rollback(args: argparse.Namespace) -> int:
    """Roll the job back to checkpoint `--to`, its output with it (`--output`, else the pipeline's)."""
    from sparkpoint.pipeline.rollback import rollback, rollback_job
    from sparkpoint.tables.sinks import open_sink
    from sparkpoint.tables.spec import table_url

    storage = job_store(args).storage
    spec = pipeline_of(args)
    if spec is not None:  # the pipeline's own output sink, at the locations the flags give
        given = {"output_url": table_url(args.output)} if args.output else {}
        config = spec.config(checkpoints_url=storage.url, job_id=storage.job_id,
                             storage_options=storage.storage_options, **given)
        report = rollback(config, args.to, operators=spec.operators, dry_run=args.dry_run)
    else:
        sink = open_sink(table_url(args.output), storage.job_id, storage_options=storage.storage_options) \
            if args.output else None
        report = rollback_job(storage, sink, args.to, dry_run=args.dry_run)
    if not printed_json(args, report.to_json()):
        print("\n".join(report.lines() if args.dry_run else [report.message]))
    return 0


def cmd_erase(args: argparse.Namespace) -> int:
    """Erase keys from every retained checkpoint and savepoint of the pipeline's job and its output."""
    from sparkpoint.pipeline.erase import (
        EraseNotVerified,
        choose_operators,
        erase,
        parse_key,
        with_keys_from,
        write_report,
    )

    spec = pipeline_of(args)
    if spec is None:
        raise UsageError("erase needs --pipeline MODULE:ATTR: the keys are typed by its operators' key column")
    only = [u.strip() for u in args.operators.split(",") if u.strip()] if args.operators else None
    chosen = choose_operators(spec.operators, only)
    types = {(op.key, op.key_type) for op in chosen}
    if len(types) > 1:
        raise UsageError("the operators named are keyed by different columns or key types ("
                         + ", ".join(f"{op.uid}: {op.key} {op.key_type or 'string'}" for op in chosen)
                         + "): erase from the ones of one key column at a time with --operators")
    column, key_type = types.pop()
    keys = [parse_key(t, key_type, column) for t in with_keys_from(args.key or [], args.keys_from)]
    storage = job_store(args).storage
    config = spec.config(checkpoints_url=storage.url, job_id=storage.job_id, storage_options=storage.storage_options)
    try:
        report = erase(config, spec.operators, keys, only=[op.uid for op in chosen], dry_run=args.dry_run)
    except EraseNotVerified as e:
        if args.report:
            write_report(e.report, args.report)
        raise
    if args.report:
        write_report(report, args.report)
    if not printed_json(args, report.to_json()):
        print("\n".join(report.lines()))
    return 0 if report.verified or args.dry_run else 1
