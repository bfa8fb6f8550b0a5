"""The Delta sink's pieces as functions of plain data: its storage options made from fsspec's, the
schema check (what a table takes), the app-transaction retention check, a subtask's rows split by
partition (the values in the file's footer) and a file's statistics from its Parquet footer.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from sparkpoint.tables.files import CHECKPOINT_COLUMN
from sparkpoint.tables.sink import SinkError, SinkSchemaMismatch

PARTITION_KEY = b"sparkpoint.partition"  # in a staged file's footer: its partition values and their types
RETENTION_PROPERTY = "delta.setTransactionRetentionDuration"
MAX_STRING_STAT = 64  # longer strings get no min/max: a truncated max would skip rows that match


class SinkRetentionTooShort(SinkError):
    """The Delta table forgets app transactions sooner than this job may replay a checkpoint."""


def delta_options(location: str, options: Mapping[str, Any]) -> dict[str, str]:
    """delta-rs storage options made from a pipeline's fsspec (s3fs) options: keys, region and an
    endpoint of its own (plain HTTP allowed for an `http://` one, a local S3-compatible server).
    delta-rs 1.x commits to S3 with conditional writes (If-None-Match), which S3 and moto honour,
    so neither a locking provider nor `AWS_S3_ALLOW_UNSAFE_RENAME` is needed."""
    if not location.startswith(("s3://", "s3a://")):
        return {}
    client = dict(options.get("client_kwargs") or {})
    out: dict[str, str] = {}
    endpoint = options.get("endpoint_url") or client.get("endpoint_url")
    keys = (("key", "AWS_ACCESS_KEY_ID"), ("secret", "AWS_SECRET_ACCESS_KEY"), ("token", "AWS_SESSION_TOKEN"))
    for key, name in keys:
        if options.get(key):
            out[name] = str(options[key])
    region = client.get("region_name") or options.get("region_name")
    if region:
        out["AWS_REGION"] = str(region)
    if endpoint:
        out["AWS_ENDPOINT_URL"] = str(endpoint)
        out.setdefault("AWS_REGION", "us-east-1")
        if str(endpoint).startswith("http://"):
            out["AWS_ALLOW_HTTP"] = "true"
    return out


def declared_schema(columns: Sequence[tuple[str, str]]) -> pa.Schema:
    """An operator's declared output columns and the sink's `checkpoint_id`. A column whose type
    is no Arrow type name this reads (`schema=` is free text for Dagster too) is left out: the rows
    the tasks stage are checked against the table all the same."""
    fields = [pa.field(name, kind) for name, text in columns if (kind := arrow_type(text)) is not None]
    if CHECKPOINT_COLUMN not in [f.name for f in fields]:
        fields.append(pa.field(CHECKPOINT_COLUMN, pa.int64()))
    return pa.schema(fields)


_TIMESTAMP = re.compile(r"timestamp\[(s|ms|us|ns)(?:,\s*(?:tz=)?([^\]]+))?\]")


def arrow_type(text: str) -> pa.DataType | None:
    """An Arrow type by its name (`int64`, `float64`, `string`, `timestamp[us, UTC]`,
    `timestamp[us, tz=UTC]`, `date32`, ...); None for one this does not read."""
    raw = " ".join(str(text).strip().split()).removesuffix(" not null")
    ts = _TIMESTAMP.fullmatch(raw)
    if ts is not None:
        return pa.timestamp(ts.group(1), tz=ts.group(2).strip() if ts.group(2) else None)
    try:
        return pa.type_for_alias(raw)
    except ValueError:
        return None


def unfit(columns: pa.Schema, table: pa.Schema, partitions: list[str], operator: str, url: str,
           evolve: bool) -> dict[str, pa.DataType]:
    """The columns the table lacks (to add, with `evolve`); SinkSchemaMismatch for a column of
    another type, a partition column not emitted, or (without `evolve`) a column it lacks."""
    wrong = [f"{f.name} ({f.type}; the table has {table.field(f.name).type})" for f in columns
             if f.name in table.names and not _fits(f.type, table.field(f.name).type)]
    if wrong:
        raise SinkSchemaMismatch(f"operator {operator} emits {', '.join(wrong)}: the Delta table {url} does not take "
                                 "them; emit the table's types, or write to another table")
    unpartitioned = [c for c in partitions if c not in columns.names]
    if unpartitioned:
        raise SinkSchemaMismatch(f"operator {operator} emits no column {', '.join(unpartitioned)}, which the Delta "
                                 f"table {url} is partitioned by: emit it")
    lacking = {f.name: f.type for f in columns if f.name not in table.names}
    if lacking and not evolve:
        said = ", ".join(f"{n} ({t})" for n, t in lacking.items())
        raise SinkSchemaMismatch(
            f"operator {operator} emits columns the Delta table {url} lacks: {said}. Add them to the table, or let "
            "the sink add them (setting output_schema_evolution=true, --conf sink.schema-evolution=true)")
    return lacking


def _fits(emitted: pa.DataType, held: pa.DataType) -> bool:
    """Whether a column of type `emitted` goes into one of type `held`: the same kind (strings,
    binaries, timestamps with a zone or without, at any width or unit), an integer or float that
    widens, or nulls."""
    if emitted == held or pa.types.is_null(emitted):
        return True
    kind = _kind(emitted)
    if kind in ("string", "binary", "timestamp", "timestamp_ntz"):
        return kind == _kind(held)
    if pa.types.is_integer(emitted) and pa.types.is_integer(held):
        return bool(held.bit_width >= emitted.bit_width)
    if (pa.types.is_integer(emitted) or pa.types.is_floating(emitted)) and pa.types.is_floating(held):
        return bool(held.bit_width >= emitted.bit_width)
    return False


def _kind(t: pa.DataType) -> str:
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return "string"
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_binary_view(t):
        return "binary"
    if pa.types.is_timestamp(t):
        return "timestamp" if t.tz is not None else "timestamp_ntz"
    return str(t)


def check_retention(configuration: Mapping[str, str | None], window: float, url: str) -> None:
    """Refuse a table that forgets app transactions sooner than `window` seconds: a replay of a
    checkpoint older than that would no longer be recognised, and would commit its rows again."""
    raw = configuration.get(RETENTION_PROPERTY)
    if raw is None:
        return
    kept = interval_seconds(raw)
    if kept is None:
        raise SinkRetentionTooShort(f"Delta table {url}: {RETENTION_PROPERTY} is {raw!r}, which sparkpoint cannot "
                                    "read; set it as 'interval <n> days' (or hours, minutes)")
    if kept < window:
        days = math.ceil(window / 86400)
        raise SinkRetentionTooShort(
            f"Delta table {url} forgets app transactions after {raw} ({RETENTION_PROPERTY}), sooner than this job "
            f"may replay a checkpoint: {_said(window)} (setting output_replay_window: the longest a job may stay "
            "stopped, or keep a checkpoint it may fall back to, e.g. retained checkpoints x checkpoint interval, plus "
            "the longest recovery you expect). A replay older than the table remembers would commit its rows twice. "
            f"Set {RETENTION_PROPERTY} to at least 'interval {days} days' (deltalake: DeltaTable(url).alter."
            f"set_table_properties({{'{RETENTION_PROPERTY}': 'interval {days} days'}}); Spark SQL: ALTER TABLE ... SET "
            "TBLPROPERTIES), or lower output_replay_window")


_INTERVAL = re.compile(r"^\s*(?:interval\s+)?(\d+(?:\.\d+)?)\s*([a-z]+?)s?\s*$", re.IGNORECASE)
_UNIT = {"nanosecond": 1e-9, "microsecond": 1e-6, "millisecond": 1e-3, "second": 1.0, "minute": 60.0,
         "hour": 3600.0, "day": 86400.0, "week": 7 * 86400.0}


def interval_seconds(text: str) -> float | None:
    """Seconds of a Delta interval (`interval 7 days`, `2 hours`); None when it is not one."""
    m = _INTERVAL.match(text)
    if not m or m.group(2).lower() not in _UNIT:
        return None
    return float(m.group(1)) * _UNIT[m.group(2).lower()]


def _said(seconds: float) -> str:
    return f"{seconds / 86400:g} days" if seconds >= 86400 else f"{seconds:g} seconds"


def split_partitions(table: pa.Table, columns: Sequence[str], operator: str
                     ) -> list[tuple[dict[str, Any], pa.Table]]:
    """The rows by partition value set: ({column: value}, the rows). No partition columns: one piece."""
    if not columns:
        return [({}, table)]
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        raise SinkSchemaMismatch(f"operator {operator} emits no column {', '.join(missing)}, which the Delta table "
                                 "is partitioned by: emit it")
    keys = table.select(list(columns)).to_pandas()
    groups = keys.groupby(list(columns), dropna=False, sort=True).indices
    out = []
    for positions in groups.values():
        piece = table.take(pa.array(positions))
        out.append(({c: piece.column(c)[0].as_py() for c in columns}, piece))
    return out


def with_partition(piece: pa.Table, values: Mapping[str, Any]) -> pa.Table:
    """A partition's rows without its partition columns, their values and types in the footer
    (pandas' metadata dropped: it names the columns that left)."""
    if not values:
        return piece.replace_schema_metadata(None)
    partition = pa.schema([piece.schema.field(c) for c in values])
    record = {"values": {c: partition_value(v) for c, v in values.items()},
              "schema": partition.serialize().to_pybytes().hex()}
    rest = piece.drop_columns(list(values))
    return rest.replace_schema_metadata({PARTITION_KEY: json.dumps(record).encode()})


def partition_of(schema: pa.Schema) -> tuple[dict[str, str | None], list[pa.Field]]:
    """A staged file's partition values (as Delta writes them) and the partition columns' fields."""
    raw = (schema.metadata or {}).get(PARTITION_KEY)
    if raw is None:
        return {}, []
    record = json.loads(raw)
    fields = list(pa.ipc.read_schema(pa.py_buffer(bytes.fromhex(record["schema"]))))
    return dict(record["values"]), fields


def partition_value(value: Any) -> str | None:
    """A partition value as the Delta protocol serializes it."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dt.datetime):
        if value.tzinfo is not None:
            value = value.astimezone(dt.UTC).replace(tzinfo=None)
        return str(value.strftime("%Y-%m-%d %H:%M:%S.%f"))
    if isinstance(value, dt.date):
        return value.isoformat()
    return str(value)


def footer_stats(meta: pq.FileMetaData) -> str:
    """A file's Delta statistics from its Parquet footer: numRecords, and per top-level column its
    nullCount and, for numbers, dates and short strings, its min and max."""
    mins: dict[str, Any] = {}
    maxs: dict[str, Any] = {}
    nulls: dict[str, int] = {}
    schema = meta.schema.to_arrow_schema()
    for i in range(meta.num_columns):
        column = meta.schema.column(i)
        if "." in column.path:
            continue  # a nested column's leaf: no statistics
        name = column.path
        stats = [meta.row_group(g).column(i).statistics for g in range(meta.num_row_groups)]
        if any(s is None for s in stats):
            continue
        if all(s.has_null_count for s in stats):
            nulls[name] = sum(s.null_count for s in stats)
        if not all(s.has_min_max for s in stats) or not stats:
            continue
        low, high = min(s.min for s in stats), max(s.max for s in stats)
        value = _stat_value(schema.field(name).type, low), _stat_value(schema.field(name).type, high)
        if value[0] is not None and value[1] is not None:
            mins[name], maxs[name] = value
    return json.dumps({"numRecords": meta.num_rows, "minValues": mins, "maxValues": maxs, "nullCount": nulls})


def _stat_value(kind: pa.DataType, value: Any) -> Any:
    """A min or max as Delta's statistics hold it; None where we give none (booleans, timestamps,
    long strings, non-finite floats, anything else)."""
    if pa.types.is_integer(kind) and isinstance(value, int):
        return value
    if pa.types.is_floating(kind) and isinstance(value, float):
        return value if math.isfinite(value) else None
    if pa.types.is_date32(kind) and isinstance(value, dt.date):
        return value.isoformat()
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        text = value.decode() if isinstance(value, bytes) else value
        return text if isinstance(text, str) and len(text) <= MAX_STRING_STAT else None
    return None
