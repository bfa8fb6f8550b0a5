"""The commands about the operators' state: `state` (export it as a table), `diff` (two snapshots),
`restore` (one subtask as a RocksDB directory), `check-upgrade` (would a restore into a changed
pipeline work?) and `bootstrap` (a savepoint written from a table)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING, Any

from sparkpoint.checkpoint.storage import storage_url
from sparkpoint.cli.common import (
    EXIT_REFUSED,
    UsageError,
    checkpoints_of,
    given_pipeline,
    job_storage,
    job_store,
    pipeline_of,
    storage_options,
)
from sparkpoint.cli.output import key_range, print_json, printed_json, progress_bar, size, write_text

if TYPE_CHECKING:
    import pandas as pd

    from sparkpoint.pipeline.spec import Pipeline
    from sparkpoint.state.operators import KeyedOperator


def cmd_state(args: argparse.Namespace) -> int:
    from sparkpoint.api import state_table

    with progress_bar(args, f"reading {args.operator}") as progress:
        # --raw needs no code: the operator may be gone from the pipeline (removed, renamed).
        pipeline = None if args.raw else pipeline_of(args)
        operator = args.operator if args.raw else _operator(pipeline, args.operator)
        meta, table = state_table(job_storage(args), operator, args.checkpoint, progress=progress, raw=args.raw)
    if args.raw and args.format != "json":  # one column of mixed values: JSON text for csv and parquet
        table["value"] = [_json_text(v) for v in table["value"]]
        for column in ("key", "user_key"):
            table[column] = [v.hex() if isinstance(v, bytes) else v for v in table[column]]
    _write_table(table, args.format, args.out)
    if args.out:
        print(f"chk-{meta.checkpoint_id}: {len(table)} rows of {args.operator} written to {args.out}", file=sys.stderr)
    return 0


def _write_table(table: pd.DataFrame, fmt: str, out: str | None) -> None:
    """`table` as csv, json (records) or parquet into `out`, or to standard output (not parquet)."""
    if fmt == "parquet":
        if not out:
            raise UsageError("--format parquet needs --out FILE")
        table.to_parquet(out, index=False)
    elif fmt == "json":
        write_text(out, table.to_json(orient="records", date_format="iso", date_unit="us") + "\n")
    else:
        write_text(out, table.to_csv(index=False))


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

    pipeline = pipeline_of(args)
    operator = _operator(pipeline, args.operator)
    needs_job = any(str(ref).strip().removeprefix("chk-").isdigit() for ref in (args.from_, args.to))
    storage = job_storage(args) if needs_job or pipeline is not None or args.checkpoints else None
    options = storage_options(args.storage_options) if args.storage_options else (
        storage.storage_options if storage is not None else None)
    local_dir = args.local_dir or (pipeline.location("local") if pipeline is not None else None)
    result = diff_snapshots(locate(args.from_, storage, options), locate(args.to, storage, options), operator,
                            local_dir=local_dir)
    table, summary = result.table, result.summary()
    if args.json and not args.out:
        records = json.loads(table.to_json(orient="records", date_format="iso", date_unit="us"))
        print_json({**summary, "rows": records})
        return 0
    _write_table(table, args.format or _format_of(args.out), args.out)
    counts = ", ".join(f"{n} {c}" for c, n in summary["changes"].items())
    how = summary["method"] + (f" ({summary['reason']})" if summary["reason"] else "")
    print(f"{operator.name} chk-{result.source.meta.checkpoint_id} -> chk-{result.target.meta.checkpoint_id}: "
          f"{counts}; by {how}; {size(summary['bytes_read'])} read"
          + (f" to {args.out}" if args.out else ""), file=sys.stderr)
    return 0


def _format_of(path: str | None) -> str:
    suffix = os.path.splitext(path or "")[1].lower()
    return {".parquet": "parquet", ".json": "json"}.get(suffix, "csv")


def cmd_restore(args: argparse.Namespace) -> int:
    from sparkpoint.state.extract import restore_subtask

    store = job_store(args)
    meta = checkpoints_of(store, args.checkpoint)[0]
    with progress_bar(args, f"restoring {args.operator}/{args.subtask}") as progress:
        info = restore_subtask(store.storage, meta, args.operator, args.subtask, args.to, progress=progress)
    if printed_json(args, info):
        return 0
    states = ", ".join(f"{name}: {n} entries" for name, n in info["states"].items()) or "no state"
    print(f"chk-{info['checkpoint_id']} {info['operator']} subtask {info['subtask']} (key groups "
          f"{key_range(info['key_group_range'])}): {info['files']} files verified, "
          f"{size(info['downloaded_bytes'])} -> {info['directory']}\n  {states}\n"
          f"  open it with: Rdict({info['directory']!r}, access_type=AccessType.read_only())")
    return 0


def cmd_check_upgrade(args: argparse.Namespace) -> int:
    """What restoring a checkpoint into the pipeline given would do, from its `_metadata` alone
    (no Spark, no state file): the same plan `run` makes before it starts."""
    from sparkpoint.pipeline.runtime import load_external_checkpoint, plan_for, restore_plan, validate_config

    pipeline = given_pipeline(args)
    if args.source and (args.checkpoints or args.job_id):
        raise UsageError("give --from, or --checkpoints and --job-id, not both")
    if bool(args.checkpoints) != bool(args.job_id):
        raise UsageError("--checkpoints and --job-id go together (without them: the pipeline's own job)")
    overrides: dict[str, Any] = {k: v for k, v in {
        "parallelism": args.parallelism, "max_parallelism": args.max_parallelism,
        "allow_non_restored_state": args.allow_non_restored_state or None,
        "allow_new_operators": args.allow_new_operators or None,
        "storage_options": storage_options(args.storage_options) if args.storage_options else None,
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
        print_json(plan.to_json() if plan is not None else {"checkpoint_id": None, "ok": True, "operators": [],
                                                            "summary": text})
    else:
        print(text)
    return 0 if plan is None or plan.ok else EXIT_REFUSED


def cmd_bootstrap(args: argparse.Namespace) -> int:
    from sparkpoint.pipeline.bootstrap import plan_bootstrap

    pipeline = given_pipeline(args)
    options = storage_options(args.storage_options) if args.storage_options else None
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
    if printed_json(args, result.to_json()):
        return 0
    # Standard output is the savepoint alone, for `--from-checkpoint "$(sparkpoint bootstrap ...)"`.
    print(result.url)
    print(f"savepoint {result.url}: {result.operator} bootstrapped from {result.rows} rows at parallelism "
          f"{plan.parallelism}, the other operators empty; {result.files} files, {size(result.bytes)}\n"
          f"  start the job from it: sparkpoint run --pipeline {args.pipeline} --from-checkpoint {result.url}",
          file=sys.stderr)
    return 0
