"""The `_metadata` format: frozen dataclasses with explicit, strictly validated JSON.

A checkpoint exists if and only if its `_metadata` exists. Everything that crosses a process
boundary (state handles from Spark tasks, `_metadata` in storage) goes through `to_json` /
`from_json` here; nothing is pickled. The field-by-field validator, and the sections that stay
plain JSON once read (source offsets, declared states, facts), are `validation`'s.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from sparkpoint.checkpoint.errors import MetadataError
from sparkpoint.checkpoint.ledger import Prices, RequestLedger
from sparkpoint.checkpoint.paths import (
    check_encodable,
    is_changelog_name,
    is_plain_name,
    is_plain_relative,
    validate_name,
    validate_relative,
)
from sparkpoint.checkpoint.validation import (
    CODEC_TYPES,  # noqa: F401  the vocabulary of declared states stays importable from here
    MAX_OFFSETS_DEPTH,  # noqa: F401
    STATE_KINDS,  # noqa: F401
    TTL_CLOCKS,  # noqa: F401
    TTL_UPDATES,  # noqa: F401
    Validator,
    declarations_from_json,
    facts_from_json,
    json_only,
)

FORMAT_NAME = "sparkpoint-checkpoint"
# Version 2 added `checksum`: a SHA-256 over the canonical JSON of every other field, so that a
# flipped byte which still parses (an operator renamed, a size changed) is caught on load.
# Version 3: a subtask may list a changelog chain (files named changelog-<id>, replayed on the
# materialized files). A checkpoint without one is still written as version 2, so that it stays
# readable by older sparkpoint; a version-2 reader would restore a chain's base and drop the chain,
# which is why a chain is written as version 3 only and a version-2 file listing one is refused.
# Version 4: a subtask may list `staged` files, the slices of a materialization in progress that
# no restore reads yet but that must live as long as the checkpoint (an older reader would drop
# them from its registry and delete them); written only when some subtask has them.
# An operator may carry `name`, its display name beside the uid it is keyed by: older readers
# ignore it, and nothing they do depends on it, so it needs no version of its own.
# Version 5: `skipped_files`, the input files the job consumed without processing them (a bad
# file under `on_bad_file="skip"`, or `sparkpoint skip`), each with the check it failed and why;
# carried from checkpoint to checkpoint. Written only when there are some.
# Version 6: a skipped file may carry `size` and `modified`, the file as it was when a content
# check skipped it (DESIGN rule 18): a later run that finds it changed says it was still being
# written; and its check may be `future_event_times`. Written only when some skipped file has
# them; older readers refuse unknown fields and checks, so they are told to upgrade instead.
FORMAT_VERSION = 6
SKIPPED_VERSION = 5
STAGED_VERSION = 4
CHAIN_VERSION = 3
CHAIN_FREE_VERSION = 2
READABLE_VERSIONS = (CHAIN_FREE_VERSION, CHAIN_VERSION, STAGED_VERSION, SKIPPED_VERSION, FORMAT_VERSION)
KINDS = ("checkpoint", "savepoint")
CLAIM_MODES = ("CLAIM", "NO_CLAIM")
MAX_CRC32 = 0xFFFFFFFF
MAX_FILE_SIZE = 1 << 53
MAX_KEY_GROUPS = 1 << 15
# Why an input file was skipped: the check it failed before any Spark work, or `manual` (`sparkpoint skip`).
SKIP_CHECKS = ("parquet", "columns", "types", "null_keys", "null_event_times", "manual", "future_event_times")
NEW_SKIP_CHECKS = ("future_event_times",)  # checks format 5 does not know
MAX_SKIPPED_FILES = 100_000
MAX_SKIP_REASON = 2000
MAX_INPUT_NAME = 1024


@dataclass(frozen=True)
class SkippedFile:
    """An input file a checkpoint consumed without processing it: its name in the input
    directory, the check it failed (one of SKIP_CHECKS), why, and the checkpoint that skipped it;
    for a file a check skipped, its size and modification time then (seconds since the epoch;
    None where the filesystem gives none, and in checkpoints of format 5)."""

    file: str
    check: str
    reason: str
    checkpoint_id: int
    size: int | None = None
    modified: float | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"file": self.file, "check": self.check, "reason": self.reason,
                               "checkpoint_id": self.checkpoint_id}
        if self.size is not None:
            out.update(size=self.size, modified=self.modified)
        return out

    def line(self) -> str:
        return f"{self.file} ({self.check}: {self.reason})"


def skip_problem(file: object, check: object, reason: object) -> str | None:
    """What is wrong with a skipped file's fields (None: nothing): a file is one plain name of the
    input directory, the check one of SKIP_CHECKS, the reason one line of text."""
    for name, value, limit in (("file", file, MAX_INPUT_NAME), ("reason", reason, MAX_SKIP_REASON)):
        if not isinstance(value, str) or not value.strip():
            return f"{name} must be a non-empty string, got {str(value)[:80]!r}"
        if len(value) > limit:
            return f"{name} is {len(value)} characters long, more than {limit}"
        try:
            check_encodable(value)
        except ValueError as e:
            return f"{name}: {e}"
        if any(ord(c) < 32 or 127 <= ord(c) < 160 for c in value):
            return f"{name} {value[:80]!r} holds a control character (a line break, an escape sequence)"
    assert isinstance(file, str)
    if "/" in file or file in (".", ".."):
        return f"file {file[:80]!r} is not one name in the input directory"
    if check not in SKIP_CHECKS:
        return f"check must be one of {', '.join(SKIP_CHECKS)}, got {str(check)[:80]!r}"
    return None


@dataclass(frozen=True)
class KeyGroupRange:
    """Inclusive range of key groups [start, end] owned by one subtask."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if self.start < 0 or self.end < self.start:
            raise ValueError(f"invalid key-group range [{self.start}, {self.end}]")

    def __contains__(self, key_group: object) -> bool:
        return isinstance(key_group, int) and self.start <= key_group <= self.end

    def __len__(self) -> int:
        return self.end - self.start + 1

    def intersects(self, other: KeyGroupRange) -> bool:
        return self.start <= other.end and other.start <= self.end

    def to_json(self) -> dict[str, int]:
        return {"start": self.start, "end": self.end}


@dataclass(frozen=True, slots=True)  # one per file: 10^6 and more in a large job
class FileHandle:
    """One file of a checkpoint in stable storage.

    `path` is relative to the job directory; `created_by` is the checkpoint that uploaded it.
    """

    local_name: str
    path: str
    size: int
    crc32: int
    created_by: int

    def to_json(self) -> dict[str, Any]:
        return {
            "local_name": self.local_name,
            "path": self.path,
            "size": self.size,
            "crc32": self.crc32,
            "created_by": self.created_by,
        }


@dataclass(frozen=True)
class SubtaskStateHandle:
    """What one subtask acknowledges for one checkpoint: its files and key-group range."""

    operator: str
    subtask: int
    checkpoint_id: int
    key_group_range: KeyGroupRange
    max_parallelism: int
    shared: tuple[FileHandle, ...]
    private: tuple[FileHandle, ...]
    # Slices of a materialization in progress (`sparkpoint.state.engine.staging`): kept alive with this
    # checkpoint, read by no restore until a later checkpoint lists them among its shared files.
    staged: tuple[FileHandle, ...] = ()
    # What the subtask's state held when it was snapshotted, for people (`inspect`, the
    # orchestrator): per state its kind, TTL and entries (RocksDB's estimate beyond
    # `EXACT_UP_TO`), timers pending and fired, entries the TTL sweep removed. No restore reads it.
    facts: dict[str, Any] | None = field(default=None, compare=False)
    # The states its operator declares (kind, key type, TTL, codec: `sparkpoint.state.schema`),
    # identical in every subtask; `_metadata` lists them once per operator (`OperatorState.states`).
    states: dict[str, Any] | None = field(default=None, compare=False)

    def files(self) -> Iterator[FileHandle]:
        """The files a restore of this subtask reads."""
        yield from self.shared
        yield from self.private

    def stored(self) -> Iterator[FileHandle]:
        """Every file this subtask's snapshot keeps alive: what a restore reads, and the staged slices."""
        yield from self.files()
        yield from self.staged

    def new_files(self) -> list[FileHandle]:
        """Files this checkpoint uploaded (the ones an abort deletes)."""
        return [f for f in self.stored() if f.created_by == self.checkpoint_id]

    def subtask_json(self) -> dict[str, Any]:
        """The fields `_metadata` lists for this subtask (`staged` only when there are some)."""
        out: dict[str, Any] = {
            "subtask": self.subtask,
            "key_group_range": self.key_group_range.to_json(),
            "shared": [f.to_json() for f in self.shared],
            "private": [f.to_json() for f in self.private],
        }
        if self.staged:
            out["staged"] = [f.to_json() for f in self.staged]
        if self.facts is not None:
            out["facts"] = self.facts
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "operator": self.operator,
            "subtask": self.subtask,
            "checkpoint_id": self.checkpoint_id,
            "key_group_range": self.key_group_range.to_json(),
            "max_parallelism": self.max_parallelism,
            "shared": [f.to_json() for f in self.shared],
            "private": [f.to_json() for f in self.private],
            **({"staged": [f.to_json() for f in self.staged]} if self.staged else {}),
            **({"facts": self.facts} if self.facts is not None else {}),
            **({"states": self.states} if self.states is not None else {}),
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), separators=(",", ":"))

    @classmethod
    def loads(cls, text: str) -> SubtaskStateHandle:
        where = "state handle"
        try:
            raw = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as e:
            raise MetadataError(f"{where} is not valid JSON: {e}") from e
        v = Validator(where)
        obj = v.obj(raw, "handle")
        handle = _subtask_from_json(
            v,
            obj,
            "handle",
            operator=_operator_name(v, v.string(obj, "operator", "handle"), "handle.operator"),
            checkpoint_id=v.integer(obj, "checkpoint_id", "handle", minimum=1),
            max_parallelism=v.integer(obj, "max_parallelism", "handle", minimum=1, maximum=MAX_KEY_GROUPS),
        )
        if "states" in obj and obj["states"] is not None:
            handle = replace(handle, states=declarations_from_json(v, obj["states"], "handle.states"))
        return handle


@dataclass(frozen=True)
class OperatorState:
    """One operator's state in a checkpoint, under its uid (the key in `operators`)."""

    max_parallelism: int
    subtasks: tuple[SubtaskStateHandle, ...]
    # The states the operator declared, by name: kind, key type, TTL and codec (with a
    # RecordCodec's fields), what a restore and `check-upgrade` compare the code's against.
    # None: checkpointed before sparkpoint recorded them, or an operator that declares none.
    states: Mapping[str, Any] | None = None
    # The operator's display name when the checkpoint was taken (so an upgrade can say "renamed");
    # None in files written before sparkpoint recorded it: the name was the uid then.
    name: str | None = None

    @property
    def parallelism(self) -> int:
        return len(self.subtasks)


@dataclass(frozen=True)
class RestoreLineage:
    """Where the job's state came from when it was (re)started."""

    restored_from: str
    claim_mode: str

    def to_json(self) -> dict[str, str]:
        return {"restored_from": self.restored_from, "claim_mode": self.claim_mode}


@dataclass(frozen=True)
class CheckpointStats:
    """Sizes and file counts of a checkpoint; and, in checkpoints written since the request
    ledger, the storage requests it made up to its commit (`ledger`: requests by operation,
    bytes up and down, input reads apart) and what they cost by the price table then in force."""

    state_size: int
    checkpointed_size: int
    files_new: int = 0
    files_reused: int = 0
    ledger: RequestLedger | None = None
    estimated_cost_usd: float | None = None
    # What the run that took it observed (absent in older checkpoints): seconds from its trigger
    # to its commit, the rows its batch brought (per operator: every operator reads the whole batch),
    # the late ones, and its restore by phase (seconds of the slowest subtask, bytes of all).
    duration_seconds: float | None = None
    records_in: int | None = None
    late_rows: int | None = None
    restore: Mapping[str, float] | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "state_size": self.state_size,
            "checkpointed_size": self.checkpointed_size,
            "files_new": self.files_new,
            "files_reused": self.files_reused,
        }
        if self.ledger is not None:  # older readers ignore fields of stats they do not know
            out.update(self.ledger.to_json(), estimated_cost_usd=self.estimated_cost_usd)
        for name in OBSERVED:
            if getattr(self, name) is not None:
                out[name] = dict(self.restore or {}) if name == "restore" else getattr(self, name)
        return out

    def observed(self, ledger: RequestLedger, prices: Prices, **run: Any) -> CheckpointStats:
        """These stats with the requests `ledger` counted, their cost by `prices`, and what the
        run observed (`run`: any of OBSERVED)."""
        return replace(self, ledger=ledger, estimated_cost_usd=prices.cost(ledger), **run)


OBSERVED = ("duration_seconds", "records_in", "late_rows", "restore")


READ_KEY = "read"  # in a committed `_metadata`'s source offsets: how its batch was read


def read_facts(raw: Any) -> dict[str, Any] | None:
    """How a batch was read, as its record says (None: not recorded): its route ("read-all" or
    "shuffle", sparkpoint.spark.routing), the bytes its tasks read, the batch's bytes on storage.
    A malformed record raises ValueError."""
    if raw is None:
        return None
    if (not isinstance(raw, dict) or raw.get("routing") not in ("read-all", "shuffle")
            or not all(isinstance(raw.get(k), int) and not isinstance(raw.get(k), bool) and raw[k] >= 0
                       for k in ("bytes_read", "batch_bytes"))):
        raise ValueError(f"read facts {str(raw)[:200]!r} are not a route with bytes_read and batch_bytes")
    return {"routing": raw["routing"], "bytes_read": raw["bytes_read"], "batch_bytes": raw["batch_bytes"]}


@dataclass(frozen=True)
class CheckpointMetadata:
    """The content of `chk-<N>/_metadata`."""

    job_id: str
    checkpoint_id: int
    kind: str
    created_at: str
    source_offsets: Any
    stats: CheckpointStats
    operators: Mapping[str, OperatorState]
    lineage: RestoreLineage | None = None
    # Paths (relative to the job directory) this job must never delete: the files of a
    # checkpoint it restored in NO_CLAIM mode. Carried forward from checkpoint to checkpoint.
    unowned: frozenset[str] = field(default_factory=frozenset)
    # Input files consumed without being processed, oldest first: those of the checkpoint it
    # restored from, then its own (`checkpoint_id` says which checkpoint skipped each).
    skipped_files: tuple[SkippedFile, ...] = ()

    @property
    def directory(self) -> str:
        return checkpoint_dir(self.checkpoint_id)

    @property
    def metadata_path(self) -> str:
        return metadata_path(self.checkpoint_id)

    @property
    def is_savepoint(self) -> bool:
        return self.kind == "savepoint"

    def read(self) -> dict[str, Any] | None:
        """How this checkpoint's batch was read (`read_facts`; None: not recorded or malformed)."""
        raw = self.source_offsets.get(READ_KEY) if isinstance(self.source_offsets, dict) else None
        try:
            return read_facts(raw)
        except ValueError:
            return None

    def operator_name(self, uid: str) -> str:
        """The display name operator `uid` had when this checkpoint was taken."""
        return self.operators[uid].name or uid

    def subtask_handles(self) -> Iterator[SubtaskStateHandle]:
        for op in self.operators.values():
            yield from op.subtasks

    def files(self) -> Iterator[FileHandle]:
        """Every file this checkpoint keeps alive (staged slices included)."""
        for handle in self.subtask_handles():
            yield from handle.stored()

    def restored_files(self) -> Iterator[FileHandle]:
        """The files a restore of this checkpoint reads: not the staged slices, which only the
        materialization in steps reads, and which it checks itself before a checkpoint switches
        to them (then they are shared files of that checkpoint)."""
        for handle in self.subtask_handles():
            yield from handle.files()

    def paths(self) -> set[str]:
        return {f.path for f in self.files()}

    def references(self) -> dict[str, int]:
        """Every path this checkpoint holds, `_metadata` included -> the checkpoint that created it."""
        refs = {f.path: f.created_by for f in self.files()}
        refs[self.metadata_path] = self.checkpoint_id
        return refs

    def has_changelog(self) -> bool:
        return any(is_changelog_name(f.local_name) for f in self.files())

    def has_staged(self) -> bool:
        return any(h.staged for h in self.subtask_handles())

    def newly_skipped(self) -> tuple[SkippedFile, ...]:
        """The input files this checkpoint itself skipped (not those it carries from older ones)."""
        return tuple(s for s in self.skipped_files if s.checkpoint_id == self.checkpoint_id)

    def format_version(self) -> int:
        """The oldest version that can say everything this checkpoint lists."""
        if any(s.size is not None or s.check in NEW_SKIP_CHECKS for s in self.skipped_files):
            return FORMAT_VERSION
        if self.skipped_files:
            return SKIPPED_VERSION
        if self.has_staged():
            return STAGED_VERSION
        return CHAIN_VERSION if self.has_changelog() else CHAIN_FREE_VERSION

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "version": self.format_version(),
            "job_id": self.job_id,
            "checkpoint_id": self.checkpoint_id,
            "kind": self.kind,
            "created_at": self.created_at,
            "lineage": self.lineage.to_json() if self.lineage else None,
            "unowned": sorted(self.unowned),
            "source_offsets": self.source_offsets,
            "stats": self.stats.to_json(),
            "operators": {
                uid: {
                    "max_parallelism": op.max_parallelism,
                    "subtasks": [h.subtask_json() for h in op.subtasks],
                    **({"states": dict(op.states)} if op.states is not None else {}),
                    **({"name": op.name} if op.name is not None else {}),
                }
                for uid, op in sorted(self.operators.items())
            },
            **({"skipped_files": [f.to_json() for f in self.skipped_files]} if self.skipped_files else {}),
        }

    def dumps(self) -> bytes:
        """The canonical JSON of every field, then `checksum` over exactly that text as the last field.

        Compact on purpose: `indent` selects json's pure-Python encoder, ~6x slower on 10,000 files.
        """
        canonical = _canonical(self.to_json())
        checksum = "sha256:" + hashlib.sha256(canonical.encode("ascii")).hexdigest()
        return (canonical[:-1] + f',"checksum":"{checksum}"}}').encode("ascii")

    @classmethod
    def loads(cls, data: bytes, *, where: str = "_metadata") -> CheckpointMetadata:
        try:
            text = data.decode("utf-8")
            raw = json.loads(text)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise MetadataError(
                f"{where} is not valid UTF-8 JSON ({e}); the checkpoint cannot be used. "
                "Restore an older checkpoint or run `sparkpoint verify`."
            ) from e
        return _metadata_from_json(Validator(where), raw, text=text)


def checkpoint_dir(checkpoint_id: int) -> str:
    return f"chk-{checkpoint_id}"


def metadata_path(checkpoint_id: int) -> str:
    return f"chk-{checkpoint_id}/_metadata"


def content_checksum(body: Mapping[str, Any]) -> str:
    """`sha256:<hex>` of the canonical JSON of every field but `checksum` itself."""
    canonical = _canonical({k: v for k, v in body.items() if k != "checksum"})
    return "sha256:" + hashlib.sha256(canonical.encode("ascii")).hexdigest()


def _checksum_of_written_text(text: str | None, stored: str) -> str | None:
    """The checksum of `text` as `dumps` wrote it (canonical JSON, `checksum` appended last), if it is.

    Hashing the bytes as read skips serializing the parsed body again; a file written any other way
    (by hand, or indented as earlier sparkpoint did) is checked by `content_checksum`.
    """
    suffix = f',"checksum":"{stored}"}}'
    if text is None or not text.endswith(suffix):
        return None
    return "sha256:" + hashlib.sha256((text[: -len(suffix)] + "}").encode("utf-8")).hexdigest()


def _canonical(body: Mapping[str, Any]) -> str:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def coverage_problem(ranges: list[KeyGroupRange], max_parallelism: int) -> str | None:
    """None when `ranges` (subtask 0, 1, ... in order) cover key groups 0..max-1 exactly once."""
    if not ranges:
        return "has no subtask: it would restore no state at all"
    expected_start = 0
    for i, r in enumerate(ranges):
        if r.start != expected_start:
            what = "leaves out" if r.start > expected_start else "overlaps"
            return (
                f"does not cover key groups 0..{max_parallelism - 1} exactly: subtask {i} starts at {r.start}, "
                f"it {what} key group {min(r.start, expected_start)}"
            )
        expected_start = r.end + 1
    if expected_start != max_parallelism:
        last = expected_start - 1
        return f"does not cover key groups 0..{max_parallelism - 1} exactly: the last subtask ends at {last}"
    return None


def utc_now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def _file_from_json(v: Validator, raw: Any, name: str) -> FileHandle:
    if type(raw) is dict:  # what sparkpoint writes, at once; anything else field by field below
        get = raw.get
        local, path, size = get("local_name"), get("path"), get("size")
        crc, created_by = get("crc32"), get("created_by")
        if (
            type(size) is int and 0 <= size <= MAX_FILE_SIZE
            and type(crc) is int and 0 <= crc <= MAX_CRC32
            and type(created_by) is int and created_by >= 0
            and is_plain_name(local) and is_plain_relative(path)
        ):
            return FileHandle(local, path, size, crc, created_by)
    obj = v.obj(raw, name)
    path = v.string(obj, "path", name)
    try:
        validate_relative(path)
    except ValueError as e:
        raise v.fail(f"{name}.path", f"is not a safe path inside the job directory: {e}") from e
    local_name = v.string(obj, "local_name", name)
    try:
        validate_name(local_name, "local file name")
    except ValueError as e:
        raise v.fail(f"{name}.local_name", str(e)) from None
    return FileHandle(
        local_name=local_name,
        path=path,
        size=v.integer(obj, "size", name, maximum=MAX_FILE_SIZE),
        crc32=v.integer(obj, "crc32", name, maximum=MAX_CRC32),
        created_by=v.integer(obj, "created_by", name),
    )


def _operator_name(v: Validator, name: str, field_name: str) -> str:
    try:
        return validate_name(name, "operator name")
    except ValueError as e:
        raise v.fail(field_name, str(e)) from None


def _subtask_from_json(
    v: Validator, obj: dict[str, Any], name: str, *, operator: str, checkpoint_id: int, max_parallelism: int
) -> SubtaskStateHandle:
    kg = v.obj(v.get(obj, "key_group_range", name), f"{name}.key_group_range")
    start = v.integer(kg, "start", f"{name}.key_group_range")
    end = v.integer(kg, "end", f"{name}.key_group_range", maximum=max_parallelism - 1)
    if end < start:
        raise v.fail(f"{name}.key_group_range", f"is empty: start {start} > end {end}")
    shared = tuple(_file_from_json(v, f, f"{name}.shared[{i}]") for i, f in enumerate(v.array(obj, "shared", name)))
    private = tuple(_file_from_json(v, f, f"{name}.private[{i}]") for i, f in enumerate(v.array(obj, "private", name)))
    staged = tuple(
        _file_from_json(v, f, f"{name}.staged[{i}]")
        for i, f in enumerate(v.array(obj, "staged", name) if "staged" in obj else [])
    )
    for f in shared + private + staged:
        if f.created_by > checkpoint_id:
            raise v.fail(f"{name}", f"file {f.path} claims to be created by a later checkpoint {f.created_by}")
    paths = [f.path for f in shared + private + staged]
    if len(set(paths)) != len(paths):
        raise v.fail(f"{name}", "lists the same stored file twice")
    return SubtaskStateHandle(
        operator=operator,
        subtask=v.integer(obj, "subtask", name),
        checkpoint_id=checkpoint_id,
        key_group_range=KeyGroupRange(start, end),
        max_parallelism=max_parallelism,
        shared=shared,
        private=private,
        staged=staged,
        facts=facts_from_json(v, obj["facts"], f"{name}.facts") if "facts" in obj else None,
    )


def state_facts(handles: Iterable[SubtaskStateHandle]) -> dict[str, Any]:
    """One operator's state over its subtasks' snapshots: per state its kind, TTL and entries;
    entries in all; what the TTL sweep removed; timers pending (count, earliest) and fired. Empty
    for snapshots that carry no facts (written before sparkpoint recorded them)."""
    facts = [h.facts for h in handles if h.facts is not None]
    if not facts:
        return {}
    states: dict[str, dict[str, Any]] = {}
    for f in facts:
        for name, state in f["states"].items():
            merged = states.setdefault(name, {"kind": state["kind"], "ttl": state["ttl"], "entries": 0})
            merged["entries"] += state["entries"]
    earliest = [f["timers"]["earliest"] for f in facts if f["timers"]["earliest"] is not None]
    return {
        "states": states,
        "entries": sum(s["entries"] for s in states.values()),
        "expired_removed": sum(f["expired_removed"] for f in facts),
        "timers_pending": sum(f["timers"]["pending"] for f in facts),
        "timers_earliest": min(earliest) if earliest else None,
        "timers_fired": sum(f["timers"]["fired"] for f in facts),
    }


def iso_micros(value: int) -> str:
    """µs since the epoch (a watermark, a timer) as ISO 8601 UTC."""
    return (datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=int(value))).isoformat()


def skipped_files_from_json(v: Validator, raw: Any, name: str) -> tuple[SkippedFile, ...]:
    """Skipped input files, checked field by field: each names one file once."""
    if not isinstance(raw, list):
        raise v.fail(name, f"must be an array, got {type(raw).__name__}")
    if len(raw) > MAX_SKIPPED_FILES:
        raise v.fail(name, f"lists {len(raw)} files, more than {MAX_SKIPPED_FILES}")
    out, seen = [], set()
    for i, entry in enumerate(raw):
        where = f"{name}[{i}]"
        obj = v.obj(entry, where)
        unknown = set(obj) - {"file", "check", "reason", "checkpoint_id", "size", "modified"}
        if unknown:
            raise v.fail(where, f"has unknown fields {sorted(str(k)[:40] for k in unknown)}")
        size, modified = None, obj.get("modified")
        if "size" in obj:
            size = v.integer(obj, "size", where, maximum=MAX_FILE_SIZE)
            if modified is not None and (not isinstance(modified, (int, float)) or isinstance(modified, bool)
                                         or not math.isfinite(modified)):
                raise v.fail(f"{where}.modified", f"must be a number of seconds or null, got {str(modified)[:80]!r}")
        elif "modified" in obj:
            raise v.fail(f"{where}.modified", "is given without `size`")
        for key in ("file", "check", "reason"):
            v.get(obj, key, where)
        problem = skip_problem(obj["file"], obj["check"], obj["reason"])
        if problem:
            raise v.fail(where, problem)
        if obj["file"] in seen:
            raise v.fail(where, f"names {obj['file'][:80]!r} a second time: a file is consumed once")
        seen.add(obj["file"])
        out.append(SkippedFile(obj["file"], obj["check"], obj["reason"],
                               v.integer(obj, "checkpoint_id", where, minimum=1), size,
                               float(modified) if size is not None and modified is not None else None))
    return tuple(out)


def load_skipped_files(raw: Any, where: str) -> tuple[SkippedFile, ...]:
    """Skipped input files from plain JSON elsewhere than `_metadata` (a pending attempt), as strictly."""
    return skipped_files_from_json(Validator(where), raw, "skipped_files")


def _metadata_from_json(v: Validator, raw: Any, *, text: str | None = None) -> CheckpointMetadata:
    """A whole `_metadata` document, section by section in the order a hostile file is told about
    the first field it breaks: format and version, checkpoint id, lineage, unowned paths, stats,
    operators, the rest; then what the version allows, and last the checksum."""
    obj = v.obj(raw, "(root)")
    version = _version_from_json(v, obj)
    checkpoint_id = v.integer(obj, "checkpoint_id", "", minimum=1)
    lineage = _lineage_from_json(v, obj.get("lineage"))
    unowned = _unowned_from_json(v, obj.get("unowned", []))
    stats = _stats_from_json(v, v.get(obj, "stats", ""))
    operators = _operators_from_json(v, v.get(obj, "operators", ""), checkpoint_id)
    meta = CheckpointMetadata(
        job_id=v.string(obj, "job_id", ""),
        checkpoint_id=checkpoint_id,
        kind=v.string(obj, "kind", "", choices=KINDS),
        created_at=v.string(obj, "created_at", ""),
        source_offsets=json_only(v, obj.get("source_offsets"), "source_offsets"),
        stats=stats,
        operators=operators,
        lineage=lineage,
        unowned=unowned,
        skipped_files=skipped_files_from_json(v, obj["skipped_files"], "skipped_files")
        if "skipped_files" in obj else (),
    )
    _check_version_holds(v, version, meta)
    _check_checksum(v, obj, text)
    return meta


def _version_from_json(v: Validator, obj: dict[str, Any]) -> int:
    """`format` and `version`: a sparkpoint checkpoint, of a version this sparkpoint reads."""
    fmt = v.get(obj, "format", "")
    if fmt != FORMAT_NAME:
        raise v.fail("format", f"must be {FORMAT_NAME!r}, got {fmt!r}: this is not a sparkpoint checkpoint")
    version = v.integer(obj, "version", "")
    if version not in READABLE_VERSIONS:
        raise v.fail(
            "version",
            f"is {version}, this sparkpoint reads versions {', '.join(map(str, READABLE_VERSIONS))}; "
            "upgrade sparkpoint to read it",
        )
    return version


def _lineage_from_json(v: Validator, raw: Any) -> RestoreLineage | None:
    if raw is None:
        return None
    lo = v.obj(raw, "lineage")
    return RestoreLineage(
        restored_from=v.string(lo, "restored_from", "lineage"),
        claim_mode=v.string(lo, "claim_mode", "lineage", choices=CLAIM_MODES),
    )


def _unowned_from_json(v: Validator, raw: Any) -> frozenset[str]:
    """The paths this checkpoint references but does not own: each safely inside the job directory."""
    if not isinstance(raw, list) or not all(isinstance(p, str) for p in raw):
        raise v.fail("unowned", "must be an array of paths")
    for i, p in enumerate(raw):
        try:
            validate_relative(p)
        except ValueError as e:
            raise v.fail(f"unowned[{i}]", f"is not a safe path inside the job directory: {e}") from None
    return frozenset(raw)


def _stats_from_json(v: Validator, raw: Any) -> CheckpointStats:
    obj = v.obj(raw, "stats")
    ledger, cost = None, None
    if "requests" in obj:  # written since the request ledger
        try:
            ledger = RequestLedger.from_json(obj)
        except ValueError as e:
            raise v.fail("stats", str(e)) from None
        cost = obj.get("estimated_cost_usd")
        if cost is not None and (isinstance(cost, bool) or not isinstance(cost, int | float) or not cost >= 0):
            raise v.fail("stats.estimated_cost_usd", f"must be a number >= 0, got {str(cost)[:80]!r}")
    return CheckpointStats(
        state_size=v.integer(obj, "state_size", "stats"),
        checkpointed_size=v.integer(obj, "checkpointed_size", "stats"),
        files_new=v.integer(obj, "files_new", "stats") if "files_new" in obj else 0,
        files_reused=v.integer(obj, "files_reused", "stats") if "files_reused" in obj else 0,
        ledger=ledger, estimated_cost_usd=None if cost is None else float(cost),
        **_observed_from_json(v, obj),
    )


def _observed_from_json(v: Validator, obj: dict[str, Any]) -> dict[str, Any]:
    """The OBSERVED fields of stats that are there, each a number >= 0 (`restore`: of them)."""
    out: dict[str, Any] = {}
    for name in OBSERVED:
        if obj.get(name) is None:
            continue
        values = obj[name] if name == "restore" else {name: obj[name]}
        if not isinstance(values, dict) or not all(
                isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x >= 0
                for x in values.values()):
            raise v.fail(f"stats.{name}", f"must be {'an object of ' if name == 'restore' else ''}numbers >= 0, "
                                          f"got {str(obj[name])[:80]!r}")
        out[name] = {k: float(x) for k, x in values.items()} if name == "restore" else (
            float(obj[name]) if name == "duration_seconds" else int(obj[name]))
    return out


def _operators_from_json(v: Validator, raw: Any, checkpoint_id: int) -> dict[str, OperatorState]:
    operators = {
        op_name: _operator_from_json(v, op_name, op_raw, checkpoint_id)
        for op_name, op_raw in v.obj(raw, "operators").items()
    }
    if not operators:
        raise v.fail("operators", "is empty: the checkpoint would restore no state at all")
    return operators


def _operator_from_json(v: Validator, op_name: str, raw: Any, checkpoint_id: int) -> OperatorState:
    """One operator: its subtasks, 0..n-1 in order, covering its key groups exactly once."""
    name = f"operators.{op_name}"
    _operator_name(v, op_name, name)
    op_obj = v.obj(raw, name)
    max_p = v.integer(op_obj, "max_parallelism", name, minimum=1, maximum=MAX_KEY_GROUPS)
    subtasks = tuple(
        _subtask_from_json(
            v,
            v.obj(s, f"{name}.subtasks[{i}]"),
            f"{name}.subtasks[{i}]",
            operator=op_name,
            checkpoint_id=checkpoint_id,
            max_parallelism=max_p,
        )
        for i, s in enumerate(v.array(op_obj, "subtasks", name))
    )
    indexes = [s.subtask for s in subtasks]
    if indexes != list(range(len(indexes))):
        raise v.fail(f"{name}.subtasks", f"must list subtasks 0..{len(indexes) - 1} in order, got {indexes}")
    gap = coverage_problem([s.key_group_range for s in subtasks], max_p)
    if gap:
        raise v.fail(f"{name}.subtasks", gap)
    states = op_obj.get("states")
    display = _operator_name(v, v.string(op_obj, "name", name), f"{name}.name") if "name" in op_obj else None
    return OperatorState(
        max_parallelism=max_p, subtasks=subtasks,
        states=None if states is None else declarations_from_json(v, states, f"{name}.states"), name=display,
    )


def _check_version_holds(v: Validator, version: int, meta: CheckpointMetadata) -> None:
    """What the document lists must exist in its version: an older reader would drop it."""
    if version < SKIPPED_VERSION and meta.skipped_files:
        raise v.fail("version", f"is {version}, but the file lists skipped files, which only version 5 has")
    if version < FORMAT_VERSION and any(s.size is not None for s in meta.skipped_files):
        raise v.fail("version", f"is {version}, but a skipped file records its size, which only version 6 has")
    if version < FORMAT_VERSION and any(s.check in NEW_SKIP_CHECKS for s in meta.skipped_files):
        raise v.fail("version", f"is {version}, but a file was skipped by a check only version 6 has")
    if version == CHAIN_FREE_VERSION and meta.has_changelog():
        raise v.fail("version", f"is {version}, but the file lists changelog files, which only version 3 has")
    if version < STAGED_VERSION and meta.has_staged():
        raise v.fail("version", f"is {version}, but the file lists staged files, which only version 4 has")


def _check_checksum(v: Validator, obj: dict[str, Any], text: str | None) -> None:
    """Last, so that a hostile file is told by the field it breaks; this catches what still parses."""
    stored = v.string(obj, "checksum", "")
    if stored != _checksum_of_written_text(text, stored) and stored != content_checksum(obj):
        raise v.fail(
            "checksum",
            "does not match the content: the file was changed or damaged after it was written. "
            "Restore an older checkpoint (sparkpoint verify lists the ones that verify)",
        )
