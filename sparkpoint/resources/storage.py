"""The checkpoint storage and the registry resources."""

from __future__ import annotations

import math
from typing import Any

import dagster as dg
from pydantic import PrivateAttr

from sparkpoint.checkpoint.errors import SparkpointError
from sparkpoint.checkpoint.retention import ClaimMode, ExternalizedRetention
from sparkpoint.checkpoint.storage import CheckpointStorage, storage_url
from sparkpoint.pipeline.maintenance import RegistryCounts, registry_counts
from sparkpoint.resources.fields import (
    DEFAULT_CHECKPOINTS,
    DEFAULT_JOB_ID,
    ResourceConfigError,
    SettingFields,
    check_settings,
    json_object,
    with_settings,
)


class CheckpointStorageResource(dg.ConfigurableResource):  # type: ignore[type-arg]
    """Where checkpoints live: `<checkpoints_url>/<job_id>/` on any fsspec filesystem."""

    checkpoints_url: str = DEFAULT_CHECKPOINTS
    storage_options: str = "{}"  # JSON, e.g. {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}}
    job_id: str = DEFAULT_JOB_ID

    def options(self) -> dict[str, Any]:
        return json_object(self.storage_options, "checkpoint storage: storage_options")

    def url(self) -> str:
        return storage_url(self.checkpoints_url)

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
        check_settings(self, "registry")
        self._counts = registry_counts(self.storage.open())  # never trusted from memory across runs

    @property
    def counts(self) -> RegistryCounts:
        return self._counts if self._counts is not None else registry_counts(self.storage.open())
