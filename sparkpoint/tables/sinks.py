"""`open_sink`: the exactly-once sink of the output a pipeline names, a URL or a table value.

The sinks themselves import on first use: a Parquet directory's needs no table library, an Iceberg
table's (`sparkpoint.tables.iceberg`) needs pyiceberg.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sparkpoint.tables.sink import DEFAULT_REPLAY_WINDOW, Sink, SinkError
from sparkpoint.tables.spec import DeltaTable, IcebergTable, ParquetDirectory, TableSpec, table_of


def open_sink(
    output: str | TableSpec,
    job_id: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    catalog: Mapping[str, Any] | None = None,
    partition_by: Sequence[str] | None = None,
    table_options: Mapping[str, Any] | None = None,
    operators: Sequence[tuple[str, str]] = (),
    evolve_schema: bool = False,
    replay_window: float = DEFAULT_REPLAY_WINDOW,
) -> Sink:
    """The sink of the output a URL or a table value names (`sparkpoint.tables.spec.table_of`): a
    directory of Parquet files, a Delta table or an Iceberg table.

    Args:
        output: the output's URL (a directory, `delta+<URL>`, `iceberg://<catalog>/<table>`) or value.
        job_id: the job whose output it is.
        storage_options: the pipeline's fsspec options (a Delta table's staged files are written with
            them; its delta-rs options default to ones made from them).
        catalog: an Iceberg URL's catalog properties.
        partition_by: the partition columns of a table the sink creates (a value's own win).
        table_options: a Delta table's delta-rs storage options (a value's own win).
        operators: (name, uid) of the pipeline's operators (a table records a transaction per uid).
        evolve_schema: add the columns a table lacks instead of refusing.
        replay_window: how long a table must remember a commit of this job (seconds).

    Raises:
        TableSpecError: a URL that names no table.
        SinkError: an output that cannot be opened (a missing library, a bad location).
    """
    table = table_of(output, catalog=catalog, partition_by=tuple(partition_by) if partition_by else None)
    if isinstance(table, ParquetDirectory):
        from sparkpoint.tables.parquet import ExactlyOnceParquetSink

        return ExactlyOnceParquetSink.at(table.url, job_id, dict(table.storage_options or storage_options or {}))
    if isinstance(table, DeltaTable):
        from sparkpoint.tables.delta import DeltaSink

        if (table.partition_by is None and partition_by) or (table.storage_options is None and table_options):
            table = DeltaTable(table.url, partition_by=table.partition_by or tuple(partition_by or ()) or None,
                               storage_options=table.storage_options or table_options)
        return DeltaSink.at(table, job_id, storage_options=storage_options, operators=operators,
                            evolve_schema=evolve_schema, replay_window=replay_window)
    assert isinstance(table, IcebergTable)
    try:
        iceberg = importlib.import_module("sparkpoint.tables.iceberg")
    except ModuleNotFoundError as e:
        if e.name != "sparkpoint.tables.iceberg":
            raise SinkError(f"cannot open Iceberg output {table.uri}: {e} (pip install 'pyiceberg[sql-sqlite,pyarrow]')"
                            ) from e
        raise SinkError(f"output {table.uri} is an Iceberg table, and this sparkpoint has no Iceberg sink "
                        "(sparkpoint.tables.iceberg is missing): write to a Delta table (delta+<URL>) or a Parquet "
                        "directory instead") from e
    sink: Sink = iceberg.IcebergSink.at(table, job_id, operators, storage_options,
                                        embedded_dir=str(Path(iceberg.EMBEDDED_DIR).resolve()),
                                        evolve_schema=evolve_schema)
    return sink


def output_facts(sink: Sink, checkpoint_id: int, staged: list[str]) -> dict[str, Any]:
    """What checkpoint N made visible (`staged`: its `_metadata`'s sink entries): files, rows and
    columns from the committed files' footers (the output is never listed: it grows by a file per
    subtask and checkpoint)."""
    return sink.facts(checkpoint_id, staged)


TABLE_VERSION_KEYS = {"version": "table_version", "snapshot_id": "snapshot_id"}  # a table's facts -> the name shown


def table_version(facts: dict[str, Any]) -> tuple[str, int | None] | None:
    """The version a table's facts name, as reports show it: ("table_version", N) for a Delta
    table, ("snapshot_id", id) for an Iceberg one (its value None when the checkpoint made no
    version); None for a directory of Parquet files."""
    for fact, shown in TABLE_VERSION_KEYS.items():
        if fact in facts:
            return shown, facts[fact]
    return None
