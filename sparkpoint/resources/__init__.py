"""Dagster resources: checkpoint storage, registry, Spark, state backend, input.

Every field is a plain string, number or boolean, so the launchpad and `EnvVar("...")` can set
it; options that are mappings are JSON text. The embedded defaults need nothing: checkpoints
under `.sparkpoint/checkpoints`, input `.sparkpoint/demo/input` (relative to the working
directory). Values are checked at setup, with a message that names the field.
"""


import dataclasses
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import dagster as dg
import pydantic
from pydantic import PrivateAttr

from sparkpoint.checkpoint.errors import SparkpointError
from sparkpoint.checkpoint.retention import ClaimMode, ExternalizedRetention
from sparkpoint.checkpoint.storage import CheckpointStorage, storage_url
from sparkpoint.pipeline.driver import StatefulPipeline
from sparkpoint.pipeline.maintenance import RegistryCounts, registry_counts
from sparkpoint.pipeline.runtime import PipelineConfig, validate_config
from sparkpoint.pipeline.settings import Setting, of_role
from sparkpoint.pipeline.spec import Pipeline
from sparkpoint.state.keygroups import MAX_KEY_GROUPS
from sparkpoint.state.rocksdb import RocksDBOptions

DEFAULT_CHECKPOINTS = ".sparkpoint/checkpoints"
DEFAULT_INPUT = ".sparkpoint/demo/input"
DEFAULT_OUTPUT = ".sparkpoint/demo/output"
DEFAULT_LOCAL_DIR = ".sparkpoint/local"
DEFAULT_JOB_ID = "demo"
R = TypeVar("R", bound=dg.ConfigurableResource)  # type: ignore[type-arg]


class ResourceConfigError(SparkpointError, ValueError):
    """A resource field has a value sparkpoint cannot use; the message names the field."""


def _json_object(value: str, field: str) -> dict[str, Any]:
    try:
        parsed = json.loads(value or "{}")
    except json.JSONDecodeError as e:
        raise ResourceConfigError(f"{field} must be a JSON object, got {value!r} ({e})") from e
    if not isinstance(parsed, dict):
        raise ResourceConfigError(f"{field} must be a JSON object, got {value!r}")
    return parsed


# How a resource's messages name it, by role.
_LABELS = {"storage": "checkpoint storage", "registry": "registry", "state_backend": "state backend",
           "source": "input"}


class SettingFields:
    """A resource whose fields include those `SETTINGS` gives its role (`with_settings`): made at
    import from the table, so mypy, which cannot see them, reads each as `Any`."""

    if TYPE_CHECKING:
        def __getattr__(self, name: str) -> Any: ...


def with_settings(role: str) -> Callable[[type[R]], type[R]]:
    """A class decorator: the resource with a field for every setting of `role` in
    `sparkpoint.pipeline.settings.SETTINGS` (the name, type and default declared there)."""

    def made(base: type[R]) -> type[R]:
        fields: dict[str, Any] = {}
        for setting in of_role(role):
            none_as = setting.resource.none_as if setting.resource else None
            annotation, default = (str, none_as) if none_as is not None else (setting.type, setting.default)
            fields[setting.resource_field or setting.name] = (annotation, default)
        cls: type[R] = pydantic.create_model(base.__name__, __base__=base, __module__=base.__module__, **fields)
        cls.__doc__, cls.__qualname__ = base.__doc__, base.__qualname__
        return cls

    return made


def _resource_value(setting: Setting, resource: Any) -> Any:
    """The setting's value as `resource` holds it (its stand-in for None is None)."""
    value = getattr(resource, setting.resource_field or setting.name)
    none_as = setting.resource.none_as if setting.resource else None
    return None if none_as is not None and value == none_as else value


def _check_settings(resource: Any, role: str) -> None:
    """Each setting of `role` through its own check, the message naming the resource."""
    for setting in of_role(role):
        for problem in setting.check(_resource_value(setting, resource)) if setting.check else []:
            raise ResourceConfigError(f"{_LABELS[role]}: {problem}")


def _pipeline_value(setting: Setting, pipeline: Pipeline) -> Any:
    """The setting's value in `pipeline` as a resource field holds it."""
    value: Any = pipeline
    for part in (setting.target or setting.name).split("."):
        value = getattr(value, part)
    none_as = setting.resource.none_as if setting.resource else None
    return none_as if value is None and none_as is not None else value


def _url(value: str) -> str:
    """A bare path means a local directory (relative to the working directory), taken literally."""
    return storage_url(value)


class CheckpointStorageResource(dg.ConfigurableResource):  # type: ignore[type-arg]
    """Where checkpoints live: `<checkpoints_url>/<job_id>/` on any fsspec filesystem."""

    checkpoints_url: str = DEFAULT_CHECKPOINTS
    storage_options: str = "{}"  # JSON, e.g. {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}}
    job_id: str = DEFAULT_JOB_ID

    def options(self) -> dict[str, Any]:
        return _json_object(self.storage_options, "checkpoint storage: storage_options")

    def url(self) -> str:
        return _url(self.checkpoints_url)

    def open(self) -> CheckpointStorage:
        options = self.options()  # names its own field when it is wrong
        try:
            return CheckpointStorage(self.url(), self.job_id, options)
        except SparkpointError as e:
            raise ResourceConfigError(f"checkpoint storage (checkpoints_url, job_id): {e}") from e

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        storage = self.open()
        try:  # reach it now: a wrong endpoint is the configuration's fault, named as such
            storage.job_dir_exists()
        except SparkpointError as e:
            raise ResourceConfigError(f"checkpoint storage (checkpoints_url, storage_options): {e}") from e


@with_settings("registry")
class CheckpointRegistryResource(SettingFields, dg.ConfigurableResource):  # type: ignore[type-arg]
    """Retention and claim mode; the shared-state registry is rebuilt from storage at setup.
    Its settings' fields (`num_retained`, `retention`, `claim_mode`, `from_checkpoint`) are those
    `sparkpoint.pipeline.settings.SETTINGS` gives the role "registry"."""

    storage: CheckpointStorageResource
    orphan_grace_seconds: float = 3600.0
    _counts: RegistryCounts | None = PrivateAttr(default=None)

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        if self.num_retained < 1:
            raise ResourceConfigError(f"registry: num_retained must be at least 1, got {self.num_retained}")
        for field, value, enum in (("retention", self.retention, ExternalizedRetention),
                                   ("claim_mode", self.claim_mode, ClaimMode)):
            if value not in {e.value for e in enum}:
                raise ResourceConfigError(
                    f"registry: {field} {value!r} is not one of {', '.join(e.value for e in enum)}"
                )
        if not math.isfinite(self.orphan_grace_seconds) or self.orphan_grace_seconds < 0:
            raise ResourceConfigError(
                f"registry: orphan_grace_seconds must be a finite number >= 0, got {self.orphan_grace_seconds}"
            )
        _check_settings(self, "registry")
        self._counts = registry_counts(self.storage.open())  # never trusted from memory across runs

    @property
    def counts(self) -> RegistryCounts:
        return self._counts if self._counts is not None else registry_counts(self.storage.open())


class SparkResource(dg.ConfigurableResource):  # type: ignore[type-arg]
    """A Spark session: by default the warm local Spark (a Spark Connect server on 127.0.0.1 that
    sparkpoint starts on first use and keeps warm: `sparkpoint.spark.warm`), any master URL
    (`local[2]`: a Spark in the run's own process), extra conf as JSON; or, with `remote`
    (`sc://host:port`), a Spark Connect client of a Spark that is already up. On Connect the runs
    of a pipeline share a server session (its Python workers stay warm between runs; see
    `sparkpoint.spark.session`): `session_for`."""

    master: str = ""  # "": the warm local Spark (SPARKPOINT_WARM_SPARK=off: local[2] in the run's process)
    remote: str = ""  # Spark Connect URL; wins over `master`
    conf: str = "{}"  # JSON object of Spark settings
    app_name: str = "sparkpoint"
    stop_on_teardown: bool = True
    _session: Any = PrivateAttr(default=None)
    _remote: str | None = PrivateAttr(default=None)
    _master: str | None = PrivateAttr(default=None)
    _conf: dict[str, Any] = PrivateAttr(default_factory=dict)

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        self._conf = _json_object(self.conf, "spark: conf")
        from sparkpoint.spark.session import check_reachable, spark_session
        from sparkpoint.spark.warm import default_spark, proven_server

        self._remote = self.remote or str(self._conf.pop("spark.remote", "")) or None
        try:
            self._master, self._remote = default_spark(self.master or None, self._remote)
            if self._remote:  # the session itself when a step knows its pipeline (`session_for`)
                check_reachable(self._remote)
                warm = proven_server(self._remote)
                if warm is not None and context.log is not None:  # a shared server says whose it is
                    context.log.info(f"Spark: attached to {warm.describe()}")
            else:
                self._session = spark_session(self._master, app_name=self.app_name)
        except SparkpointError as e:
            raise ResourceConfigError(f"spark (master, remote): {e}") from e
        if self._session is not None:
            self._configure()

    def _configure(self) -> None:
        for key, value in self._conf.items():
            self._session.conf.set(key, str(value))

    def session_for(self, driver: StatefulPipeline) -> Any:
        """The session to run `driver`'s batches on: on Spark Connect, the server session its
        runs share (same job, same code)."""
        if self._session is None and self._remote:
            from sparkpoint.spark.session import session_key

            self._connect(session_key(driver.config.job_id, driver.operators, self._conf))
        return self.session

    def _connect(self, share: str | None) -> None:
        from sparkpoint.spark.session import spark_session

        try:
            self._session = spark_session(self._master, app_name=self.app_name, remote=self._remote, share=share)
        except SparkpointError as e:
            # As when setup refused it: a configuration error, which no recovery run heals (the
            # recovery sensor reads the causes too).
            raise ResourceConfigError(f"spark (master, remote): {e}") from None
        self._configure()

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        if self._session is not None and self.stop_on_teardown:
            self._session.stop()  # PySpark never stops it by itself (a shared Connect session: this client only)
        self._session, self._remote = None, None

    @property
    def session(self) -> Any:
        if self._session is None and self._remote:  # for no pipeline in particular: a session of its own
            self._connect(None)
        if self._session is None:
            raise ResourceConfigError("spark: the session exists only while a step runs")
        return self._session


@with_settings("state_backend")
class StateBackendResource(SettingFields, dg.ConfigurableResource):  # type: ignore[type-arg]
    """The RocksDB state backend of every subtask. Its settings' fields (`local_recovery`,
    `incremental`, `changelog`, `parallelism`, `max_parallelism`, `rocksdb_block_cache_mb`,
    `allow_non_restored_state`, `allow_new_operators`, `routing`) are those
    `sparkpoint.pipeline.settings.SETTINGS` gives the role "state_backend"."""

    local_dir: str = DEFAULT_LOCAL_DIR

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        _check_settings(self, "state_backend")
        if not 1 <= self.max_parallelism <= MAX_KEY_GROUPS:
            raise ResourceConfigError(
                f"state backend: max_parallelism must be between 1 and {MAX_KEY_GROUPS}, got {self.max_parallelism}"
            )
        if self.parallelism is not None and not 1 <= self.parallelism <= self.max_parallelism:
            raise ResourceConfigError(
                f"state backend: parallelism must be between 1 and max_parallelism ({self.max_parallelism}), "
                f"got {self.parallelism}"
            )
        self.rocksdb_options()

    def rocksdb_options(self) -> RocksDBOptions:
        try:
            return RocksDBOptions(block_cache_mb=self.rocksdb_block_cache_mb)
        except ValueError as e:
            raise ResourceConfigError(f"state backend: {e}") from e


@with_settings("source")
class InputResource(SettingFields, dg.ConfigurableResource):  # type: ignore[type-arg]
    """The input directory (one Parquet file per batch) and the exactly-once output directory.
    Its settings' fields (`files_per_checkpoint`, `on_bad_file`, `max_future_event_time`,
    `settle_seconds`) are those `sparkpoint.pipeline.settings.SETTINGS` gives the role "source"."""

    input_url: str = DEFAULT_INPUT
    input_options: str = "{}"  # JSON
    output_url: str = DEFAULT_OUTPUT  # "" for no sink

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        _json_object(self.input_options, "input: input_options")
        if self.files_per_checkpoint < 1:
            raise ResourceConfigError(f"input: files_per_checkpoint must be >= 1, got {self.files_per_checkpoint}")
        _check_settings(self, "source")


@dataclass(frozen=True)
class PipelineResources:
    """One pipeline's resources, configured for the run at hand."""

    storage: CheckpointStorageResource
    registry: CheckpointRegistryResource
    state_backend: StateBackendResource
    source: InputResource

    def driver(self, pipeline: Pipeline, spark: Any = None) -> StatefulPipeline:
        """`pipeline` with what these resources set on top of its own settings (`spark` None:
        the completing half)."""
        config = self.config(pipeline)
        try:
            return StatefulPipeline(spark, config, pipeline.operators)
        except SparkpointError as e:
            raise ResourceConfigError(str(e)) from e

    def settings(self, pipeline: Pipeline) -> dict[str, Any]:
        """What these resources set, by `PipelineConfig` field (a part of a composite setting such
        as `rocksdb` on top of `pipeline`'s own)."""
        values: dict[str, Any] = {}
        parts: dict[str, dict[str, Any]] = {}
        for role in ("storage", "registry", "state_backend", "source"):
            resource = getattr(self, role)
            for setting in of_role(role):
                field, _, part = (setting.target or setting.name).partition(".")
                if part:
                    parts.setdefault(field, {})[part] = _resource_value(setting, resource)
                else:
                    values[field] = _resource_value(setting, resource)
        for field, changes in parts.items():
            try:
                values[field] = dataclasses.replace(getattr(pipeline, field), **changes)
            except ValueError as e:
                raise ResourceConfigError(f"state backend: {e}") from e
        return values

    def config(self, pipeline: Pipeline) -> PipelineConfig:
        """`pipeline`'s settings with what these resources set on top (checked; nothing is opened)."""
        storage, backend, source = self.storage, self.state_backend, self.source
        try:
            config = pipeline.config(
                input_url=_url(source.input_url), input_options=_json_object(source.input_options,
                                                                             "input: input_options"),
                output_url=_url(source.output_url) if source.output_url else None,
                checkpoints_url=storage.url(), job_id=storage.job_id, storage_options=storage.options(),
                local_dir=str(Path(backend.local_dir).resolve()), **self.settings(pipeline),
            )
            validate_config(config)
            return config
        except SparkpointError as e:
            raise ResourceConfigError(str(e)) from e


def resources_for(pipeline: Pipeline) -> dict[str, dg.ConfigurableResource]:  # type: ignore[type-arg]
    """The resources of `pipeline`, by role; the launchpad (or `EnvVar`s) override any field.

    The pipeline's settings are the *defaults* of resource classes of its own, not values given
    to the shared classes: Dagster fills the fields a run config leaves out from the class's
    defaults, so a launch that sets only `job_id` would otherwise read and write the embedded
    defaults' locations (the sample's `.sparkpoint/checkpoints`), not the pipeline's."""
    storage = _own(CheckpointStorageResource, pipeline,
                   checkpoints_url=pipeline.location("checkpoints"), job_id=pipeline.effective_job_id,
                   storage_options=json.dumps(dict(pipeline.storage_options)))
    input_options = dict(pipeline.input_options if pipeline.input_options is not None else pipeline.storage_options)
    return {
        "storage": storage,
        "registry": _own(CheckpointRegistryResource, pipeline, storage=storage, **_settings_of(pipeline, "registry")),
        "spark": _own(SparkResource, pipeline, app_name=pipeline.name),
        "state_backend": _own(StateBackendResource, pipeline, local_dir=pipeline.location("local"),
                              **_settings_of(pipeline, "state_backend")),
        "source": _own(InputResource, pipeline,
                       input_url=pipeline.location("input"), input_options=json.dumps(input_options),
                       output_url=pipeline.output_url or "",
                       **_settings_of(pipeline, "source")),
    }


def _settings_of(pipeline: Pipeline, role: str) -> dict[str, Any]:
    """`pipeline`'s settings that are fields of the resource of `role`, by field name."""
    return {setting.resource_field or setting.name: _pipeline_value(setting, pipeline) for setting in of_role(role)}


def _own(cls: type[R], pipeline: Pipeline, **defaults: Any) -> R:
    """An instance of a subclass of `cls` whose field defaults are `defaults` (a resource given as
    a field, like the registry's storage, is passed as a value)."""
    nested = {k: defaults.pop(k) for k in list(defaults) if isinstance(defaults[k], dg.ConfigurableResource)}
    name = re.sub(r"[^0-9A-Za-z_]", "_", pipeline.name)
    fields: dict[str, Any] = {k: (cls.model_fields[k].annotation, v) for k, v in defaults.items()}
    own = pydantic.create_model(f"{name}_{cls.__name__}", __base__=cls, __module__=cls.__module__, **fields)
    return own(**nested)
