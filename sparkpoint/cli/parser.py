"""The command line's parser: one function per command adds its flags (the settings' flags of `run`
come from `sparkpoint.pipeline.settings.SETTINGS`). `docs/gen_pages.py` writes the reference of
every command and option from it."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeAlias

from sparkpoint.cli.catalog import cmd_history, cmd_inspect, cmd_list, cmd_metrics, cmd_registry
from sparkpoint.cli.maintenance import cmd_erase, cmd_gc, cmd_prune, cmd_rollback, cmd_savepoint, cmd_verify
from sparkpoint.cli.run import cmd_generate, cmd_run, cmd_skip
from sparkpoint.cli.state import cmd_bootstrap, cmd_check_upgrade, cmd_diff, cmd_restore, cmd_state
from sparkpoint.pipeline.settings import BY_NAME, flagged, positive_int, seconds

Commands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"  # what add_subparsers returns

MASTER_HELP = ("Spark master URL; default: the warm local Spark (a Spark Connect server on 127.0.0.1 that "
               "sparkpoint starts once and keeps warm; SPARKPOINT_WARM_SPARK=off, or local[2], runs Spark in "
               "this process)")
VERBOSE_HELP = "show what happens, Spark's and py4j's own logs included"
INPUT_HELP = ("directory of Parquet files (fsspec URL), or a table: delta+<URL> (a Delta table), "
              "iceberg://<catalog>/<namespace>.<table> (its catalog's properties by --conf "
              "iceberg.catalog.<property>=<value>); required without --pipeline")


def build_parser() -> argparse.ArgumentParser:
    from sparkpoint import cli  # the package's docstring describes the command

    parser = argparse.ArgumentParser(prog="sparkpoint", description=(cli.__doc__ or "").splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(sub)
    for command in sub.choices.values():  # `sparkpoint run --verbose` as well as `sparkpoint --verbose run`
        command.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=VERBOSE_HELP)
    return parser


def _job_args(p: argparse.ArgumentParser) -> None:
    """The flags that name a job's checkpoints: `--pipeline`, or `--checkpoints` and `--job-id`."""
    p.add_argument("--pipeline", metavar="MODULE:ATTR",
                   help="your sparkpoint.Pipeline: its operators, locations and settings (flags override them)")
    BY_NAME["checkpoints_dir"].flag.add_to(p)  # type: ignore[union-attr]
    p.add_argument("--job-id", metavar="ID", help="the job's directory under the storage URL; default: the pipeline's")
    p.add_argument("--storage-options", metavar="JSON", help="fsspec storage options as a JSON object")


def _generate(sub: Commands) -> None:
    p = sub.add_parser("generate", help="write the sample event stream")
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--batches", type=positive_int, required=True)
    p.add_argument("--events-per-batch", type=positive_int, required=True)
    p.add_argument("--users", type=positive_int, required=True)
    p.add_argument("--items", type=positive_int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--first", type=int, default=0, help="index of the first batch (to append more later)")
    p.add_argument("--storage-options", metavar="JSON")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_generate)


def _run(sub: Commands) -> None:
    p = sub.add_parser("run", help="process every unconsumed batch, one checkpoint per batch")
    p.add_argument("--input", metavar="URL", help=INPUT_HELP)
    _job_args(p)
    p.add_argument("--output", metavar="URL",
                   help="exactly-once output of the operators' changed rows: a directory of Parquet files (any fsspec "
                        "URL), a Delta table (delta+file:///..., delta+s3://...) or an Iceberg table "
                        "(iceberg://<catalog>/<namespace>.<table>, its catalog's properties by --conf "
                        "iceberg.catalog.<property>=<value>)")
    p.add_argument("--max-batches", type=positive_int)
    p.add_argument("--local-dir", metavar="DIR", help="working RocksDB instances (default .sparkpoint/local, "
                   "with --pipeline .sparkpoint/<name>/local)")
    p.add_argument("--master", metavar="URL", help=MASTER_HELP)
    p.add_argument("--remote", metavar="sc://HOST:PORT",
                   help="attach to a running Spark through Spark Connect instead of starting one "
                        "(also --conf spark.remote=... or SPARK_REMOTE)")
    p.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE",
                   help="a setting, Flink's keys accepted (e.g. state.checkpoints.num-retained=3); "
                        "iceberg.catalog.<property>=<value>: a property of an Iceberg output's catalog")
    for setting in flagged():  # one flag per setting that has one: sparkpoint.pipeline.settings.SETTINGS
        setting.flag.add_to(p)  # type: ignore[union-attr]
    p.add_argument("--tick", action="store_true",
                   help="with no unconsumed batch, one checkpoint of no input: processing time advances, due "
                        "timers fire, TTL state expires")
    _follow_args(p)
    p.add_argument("--json", action="store_true", help="one JSON object per checkpoint")
    p.set_defaults(fn=cmd_run)


def _follow_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--follow", action="store_true",
                   help="keep one Spark session and watch the input: each landed batch is checkpointed as it "
                        "arrives, until Ctrl-C or SIGTERM (or --max-batches, --idle-seconds)")
    p.add_argument("--checkpoint-interval", type=seconds, metavar="SECONDS",
                   help="with --follow: start a checkpoint at most every SECONDS; files that land faster go into "
                        "one checkpoint (at most --files-per-checkpoint of them when set above 1, else 1000)")
    p.add_argument("--poll-interval", type=seconds, metavar="SECONDS",
                   help="with --follow: how often to look for new files while idle (default 0.2)")
    p.add_argument("--idle-seconds", type=seconds, metavar="SECONDS",
                   help="with --follow: stop once no file has been pending for SECONDS (default: never)")


def _skip(sub: Commands) -> None:
    p = sub.add_parser("skip", help="consume one unconsumed input file without processing it, recorded as skipped "
                       "with a reason: a checkpoint of no input (no Spark)")
    p.add_argument("file", metavar="FILE", help="the file's name in the input directory (as the run's error names it)")
    p.add_argument("--reason", required=True, metavar="TEXT", help="why it is skipped (one line; kept in _metadata)")
    p.add_argument("--input", metavar="DIR", help=INPUT_HELP)
    _job_args(p)
    p.add_argument("--output", metavar="URL", help="the exactly-once output, as the runs write it")
    p.add_argument("--local-dir", metavar="DIR", help="working RocksDB instances, as the runs use them")
    p.add_argument("--parallelism", type=positive_int, help="subtasks per operator, as the runs use them")
    p.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE",
                   help="a setting, as `run` takes it (Flink's keys accepted)")
    p.add_argument("--json", action="store_true", help="the checkpoint as one JSON object")
    p.set_defaults(fn=cmd_skip)


def _check_upgrade(sub: Commands) -> None:
    p = sub.add_parser("check-upgrade", help="what restoring a checkpoint into a (new) pipeline would do, per "
                       "operator, from its _metadata alone; exit 1 when the restore would be refused")
    p.add_argument("--pipeline", required=True, metavar="MODULE:ATTR", help="the pipeline to restore into")
    p.add_argument("--from", dest="source", metavar="CHECKPOINT_OR_SAVEPOINT_URL",
                   help="<checkpoints-dir>/<job-id>/chk-<N> (or its _metadata)")
    p.add_argument("--checkpoints", metavar="URL", help="with --job-id: that job's latest checkpoint "
                   "(default without --from: the pipeline's own job, as `run` would restore it)")
    p.add_argument("--job-id", metavar="ID")
    p.add_argument("--storage-options", metavar="JSON", help="fsspec storage options (default: the pipeline's)")
    p.add_argument("--parallelism", type=positive_int,
                   help="the new job's (default: the pipeline's, or the checkpoint's when it sets none)")
    p.add_argument("--max-parallelism", type=positive_int, help="the new job's (default: the pipeline's)")
    p.add_argument("--allow-non-restored-state", action="store_true",
                   help="as `run`: state of operators the pipeline lacks may be dropped")
    p.add_argument("--allow-new-operators", action="store_true",
                   help="as `run`: operators the checkpoint lacks may start empty")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_check_upgrade)


def _state(sub: Commands) -> None:
    p = sub.add_parser("state", help="export an operator's state at a checkpoint as a table")
    _job_args(p)
    p.add_argument("--operator", required=True, metavar="OP")
    p.add_argument("--checkpoint", type=positive_int, metavar="N", help="default: the latest")
    p.add_argument("--format", choices=["csv", "parquet", "json"], default="csv")
    p.add_argument("--out", metavar="FILE", help="default: standard output (csv, json)")
    p.add_argument("--raw", action="store_true",
                   help="every state through the codec _metadata recorded, one row per entry; needs no operator "
                        "code (an operator removed or renamed stays readable)")
    p.set_defaults(fn=cmd_state)


def _diff(sub: Commands) -> None:
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


def _verify(sub: Commands) -> None:
    p = sub.add_parser("verify", help="check every file of the checkpoint(s): present, size, CRC32")
    _job_args(p)
    p.add_argument("--checkpoint", type=positive_int, metavar="N", help="default: every retained checkpoint")
    p.add_argument("--shallow", action="store_true", help="check sizes only, do not read the files")
    p.add_argument("--repair", action="store_true",
                   help="rewrite missing or damaged files from task-local copies with the recorded size and CRC32")
    p.add_argument("--local-dir", default=".sparkpoint/local", metavar="DIR",
                   help="the task-local directory of `run` (where --repair looks for copies)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_verify)


def _gc(sub: Commands) -> None:
    p = sub.add_parser("gc", help="delete files no retained checkpoint references (orphan sweep)")
    _job_args(p)
    p.add_argument("--grace", type=seconds, default=3600.0, metavar="SECONDS", help="keep younger files")
    p.add_argument("--dry-run", action="store_true", help="list, delete nothing")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_gc)


def _prune(sub: Commands) -> None:
    p = sub.add_parser("prune", help="retention now (beyond --retain), stale attempts, orphans past the grace period, "
                       "and the consumed input as --input-cleanup says")
    _job_args(p)
    p.add_argument("--input", metavar="URL", help="the input directory, for --input-cleanup (default: the pipeline's)")
    BY_NAME["num_retained"].flag.add_to(p)  # type: ignore[union-attr]
    BY_NAME["input_cleanup"].flag.add_to(p)  # type: ignore[union-attr]
    p.add_argument("--grace", type=seconds, default=3600.0, metavar="SECONDS", help="keep younger orphan files")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_prune)


def _list(sub: Commands) -> None:
    p = sub.add_parser("list", help="the job's retained checkpoints, newest first")
    _job_args(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_list)


def _inspect(sub: Commands) -> None:
    p = sub.add_parser("inspect", help="one _metadata: operators, subtasks, key groups, files")
    p.add_argument("path", metavar="PATH", help="<checkpoints-dir>/<job-id>/chk-<N>, or its _metadata (fsspec URL)")
    p.add_argument("--storage-options", metavar="JSON", help="fsspec storage options as a JSON object")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_inspect)


def _registry(sub: Commands) -> None:
    p = sub.add_parser("registry", help="the shared-state registry rebuilt from the retained checkpoints")
    _job_args(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_registry)


def _metrics(sub: Commands) -> None:
    p = sub.add_parser("metrics", help="the pipeline's metrics (Flink's names) in Prometheus' text format, as its "
                                       "retained checkpoints tell them")
    _job_args(p)
    p.set_defaults(fn=cmd_metrics)


def _history(sub: Commands) -> None:
    p = sub.add_parser("history", help="every checkpoint the job's history kept (and the retained ones): durations, "
                       "sizes, requests and restores, as a table, JSON or a picture")
    _job_args(p)
    p.add_argument("--plot", metavar="FILE.png", help="draw sizes and durations over the checkpoints into FILE.png "
                   "(materializations and restores marked)")
    p.add_argument("--last", type=positive_int, metavar="N", help="only the newest N checkpoints")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_history)


def _restore(sub: Commands) -> None:
    p = sub.add_parser("restore", help="one subtask's state as a verified RocksDB directory, for debugging")
    _job_args(p)
    p.add_argument("--operator", required=True, metavar="OP")
    p.add_argument("--subtask", required=True, type=int, metavar="I")
    p.add_argument("--to", required=True, metavar="DIR", help="a new local directory")
    p.add_argument("--checkpoint", type=positive_int, metavar="N", help="default: the latest")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_restore)


def _savepoint(sub: Commands) -> None:
    p = sub.add_parser("savepoint", help="a self-contained copy of a checkpoint, never deleted by retention")
    _job_args(p)
    p.add_argument("--from-checkpoint", type=positive_int, metavar="N", help="default: the latest")
    p.add_argument("--to", metavar="URL",
                   help="a new directory for it (default: the job's own directory, as the next checkpoint id)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_savepoint)


def _rollback(sub: Commands) -> None:
    p = sub.add_parser("rollback", help="restore the job to a retained checkpoint and undo the output of the "
                       "checkpoints after it, which are retired (the next run processes their batches again)")
    _job_args(p)
    p.add_argument("--to", required=True, type=positive_int, metavar="N", help="the retained checkpoint to go back to")
    p.add_argument("--output", metavar="URL", help="the exactly-once output the runs write (default: the pipeline's)")
    p.add_argument("--dry-run", action="store_true",
                   help="say what would be retired and which output undone; change nothing")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_rollback)


def _erase(sub: Commands) -> None:
    p = sub.add_parser("erase", help="erase keys from every retained checkpoint and savepoint of the job (as new "
                       "checkpoints; the old ones are retired), its task-local copies and its output, with proof")
    _job_args(p)
    p.add_argument("--key", action="append", metavar="VALUE",
                   help="a key to erase, parsed as the operators' key column's type (repeat for more)")
    p.add_argument("--keys-from", metavar="FILE", help="a file of keys to erase, one per line")
    p.add_argument("--operators", metavar="UID,...",
                   help="the operators to erase from (default: every operator; they must share one key column)")
    p.add_argument("--dry-run", action="store_true", help="count the keys' entries per checkpoint; change nothing")
    p.add_argument("--report", metavar="FILE", help="write the report (and its proof) to FILE as JSON")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_erase)


def _bootstrap(sub: Commands) -> None:
    p = sub.add_parser("bootstrap", help="a savepoint holding an operator's initial state, written from a table "
                       "by its bootstrap function (start a job from it with run --from-checkpoint)")
    p.add_argument("--pipeline", required=True, metavar="MODULE:ATTR", help="your sparkpoint.Pipeline")
    p.add_argument("--operator", required=True, metavar="NAME", help="the operator whose bootstrap(table, state) runs")
    p.add_argument("--from", required=True, dest="source", metavar="FILE_OR_DIR",
                   help="the initial table: a Parquet file or a directory of them (fsspec URL)")
    p.add_argument("--to", required=True, metavar="SAVEPOINT_URL", help="a new directory for the savepoint")
    p.add_argument("--parallelism", type=positive_int, help="subtasks per operator (default: the pipeline's)")
    p.add_argument("--storage-options", metavar="JSON",
                   help="fsspec options for the table and the target (default: the pipeline's)")
    p.add_argument("--master", metavar="URL", help=MASTER_HELP)
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_bootstrap)


# In the order `sparkpoint --help` lists them.
COMMANDS: tuple[Callable[[Commands], None], ...] = (
    _generate, _run, _skip, _check_upgrade, _state, _diff, _verify, _gc, _prune, _list, _inspect, _registry, _metrics,
    _history, _restore, _savepoint, _rollback, _erase, _bootstrap,
)
