"""Configuration names: ours, and Flink's keys as aliases so Flink users feel at home."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sparkpoint.core.retention import ClaimMode, ExternalizedRetention, parse_bool

FLINK_ALIASES = {
    "state.checkpoints.dir": "checkpoints_dir",
    "state.checkpoints.num-retained": "num_retained",
    "execution.checkpointing.externalized-checkpoint-retention": "retention",
    "state.backend.incremental": "incremental",
    "state.backend.local-recovery": "local_recovery",
    "execution.savepoint-restore-mode": "restore_mode",
    "execution.state-recovery.claim-mode": "restore_mode",
    "execution.savepoint.path": "from_checkpoint",
    "execution.state-recovery.path": "from_checkpoint",
    "pipeline.max-parallelism": "max_parallelism",
    "parallelism.default": "parallelism",
    "execution.state-recovery.ignore-unclaimed-state": "allow_non_restored_state",
    "execution.savepoint.ignore-unclaimed-state": "allow_non_restored_state",
    "state.backend.changelog.enabled": "changelog",
}

_PARSERS: dict[str, Any] = {
    "checkpoints_dir": str,
    "num_retained": int,
    "retention": lambda v: ExternalizedRetention(str(v).upper()).value,
    "incremental": parse_bool,
    "local_recovery": parse_bool,
    "restore_mode": lambda v: ClaimMode(str(v).upper()).value,
    "from_checkpoint": str,
    "max_parallelism": int,
    "parallelism": int,
    "allow_non_restored_state": parse_bool,
    "allow_new_operators": parse_bool,
    "changelog": parse_bool,
    "changelog_materialize_share": float,
    "changelog_max_chain": int,
}


def resolve_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """Map Flink keys to ours and parse values; an unknown key or bad value is a clear error."""
    out: dict[str, Any] = {}
    for key, value in settings.items():
        name = FLINK_ALIASES.get(key, key.replace("-", "_"))
        if name not in _PARSERS:
            known = ", ".join(sorted([*FLINK_ALIASES, *_PARSERS]))
            raise ValueError(f"unknown setting {key!r}; known settings: {known}")
        try:
            out[name] = _PARSERS[name](value)
        except ValueError as e:
            raise ValueError(f"setting {key!r}: {value!r} is not valid ({e})") from e
    return out
