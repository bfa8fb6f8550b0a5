"""The state backend and the input resources."""

from __future__ import annotations

import dagster as dg

from sparkpoint.resources.fields import (
    DEFAULT_INPUT,
    DEFAULT_LOCAL_DIR,
    DEFAULT_OUTPUT,
    ResourceConfigError,
    SettingFields,
    check_settings,
    json_object,
    with_settings,
)
from sparkpoint.state.engine.rocksdb import RocksDBOptions
from sparkpoint.state.keygroups import MAX_KEY_GROUPS


@with_settings("state_backend")
class StateBackendResource(SettingFields, dg.ConfigurableResource):  # type: ignore[type-arg]
    """The RocksDB state backend of every subtask. Its settings' fields (`local_recovery`,
    `incremental`, `changelog`, `parallelism`, `max_parallelism`, `rocksdb_block_cache_mb`,
    `allow_non_restored_state`, `allow_new_operators`, `routing`) are those
    `sparkpoint.pipeline.settings.SETTINGS` gives the role "state_backend"."""

    local_dir: str = DEFAULT_LOCAL_DIR

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        check_settings(self, "state_backend")
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
        json_object(self.input_options, "input: input_options")
        if self.files_per_checkpoint < 1:
            raise ResourceConfigError(f"input: files_per_checkpoint must be >= 1, got {self.files_per_checkpoint}")
        check_settings(self, "source")
