"""Exactly-once into a Delta Lake table (delta-rs): one table version per checkpoint that emitted rows.

Tasks write a subtask's changed rows as Parquet files *inside* the table's location, under a
prefix of the job's own that no reader sees until a commit names the files:

    <table>/sparkpoint-<job>/chk-<N>/<operator>-<subtask>-<12 hex>.parquet

(not hidden: a file no commit ever named is an orphan the table's own `VACUUM` collects). A
partitioned table gets a file per partition value set; its partition columns are not in the file
(Delta keeps them in the commit), their values ride in the file's footer (`sparkpoint.partition`).

Once checkpoint N's `_metadata` exists, the driver commits the staged files in ONE Delta
transaction, rows never rewritten: an add action per file (size, and statistics read from its
footer: numRecords, min/max, nullCount), an app transaction per emitting operator (`app_id`
`<job id>/<operator uid>`, `version` N) and commit info naming the job, the operators and N
(`sparkpoint.job`, `sparkpoint.operator`, `sparkpoint.checkpoint-id`). The table is created by the
first commit when it does not exist. A checkpoint without rows makes no table version.

Fencing: before committing, the committer reads `transaction_version(app_id)`. Below N, nothing of
N is in the table. At N or above, N is committed when its files are in the table (a retried step,
a recovery finishing a commit cut short: nothing is done); otherwise the writer is fenced (a
zombie, or a retried step of an attempt that lost): `SinkFenced`, nothing committed. Two
committers racing for N both read a version below N; Delta's conflict check (the winner's app
transaction) refuses the loser's commit, which then reads again and finds N committed. A conflict
with an unrelated writer of the table (an appender) is retried, not failed.

Crash points `before-table-commit` and `after-table-commit` stop a committer just before delta-rs
commits and just after (`sparkpoint.checkpoint.crash`); the commit itself is one log entry that
delta-rs creates atomically (put-if-absent), so there is no state between them a reader sees.
"""

from __future__ import annotations

import json
import logging
import posixpath
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import fsspec
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from sparkpoint.checkpoint.crash import crash_point
from sparkpoint.checkpoint.interleave import storage_step
from sparkpoint.checkpoint.storage import storage_url
from sparkpoint.tables.delta_parts import (
    check_retention,
    declared_schema,
    delta_options,
    footer_stats,
    partition_of,
    split_partitions,
    unfit,
    with_partition,
)
from sparkpoint.tables.files import footer_facts, remove_file, rows_table, write_parquet
from sparkpoint.tables.sink import DEFAULT_REPLAY_WINDOW, RowsErased, SinkError, SinkFenced, SinkSchemaMismatch
from sparkpoint.tables.spec import DeltaTable

if TYPE_CHECKING:
    import deltalake

log = logging.getLogger(__name__)

PREFIX = "sparkpoint-"  # the job's files in the table: sparkpoint-<job>/chk-<N>/...
COMMIT_ATTEMPTS = 20  # our own tries at one commit beyond delta-rs' retries (conflicts with other writers)
HISTORY_LOOKBACK = 50  # commits `facts` reads back for the version of a checkpoint (other writers' among them)


@dataclass(frozen=True)
class StagedFile:
    """One staged file as the committer reads it from its footer."""

    rel: str
    operator: str
    size: int
    rows: int
    schema: pa.Schema  # the file's columns and the partition columns
    partition_values: dict[str, str | None]
    stats: str


@dataclass(frozen=True)
class DeltaSink:
    """The Delta table sink (`open_sink` makes it; see the module for the protocol).

    `location` is the table's fsspec URL; `storage_options` are fsspec's (the staged files),
    `delta_options` delta-rs' (the log). `table_schema` and `table_partitions` are the table's as
    the driver saw them when it made the tasks' spec (`for_tasks`; None: no table yet)."""

    url: str
    job_id: str
    location: str
    storage_options: tuple[tuple[str, Any], ...] = ()
    delta_options: tuple[tuple[str, str], ...] = ()
    partition_by: tuple[str, ...] = ()
    operators: tuple[tuple[str, str], ...] = ()  # (name, uid) of the pipeline's operators
    evolve_schema: bool = False
    replay_window: float = DEFAULT_REPLAY_WINDOW
    table_schema: bytes | None = None
    table_partitions: tuple[str, ...] | None = None

    @classmethod
    def at(cls, table: DeltaTable, job_id: str, *, storage_options: Mapping[str, Any] | None = None,
           operators: Sequence[tuple[str, str]] = (), evolve_schema: bool = False,
           replay_window: float = DEFAULT_REPLAY_WINDOW) -> DeltaSink:
        location = storage_url(table.url).rstrip("/")
        options = dict(storage_options or {})
        delta = dict(table.storage_options) if table.storage_options is not None else delta_options(location, options)
        sink = cls(table.uri, job_id, location, tuple(sorted(options.items())),
                   tuple(sorted((str(k), str(v)) for k, v in delta.items())), tuple(table.partition_by or ()),
                   tuple(operators), evolve_schema, replay_window)
        try:
            sink._fs()
        except (ValueError, ImportError) as e:
            raise SinkError(f"cannot open output {table.uri}: {e}") from e
        return sink

    # --- where things are ----------------------------------------------------------------------

    def _fs(self) -> tuple[Any, str]:
        fs, root = fsspec.core.url_to_fs(self.location, **dict(self.storage_options))
        return fs, root.rstrip("/")

    @property
    def _uri(self) -> str:
        """The table as delta-rs opens it (a local table by its path)."""
        return self.location[len("file://"):] if self.location.startswith("file://") else self.location

    @property
    def _log(self) -> str:
        """The table's log, as the interleaving checker sees it: every read of the table and every
        commit is one step on it (a commit creates its next entry)."""
        return f"{self.location}/_delta_log"

    @property
    def _prefix(self) -> str:
        return f"{PREFIX}{self.job_id}"

    def _staged_re(self) -> re.Pattern[str]:
        return re.compile(re.escape(self._prefix) + r"/chk-(\d+)/([A-Za-z0-9_.-]+)-\d{5}-[0-9a-f]{12}\.parquet")

    def _staged_of(self, rel: str, checkpoint_id: int) -> str:
        """The operator of a staged name of checkpoint N; SinkError for anything else (a name
        never leaves the job's prefix)."""
        m = self._staged_re().fullmatch(rel)
        if not m or int(m.group(1)) != checkpoint_id:
            raise SinkError(f"{rel!r} is not a staged file of checkpoint {checkpoint_id} in {self.url}")
        return m.group(2)

    def app_id(self, operator: str) -> str:
        """The app transaction id of an operator (by name) of this job: `<job id>/<operator uid>`."""
        return f"{self.job_id}/{dict(self.operators).get(operator, operator)}"

    def _load(self) -> deltalake.DeltaTable | None:
        """The table's latest version; None when there is no table yet."""
        from deltalake import DeltaTable as Table
        from deltalake.exceptions import TableNotFoundError

        storage_step("read", self._log)
        try:
            return Table(self._uri, storage_options=dict(self.delta_options) or None)
        except TableNotFoundError:
            return None

    # --- before Spark starts -------------------------------------------------------------------

    def check_start(self, outputs: Mapping[str, Sequence[tuple[str, str]]]) -> None:
        """Refuse, before Spark starts, a table that forgets app transactions sooner than the job's
        replay window, or whose schema does not take what the operators declare they emit (with
        `evolve_schema`, the columns it lacks are added now, in a table version of their own)."""
        table = self._load()
        if table is None:
            for operator, columns in outputs.items():
                missing = [c for c in self.partition_by if columns and c not in dict(columns)]
                if missing:
                    raise SinkSchemaMismatch(
                        f"operator {operator} declares no column {', '.join(missing)}, which the Delta table "
                        f"{self.url} is to be partitioned by (partition_by): emit it, or partition by others")
            return
        check_retention(table.metadata().configuration, self.replay_window, self.url)
        schema = pa.schema(table.schema().to_arrow())
        partitions = list(table.metadata().partition_columns)
        lacking: dict[str, pa.DataType] = {}
        for operator, columns in outputs.items():
            if not columns:
                continue
            declared = declared_schema(columns)
            lacking.update(unfit(declared, schema, partitions, operator, self.url, self.evolve_schema))
        if lacking:
            self._add_columns(table, lacking)

    def _add_columns(self, table: deltalake.DeltaTable, columns: Mapping[str, pa.DataType]) -> None:
        from deltalake import Field, Schema
        from deltalake.transaction import CommitProperties

        fields = list(Schema.from_arrow(pa.schema([pa.field(n, t) for n, t in columns.items()])).fields)
        log.warning("output %s: adding columns %s to the table (schema evolution)", self.url,
                    ", ".join(f"{n} {t}" for n, t in columns.items()))
        storage_step("create", self._log)
        info = {"sparkpoint.job": self.job_id, "sparkpoint.schema-evolution": sorted(columns)}
        table.alter.add_columns([Field(f.name, f.type, nullable=True) for f in fields],
                                commit_properties=CommitProperties(custom_metadata=info))

    def for_tasks(self) -> DeltaSink:
        """This sink with the table's schema and partition columns now (none before the table exists)."""
        table = self._load()
        if table is None:
            return replace(self, table_schema=None, table_partitions=None)
        schema = pa.schema(table.schema().to_arrow())
        return replace(self, table_schema=schema.serialize().to_pybytes(),
                       table_partitions=tuple(table.metadata().partition_columns))

    # --- in the tasks ----------------------------------------------------------------------------

    def stage(self, checkpoint_id: int, operator: str, subtask: int, rows: pd.DataFrame) -> list[str]:
        """Write one subtask's changed rows for checkpoint N into the table's location, unseen
        until the commit: a file per partition value set; returns their names in the table."""
        if rows.empty:
            return []
        table = self._fitted(rows_table(rows, checkpoint_id), operator)
        fs, root = self._fs()
        staged = []
        for values, piece in split_partitions(table, self._partitions(), operator):
            rel = f"{self._prefix}/chk-{checkpoint_id}/{operator}-{subtask:05d}-{uuid.uuid4().hex[:12]}.parquet"
            path = f"{root}/{rel}"
            fs.makedirs(posixpath.dirname(path), exist_ok=True)
            storage_step("write", path)
            write_parquet(fs, path, with_partition(piece, values))
            staged.append(rel)
        return staged

    def _partitions(self) -> tuple[str, ...]:
        return self.table_partitions if self.table_partitions is not None else self.partition_by

    def _fitted(self, table: pa.Table, operator: str) -> pa.Table:
        """The rows with the table's types (a safe cast), refused when a column does not fit."""
        if self.table_schema is None:  # the first commit makes the table: Delta keeps timestamps in µs
            return pa.Table.from_arrays([c.cast(pa.timestamp("us", c.type.tz), safe=True)
                                         if pa.types.is_timestamp(c.type) and c.type.unit == "ns" else c
                                         for c in table.columns], names=table.column_names)
        target = pa.ipc.read_schema(pa.py_buffer(self.table_schema))
        unfit(table.schema, target, list(self._partitions()), operator, self.url, self.evolve_schema)
        columns = []
        for field in table.schema:
            column = table.column(field.name)
            if field.name in target.names and target.field(field.name).type != field.type:
                wanted = target.field(field.name).type
                try:
                    column = column.cast(wanted, safe=True)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                    raise SinkSchemaMismatch(
                        f"operator {operator} emits column {field.name} as {field.type}, which the Delta table "
                        f"{self.url} holds as {wanted} and the values do not convert ({e}): emit {wanted}"
                    ) from e
            columns.append(column)
        return pa.Table.from_arrays(columns, names=table.column_names)

    # --- on the driver ---------------------------------------------------------------------------

    def commit(self, checkpoint_id: int, staged: list[str], *, resuming: bool = False) -> int:
        """Commit checkpoint N's staged files to the table in one transaction, exactly once;
        returns the files committed now (0: committed before, or no rows). `resuming`: a later
        start finishing a commit a crash may have cut short; a commit found done is left as it is.

        Raises SinkFenced when the table records N or a newer checkpoint for an operator while
        N's files are not in it (nothing is committed)."""
        if not staged:
            return 0
        operators = sorted({self._staged_of(rel, checkpoint_id) for rel in staged})
        files: list[StagedFile] | None = None
        for attempt in range(COMMIT_ATTEMPTS):
            table = self._load()
            if self._is_committed(table, checkpoint_id, staged, operators, resuming):
                return 0
            files = files or [self._read_staged(rel, checkpoint_id) for rel in staged]
            crash_point("before-table-commit")
            try:
                self._commit_once(table, checkpoint_id, files, operators)
            except Exception as e:  # a conflict: read the table again, and see whether N is in it now
                if not _conflict(e) or attempt == COMMIT_ATTEMPTS - 1:
                    raise
                log.info("output %s: checkpoint %s's commit met another writer's (%s); trying again", self.url,
                         checkpoint_id, e)
                time.sleep(min(2.0, 0.05 * 2 ** attempt))
                continue
            crash_point("after-table-commit")
            return len(staged)
        raise AssertionError("unreachable")

    def _is_committed(self, table: deltalake.DeltaTable | None, checkpoint_id: int, staged: list[str],
                      operators: list[str], resuming: bool) -> bool:
        """Whether checkpoint N is in the table already; raises SinkFenced for a writer the table
        has moved past. Cheap in the usual case: every operator's recorded version below N."""
        if table is None:
            return False
        versions = {op: table.transaction_version(self.app_id(op)) for op in operators}
        known = all(op in dict(self.operators) for op in operators)
        if known and all(v is None or v < checkpoint_id for v in versions.values()):
            return False
        present = set(staged) & set(self._paths(table))
        if present == set(staged):
            log.info("output %s: checkpoint %s is committed already", self.url, checkpoint_id)
            return True
        recorded = max((v for v in versions.values() if v is not None), default=None)
        if resuming and (present or (recorded is not None and recorded >= checkpoint_id)):
            log.warning("output %s: checkpoint %s was committed before and some of its files have left the table "
                        "since: left as it is", self.url, checkpoint_id)
            return True
        if present:
            raise SinkError(f"output {self.url}: {len(present)} of checkpoint {checkpoint_id}'s {len(staged)} files "
                            "are in the table and the others are not: it was changed by hand; restore them or "
                            "remove these by hand, then run again")
        if recorded is not None and recorded >= checkpoint_id:
            apps = ", ".join(f"{self.app_id(op)}={v}" for op, v in versions.items())
            raise SinkFenced(
                f"output {self.url} records checkpoint {recorded} of job {self.job_id} ({apps}), and checkpoint "
                f"{checkpoint_id} of this writer is not in it: this is a fenced writer (a zombie completer, or a "
                "retried step of an attempt that lost), so it commits nothing; the job goes on from the table's")
        return False

    def _paths(self, table: deltalake.DeltaTable) -> list[str]:
        """The table's files (relative paths) under this job's prefix."""
        storage_step("read", self._log)
        paths = pa.table(table.get_add_actions(flatten=True)).column("path").to_pylist()
        return [p for p in paths if p.startswith(self._prefix + "/")]

    def _read_staged(self, rel: str, checkpoint_id: int) -> StagedFile:
        fs, root = self._fs()
        path = f"{root}/{rel}"
        storage_step("read", path)
        try:
            size = int(fs.info(path)["size"])
            with fs.open(path, "rb") as f:
                meta = pq.ParquetFile(f).metadata
        except FileNotFoundError:
            raise SinkError(
                f"checkpoint {checkpoint_id} is committed with output file {path}, which is gone and not in the "
                f"table: rows it wrote are lost. Put it back from a backup, or delete chk-{checkpoint_id}/_metadata "
                "by hand so its batch is processed again from the checkpoint before it") from None
        values, partition_schema = partition_of(meta.schema.to_arrow_schema())
        schema = pa.schema([*meta.schema.to_arrow_schema().remove_metadata(), *partition_schema])
        return StagedFile(rel, self._staged_of(rel, checkpoint_id), size, meta.num_rows, schema, values,
                          footer_stats(meta))

    def _commit_once(self, table: deltalake.DeltaTable | None, checkpoint_id: int, files: list[StagedFile],
                     operators: list[str]) -> None:
        from deltalake import Schema
        from deltalake.transaction import (
            AddAction,
            CommitProperties,
            RemoveAction,
            Transaction,
            create_table_with_add_actions,
        )

        now = int(time.time() * 1000)
        adds = [AddAction(f.rel, f.size, f.partition_values, now, True, f.stats) for f in files]
        properties = CommitProperties(
            app_transactions=[Transaction(self.app_id(op), checkpoint_id, now) for op in operators],
            custom_metadata={"sparkpoint.job": self.job_id, "sparkpoint.operator": ",".join(operators),
                             "sparkpoint.operators": [dict(self.operators).get(op, op) for op in operators],
                             "sparkpoint.checkpoint-id": checkpoint_id})
        schema = pa.unify_schemas([f.schema for f in files], promote_options="permissive")
        storage_step("create", self._log)
        if table is None:
            create_table_with_add_actions(self._uri, Schema.from_arrow(schema), adds, mode="error",
                                          partition_by=list(self.partition_by) or None,
                                          storage_options=dict(self.delta_options) or None,
                                          commit_properties=properties)
            return
        current = pa.schema(table.schema().to_arrow())
        partitions = list(table.metadata().partition_columns)
        lacking = unfit(schema, current, partitions, ",".join(operators), self.url, self.evolve_schema)
        if lacking:
            self._add_columns(table, lacking)
            table = self._load()
            assert table is not None
        actions: list[AddAction | RemoveAction] = list(adds)
        table.create_write_transaction(actions, "append", table.schema(), partition_by=partitions or None,
                                       commit_properties=properties)

    def discard_staged(self, checkpoint_id: int, staged: list[str]) -> None:
        """Delete these staged files of checkpoint N (an aborted attempt's), never one the table has."""
        for rel in staged:
            self._staged_of(rel, checkpoint_id)
        table = self._load()
        kept = set(self._paths(table)) if table is not None else set()
        fs, root = self._fs()
        for rel in staged:
            if rel in kept:
                continue
            storage_step("delete", f"{root}/{rel}")
            remove_file(fs, f"{root}/{rel}")

    def committed(self, after: int = 0) -> dict[int, list[str]]:
        """This job's files in the table (relative paths) by checkpoint id, above `after`."""
        table = self._load()
        if table is None:
            return {}
        pattern = self._staged_re()
        out: dict[int, list[str]] = {}
        for path in self._paths(table):
            m = pattern.fullmatch(path)
            if m and int(m.group(1)) > after:
                out.setdefault(int(m.group(1)), []).append(path)
        return out

    def rollback(self, after: int) -> list[int]:
        """Remove the rows of checkpoints newer than `after` from the table (one new version)."""
        return self.drop([cid for cid in self.committed() if cid > after])

    def drop(self, checkpoint_ids: list[int]) -> list[int]:
        """Remove the files of these checkpoints from the table in one new version (the files
        stay for time travel until the table's VACUUM); returns the ids that had any."""
        from deltalake.transaction import AddAction, CommitProperties, RemoveAction

        wanted = set(checkpoint_ids)
        for attempt in range(COMMIT_ATTEMPTS):
            table = self._load()
            if table is None:
                return []
            held = pa.table(table.get_add_actions(flatten=True)).to_pylist()
            pattern = self._staged_re()
            doomed = [(a, int(m.group(1))) for a in held
                      if (m := pattern.fullmatch(a["path"])) is not None and int(m.group(1)) in wanted]
            if not doomed:
                return []
            now = int(time.time() * 1000)
            partitions = list(table.metadata().partition_columns)
            removes = [RemoveAction(a["path"], True, now, a["size_bytes"],
                                    {c: a.get(f"partition.{c}") for c in partitions} if partitions else None)
                       for a, _ in doomed]
            dropped = sorted({cid for _, cid in doomed})
            storage_step("create", self._log)
            actions: list[AddAction | RemoveAction] = list(removes)
            info = {"sparkpoint.job": self.job_id, "sparkpoint.dropped-checkpoints": dropped}
            try:
                table.create_write_transaction(actions, "append", table.schema(), partition_by=partitions or None,
                                               commit_properties=CommitProperties(custom_metadata=info))
            except Exception as e:
                if not _conflict(e) or attempt == COMMIT_ATTEMPTS - 1:
                    raise
                time.sleep(min(2.0, 0.05 * 2 ** attempt))
                continue
            return dropped
        raise AssertionError("unreachable")

    def erase_rows(self, column: str, values: Sequence[object], *, dry_run: bool = False) -> RowsErased:
        """Remove this job's rows whose `column` holds one of `values`: one table version replaces
        the files that hold them with copies without them (new names of the same checkpoint, so a
        rollback drops the copies), then exactly the removed files are deleted from storage
        (`sparkpoint.tables.delta_erase`: time travel to before the erase loses those files).

        Raises SinkError for a column the table lacks or partitions by."""
        from sparkpoint.tables.delta_erase import erase_delta_rows

        table = self._load()
        if table is not None:
            names = pa.schema(table.schema().to_arrow()).names
            if column in table.metadata().partition_columns:
                raise SinkError(f"cannot erase by {column!r} from {self.url}: the table is partitioned by it, so "
                                "its rows are whole partitions; delete them with the table's own DELETE")
            if column not in names:
                raise SinkError(f"the Delta table {self.url} has no column {column!r} to erase by; it has "
                                f"{', '.join(names)}")
        return erase_delta_rows(self, column, list(values), dry_run=dry_run)

    def discard_staging(self, up_to: int) -> None:
        """Delete staged files of checkpoints up to `up_to` that no commit named: in a checkpoint
        the table holds, the files beside its own (an attempt that lost); in one above every
        version the table records, all. A checkpoint at or below it with none of its files in the
        table is left to the table's VACUUM: it may have been removed by a rollback, and its files
        are still the older versions' (time travel)."""
        fs, root = self._fs()
        base = f"{root}/{self._prefix}"
        storage_step("list", f"{base}/chk-*")
        try:
            entries = fs.ls(base, detail=False)
        except FileNotFoundError:
            return
        chosen = {}
        for path in entries:
            name = posixpath.basename(path.rstrip("/"))
            if name.startswith("chk-") and name[4:].isdigit() and int(name[4:]) <= up_to:
                chosen[int(name[4:])] = path.rstrip("/")
        if not chosen:
            return
        table = self._load()
        held = self.committed() if table is not None else {}
        recorded = max((v for uid in {u for _, u in self.operators}
                        if table is not None and (v := table.transaction_version(f"{self.job_id}/{uid}")) is not None),
                       default=0)
        for cid, path in sorted(chosen.items()):
            if cid not in held and cid <= recorded:
                continue
            keep = {posixpath.basename(p) for p in held.get(cid, [])}
            storage_step("list", f"{path}/*")
            for f in fs.ls(path, detail=False):
                if posixpath.basename(f) not in keep:
                    storage_step("delete", f)
                    remove_file(fs, f)
            if not keep:
                try:
                    fs.rmdir(path)
                except (OSError, NotImplementedError):
                    pass

    def facts(self, checkpoint_id: int, staged: list[str]) -> dict[str, Any]:
        """What checkpoint N committed: files and rows from its files' footers (the keys of the
        Parquet sink's facts), the table `version` whose commit info names N (None: N made no
        version, or it is older than the last `HISTORY_LOOKBACK` commits) and the table's columns
        at its latest version. For a report after the commit: a table that cannot be read is named
        in `unreadable`, never raised."""
        fs, root = self._fs()
        for rel in staged:
            self._staged_of(rel, checkpoint_id)
        facts = footer_facts(fs, self.url, [f"{root}/{rel}" for rel in staged])
        facts["version"] = None
        if not staged:
            return facts
        try:
            table = self._load()
            if table is not None:
                facts["version"] = self.version_of(table, checkpoint_id)
                facts["columns"] = {f.name: str(f.type) for f in pa.schema(table.schema().to_arrow())}
        except Exception as e:  # noqa: BLE001  reporting only: the checkpoint is committed
            facts["unreadable"].append(f"{self.url}: {type(e).__name__}: {e}")
        return facts

    def version_of(self, table: deltalake.DeltaTable, checkpoint_id: int) -> int | None:
        """The table version whose commit info names checkpoint N of this job, from the newest
        version back, at most `HISTORY_LOOKBACK` commit files (a report asks right after the
        commit: usually the newest file is it). Read with fsspec: delta-rs' `history()` reads every
        one of them first, and holds the GIL while it waits for an answer."""
        fs, root = self._fs()
        newest = table.version()
        for version in range(newest, max(-1, newest - HISTORY_LOOKBACK), -1):
            path = f"{root}/_delta_log/{version:020d}.json"
            storage_step("read", path)
            try:
                lines = fs.cat_file(path).decode().splitlines()
            except FileNotFoundError:  # the log was cleaned up past it
                return None
            infos = [json.loads(line).get("commitInfo") or {} for line in lines if line.strip()]
            if any(i.get("sparkpoint.job") == self.job_id and i.get("sparkpoint.checkpoint-id") == checkpoint_id
                   for i in infos):
                return version
        return None


def _conflict(error: Exception) -> bool:
    """A commit that lost to another writer (delta-rs' CommitFailedError), or a create that found
    the table made meanwhile: worth reading the table again."""
    from deltalake.exceptions import CommitFailedError, DeltaError

    if isinstance(error, CommitFailedError):
        return True
    return isinstance(error, DeltaError) and "exist" in str(error).lower()
