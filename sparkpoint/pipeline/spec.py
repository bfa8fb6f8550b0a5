"""`Pipeline`: the user's pipeline as one immutable value, the unit every front end takes.

A name (the default job id), keyed operators, where input lands, where checkpoints and output go,
and the settings the CLI flags and the Dagster resources set, with the same checks and messages:

    clicks = Pipeline("clicks", [clicks_per_user, pages_per_user],
                      input_url="landing/clicks", checkpoints_url="s3://bucket/checkpoints",
                      storage_options={"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}})
    clicks.with_(parallelism=4).read_state("clicks_per_user")

`sparkpoint run --pipeline MODULE:ATTR` runs it (flags override its settings); `state` and
`restore` take `--pipeline` to know its operators and locations.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sparkpoint.checkpoint.retention import ClaimMode, ExternalizedRetention
from sparkpoint.checkpoint.storage import CheckpointStorage, storage_url
from sparkpoint.lazy import lazy_module
from sparkpoint.pipeline.fingerprint import fingerprint
from sparkpoint.pipeline.runtime import PipelineConfig, PipelineError, validate_config
from sparkpoint.pipeline.settings import SETTINGS, PipelineSettings, resolve_settings
from sparkpoint.state.engine.rocksdb import RocksDBOptions
from sparkpoint.state.extract import state_table
from sparkpoint.state.operators import KeyedOperator
from sparkpoint.tables.spec import (
    DeltaTable,
    IcebergTable,
    ParquetDirectory,
    TableSpec,
    TableSpecError,
    table_of,
    table_url,
)

if TYPE_CHECKING:
    import pandas as pd
else:
    pd = lazy_module("pandas")

DEFAULT_ROOT = ".sparkpoint"  # locations a pipeline leaves unset: .sparkpoint/<name>/{input,checkpoints,...}


@dataclass(frozen=True)
class Pipeline(PipelineSettings):  # type: ignore[misc]  # its settings' fields: made from the table
    """Your pipeline as one immutable value: the unit every front end takes.

    A name (the default job id), keyed operators, where input lands, where checkpoints and output go,
    and the settings. The CLI (`sparkpoint run --pipeline MODULE:ATTR`, whose flags override its
    settings), the notebook API, `build_pipeline_defs` (Dagster), its `dg` component and
    `sparkpoint_dag` (Airflow) all take it. Locations left unset go under `.sparkpoint/<name>/`.
    Every value is checked when the pipeline is made, with the messages the CLI gives.

    Besides the arguments below it takes every setting of [Configuration](../configuration.md#every-setting)
    (its default and what it does are there) as a keyword-only field of its name — `num_retained`,
    `parallelism`, `event_time`, `on_bad_file`, `max_future_event_time`, `routing`, ... — but
    `checkpoints_dir` (`checkpoints_url`) and the `rocksdb_*` ones (`rocksdb`); each is declared once,
    in `sparkpoint.pipeline.settings.SETTINGS`.

    Example:
        ```python
        clicks = Pipeline("clicks", [clicks_per_user, pages_per_user],
                          input_url="landing/clicks", checkpoints_url="s3://bucket/checkpoints",
                          storage_options={"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}})
        clicks.with_(parallelism=4).read_state("clicks_per_user")
        ```

    Args:
        name: the pipeline's name: the default job id, the prefix of its Dagster names and its Airflow DAG id.
        operators: one or more `KeyedOperator`, with distinct names and uids.
        input_url: where batch files land (a directory of Parquet files, any fsspec URL).
        input: the input as a table instead: `DeltaTable(url)` or `IcebergTable(identifier, catalog={...})`
            (`sparkpoint.tables.spec`), whose new versions are the batches; or a `ParquetDirectory`, or a URL
            (`delta+file:///...`, `iceberg://<catalog>/<namespace>.<table>`). Not with `input_url`.
        checkpoints_url: the checkpoint storage (any fsspec URL); the job's directory is `<checkpoints_url>/<job id>/`.
        output_url: where the exactly-once sink writes what operators that `emit` return: a directory of
            Parquet files (any fsspec URL), or a table's URL (`delta+file:///...`, `iceberg://<catalog>/<ns>.<table>`);
            None: no output.
        output: the output as a value: `sparkpoint.DeltaTable(url, partition_by=..., storage_options=...)`,
            `sparkpoint.IcebergTable(identifier, catalog={...})` or `sparkpoint.ParquetDirectory(url)` (or a URL).
        local_dir: the working RocksDB instances and task-local copies (a local disk).
        job_id: the job's directory under `checkpoints_url`; default: `name`.
        storage_options: fsspec options of the checkpoint storage (and of the input and output, unless
            `input_options` is given).
        input_options: fsspec options of the input; default: `storage_options`.
        rocksdb: RocksDBOptions (`sparkpoint.state.engine.rocksdb`): the `rocksdb_*` settings (block cache,
            index and filter blocks).

    Raises:
        PipelineError: a setting the CLI would refuse (each message says what to change).
    """
    name: str
    operators: tuple[KeyedOperator, ...]
    input_url: str | None = None
    checkpoints_url: str | None = None
    output_url: str | None = None
    output: TableSpec | str | None = None  # a table value or its URL; `output_url`, when given too, is the location
    local_dir: str | None = None
    job_id: str | None = None
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    input_options: Mapping[str, Any] | None = None  # default: storage_options
    input: TableSpec | str | None = None  # a table as input (beside input_url, a directory)
    rocksdb: RocksDBOptions = field(default_factory=RocksDBOptions)  # the `rocksdb_*` settings
    # ... and a field per setting of sparkpoint.pipeline.settings.SETTINGS (PipelineSettings)

    def __post_init__(self) -> None:
        object.__setattr__(self, "operators", tuple(self.operators))
        if self.input is not None:
            if self.input_url is not None:
                raise PipelineError(f"pipeline {self.name!r}: give input_url (a directory) or input (a table), "
                                    "not both")
            try:
                object.__setattr__(self, "input", table_of(self.input))
            except TableSpecError as e:
                raise PipelineError(f"pipeline {self.name!r}: input {self.input!r}: {e}") from e
        if not self.operators or not all(isinstance(op, KeyedOperator) for op in self.operators):
            raise PipelineError(f"pipeline {self.name!r}: operators must be one or more KeyedOperator")
        for what, values in (("names", [op.name for op in self.operators]),
                             ("uids", [op.uid for op in self.operators])):
            if len(set(values)) != len(values):
                raise PipelineError(f"pipeline {self.name!r}: operator {what} must be unique, got {values}")
        for field_name, enum in (("retention", ExternalizedRetention), ("restore_mode", ClaimMode)):
            value = getattr(self, field_name)
            if value not in {e.value for e in enum}:
                raise PipelineError(f"pipeline {self.name!r}: {field_name} {value!r} is not one of "
                                    + ", ".join(e.value for e in enum))
        validate_config(self.config())  # the CLI's and the resources' checks, with their messages

    @property
    def settings(self) -> Any:
        """Its settings as one frozen value (`PipelineSettings`: a field per setting of the table).

        Example:
            ```python
            clicks.settings.num_retained          # 2
            ```
        """
        return PipelineSettings(**{s.name: getattr(self, s.name) for s in SETTINGS if s.field == s.name})

    @property
    def effective_job_id(self) -> str:
        """The job id its checkpoints go under: `job_id`, else the name.

        Example:
            ```python
            Pipeline("clicks", ops).effective_job_id                 # "clicks"
            ```
        """
        return self.job_id or self.name

    def with_(self, **changes: Any) -> Pipeline:
        """A copy with `changes` (any field), checked like the original.

        Example:
            ```python
            bigger = clicks.with_(parallelism=8, num_retained=3)
            ```

        Args:
            **changes: field name -> new value.

        Returns:
            The new `Pipeline`.

        Raises:
            PipelineError: a changed value the pipeline refuses.
        """
        return dataclasses.replace(self, **changes)

    def with_settings(self, settings: Mapping[str, Any]) -> Pipeline:
        """A copy with `settings` under our names or Flink's keys, as `sparkpoint run --conf` takes them.

        Example:
            ```python
            clicks.with_settings({"state.checkpoints.num-retained": "3", "parallelism.default": 4})
            ```

        Args:
            settings: setting -> value (strings are parsed: `"true"`, `"3"`, `"1gb"`); see
                [Configuration](../configuration.md).

        Returns:
            The new `Pipeline`.

        Raises:
            PipelineError: an unknown setting or a value it cannot take (the message lists the known settings).
        """
        try:
            resolved = resolve_settings(settings)
        except ValueError as e:
            raise PipelineError(f"pipeline {self.name!r}: {e}") from e
        if "checkpoints_dir" in resolved:
            resolved["checkpoints_url"] = resolved.pop("checkpoints_dir")
        return self.with_(**resolved)

    def location(self, kind: str) -> str:
        """Where `kind` is: as given, or under `.sparkpoint/<name>/`.

        Example:
            ```python
            Pipeline("clicks", ops).location("checkpoints")          # ".sparkpoint/clicks/checkpoints"
            ```

        Args:
            kind: "input", "checkpoints", "output" or "local".

        Returns:
            The URL or path as given, or the default one.
        """
        source = self.input.uri if isinstance(self.input, (DeltaTable, IcebergTable)) else \
            self.input.url if isinstance(self.input, ParquetDirectory) else self.input_url
        given = {"input": source, "checkpoints": self.checkpoints_url, "output": self.output_url,
                 "local": self.local_dir}[kind]
        return given if given else str(Path(DEFAULT_ROOT) / self.name / kind)

    def config(self, **overrides: Any) -> PipelineConfig:
        """The driver's settings, resolved: locations as URLs, the local directory absolute.

        Example:
            ```python
            clicks.config(parallelism=3).job_id                       # "clicks"
            ```

        Args:
            **overrides: what flags or resources set on top, by `PipelineConfig` field name.

        Returns:
            A `sparkpoint.pipeline.runtime.PipelineConfig`.
        """
        values: dict[str, Any] = {
            "input_url": storage_url(self.location("input")),
            "checkpoints_url": storage_url(self.location("checkpoints")),
            "job_id": self.effective_job_id,
            "storage_options": dict(self.storage_options),
            "input_options": dict(self.input.storage_options if isinstance(self.input, ParquetDirectory)
                                  and self.input.storage_options is not None else self.input_options
                                  if self.input_options is not None else self.storage_options),
            "input_table": self.input if isinstance(self.input, (DeltaTable, IcebergTable)) else None,
            **self._output_config(),
            "local_dir": str(Path(self.location("local")).resolve()),
        }
        for f in dataclasses.fields(PipelineConfig):
            if f.name not in values and hasattr(self, f.name):
                values[f.name] = getattr(self, f.name)
        values.update(overrides)
        if "input_url" in overrides and "input_table" not in overrides:  # a resource's or an override's input
            values["input_table"] = _table_named(overrides["input_url"], values.get("input_table"))
        if values.get("local_dir"):  # as the driver means it: Spark's workers (a Connect server's) run elsewhere
            values["local_dir"] = str(Path(values["local_dir"]).resolve())
        return PipelineConfig(**values)

    def output_table(self) -> TableSpec | None:
        """Its output as a table value (`output`, else what `output_url` names; None: no output).

        Example:
            ```python
            Pipeline("clicks", ops, output_url="delta+s3://lake/clicks").output_table()  # DeltaTable("s3://lake/clicks")
            ```

        Returns:
            A `ParquetDirectory`, `DeltaTable` or `IcebergTable`, or None.
        """
        given = self.output_url if self.output_url else self.output
        if given is None:
            return None
        table = table_of(given)
        if isinstance(given, str) and self.output is not None and not isinstance(self.output, str):
            table = _located(self.output, table)
        return table

    def _output_config(self) -> dict[str, Any]:
        """The `PipelineConfig` fields of its output: the URL form, partition columns, delta-rs
        options, an Iceberg catalog's properties."""
        try:
            table = self.output_table()
        except TableSpecError as e:
            raise PipelineError(f"pipeline {self.name!r}: output: {e}") from e
        if table is None:
            return {"output_url": None}
        out: dict[str, Any] = {"output_url": table_url(table)}
        if isinstance(table, DeltaTable):
            out["output_partition_by"] = table.partition_by
            out["output_options"] = dict(table.storage_options) if table.storage_options is not None else None
        if isinstance(table, IcebergTable):
            out["output_catalog"] = dict(table.catalog)
        return out

    def code_version(self) -> str:
        """A digest of the operators' definitions and code: Dagster's code version of the assets.

        Stable across processes; changes when an operator's definition or code changes, or a value its
        functions compute with: what they close over (an operator a factory made with `threshold=10`
        and one made with `threshold=1000` differ), their defaults, the globals they name, a
        `functools.partial`'s arguments. What is covered and what is not: `sparkpoint.pipeline.fingerprint`.

        Example:
            ```python
            clicks.code_version()          # e.g. "3f2a9c1de07b4411"
            ```

        Returns:
            16 hex digits.
        """
        digest = hashlib.sha256()
        for op in self.operators:
            digest.update(repr((op.name, op.key, op.columns, op.emits, op.schema)).encode())
            if op.uid != op.name:  # a uid of its own; unset or equal to the name: as before uids existed
                digest.update(repr(("uid", op.uid)).encode())
            optional = [fn for fn in (op.on_timer, op.bootstrap) if fn is not None]  # unset: as before they existed
            for fn in (op.process, op.export, *optional):
                digest.update(fingerprint(fn).encode())
        if self.event_time is not None:  # what the operators see and when their timers fire
            digest.update(repr((self.event_time, float(self.allowed_lateness), self.late)).encode())
        return digest.hexdigest()[:16]

    def operator(self, name: str) -> KeyedOperator:
        """Its operator called `name`.

        Example:
            ```python
            clicks.operator("pages_per_user").key         # "user"
            ```

        Args:
            name: the operator's name.

        Returns:
            The `KeyedOperator`.

        Raises:
            PipelineError: no operator of that name (the message lists them).
        """
        for op in self.operators:
            if op.name == name:
                return op
        raise PipelineError(f"pipeline {self.name!r} has no operator {name!r}; it has: "
                            + ", ".join(op.name for op in self.operators))

    # --- reading its own checkpoints (the notebook API with this pipeline's locations) ---------

    def storage(self) -> CheckpointStorage:
        """Its checkpoint storage (`<checkpoints>/<job id>/`), for the lower-level tools.

        Example:
            ```python
            clicks.storage().job_url          # "file:///.../checkpoints/clicks"
            ```

        Returns:
            A `sparkpoint.checkpoint.storage.CheckpointStorage`.
        """
        return CheckpointStorage(storage_url(self.location("checkpoints")), self.effective_job_id,
                                 dict(self.storage_options))

    def read_state(self, operator: str, checkpoint: int | None = None) -> pd.DataFrame:
        """The state of its operator `operator` at a checkpoint, as its `export` makes it.

        Example:
            ```python
            clicks.read_state("clicks_per_user")                  # at the latest checkpoint
            clicks.read_state("pages_per_user", checkpoint=7)
            ```

        Args:
            operator: the operator's name.
            checkpoint: the checkpoint id; None: the latest.

        Returns:
            Every subtask's export in one DataFrame, sorted by key.

        Raises:
            PipelineError: no operator of that name.
            CheckpointNotFound: no such checkpoint (the message lists the completed ones).
        """
        return state_table(self.storage(), self.operator(operator), checkpoint)[1]


def _table_named(url: str, table: DeltaTable | IcebergTable | None) -> DeltaTable | IcebergTable | None:
    """The input table `url` names: `table` when it is its URI (an Iceberg table keeps its catalog's
    properties), another table for another table URL, none for a directory."""
    if table is not None and url == table.uri:
        return table
    named = table_of(url)
    return named if isinstance(named, (DeltaTable, IcebergTable)) else None


def _located(value: TableSpec, named: TableSpec) -> TableSpec:
    """`value` (a pipeline's `output`) at the location `named` (its `output_url`), when both are
    tables of one kind: the value's partition columns and catalog stay."""
    if isinstance(value, DeltaTable) and isinstance(named, DeltaTable):
        return dataclasses.replace(value, url=named.url)
    if isinstance(value, IcebergTable) and isinstance(named, IcebergTable):
        return dataclasses.replace(value, identifier=named.identifier,
                                   catalog={**value.catalog, **named.catalog})
    return named


def load_pipeline(reference: str) -> Pipeline:
    """`MODULE:ATTR` (the module importable from the working directory or the path) -> its Pipeline."""
    found = _load(reference, "--pipeline", "my_project.pipelines:clicks")
    if not isinstance(found, Pipeline):
        raise PipelineError(f"--pipeline {reference!r} is a {type(found).__name__}, not a sparkpoint.Pipeline")
    return found


def load_operator(reference: str) -> KeyedOperator:
    """`MODULE:ATTR` -> its KeyedOperator."""
    found = _load(reference, "operator", "my_project.operators:clicks_per_user")
    if not isinstance(found, KeyedOperator):
        raise PipelineError(f"operator {reference!r} is a {type(found).__name__}, not a sparkpoint.KeyedOperator")
    return found


def _load(reference: str, what: str, example: str) -> Any:
    module_name, _, attr = reference.partition(":")
    if not module_name or not attr:
        raise PipelineError(f"{what} {reference!r} must be MODULE:ATTR, e.g. {example}")
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # a module next to where the command runs, as `python -m` finds it
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise PipelineError(f"{what} {reference!r}: cannot import {module_name!r} ({e})") from e
    try:
        return getattr(module, attr)
    except AttributeError:
        raise PipelineError(f"{what} {reference!r}: module {module_name!r} has no {attr!r}") from None
