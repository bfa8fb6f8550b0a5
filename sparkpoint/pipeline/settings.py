"""Configuration names: ours, and Flink's keys as aliases so Flink users feel at home."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from sparkpoint.checkpoint.retention import ClaimMode, ExternalizedRetention, parse_bool
from sparkpoint.state.rocksdb import RocksDBOptions

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
    "state.backend.rocksdb.block.cache-size": "rocksdb_block_cache_mb",
}

_SIZE = re.compile(r"(\d+)\s*(k|kb|m|mb|g|gb|t|tb)?")
_MB_PER_UNIT = {"k": 1 / 1024, "m": 1, "g": 1024, "t": 1024 * 1024}


def parse_megabytes(value: str | int) -> int:
    """A size in whole megabytes: `256` (MB), `256mb`, `1gb`, `1 GB`. At least 1 MB."""
    match = _SIZE.fullmatch(str(value).strip().lower())
    if match is None:
        raise ValueError(f"expected a size such as 256mb or 1gb, got {value!r}")
    number, unit = int(match.group(1)), match.group(2)
    if unit is None and number >= 1 << 20:  # Flink reads a bare number as bytes: do not guess
        raise ValueError(f"{number} MB is over a terabyte; give the unit, e.g. {number >> 20}mb if it was bytes")
    mb = number * _MB_PER_UNIT[(unit or "m")[0]]
    if mb < 1 or mb != int(mb):
        raise ValueError(f"expected whole megabytes, at least 1, got {value!r}")
    return int(mb)


# Settings of RocksDBOptions: resolve_settings gathers them into one `rocksdb` entry.
_ROCKSDB_FIELDS = {"rocksdb_block_cache_mb": "block_cache_mb",
                   "rocksdb_cache_index_and_filter_blocks": "cache_index_and_filter_blocks"}

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
    "changelog_materialize_in_steps": parse_bool,
    "rocksdb_block_cache_mb": parse_megabytes,
    "rocksdb_cache_index_and_filter_blocks": parse_bool,
    "event_time": str,
    "allowed_lateness": float,
    "late": str,
    "on_bad_file": lambda v: str(v).strip().lower(),  # fail | skip: checked with the other settings
}


def resolve_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """Map Flink keys to ours and parse values; an unknown key or bad value is a clear error.
    RocksDB's settings come back as one `rocksdb` entry (a RocksDBOptions)."""
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
    rocksdb = {_ROCKSDB_FIELDS[name]: out.pop(name) for name in list(out) if name in _ROCKSDB_FIELDS}
    if rocksdb:
        try:
            out["rocksdb"] = RocksDBOptions(**rocksdb)
        except ValueError as e:
            raise ValueError(f"RocksDB settings: {e}") from e
    return out
