"""The state changelog (Flink's FLIP-158, "generic log-based incremental checkpoints").

With the changelog on, a checkpoint of a subtask no longer uploads RocksDB files: it uploads the
entries its states changed since the previous checkpoint, as one compact file. Every few
checkpoints the subtask *materializes*: it uploads RocksDB's own files (incrementally, as
without the changelog) and the chain of changelog files starts anew. A checkpoint's handle
lists the files of the last materialization plus the changelog chain after it; every file is a
shared file the registry counts like any other, so a changelog file lives exactly as long as a
retained checkpoint needs it. Restore = the materialized files, then the chain replayed in order.

Why it pays: RocksDB's compactions rewrite unchanged entries into new SSTs, and every new SST is
an upload; a changelog uploads each changed entry once, deduplicated within the checkpoint,
sorted and zstd-compressed.

The file format (version 1):

    MAGIC (8 bytes) | header length (u32 LE) | header (JSON) | body (zstd)

    header: {"version": 1, "raw_size": n, "states": [{"name", "ranges", "entries"}, ...]}
    body, per state in header order:
        ranges × (u32 len, lower, u32 len, upper)      range deletes, applied first
        entries × u32 key length, entries × i32 value length (-1: delete),
        the keys, then the values                       sorted by key, last write wins
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from rocksdict import Rdict, WriteBatch

MAGIC = b"SPKCHLG1"
FORMAT_VERSION = 1
LOCAL_PREFIX = "changelog-"  # the local name of a changelog file: changelog-<checkpoint id, 12 digits>
SUFFIX = ".changelog"  # the suffix of its name on stable storage
_U32 = struct.Struct("<I")
_CODEC = pa.Codec("zstd", compression_level=3)
_REPLAY_BATCH = 50_000
_MAX_HEADER = 1 << 20
_MAX_RATIO = 1000  # zstd compresses no real changelog more than this


class ChangelogFormatError(ValueError):
    """A changelog file that is not one (its CRC32 matched _metadata, so it was written wrong)."""


def local_name(checkpoint_id: int) -> str:
    return f"{LOCAL_PREFIX}{checkpoint_id:012d}"


def is_changelog(name: str) -> bool:
    return name.startswith(LOCAL_PREFIX)


@dataclass(frozen=True)
class ChangelogOptions:
    """When to materialize: the chain's bytes reach `materialize_share` of the materialized
    files' bytes, or the chain reaches `max_chain` files. A longer chain uploads less (each
    materialization re-uploads what compaction rewrote) and restores slower from stable storage
    (the working database and the task-local copy restore without replaying anything)."""

    enabled: bool = False
    materialize_share: float = 2.0
    max_chain: int = 64

    def __post_init__(self) -> None:
        if not self.materialize_share > 0:
            raise ValueError(f"changelog materialize share must be > 0, got {self.materialize_share}")
        if self.max_chain < 1:
            raise ValueError(f"changelog max chain must be >= 1, got {self.max_chain}")

    def should_materialize(self, materialized_bytes: int, chain_bytes: int, chain_files: int) -> bool:
        """Decide before writing the next changelog file (chain figures without it)."""
        if materialized_bytes <= 0:
            return True
        return chain_files >= self.max_chain or chain_bytes >= self.materialize_share * materialized_bytes


@dataclass
class _StateChanges:
    entries: dict[bytes, bytes | None] = field(default_factory=dict)  # None: deleted
    ranges: list[tuple[bytes, bytes]] = field(default_factory=list)


class ChangeLog:
    """The writes of one subtask since its last snapshot: per state the last value of every key
    written, and the range deletes. Replaying it on the state of the last snapshot gives the
    current state: range deletes first, then the entries (a range delete drops the entries
    written before it in its range, so an entry kept was written after every range covering it).
    """

    def __init__(self) -> None:
        self._states: dict[str, _StateChanges] = {}

    def __len__(self) -> int:
        return sum(len(s.entries) + len(s.ranges) for s in self._states.values())

    def _of(self, state: str) -> _StateChanges:
        changes = self._states.get(state)
        if changes is None:
            changes = self._states[state] = _StateChanges()
        return changes

    def put(self, state: str, key: bytes, value: bytes) -> None:
        self._of(state).entries[key] = value

    def delete(self, state: str, key: bytes) -> None:
        self._of(state).entries[key] = None

    def write_batch(self, state: str, puts: list[tuple[bytes, bytes]], deletes: list[bytes]) -> None:
        entries = self._of(state).entries
        entries.update(puts)
        entries.update(dict.fromkeys(deletes))

    def delete_range(self, state: str, lower: bytes, upper: bytes) -> None:
        changes = self._of(state)
        for key in [k for k in changes.entries if lower <= k < upper]:
            del changes.entries[key]
        changes.ranges.append((lower, upper))

    def clear(self) -> None:
        self._states.clear()

    def write(self, path: Path, state_names: Iterable[str]) -> int:
        """Write the changes to `path` (every state named, changed or not); returns its size."""
        names = sorted(set(state_names) | set(self._states))
        header: dict[str, Any] = {"version": FORMAT_VERSION, "states": []}
        parts: list[bytes] = []
        for name in names:
            changes = self._states.get(name, _StateChanges())
            items = sorted(changes.entries.items())
            keys = [k for k, _ in items]
            values = [v for _, v in items]
            for lower, upper in changes.ranges:
                parts += [_U32.pack(len(lower)), lower, _U32.pack(len(upper)), upper]
            parts.append(np.fromiter(map(len, keys), dtype="<u4", count=len(keys)).tobytes())
            parts.append(
                np.fromiter((-1 if v is None else len(v) for v in values), dtype="<i4", count=len(values)).tobytes()
            )
            parts.append(b"".join(keys))
            parts.append(b"".join(v for v in values if v is not None))
            header["states"].append({"name": name, "ranges": len(changes.ranges), "entries": len(items)})
        raw = b"".join(parts)
        header["raw_size"] = len(raw)
        head = json.dumps(header, separators=(",", ":")).encode()
        body = _CODEC.compress(raw, asbytes=True) if raw else b""
        with open(path, "wb") as f:
            f.write(MAGIC + _U32.pack(len(head)) + head + body)
        return len(MAGIC) + 4 + len(head) + len(body)


@dataclass(frozen=True)
class StateChanges:
    """One state's section of a changelog file, decoded."""

    name: str
    ranges: list[tuple[bytes, bytes]]
    entries: list[tuple[bytes, bytes | None]]


def read(path: Path) -> list[StateChanges]:
    """Decode a changelog file; ChangelogFormatError says what is wrong with it."""
    data = path.read_bytes()
    if data[: len(MAGIC)] != MAGIC:
        raise ChangelogFormatError(f"{path.name}: not a sparkpoint changelog file (bad magic bytes)")
    try:
        (head_len,) = _U32.unpack_from(data, len(MAGIC))
        if head_len > _MAX_HEADER:
            raise ChangelogFormatError(f"{path.name}: header of {head_len} bytes")
        start = len(MAGIC) + 4
        header = json.loads(data[start : start + head_len])
        if not isinstance(header, dict) or header.get("version") != FORMAT_VERSION:
            raise ChangelogFormatError(f"{path.name}: unknown changelog format version")
        raw_size = header["raw_size"]
        body = data[start + head_len :]
        if not isinstance(raw_size, int) or not 0 <= raw_size <= _MAX_RATIO * len(body):
            raise ChangelogFormatError(f"{path.name}: header claims {raw_size!r} bytes from a {len(body)}-byte body")
        try:
            raw = _CODEC.decompress(body, decompressed_size=raw_size, asbytes=True) if raw_size else b""
        except (OSError, pa.ArrowException) as e:
            raise ChangelogFormatError(f"{path.name}: body does not decompress ({e})") from e
        if len(raw) != raw_size:
            raise ChangelogFormatError(f"{path.name}: body decompresses to {len(raw)} bytes, header says {raw_size}")
        return _decode(raw, header["states"], path.name)
    except ChangelogFormatError:
        raise
    except (ValueError, KeyError, TypeError, struct.error, pa.ArrowException) as e:
        raise ChangelogFormatError(f"{path.name}: malformed changelog ({e})") from e


def _decode(raw: bytes, states: list[dict[str, Any]], name: str) -> list[StateChanges]:
    out: list[StateChanges] = []
    pos = 0

    def take(n: int) -> bytes:
        nonlocal pos
        if n < 0 or pos + n > len(raw):
            raise ChangelogFormatError(f"{name}: truncated changelog body")
        chunk = raw[pos : pos + n]
        pos += n
        return chunk

    for state in states:
        ranges = []
        for _ in range(int(state["ranges"])):
            lower = take(_U32.unpack(take(4))[0])
            upper = take(_U32.unpack(take(4))[0])
            ranges.append((lower, upper))
        n = int(state["entries"])
        key_lens = np.frombuffer(take(4 * n), dtype="<u4").astype(np.int64)
        value_lens = np.frombuffer(take(4 * n), dtype="<i4").astype(np.int64)
        keys_blob = take(int(key_lens.sum()))
        values_blob = take(int(value_lens[value_lens > 0].sum()))
        key_ends = np.cumsum(key_lens).tolist()
        value_ends = np.cumsum(np.maximum(value_lens, 0)).tolist()
        entries: list[tuple[bytes, bytes | None]] = []
        k0 = v0 = 0
        for k1, v1, vl in zip(key_ends, value_ends, value_lens.tolist()):
            entries.append((keys_blob[k0:k1], None if vl < 0 else values_blob[v0:v1]))
            k0, v0 = k1, v1
        out.append(StateChanges(str(state["name"]), ranges, entries))
    if pos != len(raw):
        raise ChangelogFormatError(f"{name}: {len(raw) - pos} bytes after the last state")
    return out


def replay(db: Rdict, path: Path, ensure_states: Callable[[list[str]], None]) -> int:
    """Apply one changelog file to an open database; returns the number of entries written."""
    sections = read(path)
    ensure_states([s.name for s in sections])
    written = 0
    for section in sections:
        cf = db.get_column_family(section.name)
        handle = db.get_column_family_handle(section.name)
        for lower, upper in section.ranges:
            cf.delete_range(lower, upper)
        for i in range(0, len(section.entries), _REPLAY_BATCH):
            batch = WriteBatch(raw_mode=True)
            for key, value in section.entries[i : i + _REPLAY_BATCH]:
                if value is None:
                    batch.delete(key, handle)
                else:
                    batch.put(key, value, handle)
            db.write(batch)
        written += len(section.entries)
    return written
