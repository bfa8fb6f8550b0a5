"""What every resource shares: the embedded defaults, the error that names a field, and the
fields made from `sparkpoint.pipeline.settings.SETTINGS` (`with_settings`), read and checked by role."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import dagster as dg
import pydantic

from sparkpoint.checkpoint.errors import SparkpointError
from sparkpoint.pipeline.settings import Setting, of_role
from sparkpoint.pipeline.spec import Pipeline

DEFAULT_CHECKPOINTS = ".sparkpoint/checkpoints"
DEFAULT_INPUT = ".sparkpoint/demo/input"
DEFAULT_OUTPUT = "delta+.sparkpoint/demo/output"  # the sample's Delta table
DEFAULT_LOCAL_DIR = ".sparkpoint/local"
DEFAULT_JOB_ID = "demo"
R = TypeVar("R", bound=dg.ConfigurableResource)  # type: ignore[type-arg]


class ResourceConfigError(SparkpointError, ValueError):
    """A resource field has a value sparkpoint cannot use; the message names the field."""


def json_object(value: str, field: str) -> dict[str, Any]:
    try:
        parsed = json.loads(value or "{}")
    except json.JSONDecodeError as e:
        raise ResourceConfigError(f"{field} must be a JSON object, got {value!r} ({e})") from e
    if not isinstance(parsed, dict):
        raise ResourceConfigError(f"{field} must be a JSON object, got {value!r}")
    return parsed


# How a resource's messages name it, by role.
LABELS = {"storage": "checkpoint storage", "registry": "registry", "state_backend": "state backend",
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


def resource_value(setting: Setting, resource: Any) -> Any:
    """The setting's value as `resource` holds it (its stand-in for None is None)."""
    value = getattr(resource, setting.resource_field or setting.name)
    none_as = setting.resource.none_as if setting.resource else None
    return None if none_as is not None and value == none_as else value


def check_settings(resource: Any, role: str) -> None:
    """Each setting of `role` through its own check, the message naming the resource."""
    for setting in of_role(role):
        for problem in setting.check(resource_value(setting, resource)) if setting.check else []:
            raise ResourceConfigError(f"{LABELS[role]}: {problem}")


def pipeline_value(setting: Setting, pipeline: Pipeline) -> Any:
    """The setting's value in `pipeline` as a resource field holds it."""
    value: Any = pipeline
    for part in (setting.target or setting.name).split("."):
        value = getattr(value, part)
    none_as = setting.resource.none_as if setting.resource else None
    return none_as if value is None and none_as is not None else value


