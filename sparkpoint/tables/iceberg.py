"""Exactly-once Iceberg sink: one table snapshot per checkpoint, committed on the driver with pyiceberg.

Tasks write a subtask's changed rows as Parquet into the table's data directory,
`<table location>/data/sparkpoint-<job>/chk-<N>/<operator>-<subtask>-<uuid>.parquet` (a file per
partition value of a partitioned table), where no reader sees them until a snapshot lists them.
Once checkpoint N's `_metadata` exists the driver adds them to the table with `add_files` in one
transaction (the rows are never rewritten); the snapshot's summary carries `sparkpoint.job`,
`sparkpoint.operator` and `sparkpoint.checkpoint-id`, as Flink's IcebergCommitter writes them;
the snapshot is tagged `sparkpoint-<job>-chk-<N>` (the newest `checkpoint_tags` checkpoints keep
theirs, for a rollback to them) and the tag `sparkpoint-<job>-latest` moves to it: a tag keeps its
snapshot, and with it the record of the job's newest checkpoint, from snapshot expiry.

Exactly once: before each commit the sink reads which checkpoints the table's snapshots record
for this job. A checkpoint the table holds is not committed again (a retried step, a recovery, a
zombie completer); one below the newest it holds is a fenced writer, unless the commit is a later
start's `resuming` one (checkpoints are committed in order: a newer one there means this one
was). The commit asserts the branch head it read, so a writer that committed in between makes it
fail; it is then read and tried again (pyiceberg's own retry would rebase the snapshot without
reading the table again).
`drop` and `rollback` remove exactly this job's files of those checkpoints in one delete snapshot,
keeping every other writer's rows and the record of what was committed.
"""

from __future__ import annotations

import logging
import os
import posixpath
import random
import re
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any, TypeVar

import fsspec
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pyiceberg.catalog import Catalog, load_catalog
from pyiceberg.exceptions import (
    CommitFailedException,
    CommitStateUnknownException,
    NoSuchNamespaceError,
    NoSuchTableError,
    ResolveError,
    TableAlreadyExistsError,
    ValidationError,
)
from pyiceberg.io.pyarrow import _pyarrow_to_schema_without_ids, parquet_file_to_data_file, schema_to_pyarrow
from pyiceberg.manifest import DataFile, ManifestContent
from pyiceberg.partitioning import PartitionField, PartitionSpec, partition_record_value
from pyiceberg.schema import Schema, promote
from pyiceberg.table import Table, TableProperties
from pyiceberg.table.refs import SnapshotRefType
from pyiceberg.table.snapshots import Operation
from pyiceberg.table.update import RemoveSnapshotRefUpdate, SetSnapshotRefUpdate, TableUpdate
from pyiceberg.table.update.snapshot import _OverwriteFiles
from pyiceberg.types import IcebergType, ListType, MapType, StructType
from pyiceberg.utils.concurrent import ExecutorFactory
from pyiceberg.utils.config import Config

from sparkpoint.checkpoint.crash import crash_point
from sparkpoint.checkpoint.interleave import storage_step
from sparkpoint.tables.files import remove_file
from sparkpoint.tables.sink import RowsErased, SinkError
from sparkpoint.tables.spec import IcebergTable

log = logging.getLogger(__name__)

JOB = "sparkpoint.job"
OPERATOR = "sparkpoint.operator"
CHECKPOINT = "sparkpoint.checkpoint-id"
DROPPED = "sparkpoint.dropped-checkpoints"
CHECKPOINT_COLUMN = "checkpoint_id"
COMMIT_RETRY_SECONDS = 120.0  # how long a commit goes on losing to other writers; backoff 50 ms doubling to 2 s
_STAGED = re.compile(r"^chk-(\d+)/([A-Za-z0-9_.-]+-\d{5})-[0-9a-f]{12}\.parquet$")  # after "<job prefix>/"
T = TypeVar("T")


class IcebergSinkFenced(SinkError):
    """A commit of a checkpoint older than the newest one the table holds for the job: this writer
    (a zombie completer, a stale retry) was overtaken and must not commit."""


class IcebergSchemaMismatch(SinkError):
    """The table does not take the output's columns and types (or cannot be evolved to)."""


class IcebergStagedFileLost(SinkError):
    """A staged file of a checkpoint to commit is gone: rows the checkpoint says it wrote are lost."""


EMBEDDED_DIR = ".sparkpoint/iceberg"  # the embedded default catalog's directory (relative to the working directory)


def embedded_catalog(directory: str) -> dict[str, str]:
    """The embedded default catalog: pyiceberg's SQL catalog on SQLite under `directory`, with its
    warehouse beside it (`<directory>/catalog.db`, `<directory>/warehouse`)."""
    root = os.path.abspath(os.path.expanduser(directory))
    os.makedirs(root, exist_ok=True)
    return {"type": "sql", "uri": f"sqlite:///{root}/catalog.db", "warehouse": f"file://{root}/warehouse"}


def catalog_properties(table: IcebergTable, embedded_dir: str | None = None) -> dict[str, str]:
    """The properties `load_catalog` gets for `table`: its own (`catalog=`), else none when
    pyiceberg has a configuration of that name (`~/.pyiceberg.yaml`,
    `PYICEBERG_CATALOG__<NAME>__*`), else the embedded SQLite catalog under `embedded_dir`."""
    props = {key: str(value) for key, value in table.catalog.items() if key != "name"}
    if not props and Config().get_catalog_config(table.catalog_name) is None:
        if embedded_dir is None:
            raise SinkError(
                f"Iceberg catalog {table.catalog_name!r} of {table.uri} has no properties and pyiceberg has no "
                "configuration of it: give IcebergTable(..., catalog={'uri': ..., 'warehouse': ...}) (on the "
                "command line --conf iceberg.catalog.uri=... --conf iceberg.catalog.warehouse=...)")
        props = embedded_catalog(embedded_dir)
    return props


def table_storage(table: IcebergTable, embedded_dir: str | None,
                  storage_options: Mapping[str, Any] | None) -> tuple[dict[str, str], dict[str, Any]]:
    """(the catalog's properties, the fsspec options tasks write with). The table's files are
    reached with the S3 properties its catalog names (`catalog=`, pyiceberg's configuration, or
    pyiceberg-style `s3.*` keys among `storage_options`) when it names any, else with the
    pipeline's fsspec options, which pyiceberg then gets as its S3 properties."""
    given = dict(storage_options or {})
    props = {**{k: str(v) for k, v in given.items() if "." in k}, **catalog_properties(table, embedded_dir)}
    configured = {**{str(k): v for k, v in (Config().get_catalog_config(table.catalog_name) or {}).items()}, **props}
    if any(key.startswith("s3.") for key in configured):
        return props, fsspec_options({k: str(v) for k, v in configured.items()})
    options = {k: v for k, v in given.items() if "." not in k}
    return {**io_properties(options), **props}, options


def io_properties(storage_options: Mapping[str, Any]) -> dict[str, str]:
    """pyiceberg's S3 properties for fsspec (s3fs) options; a custom endpoint without a region
    gets `us-east-1`, since pyiceberg would otherwise ask AWS where the bucket is."""
    client = dict(storage_options.get("client_kwargs") or {})
    pairs = {
        "s3.access-key-id": storage_options.get("key"),
        "s3.secret-access-key": storage_options.get("secret"),
        "s3.session-token": storage_options.get("token"),
        "s3.endpoint": storage_options.get("endpoint_url") or client.get("endpoint_url"),
        "s3.region": client.get("region_name"),
    }
    props = {key: str(value) for key, value in pairs.items() if value}
    if "s3.endpoint" in props:
        props.setdefault("s3.region", "us-east-1")
    return props


def fsspec_options(props: Mapping[str, str]) -> dict[str, Any]:
    """fsspec (s3fs) options for pyiceberg's S3 properties: how tasks reach the table's files."""
    options: dict[str, Any] = {}
    for ours, theirs in (("key", "s3.access-key-id"), ("secret", "s3.secret-access-key"),
                         ("token", "s3.session-token")):
        if props.get(theirs):
            options[ours] = props[theirs]
    client = {name: props[key] for name, key in (("endpoint_url", "s3.endpoint"), ("region_name", "s3.region"))
              if props.get(key)}
    if client:
        options["client_kwargs"] = client
    return options


@lru_cache(maxsize=16)
def _catalog(name: str, props: tuple[tuple[str, str], ...]) -> Catalog:
    """One catalog object per process and configuration (a SQL catalog holds a connection pool)."""
    return load_catalog(name, **dict(props))


@dataclass(frozen=True)
class IcebergSink:
    """The exactly-once sink into one Iceberg table (see the module's docstring).

    A small frozen value: tasks get it pickled and need only `location`, `storage_options` and
    the table's schema and partition spec as they were when the sink was opened on the driver;
    the catalog is reached on the driver only.
    """

    url: str
    job_id: str
    identifier: str
    catalog_name: str
    catalog: tuple[tuple[str, str], ...]
    location: str  # the table's (where the first commit creates it when it does not exist)
    data_path: str = ""  # where its data files go: `<location>/data` unless the table says otherwise
    operators: tuple[tuple[str, str], ...] = ()
    storage_options: tuple[tuple[str, Any], ...] = ()
    table_schema: str | None = None  # the table's schema (pyiceberg JSON) when the sink was opened
    partition_spec: str | None = None  # its partition spec (JSON) when partitioned
    checkpoint_tags: int = 10
    evolve_schema: bool = False  # `check_start` evolves a table that lacks output columns instead of refusing

    @classmethod
    def at(cls, table: IcebergTable, job_id: str, operators: Mapping[str, str] | Sequence[tuple[str, str]],
           storage_options: Mapping[str, Any] | None = None, *, embedded_dir: str | None = EMBEDDED_DIR,
           checkpoint_tags: int = 10, evolve_schema: bool = False) -> IcebergSink:
        """The sink of `job_id` into `table`, for the emitting operators `operators` (name -> uid).
        `checkpoint_tags`: how many of the newest checkpoints keep their tag (give the number of
        retained checkpoints; older tags are removed so that snapshot expiry can reclaim them).
        `embedded_dir`: where the embedded SQLite catalog goes when the table's catalog has no
        properties and pyiceberg no configuration of it (None: refuse such a table).

        On the driver, before Spark starts: loads the catalog, reads the table (or where the
        catalog will create it on the first commit) and refuses a partitioning `add_files`
        cannot take.

        Raises:
            SinkError: the catalog cannot be loaded, or says nowhere for a new table.
            IcebergSchemaMismatch: the table is partitioned by a transform that does not keep order.
        """
        props, options = table_storage(table, embedded_dir, storage_options)
        sink = cls(table.uri, job_id, table.identifier, table.catalog_name, tuple(sorted(props.items())), "",
                   operators=tuple(sorted(dict(operators).items())), storage_options=tuple(sorted(options.items())),
                   checkpoint_tags=checkpoint_tags, evolve_schema=evolve_schema)
        return sink._opened()

    # --- the Sink protocol's steps before Spark starts, and reports ------------------------------

    def check_start(self, outputs: Mapping[str, Sequence[tuple[str, str]]]) -> None:
        """Before Spark starts: create a missing table from the columns the operators declare, and
        refuse (or, with `evolve_schema`, evolve) a table that does not take them. Operators that
        declare no columns are left to the first commit, which creates the table from the files."""
        from sparkpoint.tables.delta_parts import declared_schema

        declared = [declared_schema(columns) for columns in outputs.values() if columns]
        if declared:
            prepare_table(self, pa.unify_schemas(declared), evolve=self.evolve_schema)

    def for_tasks(self) -> IcebergSink:
        """This sink with the table's schema and partition spec now (tasks cast their rows to them)."""
        return self._opened()

    def facts(self, checkpoint_id: int, staged: list[str]) -> dict[str, Any]:
        """What checkpoint N added to the table (`output_facts`)."""
        return output_facts(self, checkpoint_id, staged)

    def _opened(self) -> IcebergSink:
        """This sink with the table's location, schema and partition spec read now."""
        try:
            catalog = self._catalog()
        except (ValueError, ImportError, OSError) as e:
            raise SinkError(f"cannot open the Iceberg catalog of {self.url}: {e}") from e
        table = self._load()
        if table is None:
            location = self.location or _new_table_location(catalog, self.identifier, self.url)
            return replace(self, location=location, data_path=f"{location}/data", table_schema=None,
                           partition_spec=None)
        spec = table.spec()
        unordered = [f"{f.transform}({table.schema().find_column_name(f.source_id)})" for f in spec.fields
                     if not f.transform.preserves_order]
        if unordered:
            raise IcebergSchemaMismatch(
                f"Iceberg table {self.identifier} is partitioned by {', '.join(unordered)}: pyiceberg's add_files "
                "infers a file's partition from its column statistics, which these transforms do not keep. "
                "Partition the table by identity, truncate or time transforms, or write to another table")
        location = table.location().rstrip("/")
        data = table.metadata.properties.get(TableProperties.WRITE_DATA_PATH) or f"{location}/data"
        return replace(self, location=location, data_path=data.rstrip("/"),
                       table_schema=table.schema().model_dump_json(),
                       partition_spec=None if spec.is_unpartitioned() else spec.model_dump_json())

    # --- names -----------------------------------------------------------------------------------

    @property
    def prefix(self) -> str:
        """Where this job's files go: staged names are relative to it."""
        return f"{self.data_path}/sparkpoint-{self.job_id}"

    def _tag(self, checkpoint_id: int) -> str:
        return f"sparkpoint-{self.job_id}-chk-{checkpoint_id}"

    @property
    def latest_tag(self) -> str:
        """The tag on the snapshot of the job's newest checkpoint. No two jobs' tags share a name:
        a checkpoint's ends in `-chk-<digits>`, this one in `-latest`."""
        return f"sparkpoint-{self.job_id}-latest"

    def _tag_updates(self, checkpoint_id: int, snapshot_id: int, refs: Mapping[str, Any]) -> tuple[TableUpdate, ...]:
        """The latest tag moved to this snapshot, its checkpoint's tag, and the tags of checkpoints
        beyond the newest `checkpoint_tags` removed."""
        mine = re.compile(rf"sparkpoint-{re.escape(self.job_id)}-chk-(\d+)")
        tagged = [int(m.group(1)) for name in refs if (m := mine.fullmatch(name))]
        keep = set(sorted({*tagged, checkpoint_id})[-self.checkpoint_tags:]) if self.checkpoint_tags > 0 else set()
        names = [self.latest_tag] + [self._tag(checkpoint_id)] * (checkpoint_id in keep)
        return (*(SetSnapshotRefUpdate.model_validate({"ref-name": name, "type": SnapshotRefType.TAG,
                                                       "snapshot-id": snapshot_id}) for name in names),
                *(RemoveSnapshotRefUpdate.model_validate({"ref-name": self._tag(cid)})
                  for cid in tagged if cid not in keep))

    def _summary(self, checkpoint_id: int) -> dict[str, str]:
        return {JOB: self.job_id, OPERATOR: ",".join(uid for _, uid in self.operators),
                CHECKPOINT: str(checkpoint_id)}

    def _fs(self) -> tuple[Any, str]:
        fs, root = fsspec.core.url_to_fs(self.prefix, **dict(self.storage_options))
        return fs, root.rstrip("/")

    # --- in the tasks ----------------------------------------------------------------------------

    def stage(self, checkpoint_id: int, operator: str, subtask: int, rows: pd.DataFrame) -> list[str]:
        """Write one subtask's changed rows for checkpoint N into the table's data directory,
        invisible until committed: a file per partition; returns their names (none for no rows)."""
        if rows.empty:
            return []
        frame = rows.assign(**{CHECKPOINT_COLUMN: pd.Series(np.full(len(rows), checkpoint_id, dtype="int64"),
                                                             index=rows.index)})
        table = self._as_table_types(pa.Table.from_pandas(frame, preserve_index=False))
        fs, root = self._fs()
        fs.makedirs(f"{root}/chk-{checkpoint_id}", exist_ok=True)
        names = []
        for part in self._partitions(table):
            rel = f"chk-{checkpoint_id}/{operator}-{subtask:05d}-{uuid.uuid4().hex[:12]}.parquet"
            storage_step("write", f"{self.prefix}/{rel}")
            with fs.open(f"{root}/{rel}", "wb") as f:
                pq.write_table(part, f)
            names.append(rel)
        return names

    def _as_table_types(self, table: pa.Table) -> pa.Table:
        """The rows in the table's types (an `int32` column of a `long` column as `int64`, ...), its
        required columns non-nullable, timestamps in microseconds (Iceberg's), no field ids
        (`add_files` maps columns by name); columns the table lacks stay as they are."""
        target = {} if self.table_schema is None else {f.name: f for f in schema_to_pyarrow(
            Schema.model_validate_json(self.table_schema), include_field_ids=False)}
        fields, columns = [], []
        for field, column in zip(table.schema, table.columns):
            want = target.get(field.name, pa.field(field.name, _microseconds(field.type)))
            if not want.nullable and column.null_count:
                raise SinkError(f"column {field.name!r} holds nulls, but it is required in Iceberg table "
                                f"{self.identifier}: emit a value for every row, or make the column optional")
            temporal = pa.types.is_timestamp(field.type) or pa.types.is_time(field.type)
            columns.append(column if column.type == want.type else pc.cast(column, want.type, safe=not temporal))
            fields.append(pa.field(field.name, want.type, nullable=want.nullable))
        return pa.Table.from_arrays(columns, schema=pa.schema(fields))

    def _partitions(self, table: pa.Table) -> list[pa.Table]:
        """The rows split by partition value (`add_files` reads a file's partition from its
        column statistics: each file must hold one value of every partition field)."""
        if self.partition_spec is None or self.table_schema is None:
            return [table]
        spec = PartitionSpec.model_validate_json(self.partition_spec)
        schema = Schema.model_validate_json(self.table_schema)
        key = pa.array(np.zeros(table.num_rows, dtype="int64"))
        for field in spec.fields:
            index, count = _partition_index(field, schema, table)
            key = pc.add(pc.multiply(key, count), index)
        return [table.filter(pc.equal(key, value)) for value in pc.unique(key).to_pylist()]

    # --- on the driver ---------------------------------------------------------------------------

    def commit(self, checkpoint_id: int, staged: list[str], *, resuming: bool = False) -> int:
        """Add checkpoint N's staged files to the table in one snapshot, exactly once; returns the
        files added now (0 when the table holds N already).

        Safe to repeat and beside another process committing the same checkpoint; a conflict with
        any other writer is read again and retried. With `resuming` (a later start finishing a
        commit a crash may have cut short) staged files that are all gone are taken as committed
        before and since removed from the table by its own maintenance.

        Raises:
            IcebergSinkFenced: the table holds a newer checkpoint of this job.
            IcebergStagedFileLost: a staged file is gone.
            IcebergSchemaMismatch: the table does not take the files' columns.
        """
        if not staged:
            return 0
        for rel in staged:
            _staged_of(rel, checkpoint_id)
        paths = [f"{self.prefix}/{rel}" for rel in staged]
        described: dict[tuple[int, int], list[DataFile]] = {}  # the files' footers, read once per schema and spec

        def attempt() -> int:
            table = self._load()
            held = {} if table is None else self._held(table)
            if checkpoint_id in held or (resuming and held and checkpoint_id < max(held)):
                return 0
            if held and checkpoint_id < max(held):
                raise IcebergSinkFenced(
                    f"checkpoint {checkpoint_id} of job {self.job_id} is older than checkpoint {max(held)}, which "
                    f"Iceberg table {self.identifier} already holds for this job: this writer was overtaken (a "
                    "zombie completer or a stale retry) and commits nothing. Stop it; the newer run's output stands")
            if resuming and not any(self._exists(rel) for rel in staged):
                log.warning("checkpoint %s's staged files are gone and %s does not record it: taken as committed "
                            "before and removed by the table's maintenance since", checkpoint_id, self.identifier)
                return 0
            table = table or self._create(self._staged_schema(checkpoint_id, paths))
            key = (table.metadata.current_schema_id, table.metadata.default_spec_id)
            if key not in described:
                described.clear()
                described[key] = self._data_files(table, checkpoint_id, paths)
            crash_point("before-table-commit")
            storage_step("create", f"{self.url}#{self._tag(checkpoint_id)}")
            self._append(table, checkpoint_id, described[key])
            crash_point("after-table-commit")
            return len(paths)

        return self._retrying(f"commit of checkpoint {checkpoint_id}", attempt)

    def _data_files(self, table: Table, checkpoint_id: int, paths: list[str]) -> list[DataFile]:
        """The staged files as the table's data files (from their Parquet footers: row counts,
        column bounds, the partition), read before the commit's window opens."""
        try:
            return list(ExecutorFactory.get_or_create().map(
                lambda path: parquet_file_to_data_file(table.io, table.metadata, path), paths))
        except FileNotFoundError as e:
            raise self._lost(checkpoint_id, paths, e) from e
        except (ValueError, TypeError) as e:
            raise IcebergSchemaMismatch(
                f"Iceberg table {self.identifier} does not take checkpoint {checkpoint_id}'s files: {e}. Check the "
                "output columns against the table before starting (check_schema), or let the sink evolve the "
                "table's schema (evolve_schema)") from e

    def _append(self, table: Table, checkpoint_id: int, data_files: list[DataFile]) -> None:
        """One transaction: the files appended as they are (a fast append), the summary, the tag.
        What it needs of the table is read from `table.metadata`: every read of the transaction's
        own metadata deep-copies the whole of it, and the commit's window is what another writer
        can close."""
        base = table.metadata
        tx = _without_own_retry(table).transaction()
        if base.name_mapping() is None:  # files without field ids are read by column name
            tx.set_properties({TableProperties.DEFAULT_NAME_MAPPING: base.schema().name_mapping.model_dump_json()})
        with tx.update_snapshot(snapshot_properties=self._summary(checkpoint_id)).fast_append() as append:
            for data_file in data_files:
                append.append_data_file(data_file)
        # Staged as they are (no requirement: the branch head asserted above serialises our commits),
        # since ManageSnapshots would read the transaction's metadata, a deep copy, twice per tag.
        tx._apply(self._tag_updates(checkpoint_id, append.snapshot_id, base.refs))
        tx.commit_transaction()

    def discard_staged(self, checkpoint_id: int, staged: list[str]) -> None:
        """Delete these staged files of checkpoint N, except those the table holds (another
        attempt at N may be live, or committed them)."""
        for rel in staged:
            _staged_of(rel, checkpoint_id)
        table = self._load()
        keep = set() if table is None else self._added_by(table, self._held(table).get(checkpoint_id))
        self._delete([rel for rel in staged if rel not in keep])

    def committed(self, after: int = 0) -> dict[int, list[str]]:
        """This job's data files in the table's current snapshot, by checkpoint id, above `after`."""
        table = self._load()
        if table is None:
            return {}
        return {cid: sorted(f.file_path for f in files) for cid, files in self._live(table).items() if cid > after}

    def rollback(self, after: int) -> list[int]:
        """Remove the rows of checkpoints newer than `after` (they are about to be replayed)."""
        return self._drop(lambda cid: cid > after)

    def drop(self, checkpoint_ids: list[int]) -> list[int]:
        """Remove exactly this job's files of these checkpoints in one delete snapshot, keeping
        every other writer's rows; returns the ids that had any."""
        wanted = set(checkpoint_ids)
        return self._drop(lambda cid: cid in wanted)

    def _drop(self, chosen: Callable[[int], bool]) -> list[int]:
        def attempt() -> list[int]:
            table = self._load()
            live = {} if table is None else self._live(table)
            dropped = sorted(cid for cid in live if chosen(cid))
            if table is None or not dropped:
                return []
            storage_step("create", f"{self.url}#drop-{','.join(map(str, dropped))}")
            tx = _without_own_retry(table).transaction()
            # pyiceberg's public delete takes a row filter; removing files by identity, without
            # rewriting any, is what its overwrite producer does (a snapshot that adds nothing).
            delete = _OverwriteFiles(operation=Operation.DELETE, transaction=tx, io=table.io, snapshot_properties={
                JOB: self.job_id, OPERATOR: ",".join(uid for _, uid in self.operators),
                DROPPED: ",".join(map(str, dropped))})
            for cid in dropped:
                for data_file in live[cid]:
                    delete.delete_data_file(data_file)
            delete.commit()
            tx.commit_transaction()
            return dropped

        return self._retrying("removal of checkpoints' rows", attempt)

    def erase_rows(self, column: str, values: Sequence[object], *, dry_run: bool = False) -> RowsErased:
        """Remove this job's rows whose `column` holds one of `values`: one overwrite snapshot
        replaces the data files that hold them with copies without them (new names of the same
        checkpoint, so a rollback drops the copies; `sparkpoint.tables.iceberg_erase`). Older
        snapshots and the sink's tags keep the old files until they expire.

        Raises SinkError for a column the table lacks."""
        from sparkpoint.tables.iceberg_erase import erase_iceberg_rows

        return erase_iceberg_rows(self, column, list(values), dry_run=dry_run)

    def discard_staging(self, up_to: int) -> None:
        """Delete staged files of checkpoints up to `up_to` that the table never took. Files of a
        checkpoint it holds stay (time travel and tags still read them), and so does every file
        of newer checkpoints (a live writer's, racing for the next id)."""
        fs, root = self._fs()
        storage_step("list", f"{self.prefix}/chk-*")
        try:
            entries = fs.ls(root, detail=False)
        except FileNotFoundError:
            return
        ids = [int(name[4:]) for name in (posixpath.basename(e.rstrip("/")) for e in entries)
               if name.startswith("chk-") and name[4:].isdigit() and int(name[4:]) <= up_to]
        table = self._load()
        held = set() if table is None else set(self._held(table))
        candidates = [cid for cid in ids if cid not in held]
        if not candidates:
            return
        live = set() if table is None else {f.file_path for files in self._live(table).values() for f in files}
        for cid in candidates:
            storage_step("list", f"{self.prefix}/chk-{cid}/*")
            names = [f"chk-{cid}/{posixpath.basename(p)}" for p in fs.ls(f"{root}/chk-{cid}", detail=False)]
            self._delete([n for n in names if f"{self.prefix}/{n}" not in live])

    # --- reading and writing the table -----------------------------------------------------------

    def _catalog(self) -> Catalog:
        return _catalog(self.catalog_name, self.catalog)

    def _load(self) -> Table | None:
        storage_step("read", f"{self.url}#metadata")
        try:
            return self._catalog().load_table(self.identifier)
        except NoSuchTableError:
            return None

    def _staged_schema(self, checkpoint_id: int, paths: list[str]) -> pa.Schema:
        """The columns of these staged files together."""
        fs, root = self._fs()
        schemas = []
        for path in paths:
            try:
                with fs.open(f"{root}/{path[len(self.prefix) + 1:]}", "rb") as f:
                    schemas.append(pq.read_schema(f))
            except FileNotFoundError as e:
                raise self._lost(checkpoint_id, paths, e) from e
        return pa.unify_schemas(schemas).remove_metadata()

    def _lost(self, checkpoint_id: int, paths: list[str], error: Exception) -> IcebergStagedFileLost:
        missing = [p for p in paths if not self._exists(p[len(self.prefix) + 1:])]
        return IcebergStagedFileLost(
            f"checkpoint {checkpoint_id} is committed with staged output {', '.join(missing) or error}, which is "
            f"gone: rows it wrote are lost. Put the files back, or (with an older checkpoint retained) delete "
            f"chk-{checkpoint_id}/_metadata by hand so that its batch is processed again")

    def _create(self, schema: pa.Schema) -> Table:
        """Create the table (and its namespace) with these columns, all optional, unpartitioned
        (a table someone else created meanwhile is taken as it is)."""
        catalog = self._catalog()
        storage_step("create", f"{self.url}#table")
        try:
            catalog.create_namespace_if_not_exists(Catalog.namespace_from(self.identifier))
            return catalog.create_table(self.identifier, schema, location=self.location)
        except TableAlreadyExistsError:
            return catalog.load_table(self.identifier)

    def _held(self, table: Table) -> dict[int, int]:
        """The checkpoints of this job the table's snapshots record (all of them, not only the
        current branch's ancestors: a table rolled back past N still was given N): id -> snapshot."""
        held: dict[int, int] = {}
        for snapshot in table.metadata.snapshots:
            summary = snapshot.summary.additional_properties if snapshot.summary else {}
            if summary.get(JOB) == self.job_id and str(summary.get(CHECKPOINT, "")).isdigit():
                held[int(summary[CHECKPOINT])] = snapshot.snapshot_id
        return held

    def _live(self, table: Table) -> dict[int, list[DataFile]]:
        """This job's data files in the current snapshot, by checkpoint id."""
        snapshot = table.current_snapshot()
        out: dict[int, list[DataFile]] = {}
        if snapshot is None:
            return out
        for manifest in snapshot.manifests(table.io):
            if manifest.content != ManifestContent.DATA:
                continue
            for entry in manifest.fetch_manifest_entry(table.io, discard_deleted=True):
                path = entry.data_file.file_path
                m = _STAGED.fullmatch(path[len(self.prefix) + 1:]) if path.startswith(self.prefix + "/") else None
                if m:
                    out.setdefault(int(m.group(1)), []).append(entry.data_file)
        return out

    def _added_by(self, table: Table, snapshot_id: int | None) -> set[str]:
        """Names (relative to `prefix`) of the files one snapshot added."""
        snapshot = None if snapshot_id is None else table.snapshot_by_id(snapshot_id)
        if snapshot is None:
            return set()
        return {e.data_file.file_path.removeprefix(self.prefix + "/")
                for m in snapshot.manifests(table.io) if m.added_snapshot_id == snapshot_id
                for e in m.fetch_manifest_entry(table.io, discard_deleted=True) if e.snapshot_id == snapshot_id}

    def _exists(self, rel: str) -> bool:
        """Whether a staged file exists, where only "not found" means no (fsspec's `exists` says
        False on any error, and a timeout must never pass for a commit that happened before)."""
        fs, root = self._fs()
        storage_step("info", f"{self.prefix}/{rel}")
        try:
            fs.info(f"{root}/{rel}")
        except FileNotFoundError:
            return False
        return True

    def _delete(self, names: list[str]) -> None:
        fs, root = self._fs()
        for rel in names:
            storage_step("delete", f"{self.prefix}/{rel}")
            remove_file(fs, f"{root}/{rel}")

    def _retrying(self, what: str, attempt: Callable[[], T]) -> T:
        """Run `attempt` (read the table, decide, commit) until it commits or decides; a commit that
        lost to another writer is read again after a jittered backoff."""
        wait, deadline, lost = 0.05, time.monotonic() + COMMIT_RETRY_SECONDS, 0
        while True:
            try:
                return attempt()
            except (CommitFailedException, CommitStateUnknownException) as e:
                lost += 1
                if time.monotonic() > deadline:
                    raise SinkError(f"{what} into Iceberg table {self.identifier} lost to other writers {lost} times "
                                    f"in {COMMIT_RETRY_SECONDS:.0f} s; last: {e}. Run the step again") from e
                log.info("%s into %s conflicted with another writer (%s); reading the table again", what,
                         self.identifier, e)
                time.sleep(wait * random.uniform(1.0, 1.5))
                wait = min(wait * 2, 2.0)


def _without_own_retry(table: Table) -> Table:
    """The table, for one transaction that pyiceberg does not retry by itself: its retry rebases
    the snapshot onto the new head without reading what the table holds for the job, and drops
    the tag. The setting lives on this in-memory copy only, never in the table."""
    metadata = table.metadata
    quiet = metadata.model_copy(update={"properties": {**metadata.properties, TableProperties.COMMIT_NUM_RETRIES: "0"}})
    return Table(table.name(), quiet, table.metadata_location, table.io, table.catalog)


def _new_table_location(catalog: Catalog, identifier: str, url: str) -> str:
    """Where the catalog puts a table it creates (`<warehouse>/<namespace>/<table>` for the SQL
    catalog); the sink creates it there on the first commit."""
    namespace, _, name = identifier.rpartition(".")
    resolve = getattr(catalog, "_resolve_table_location", None)
    try:
        if resolve is not None:
            return str(resolve(None, namespace, name)).rstrip("/")
    except NoSuchNamespaceError:
        pass
    except ValueError as e:
        raise SinkError(f"{url} does not exist and its catalog has no warehouse to create it in: {e}") from e
    warehouse = catalog.properties.get("warehouse")
    if not warehouse:
        raise SinkError(f"{url} does not exist and its catalog says nowhere to create it: create the table first, "
                        "or give the catalog a `warehouse` property")
    return f"{warehouse.rstrip('/')}/{namespace}/{name}"


def _partition_index(field: PartitionField, schema: Schema, table: pa.Table) -> tuple[pa.Array, int]:
    """Each row's value of one partition field, as an index among the field's distinct values
    (null its own), and how many there are. Each distinct source value is transformed once, in
    Python: pyiceberg's vectorised transforms need the optional `pyiceberg-core`."""
    name = schema.find_column_name(field.source_id)
    if name not in table.column_names:
        return pa.array(np.zeros(table.num_rows, dtype="int64")), 1
    transform = field.transform.transform(schema.find_field(field.source_id).field_type)
    encoded = pc.dictionary_encode(table.column(name).combine_chunks())
    values = [transform(partition_record_value(field, v, schema)) for v in encoded.dictionary.to_pylist()]
    distinct = {value: n for n, value in enumerate(dict.fromkeys(values))}
    position = pa.array([distinct[value] for value in values], pa.int64())
    return pc.fill_null(pc.take(position, encoded.indices), len(distinct)), len(distinct) + 1


def _microseconds(kind: pa.DataType) -> pa.DataType:
    """Iceberg (format 2) keeps timestamps in microseconds: pandas' nanoseconds are truncated."""
    if pa.types.is_timestamp(kind) and kind.unit == "ns":
        return pa.timestamp("us", tz=kind.tz)
    return kind


def _staged_of(rel: str, checkpoint_id: int) -> None:
    m = _STAGED.fullmatch(rel)
    if not m or int(m.group(1)) != checkpoint_id:
        raise SinkError(f"{rel!r} is not a staged file of checkpoint {checkpoint_id}")


def output_facts(sink: IcebergSink, checkpoint_id: int, staged: list[str]) -> dict[str, Any]:
    """What checkpoint N added to the table, from its snapshot's summary (no data file is read):
    the keys of the Parquet sink's facts (url, files, rows, columns, unreadable) and the
    snapshot's id and bytes. For a report after the commit: a failure is named in `unreadable`,
    never raised; `snapshot_id` is None when N added no rows (or its snapshot expired)."""
    facts: dict[str, Any] = {"url": sink.url, "table": sink.identifier, "files": 0, "rows": 0, "bytes": 0,
                             "columns": {}, "snapshot_id": None, "unreadable": []}
    try:
        table = sink._load()
        snapshot = None if table is None else table.snapshot_by_id(sink._held(table).get(checkpoint_id, -1))
        if table is None or snapshot is None:
            return facts
        summary = snapshot.summary.additional_properties if snapshot.summary else {}
        schema = table.schemas().get(snapshot.schema_id, table.schema()) if snapshot.schema_id is not None \
            else table.schema()
        facts.update(files=int(summary.get("added-data-files", 0)), rows=int(summary.get("added-records", 0)),
                     bytes=int(summary.get("added-files-size", 0)), snapshot_id=snapshot.snapshot_id,
                     columns={f.name: str(f.field_type) for f in schema.fields})
    except Exception as e:  # noqa: BLE001  reporting only: the checkpoint is committed
        facts["unreadable"].append(f"{sink.url}: {type(e).__name__}: {e}")
    return facts


# --- the schema guard ----------------------------------------------------------------------------


def output_schema(columns: pa.Schema) -> pa.Schema:
    """The columns the sink writes: the operators' output and `checkpoint_id` (int64)."""
    if CHECKPOINT_COLUMN in columns.names:
        return columns
    return columns.append(pa.field(CHECKPOINT_COLUMN, pa.int64()))


def check_schema(sink: IcebergSink, columns: pa.Schema) -> list[str]:
    """Before Spark starts: why the sink's table would not take these output columns (empty when
    it would, or when the table does not exist yet: the first commit creates it from them)."""
    table = sink._load()
    return [] if table is None else schema_problems(table.schema(), output_schema(columns))


def prepare_table(sink: IcebergSink, columns: pa.Schema, *, evolve: bool = False) -> IcebergSink:
    """Before Spark starts: make sure the sink's table takes the output columns, or say why. A
    missing table is created from them (with its namespace); an existing one that lacks a column
    or has a narrower type is evolved when `evolve` (the pipeline's setting), else refused.
    Returns the sink that writes the table's schema (the one to hand to the tasks).

    Raises:
        IcebergSchemaMismatch: naming each column and both types, and what to change.
    """
    wanted = output_schema(columns)
    table = sink._load()
    if table is None:
        if problems := _unrepresentable(wanted):
            raise IcebergSchemaMismatch(f"Iceberg table {sink.identifier} cannot be created: " + "; ".join(problems))
        sink._create(pa.schema([f.with_type(_microseconds(f.type)) for f in wanted]))
        return sink._opened()
    problems = schema_problems(table.schema(), wanted)
    if not problems:
        return sink._opened()
    if evolve:
        return evolve_schema(sink, columns)
    raise IcebergSchemaMismatch(
        f"Iceberg table {sink.identifier} does not take the output of {', '.join(n for n, _ in sink.operators)} "
        f"(refused before Spark starts): {'; '.join(problems)}. Change the operators' output or the table, or "
        "let sparkpoint evolve the table's schema (new columns optional, int/float widened)")


def evolve_schema(sink: IcebergSink, columns: pa.Schema) -> IcebergSink:
    """Evolve the table to take these output columns (`update_schema().union_by_name`: new
    columns are added as optional, `int`/`float` widened to `long`/`double`); returns the sink
    that writes the evolved schema.

    Raises:
        IcebergSchemaMismatch: a column's type cannot be evolved into the table's (named).
    """
    wanted = output_schema(columns)
    problems: list[str] = []

    def attempt() -> None:
        table = sink._load()
        if table is None:
            return
        problems[:] = _unrepresentable(wanted)
        if problems:
            return
        try:
            with table.update_schema() as update:
                update.union_by_name(_pyarrow_to_schema_without_ids(wanted, downcast_ns_timestamp_to_us=True))
        except (ValueError, TypeError, ValidationError) as e:
            problems[:] = schema_problems(table.schema(), wanted) or [str(e)]

    sink._retrying("schema evolution", attempt)
    table = sink._load()
    if table is not None and not problems:
        problems = schema_problems(table.schema(), wanted)
    if problems:
        raise IcebergSchemaMismatch(f"Iceberg table {sink.identifier} cannot be evolved to take the output: "
                                    + "; ".join(problems))
    return sink._opened()


def schema_problems(table_schema: Schema, columns: pa.Schema) -> list[str]:
    """What keeps a table of `table_schema` from taking files of `columns`, naming each column
    and both types: a column the table lacks, a type it cannot read as its own, a required column
    the output does not have, a type Iceberg cannot store."""
    problems = _unrepresentable(columns)
    bad = {p.split("'")[1] for p in problems}
    names = set(columns.names)
    for field in columns:
        if field.name in bad:
            continue
        ours = _pyarrow_to_schema_without_ids(pa.schema([field]), downcast_ns_timestamp_to_us=True).fields[0]
        try:
            theirs = table_schema.find_field(field.name)
        except ValueError:
            problems.append(f"column '{field.name}' ({ours.field_type}) is not in the table")
            continue
        problems += _type_problems(field.name, theirs.field_type, ours.field_type)
    problems += [f"the table's required column '{f.name}' ({f.field_type}) is not among the output columns"
                 for f in table_schema.fields if f.required and f.name not in names]
    return problems


def _unrepresentable(columns: pa.Schema) -> list[str]:
    problems = []
    for field in columns:
        try:
            _pyarrow_to_schema_without_ids(pa.schema([field]), downcast_ns_timestamp_to_us=True)
        except (TypeError, ValueError) as e:
            problems.append(f"column '{field.name}' has type {field.type}, which Iceberg cannot store ({e})")
    return problems


def _type_problems(path: str, table_type: IcebergType, output_type: IcebergType) -> list[str]:
    """Why a column of `output_type` cannot be read as the table's `table_type` (nested by name)."""
    if isinstance(table_type, StructType) and isinstance(output_type, StructType):
        problems = []
        for field in output_type.fields:
            theirs = next((f for f in table_type.fields if f.name == field.name), None)
            if theirs is None:
                problems.append(f"field '{path}.{field.name}' ({field.field_type}) is not in the table")
            else:
                problems += _type_problems(f"{path}.{field.name}", theirs.field_type, field.field_type)
        return problems
    if isinstance(table_type, ListType) and isinstance(output_type, ListType):
        return _type_problems(f"{path}[]", table_type.element_type, output_type.element_type)
    if isinstance(table_type, MapType) and isinstance(output_type, MapType):
        return (_type_problems(f"{path}.key", table_type.key_type, output_type.key_type)
                + _type_problems(f"{path}.value", table_type.value_type, output_type.value_type))
    if table_type == output_type:
        return []
    try:
        promote(output_type, table_type)
        return []
    except ResolveError:
        return [f"column '{path}' is {output_type} in the output but {table_type} in the table"]
