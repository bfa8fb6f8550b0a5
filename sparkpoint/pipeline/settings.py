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
    "max_future_event_time": lambda v: None if v is None or str(v).strip().lower() in ("none", "off") else float(v),
    "routing": lambda v: str(v).strip().lower(),  # auto | read-all | shuffle: checked with the other settings
}


# What each setting does, for people: `make docs` renders the configuration table from this
# (beside each name its Flink keys, its default and its `sparkpoint run` flag), and fails on a
# setting without a line here.
SETTING_DOCS = {
    "checkpoints_dir": "fsspec URL of the checkpoint storage (`file://`, `s3://`, `gs://`, ...)",
    "num_retained": "completed checkpoints kept; older ones are subsumed and the files only they referenced deleted",
    "retention": "what a shutdown deletes: `RETAIN_ON_CANCELLATION`, `DELETE_ON_CANCELLATION` or "
                 "`NO_EXTERNALIZED_CHECKPOINTS` (never savepoints)",
    "incremental": "upload only the files the last confirmed checkpoint lacks",
    "local_recovery": "keep a task-local copy of the latest checkpoint next to the working database",
    "restore_mode": "claim mode of `from_checkpoint`: `CLAIM` (the checkpoint becomes the job's own) or `NO_CLAIM` "
                    "(only ever read)",
    "from_checkpoint": "start a new job from this `<checkpoints-dir>/<job-id>/chk-<N>` (a checkpoint or a savepoint)",
    "max_parallelism": "key groups (at most 32,768); fixed for the life of a job's state",
    "parallelism": "subtasks per operator; may change between runs (the state is rescaled by key group)",
    "allow_non_restored_state": "drop the state of operators the checkpoint holds and the job no longer runs",
    "allow_new_operators": "start operators the checkpoint lacks empty",
    "changelog": "changelog checkpoints (Flink's FLIP-158): upload the entries that changed, materialize now and then",
    "changelog_materialize_share": "materialize when the chain reaches this share of the state's bytes (the larger of "
                                   "the last materialization and the working SSTs now)",
    "changelog_max_chain": "... or once the chain has this many changelog files",
    "changelog_materialize_in_steps": "upload a materialization as slices over the next checkpoints (no checkpoint "
                                      "above about twice the mean upload) instead of all in one",
    "rocksdb_block_cache_mb": "the process's RocksDB block cache, shared by every database and state it opens, with a "
                              "unit (`64mb`, `1gb`) or in MB, from 1 MB to 1 TB; index and filter blocks live in it. "
                              "The memtables of all of them together are held to two 64 MB write buffers beside it",
    "rocksdb_cache_index_and_filter_blocks": "false: every open loads each SST's whole index and filter into memory "
                                             "(RocksDB's default, slower to open)",
    "event_time": "the input's event-time column (a timestamp): a watermark, late rows, event-time timers and TTL",
    "allowed_lateness": "seconds the watermark trails the highest event time seen",
    "late": "rows below the watermark their batch starts with: `drop` or `process`",
    "on_bad_file": "a batch file that fails its checks before Spark (not Parquet, a missing column, a wrong key type, "
                   "null keys): `fail` stops before any upload, `skip` consumes it unprocessed and records it in "
                   "`_metadata`",
    "max_future_event_time": "seconds an input file's highest event time may lie beyond its batch's processing "
                             "time; a file beyond is a bad file (check `future_event_times`) under `on_bad_file`, "
                             "so that one row in year 2999 (a producer's unit mix-up) does not move the watermark "
                             "for good; `none`: no bound. With `event_time` only",
    "routing": "how a batch's rows reach their subtasks: `read-all` (each subtask's task reads the whole batch; one "
               "stage), `shuffle` (read once, routed by key group through Spark's shuffle) or `auto` (the shuffle once "
               "read-all would read 64 MB or more beyond the batch); the route taken is in `_metadata`",
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
