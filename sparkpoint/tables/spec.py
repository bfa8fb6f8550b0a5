"""The tables a pipeline writes to and reads from, as the user names them, and their URL forms.

    Pipeline("clicks", ops, output=DeltaTable("s3://lake/clicks_per_user", partition_by=["day"]))
    Pipeline("clicks", ops, output=IcebergTable("analytics.clicks", catalog={"uri": "sqlite:///cat.db"}))

A URL names each one on the command line and in the orchestrators' config:

- a plain fsspec URL or path: a directory of Parquet files (`ParquetDirectory`);
- `delta+<fsspec URL>` (`delta+file:///lake/t`, `delta+s3://bucket/t`): a Delta table (`DeltaTable`);
- `iceberg://<catalog name>/<namespace>.<table>`: an Iceberg table in a pyiceberg catalog
  (`IcebergTable`); its catalog's properties come from `catalog=` (the CLI's `--conf
  iceberg.catalog.<property>=<value>`), else from pyiceberg's own configuration of that name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sparkpoint.checkpoint.errors import SparkpointError
from sparkpoint.checkpoint.storage import storage_url

DELTA_SCHEME = "delta+"
ICEBERG_SCHEME = "iceberg://"


class TableSpecError(SparkpointError, ValueError):
    """A table URL or value that names no table we can write or read."""


@dataclass(frozen=True)
class ParquetDirectory:
    """A directory of Parquet files (any fsspec URL): a pipeline's input, or its exactly-once output.

    Example:
        ```python
        Pipeline("clicks", ops, output=ParquetDirectory("s3://lake/clicks_out"))   # as output_url="s3://..."
        ```

    Args:
        url: the directory.
        storage_options: fsspec options; default: the pipeline's.
    """

    url: str
    storage_options: Mapping[str, Any] | None = None

    @property
    def uri(self) -> str:
        """Its URL form (the directory's URL): what `--output` and `--input` take."""
        return storage_url(self.url).rstrip("/")


@dataclass(frozen=True)
class DeltaTable:
    """A Delta Lake table, written and read with delta-rs (`deltalake`), created on the first commit.

    Each checkpoint that emitted rows is one table version, committed exactly once with an app
    transaction per operator (`<job id>/<operator uid>`, the checkpoint id).

    Example:
        ```python
        Pipeline("clicks", ops, output=DeltaTable("s3://lake/clicks_per_user", partition_by=["day"]))
        DeltaTable("/data/clicks").uri          # "delta+file:///data/clicks": what --output takes
        ```

    Args:
        url: the table's location (any URL delta-rs opens: a path, `file://`, `s3://`, ...).
        partition_by: partition columns of a table the sink creates (an existing table keeps its own).
        storage_options: delta-rs storage options (`AWS_ENDPOINT_URL`, ...); default: derived from the
            pipeline's fsspec options.
    """

    url: str
    partition_by: tuple[str, ...] | None = None
    storage_options: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.partition_by is not None:
            object.__setattr__(self, "partition_by", tuple(
                [self.partition_by] if isinstance(self.partition_by, str) else self.partition_by))

    @property
    def uri(self) -> str:
        """Its URL form: `delta+<location>` (a path made absolute): what `--output` and `--input` take."""
        return DELTA_SCHEME + storage_url(self.url).rstrip("/")


@dataclass(frozen=True)
class IcebergTable:
    """An Apache Iceberg table in a pyiceberg catalog (the SQL catalog on SQLite by default).

    Example:
        ```python
        IcebergTable("analytics.clicks", catalog={"name": "lake", "uri": "sqlite:///cat.db",
                                                  "warehouse": "file:///data/warehouse"})
        ```

    Args:
        identifier: `<namespace>.<table>` (a namespace may have dots: the last part is the table).
        catalog: the catalog's properties (`name` among them, default `"default"`; `uri`, `warehouse`,
            `type`, ...), as pyiceberg's `load_catalog` takes them.
    """

    identifier: str
    catalog: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if "." not in self.identifier.strip(".") or any(not part for part in self.identifier.split(".")):
            raise TableSpecError(f"Iceberg table {self.identifier!r} must be named <namespace>.<table>")

    @property
    def catalog_name(self) -> str:
        """The catalog's name (`catalog["name"]`, default `"default"`)."""
        return str(self.catalog.get("name", "default"))

    @property
    def uri(self) -> str:
        """Its URL form: `iceberg://<catalog name>/<namespace>.<table>`."""
        return f"{ICEBERG_SCHEME}{self.catalog_name}/{self.identifier}"


TableSpec = ParquetDirectory | DeltaTable | IcebergTable


def table_url(value: str | TableSpec) -> str:
    """The URL form of an output or input as a user gives it: a table's `delta+...` or
    `iceberg://...` (a Delta location made absolute), a directory's `storage_url`."""
    table = table_of(value)
    return storage_url(table.url) if isinstance(table, ParquetDirectory) else table.uri


def table_of(value: str | TableSpec, *, catalog: Mapping[str, Any] | None = None,
             partition_by: tuple[str, ...] | None = None) -> TableSpec:
    """The table a URL (or a value) names: `delta+...` a Delta table, `iceberg://...` an Iceberg
    table (with `catalog`'s properties), anything else a directory of Parquet files."""
    if not isinstance(value, str):
        return value
    if value.startswith(DELTA_SCHEME):
        location = value[len(DELTA_SCHEME):]
        if not location:
            raise TableSpecError(f"{value!r} names no Delta table location: write delta+file:///path or delta+s3://...")
        return DeltaTable(location, partition_by=partition_by)
    if value.startswith(ICEBERG_SCHEME):
        name, _, identifier = value[len(ICEBERG_SCHEME):].partition("/")
        if not name or not identifier:
            raise TableSpecError(f"{value!r} must be iceberg://<catalog name>/<namespace>.<table>")
        return IcebergTable(identifier, catalog={**(catalog or {}), "name": name})
    return ParquetDirectory(value)
