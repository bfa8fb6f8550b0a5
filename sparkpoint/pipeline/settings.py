"""Every pipeline setting, declared once (as Flink's `ConfigOption`s are): its name, type, default,
Flink keys, description, and which surfaces take it. `SETTINGS` is the one table from which
`--conf` parsing and Flink's aliases, the `sparkpoint run` flags, the Dagster resources' fields and
the configuration page of the docs are made; a `Pipeline`'s fields and `PipelineConfig`'s are
checked against it by the tests. The Airflow operators' `overrides` and the `dg` component's
`settings:` go through `resolve_settings`.

Adding a setting is one `Setting(...)` below (and its use where it acts).

Importable without Dagster, Spark or pandas (the CLI builds its parser from it).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sparkpoint.checkpoint.ledger import DEFAULT_PRICES, Prices
from sparkpoint.checkpoint.retention import ClaimMode, ExternalizedRetention, parse_bool
from sparkpoint.checkpoint.storage import storage_url
from sparkpoint.state.engine.changelog import ChangelogOptions
from sparkpoint.state.engine.rocksdb import RocksDBOptions

# The values the modules that act on them own (sparkpoint.pipeline.badfiles, .spark.routing,
# .state.eventtime), repeated here so that building the CLI's parser imports no pandas; the tests
# hold them equal.
ON_BAD_FILE = ("fail", "skip")
TABLE_CHANGES = ("fail", "skip", "feed")  # sparkpoint.tables.source's
ROUTINGS = ("auto", "read-all", "shuffle")
MAX_FUTURE_EVENT_TIME = 24 * 3600.0
SETTLE_SECONDS = 2.0  # sparkpoint.spark.settling's
REPLAY_WINDOW = 7 * 24 * 3600.0  # sparkpoint.tables.sink's DEFAULT_REPLAY_WINDOW
HISTORY_KEEP = 10_000  # sparkpoint.checkpoint.history's DEFAULT_KEEP
INPUT_CLEANUPS = ("keep", "delete", "archive")  # sparkpoint.pipeline.cleanup's: archive takes :<url>

_SIZE = re.compile(r"(\d+)\s*(k|kb|m|mb|g|gb|t|tb)?")
_MB_PER_UNIT = {"k": 1 / 1024, "m": 1, "g": 1024, "t": 1024 * 1024}


def parse_megabytes(value: str | int) -> int:
    """A size in whole megabytes: `256` (MB), `256mb`, `1gb`, `1 GB`. At least 1 MB."""
    match = _SIZE.fullmatch(str(value).strip().lower())
    if match is None:
        raise ValueError(f"expected a size such as 256mb or 1gb, got {value!r}")
    number, unit = int(match.group(1)), match.group(2)
    if unit is None and number >= 1 << 20:  # Flink reads a bare number as bytes: do not guess
        raise ValueError(f"{number} MB is over a terabyte; give the unit, e.g. {number >> 20}mb if it was bytes")
    mb = number * _MB_PER_UNIT[(unit or "m")[0]]
    if mb < 1 or mb != int(mb):
        raise ValueError(f"expected whole megabytes, at least 1, got {value!r}")
    return int(mb)


def positive_int(text: str) -> int:
    """A flag's whole number of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def seconds(text: str) -> float:
    """A flag's finite number of seconds >= 0."""
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text}")
    return value


def _lower(value: Any) -> str:
    return str(value).strip().lower()


def _optional_seconds(value: Any) -> float | None:
    return None if value is None or _lower(value) in ("none", "off") else float(value)


def check_on_bad_file(value: Any) -> list[str]:
    from sparkpoint.pipeline.badfiles import check_on_bad_file

    return check_on_bad_file(value)


def check_max_future_event_time(value: Any) -> list[str]:
    from sparkpoint.state.eventtime import check_max_future_event_time

    return check_max_future_event_time(value)


def check_settle_seconds(value: Any) -> list[str]:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        return [f"settle_seconds must be a finite number of seconds >= 0, got {value!r}"]
    return []


def check_table_changes(value: Any) -> list[str]:
    from sparkpoint.tables.source import check_table_changes

    return check_table_changes(value)


def _optional_megabytes(value: Any) -> int | None:
    return None if value is None or _lower(value) in ("none", "off", "") else parse_megabytes(value)


def _optional_int(value: Any) -> int | None:
    return None if value is None or _lower(value) in ("none", "off", "") else int(value)
def check_replay_window(value: Any) -> list[str]:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        return [f"output_replay_window must be a finite number of seconds >= 0, got {value!r}"]
    return []


def parse_prices(value: Any) -> str:
    """A price table as text (`sparkpoint.checkpoint.ledger.Prices.parse`), checked."""
    Prices.parse(str(value))
    return str(value)


def _optional_url(value: Any) -> str | None:
    text = "" if value is None else str(value).strip()
    if text.lower() in ("", "none", "off"):
        return None
    if not re.fullmatch(r"https?://[^\s/]+(/\S*)?", text):
        raise ValueError(f"expected an http:// or https:// URL such as http://127.0.0.1:9091, got {text!r}")
    return text
def _optional_text(value: Any) -> str | None:
    return None if value is None or _lower(value) in ("none", "off", "") else str(value).strip()


def check_history_max_checkpoints(value: Any) -> list[str]:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return [f"history_max_checkpoints must be a whole number >= 0 (0: no history), got {value!r}"]
    return []


def check_lineage_transport(value: Any) -> list[str]:
    if value is None or value == "console" or str(value).startswith(("file://", "http://", "https://")):
        return []
    return [f"lineage_transport must be file:///<path>, an http(s):// URL, console or none, got {value!r}"]


def parse_input_cleanup(value: Any) -> str:
    """`input_cleanup`: `keep`, `delete` or `archive:<url>` (the URL any fsspec URL, or a path made one)."""
    text = str(value).strip()
    mode, colon, url = text.partition(":")
    if mode.lower() in INPUT_CLEANUPS[:2] and not colon:
        return mode.lower()
    if mode.lower() == INPUT_CLEANUPS[2] and colon and url.strip():
        return f"{INPUT_CLEANUPS[2]}:{storage_url(url.strip())}"
    raise ValueError(f"input_cleanup must be keep, delete or archive:<url> (e.g. archive:s3://bucket/archive), "
                     f"got {value!r}")


def input_cleanup_flag(text: str) -> str:
    """`--input-cleanup`'s value, checked as the setting is."""
    try:
        return parse_input_cleanup(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def check_input_cleanup(value: Any) -> list[str]:
    try:
        parse_input_cleanup(value)
    except ValueError as e:
        return [str(e)]
    return []


def check_routing(value: Any) -> list[str]:
    from sparkpoint.spark.routing import check_routing

    return check_routing(value)


@dataclass(frozen=True)
class Flag:
    """A setting's `sparkpoint run` flag (argparse's arguments)."""

    name: str  # "--retain"
    help: str
    type: Callable[[str], Any] | None = None
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    switch: bool = False  # takes no value: turns the setting on
    shared: bool = False  # declared with the arguments every job command takes (`--checkpoints`)

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        """Add this flag to `parser` (its default is None: unset, the pipeline's own setting stays)."""
        if self.switch:
            parser.add_argument(self.name, action="store_const", const=True, help=self.help or None)
            return
        kwargs: dict[str, Any] = {"help": self.help} if self.help else {}
        if self.type is not None:
            kwargs["type"] = self.type
        if self.metavar is not None:
            kwargs["metavar"] = self.metavar
        if self.choices is not None:
            kwargs["choices"] = list(self.choices)
        parser.add_argument(self.name, **kwargs)


ROLES = ("storage", "registry", "state_backend", "source")  # the Dagster resources a pipeline has, by role


@dataclass(frozen=True)
class Resource:
    """Where a setting is a field of a pipeline's Dagster resources."""

    role: str  # one of ROLES
    field: str = ""  # the field's name; "": the setting's
    none_as: str | None = None  # a field that cannot be None (the launchpad's text box): this value stands for None


@dataclass(frozen=True)
class Setting:
    """One setting, declared once: what every surface takes of it.

    Args:
        name: our name: the `Pipeline` and `PipelineConfig` field, the `--conf` key.
        type: its Python type (the fields' annotation).
        default: its default.
        description: what it does, for people (the docs' configuration table).
        parse: a `--conf` value (text or a value) -> the setting's value; raises ValueError.
        flink: Flink's keys for it, taken by `--conf` as aliases.
        flag: its `sparkpoint run` flag (None: `--conf` only).
        resource: its Dagster resource field (None: not a field of the resources).
        check: what is wrong with a value, as messages (empty: nothing).
        conf: `--conf` (and `with_settings`, the component's `settings:`, Airflow's `overrides`) take it.
        target: where it lands on a `Pipeline` ("": `name`; `rocksdb.block_cache_mb`: a part of `rocksdb`).
        shown_default: the default as the docs show it ("": the value).
    """

    name: str
    type: Any
    default: Any
    description: str
    parse: Callable[[Any], Any]
    flink: tuple[str, ...] = ()
    flag: Flag | None = None
    resource: Resource | None = None
    check: Callable[[Any], list[str]] | None = None
    conf: bool = True
    target: str = ""
    shown_default: str = ""

    @property
    def field(self) -> str:
        """The `Pipeline` / `PipelineConfig` field it sets."""
        return (self.target or self.name).split(".")[0]

    @property
    def resource_field(self) -> str | None:
        return (self.resource.field or self.name) if self.resource else None


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "checkpoints_dir", str | None, None,
        "fsspec URL of the checkpoint storage (`file://`, `s3://`, `gs://`, ...)",
        str, flink=("state.checkpoints.dir",), target="checkpoints_url",
        flag=Flag("--checkpoints", "checkpoint storage (fsspec URL); required without --pipeline", metavar="URL",
                  shared=True),
        shown_default=".sparkpoint/<name>/checkpoints"),
    Setting(
        "num_retained", int, 2,
        "completed checkpoints kept; older ones are subsumed and the files only they referenced deleted",
        int, flink=("state.checkpoints.num-retained",),
        flag=Flag("--retain", "completed checkpoints to keep (default 2)", type=positive_int),
        resource=Resource("registry")),
    Setting(
        "retention", str, ExternalizedRetention.RETAIN_ON_CANCELLATION.value,
        "what a shutdown deletes: `RETAIN_ON_CANCELLATION`, `DELETE_ON_CANCELLATION` or "
        "`NO_EXTERNALIZED_CHECKPOINTS` (never savepoints)",
        lambda v: ExternalizedRetention(str(v).upper()).value,
        flink=("execution.checkpointing.externalized-checkpoint-retention",), resource=Resource("registry")),
    Setting(
        "incremental", bool, True,
        "upload only the files the last confirmed checkpoint lacks",
        parse_bool, flink=("state.backend.incremental",), resource=Resource("state_backend")),
    Setting(
        "local_recovery", bool, True,
        "keep a task-local copy of the latest checkpoint next to the working database",
        parse_bool, flink=("state.backend.local-recovery",), resource=Resource("state_backend")),
    Setting(
        "restore_mode", str, ClaimMode.CLAIM.value,
        "claim mode of `from_checkpoint`: `CLAIM` (the checkpoint becomes the job's own) or `NO_CLAIM` "
        "(only ever read)",
        lambda v: ClaimMode(str(v).upper()).value,
        flink=("execution.savepoint-restore-mode", "execution.state-recovery.claim-mode"),
        flag=Flag("--restore-mode", "", choices=tuple(m.value for m in ClaimMode)),
        resource=Resource("registry", "claim_mode")),
    Setting(
        "from_checkpoint", str | None, None,
        "start a new job from this `<checkpoints-dir>/<job-id>/chk-<N>` (a checkpoint or a savepoint)",
        str, flink=("execution.savepoint.path", "execution.state-recovery.path"),
        flag=Flag("--from-checkpoint", "<checkpoints-dir>/<job-id>/chk-<N> to start from", metavar="PATH"),
        resource=Resource("registry", none_as="")),
    Setting(
        "max_parallelism", int, 128,
        "key groups (at most 32,768); fixed for the life of a job's state",
        int, flink=("pipeline.max-parallelism",),
        flag=Flag("--max-parallelism", "key groups (default 128)", type=positive_int),
        resource=Resource("state_backend")),
    Setting(
        "parallelism", int | None, None,
        "subtasks per operator; may change between runs (the state is rescaled by key group)",
        int, flink=("parallelism.default",),
        flag=Flag("--parallelism", "subtasks per operator (default: the latest checkpoint's, 2 for a first run); "
                  "a change rescales the state by key groups, said in one line", type=positive_int),
        resource=Resource("state_backend")),
    Setting(
        "files_per_checkpoint", int, 1,
        "input files per checkpoint",
        int, conf=False,
        flag=Flag("--files-per-checkpoint", "input files per checkpoint (default 1)", type=positive_int),
        resource=Resource("source")),
    Setting(
        "max_input_mb_per_checkpoint", int | None, None,
        "input bytes per checkpoint at most, with a unit (`256mb`, `1gb`) or in MB: a batch ends before the file "
        "that would take it beyond (it takes one file whatever its size); `none`: files_per_checkpoint alone",
        _optional_megabytes),
    Setting(
        "allow_non_restored_state", bool, False,
        "drop the state of operators the checkpoint holds and the job no longer runs",
        parse_bool,
        flink=("execution.state-recovery.ignore-unclaimed-state", "execution.savepoint.ignore-unclaimed-state"),
        flag=Flag("--allow-non-restored-state", "start although the checkpoint holds operators this job does not "
                  "run (their state is dropped)", switch=True),
        resource=Resource("state_backend")),
    Setting(
        "allow_new_operators", bool, False,
        "start operators the checkpoint lacks empty",
        parse_bool,
        flag=Flag("--allow-new-operators", "start although the checkpoint lacks some of this job's operators (they "
                  "start empty)", switch=True),
        resource=Resource("state_backend")),
    Setting(
        "changelog", bool, True,
        "changelog checkpoints (Flink's FLIP-158): upload the entries that changed, materialize now and then",
        parse_bool, flink=("state.backend.changelog.enabled",), resource=Resource("state_backend")),
    Setting(
        "changelog_materialize_share", float, ChangelogOptions().materialize_share,
        "materialize when what a restore reads (the last materialization and the chain) exceeds the state's "
        "bytes (its working SSTs compacted, as a materialization writes them) by this share of them: overwritten, "
        "deleted and expired entries, not a growing state's new ones",
        float),
    Setting(
        "changelog_max_chain", int, ChangelogOptions().max_chain,
        "... or once the chain has this many changelog files",
        int),
    Setting(
        "changelog_materialize_in_steps", bool, True,
        "upload a materialization as slices over the next checkpoints (no checkpoint above about twice the mean "
        "upload) instead of all in one",
        parse_bool),
    Setting(
        "rocksdb_block_cache_mb", int, RocksDBOptions().block_cache_mb,
        "the process's RocksDB block cache, shared by every database and state it opens, with a unit (`64mb`, "
        "`1gb`) or in MB, from 1 MB to 1 TB; index and filter blocks live in it. The memtables of all of them "
        "together are held to two 64 MB write buffers beside it",
        parse_megabytes, flink=("state.backend.rocksdb.block.cache-size",), target="rocksdb.block_cache_mb",
        resource=Resource("state_backend")),
    Setting(
        "rocksdb_cache_index_and_filter_blocks", bool, RocksDBOptions().cache_index_and_filter_blocks,
        "false: every open loads each SST's whole index and filter into memory (RocksDB's default, slower to open)",
        parse_bool, target="rocksdb.cache_index_and_filter_blocks"),
    Setting(
        "rocksdb_min_file_mb", float, RocksDBOptions().min_file_mb,
        "the least size, in MB, of a state's SST files, which are cut at about one key group's bytes of the "
        "state (what an erase reads for a key) and never above 64 MB: raise it where many small files cost "
        "more requests than a key's erase saves",
        float, target="rocksdb.min_file_mb"),
    Setting(
        "event_time", str | None, None,
        "the input's event-time column (a timestamp): a watermark, late rows, event-time timers and TTL",
        str,
        flag=Flag("--event-time", "the input's timestamp column: a watermark, late rows, event-time timers and "
                  "TTL", metavar="COLUMN")),
    Setting(
        "allowed_lateness", float, 0.0,
        "seconds the watermark trails the highest event time seen",
        float,
        flag=Flag("--allowed-lateness", "how far the watermark trails the highest event time seen (default 0)",
                  type=seconds, metavar="SECONDS")),
    Setting(
        "late", str, "drop",
        "rows below the watermark their batch starts with: `drop` or `process`",
        str,
        flag=Flag("--late", "rows below the watermark their batch starts with: dropped (default) or processed",
                  choices=("drop", "process"))),
    Setting(
        "on_bad_file", str, "fail",
        "a batch file that fails its checks before Spark (not Parquet, a missing column, a wrong key type, null "
        "keys): `fail` stops before any upload, `skip` consumes it unprocessed and records it in `_metadata`",
        _lower, check=check_on_bad_file,
        flag=Flag("--on-bad-file", "an input file that is not Parquet, lacks a column, has a wrong type or null "
                  "keys: fail before any upload (default), or skip it (recorded in the checkpoint)",
                  choices=ON_BAD_FILE),
        resource=Resource("source")),
    Setting(
        "max_future_event_time", float | None, MAX_FUTURE_EVENT_TIME,
        "seconds an input file's highest event time may lie beyond its batch's processing time; a file beyond is "
        "a bad file (check `future_event_times`) under `on_bad_file`, so that one row in year 2999 (a producer's "
        "unit mix-up) does not move the watermark for good; `none`: no bound. With `event_time` only",
        _optional_seconds, check=check_max_future_event_time,
        flag=Flag("--max-future-event-time", "an input file whose highest event time lies more than SECONDS beyond "
                  "its batch's processing time is a bad file, as --on-bad-file says (default 86400: one day; "
                  "--conf max_future_event_time=none: no bound)", type=seconds, metavar="SECONDS"),
        resource=Resource("source")),
    Setting(
        "settle_seconds", float, SETTLE_SECONDS,
        "seconds an input file's size and modification time must stay unchanged before it counts as landed: the "
        "input sensor and `--follow` offer it only then, and a file that fails its checks is skipped or refused "
        "only then (two looks this far apart); a file still being written before it ends the batch, unconsumed. "
        "Raise it when a writer may pause longer mid-file",
        float, check=check_settle_seconds,
        flag=Flag("--settle-seconds", "how long an input file must be unchanged before a failing check counts (and "
                  "before --follow takes it); default 2", type=seconds, metavar="SECONDS"),
        resource=Resource("source")),
    Setting(
        "rescan", bool, False,
        "list the whole input directory (every date partition), not only the names above the offsets' floor: "
        "slower the longer the job has run; it names in a warning the batch files below the floor that look late "
        "(modified after the floor's file), which the floor refuses (docs: A pipeline's life)",
        parse_bool,
        flag=Flag("--rescan", "list the whole input directory, not only above the last checkpoint's floor, and "
                  "warn of late files below it", switch=True),
        resource=Resource("source")),
    Setting(
        "input_cleanup", str, "keep",
        "what `prune` (the retention sensor's run, `sparkpoint prune`, Airflow's prune task) and the end of a "
        "`sparkpoint run` (not `--follow`) do with an input file once every retained checkpoint and savepoint has "
        "consumed it (so no restore, fallback or rollback reads it again), never one of a pending attempt: `keep` "
        "(default), `delete`, or `archive:<url>` (copied "
        "to `<url>/<name>` and checked by size and CRC32, then deleted; with the input's storage options). "
        "Deletes go in batches (1,000 keys per S3 request). A table input takes only `keep`",
        parse_input_cleanup, check=check_input_cleanup,
        flag=Flag("--input-cleanup", "what prune (and a run, at its end) does with input files every retained "
                  "checkpoint has consumed: "
                  "keep (default), delete, or archive:URL (copied, checked, then deleted)", type=input_cleanup_flag,
                  metavar="keep|delete|archive:URL"),
        resource=Resource("source")),
    Setting(
        "routing", str, "auto",
        "how a batch's rows reach their subtasks: `read-all` (each subtask's task reads the whole batch; one "
        "stage), `shuffle` (read once, routed by key group through Spark's shuffle) or `auto` (the shuffle once "
        "read-all would read 64 MB or more beyond the batch); the route taken is in `_metadata`",
        _lower, check=check_routing,
        flag=Flag("--routing", "how a batch reaches its subtasks: each subtask's task reads the whole batch "
                  "(read-all), the batch is read once and routed through Spark's shuffle (shuffle), or auto "
                  "(default: the shuffle once read-all would read 64 MB or more beyond the batch)",
                  choices=ROUTINGS),
        resource=Resource("state_backend")),
    Setting(
        "table_changes", str, "fail",
        "a commit of an input table that removes or rewrites rows (a DELETE, an UPDATE, a MERGE, an overwrite): "
        "`fail` stops before it, naming the version; `skip` passes over it (the state keeps what it removed); "
        "`feed` reads it as Delta's change data feed, rows with a `_change_type` column (insert, delete, "
        "update_preimage, update_postimage; appends are inserts). A compaction (Delta `dataChange=false`, "
        "Iceberg `replace`) adds no rows and is always passed over. Iceberg tables take `fail` or `skip`",
        _lower, flink=("source.table.changes",), check=check_table_changes),
    Setting(
        "table_resume_from", int | None, None,
        "an input table's version (Iceberg: snapshot id) to go on from when the job has not consumed up to it, "
        "reading nothing of the versions in between: the way on once the table no longer has the versions after "
        "the consumed one (vacuumed, log cleaned up, snapshots expired); the error names the versions it has",
        _optional_int, flink=("source.table.resume-from",)),
    Setting(
        "output_schema_evolution", bool, False,
        "add the columns an emitting operator writes and the output table lacks (Delta: new nullable columns, in "
        "a table version of their own) instead of refusing the run before Spark starts",
        parse_bool, flink=("sink.schema-evolution",)),
    Setting(
        "output_replay_window", float, REPLAY_WINDOW,
        "seconds a Delta output table must remember this job's commits (its app transactions): the longest the "
        "job may stay stopped, or keep a checkpoint it may fall back to (about retained checkpoints x checkpoint "
        "interval), plus the longest recovery you expect. A table whose `delta.setTransactionRetentionDuration` is "
        "shorter is refused at start (a replay older than the table remembers would commit its rows twice)",
        float, flink=("sink.replay-window",), check=check_replay_window, shown_default="604800 (7 days)"),
    Setting(
        "storage_prices", str, DEFAULT_PRICES,
        "the price table a checkpoint's `estimated_cost_usd` is computed by: USD per 1,000 requests of each "
        "operation (PUT, COPY, LIST, GET, HEAD, DELETE) and per GB in and out, as `NAME=USD,...`; the ones "
        "given replace the defaults, S3 Standard's public prices in us-east-1 as of 2026-11-28 (data out priced "
        "as to the internet: `out_per_gb=0` for a reader in the same region)",
        parse_prices, flink=("state.checkpoints.storage-prices",)),
    Setting(
        "metrics_pushgateway", str | None, None,
        "a Prometheus Pushgateway URL (`http://host:9091`): after every checkpoint and restore the pipeline's "
        "metrics are pushed there, grouped by job (the pipeline's job id); none: not pushed",
        _optional_url, flink=("metrics.reporter.promgateway.hostUrl",)),
    Setting(
        "metrics_otlp_endpoint", str | None, None,
        "an OpenTelemetry collector's OTLP/HTTP metrics endpoint (`http://host:4318/v1/metrics`): the "
        "pipeline's metrics are exported there after every checkpoint; none: not exported",
        _optional_url, flink=("metrics.reporter.otel.exporter.endpoint",)),
    Setting(
        "history_max_checkpoints", int, HISTORY_KEEP,
        "checkpoints the job's history keeps (`<job>/_history/`, read by `sparkpoint history`): a record of a few "
        "hundred bytes each, written by the completer after `_metadata`, folded into segments of 1,000; `0`: "
        "no history is written",
        int, check=check_history_max_checkpoints),
    Setting(
        "traces_endpoint", str | None, None,
        "OpenTelemetry traces, one per checkpoint and one per restore, with a span per operator, subtask and phase: "
        "an OTLP/HTTP endpoint (`http://127.0.0.1:4318/v1/traces`), or `global` for the tracer provider the "
        "process installed; `none`: off (nothing is imported)",
        _optional_text),
    Setting(
        "lineage_transport", str | None, None,
        "OpenLineage run events, a START and a COMPLETE per checkpoint (inputs: the batch's files or table version; "
        "output: the sink): `file:///path/events.jsonl` (the client's file transport, one event a line), an "
        "`http(s)://` URL (its HTTP transport) or `console`; `none`: off (nothing is imported)",
        _optional_text, check=check_lineage_transport),
    Setting(
        "lineage_namespace", str, "sparkpoint",
        "the OpenLineage job namespace of the pipeline's job (the job's name is its job id)",
        str),
)

BY_NAME = {s.name: s for s in SETTINGS}


def _settings_class() -> Any:
    fields = [(s.name, s.type, dataclasses.field(default=s.default)) for s in SETTINGS if s.field == s.name]
    made = dataclasses.make_dataclass("PipelineSettings", fields, frozen=True, kw_only=True,
                                      namespace={"__module__": __name__})
    made.__doc__ = ("A pipeline's settings as one frozen value: a field per setting of `SETTINGS` that is a "
                    "field of its own (keyword-only, with its declared type and default).")
    return made


# The fields `Pipeline` and `PipelineConfig` have a setting each by: both are PipelineSettings.
# (Typed `Any` because it is made from the table: mypy sees these fields as Any.)
PipelineSettings: Any = _settings_class()


def flink_aliases() -> dict[str, str]:
    """Flink's key -> our name, for every setting `--conf` takes."""
    return {key: s.name for s in SETTINGS if s.conf for key in s.flink}


def flagged() -> tuple[Setting, ...]:
    """The settings `sparkpoint run` has a flag of its own for (not the arguments every job command shares)."""
    return tuple(s for s in SETTINGS if s.flag is not None and not s.flag.shared)


def of_role(role: str) -> tuple[Setting, ...]:
    """The settings that are fields of the Dagster resource of `role`."""
    return tuple(s for s in SETTINGS if s.resource is not None and s.resource.role == role)


# Read by older code and tests: made from SETTINGS, never written by hand.
FLINK_ALIASES = flink_aliases()
SETTING_DOCS = {s.name: s.description for s in SETTINGS if s.conf}


def resolve_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """Map Flink keys to ours and parse values; an unknown key or bad value is a clear error.
    RocksDB's settings come back as one `rocksdb` entry (a RocksDBOptions)."""
    conf = {s.name: s for s in SETTINGS if s.conf}
    aliases = flink_aliases()
    out: dict[str, Any] = {}
    for key, value in settings.items():
        name = aliases.get(key, key.replace("-", "_"))
        if name not in conf:
            known = ", ".join(sorted([*aliases, *conf]))
            raise ValueError(f"unknown setting {key!r}; known settings: {known}")
        try:
            out[name] = conf[name].parse(value)
        except ValueError as e:
            raise ValueError(f"setting {key!r}: {value!r} is not valid ({e})") from e
    rocksdb = {conf[name].target.split(".")[1]: out.pop(name) for name in list(out)
               if conf[name].target.startswith("rocksdb.")}
    if rocksdb:
        try:
            out["rocksdb"] = RocksDBOptions(**rocksdb)
        except ValueError as e:
            raise ValueError(f"RocksDB settings: {e}") from e
    return out
