"""The state changelog (Flink's FLIP-158, "generic log-based incremental checkpoints").

With the changelog on, a checkpoint of a subtask no longer uploads RocksDB files: it uploads the
entries its states changed since the previous checkpoint, as one compact file. When the chain
makes a restore read much more than the state holds (`ChangelogOptions`), the subtask
*materializes*: it uploads RocksDB's own files (in steps, or incrementally as without the
changelog) and the chain of changelog files starts anew. A checkpoint's handle
lists the files of the last materialization plus the changelog chain after it; every file is a
shared file the registry counts like any other, so a changelog file lives exactly as long as a
retained checkpoint needs it. Restore = the materialized files, then the chain replayed in order.

Why it pays: RocksDB's compactions rewrite unchanged entries into new SSTs, and every new SST is
an upload; a changelog uploads each changed entry once, deduplicated within the checkpoint,
sorted and zstd-compressed.

The file format (version 1):

    MAGIC (8 bytes) | header length (u32 LE) | header (JSON) | body: zstd frames

    header: {"version": 1, "raw_size": n, "frames": [[compressed, raw], ...],
             "states": [{"name", "ranges", "entries"}, ...]}
    every frame decompresses to at most 64 MiB, so a reader's memory is bounded by what it
    reads, never by a size the file claims; the raw body, per state in header order:
        ranges × (u32 len, lower, u32 len, upper)      range deletes (lower <= upper), applied first
        entries × u32 key length, entries × i32 value length (-1: delete),
        the keys, then the values                       sorted by key, last write wins
"""

from __future__ import annotations

import functools
import heapq
import json
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from sparkpoint.checkpoint.paths import CHANGELOG_PREFIX, is_changelog_name
from sparkpoint.lazy import lazy_module
from sparkpoint.state.engine.localfiles import write_new

if TYPE_CHECKING:
    import numpy as np
    import pyarrow as pa
    import rocksdict
    from rocksdict import Rdict
else:
    np = lazy_module("numpy")
    pa = lazy_module("pyarrow")
    rocksdict = lazy_module("rocksdict")

MAGIC = b"SPKCHLG1"
FORMAT_VERSION = 1
SUFFIX = ".changelog"  # the suffix of its name on stable storage
_U32 = struct.Struct("<I")


@functools.cache
def _codec() -> pa.Codec:
    """The frames' zstd codec, made when a changelog is first written or read."""
    return pa.Codec("zstd", compression_level=3)


_REPLAY_BATCH = 50_000
_MAX_HEADER = 16 << 20
_FRAME = 64 << 20  # raw bytes per zstd frame, at most
_MAX_STATES = 4096


class ChangelogFormatError(ValueError):
    """A changelog file that is not one (its CRC32 matched _metadata, so it was written wrong)."""


def local_name(checkpoint_id: int) -> str:
    return f"{CHANGELOG_PREFIX}{checkpoint_id:012d}"


is_changelog = is_changelog_name


# With the changelog on, no upload depends on which SSTs the working database's compactions write
# (a materialization in steps writes slices of its own): the working database is kept within 25%
# of its compacted size (universal compaction considered at every second flush, rewriting it
# whole once the newer runs pass 25% of the oldest), so that its SSTs measure the state. Measured
# on a state overwritten by a quarter per flush: 1.0-1.1x compacted, against 1.0-2.6x with the
# file-only settings (RocksDBOptions).
WORKING_SIZE_AMPLIFICATION = 25  # percent
WORKING_LEVEL0_TRIGGER = 2


@dataclass(frozen=True)
class ChangelogOptions:
    """When to materialize: once what a restore of the next checkpoint would read (the last
    materialization plus the chain) exceeds the state's bytes now by `materialize_share` of them,
    or the chain reaches `max_chain` files.

    The state's bytes now are the working database's SSTs, kept nearly compact while the
    changelog is on (`WORKING_SIZE_AMPLIFICATION`) and compacted whole before they are weighed
    when only their overwritten versions keep the chain from calling for a materialization
    (`Snapshotter`), scaled to what a materialization now would write. The excess is then what
    the chain and the base hold that the state no longer does: values overwritten since,
    entries deleted or expired since (a chain of tombstones and expired entries is all excess).
    A chain that only adds entries (a growing state) carries no excess and does not call for a
    materialization: it would upload the whole state again and read no fewer bytes on restore.
    A longer chain uploads less (each materialization writes the state again) and restores more
    bytes; the chain's bytes, not its length, are what a restore pays for."""

    enabled: bool = False
    materialize_share: float = 0.35
    max_chain: int = 64
    # Upload a materialization as slices over the next checkpoints (`sparkpoint.state.engine.staging`)
    # instead of all in the checkpoint that calls for it; the excess then reaches about 1.75x the
    # share above before the materialization takes over, never 2x (then it is done at once).
    in_steps: bool = True
    slice_min_bytes: int = 64 << 10  # a smaller slice waits for the next checkpoint, unless it is the last

    def __post_init__(self) -> None:
        if not self.materialize_share > 0:
            raise ValueError(f"changelog materialize share must be > 0, got {self.materialize_share}")
        if self.max_chain < 1:
            raise ValueError(f"changelog max chain must be >= 1, got {self.max_chain}")

    def excess(self, state_bytes: int, base_bytes: int, chain_bytes: int) -> int:
        """The bytes a restore would read beyond the state's own (base: the materialized files)."""
        return base_bytes + chain_bytes - state_bytes

    def should_materialize(self, state_bytes: int, base_bytes: int, chain_bytes: int, chain_files: int) -> bool:
        """Decide before writing the next changelog file (chain figures without it)."""
        if state_bytes <= 0:
            return True
        return chain_files >= self.max_chain or (
            self.excess(state_bytes, base_bytes, chain_bytes) >= self.materialize_share * state_bytes)

    def thresholds(self, state_bytes: int) -> tuple[float, int]:
        """(chain bytes, chain files) of growth a materialization in steps is paced against: the
        excess that calls for one, and the chain's length."""
        return self.materialize_share * state_bytes, self.max_chain

    def overdue(self, state_bytes: int, base_bytes: int, chain_bytes: int, chain_files: int) -> bool:
        """The chain is twice what calls for a materialization: too long to start one in steps."""
        return state_bytes <= 0 or chain_files >= 2 * self.max_chain or (
            self.excess(state_bytes, base_bytes, chain_bytes) >= 2 * self.materialize_share * state_bytes)


@dataclass
class _StateChanges:
    entries: dict[bytes, bytes | None] = field(default_factory=dict)  # None: deleted
    stamps: dict[bytes, int] = field(default_factory=dict)  # key -> when it was last written
    ranges: list[tuple[bytes, bytes, int]] = field(default_factory=list)  # (lower, upper, when)

    def surviving(self) -> tuple[list[bytes], list[bytes | None]]:
        """The keys, sorted, and their values, without the entries a later range delete covers:
        one sweep over the sorted keys with a heap of the ranges open at each key, newest on top.
        (The keys usually come sorted already: writes go to RocksDB in key order.)"""
        keys = sorted(self.entries)
        values = list(map(self.entries.__getitem__, keys))
        if not self.ranges:
            return keys, values
        ranges = sorted(self.ranges)
        open_ranges: list[tuple[int, bytes]] = []  # (-when, upper)
        out_keys: list[bytes] = []
        out_values: list[bytes | None] = []
        i = 0
        for key, value in zip(keys, values):
            while i < len(ranges) and ranges[i][0] <= key:
                heapq.heappush(open_ranges, (-ranges[i][2], ranges[i][1]))
                i += 1
            while open_ranges and open_ranges[0][1] <= key:  # the newest open range ended before key
                heapq.heappop(open_ranges)
            if not open_ranges or -open_ranges[0][0] < self.stamps[key]:
                out_keys.append(key)
                out_values.append(value)
        return out_keys, out_values


class ChangeLog:
    """The writes of one subtask since its last snapshot: per state the last value of every key
    written, and the range deletes. Replaying it on the state of the last snapshot gives the
    current state: range deletes first, then the entries (a range delete drops the entries
    written before it in its range, so an entry kept was written after every range covering it).
    """

    def __init__(self) -> None:
        self._states: dict[str, _StateChanges] = {}
        self._clock = 0  # orders writes against range deletes

    def __len__(self) -> int:
        return sum(len(s.entries) + len(s.ranges) for s in self._states.values())

    def _of(self, state: str) -> _StateChanges:
        changes = self._states.get(state)
        if changes is None:
            changes = self._states[state] = _StateChanges()
        return changes

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def put(self, state: str, key: bytes, value: bytes) -> None:
        changes = self._of(state)
        changes.entries[key] = value
        changes.stamps[key] = self._tick()

    def delete(self, state: str, key: bytes) -> None:
        changes = self._of(state)
        changes.entries[key] = None
        changes.stamps[key] = self._tick()

    def write_batch(self, state: str, puts: list[tuple[bytes, bytes]], deletes: list[bytes]) -> None:
        changes, now = self._of(state), self._tick()
        changes.entries.update(puts)
        changes.entries.update(dict.fromkeys(deletes))
        changes.stamps.update(dict.fromkeys([k for k, _ in puts], now))
        changes.stamps.update(dict.fromkeys(deletes, now))

    def delete_range(self, state: str, lower: bytes, upper: bytes) -> None:
        """O(1): the entries it covers are dropped when the log is written (`surviving`)."""
        self._of(state).ranges.append((lower, upper, self._tick()))

    def clear(self) -> None:
        self._states.clear()
        self._clock = 0

    def write(self, path: Path, state_names: Iterable[str]) -> int:
        """Write the changes to `path` (every state named, changed or not); returns its size."""
        names = sorted(set(state_names) | set(self._states))
        header: dict[str, Any] = {"version": FORMAT_VERSION, "states": []}
        parts: list[bytes] = []
        for name in names:
            changes = self._states.get(name, _StateChanges())
            keys, values = changes.surviving()
            for lower, upper, _ in changes.ranges:
                parts += [_U32.pack(len(lower)), lower, _U32.pack(len(upper)), upper]
            parts.append(np.fromiter(map(len, keys), dtype="<u4", count=len(keys)).tobytes())
            try:
                written = cast(list[bytes], values)  # unless a len() below meets a None
                value_lens = np.fromiter(map(len, written), dtype="<i4", count=len(written))
            except TypeError:  # deletes (None): length -1, and no bytes
                value_lens = np.fromiter((-1 if v is None else len(v) for v in values), dtype="<i4", count=len(values))
                written = [v for v in values if v is not None]
            parts += [value_lens.tobytes(), b"".join(keys), b"".join(written)]
            header["states"].append({"name": name, "ranges": len(changes.ranges), "entries": len(keys)})
        raw = b"".join(parts)
        frames = [_codec().compress(raw[i : i + _FRAME], asbytes=True) for i in range(0, len(raw), _FRAME)]
        header["raw_size"] = len(raw)
        header["frames"] = [[len(f), min(_FRAME, len(raw) - i * _FRAME)] for i, f in enumerate(frames)]
        head = json.dumps(header, separators=(",", ":")).encode()
        write_new(path, b"".join([MAGIC, _U32.pack(len(head)), head, *frames]))  # never through a link
        return len(MAGIC) + 4 + len(head) + sum(len(f) for f in frames)


@dataclass(frozen=True)
class StateChanges:
    """One state's section of a changelog file, decoded."""

    name: str
    ranges: list[tuple[bytes, bytes]]
    entries: list[tuple[bytes, bytes | None]]


def raw_limit(declared_bytes: int) -> int:
    """How many decompressed bytes a changelog may expand to, for a state whose `_metadata`
    declares `declared_bytes` (its files, compressed): a checksum-valid file that claims more is
    a bomb, refused before anything is decompressed. Raw changes are larger than the compressed
    state by the compression ratio (zstd on these entries: about 3x); 16x leaves room."""
    return max(_FRAME, 16 * max(declared_bytes, 0))


def read(path: Path, *, max_raw: int | None = None) -> list[StateChanges]:
    """Decode a changelog file; ChangelogFormatError says what is wrong with it."""
    return decode(path.read_bytes(), path.name, max_raw=max_raw)


def decode(data: bytes, name: str, *, max_raw: int | None = None) -> list[StateChanges]:
    """Decode the bytes of changelog file `name` (`sparkpoint verify` checks them with this).

    `max_raw` (see `raw_limit`) bounds the memory decoding takes: the body is decompressed frame
    by frame into one buffer of the size the header declares, which must not exceed it."""
    if data[: len(MAGIC)] != MAGIC:
        raise ChangelogFormatError(f"{name}: not a sparkpoint changelog file (bad magic bytes)")
    try:
        (head_len,) = _U32.unpack_from(data, len(MAGIC))
        if head_len > _MAX_HEADER:
            raise ChangelogFormatError(f"{name}: header of {head_len} bytes")
        start = len(MAGIC) + 4
        header = json.loads(data[start : start + head_len])
        if not isinstance(header, dict) or header.get("version") != FORMAT_VERSION:
            raise ChangelogFormatError(f"{name}: unknown changelog format version")
        raw = _decompress(data[start + head_len :], header["frames"], header["raw_size"], name, max_raw)
        states = header["states"]
        if not isinstance(states, list) or len(states) > _MAX_STATES:
            raise ChangelogFormatError(f"{name}: the header's state list is malformed")
        return _decode(raw, states, name)
    except ChangelogFormatError:
        raise
    except (ValueError, KeyError, TypeError, struct.error) as e:
        raise ChangelogFormatError(f"{name}: malformed changelog ({e})") from e


def _decompress(body: bytes, frames: list[list[int]], raw_size: int, name: str, max_raw: int | None) -> bytes:
    if sum(c for c, _ in frames) != len(body) or sum(r for _, r in frames) != raw_size:
        raise ChangelogFormatError(f"{name}: frame sizes do not add up to the body ({len(body)} bytes)")
    if max_raw is not None and raw_size > max_raw:
        raise ChangelogFormatError(
            f"{name}: declares {raw_size} decompressed bytes, more than the {max_raw} its checkpoint's state "
            f"allows ({len(body)} compressed bytes: a decompression bomb, or a file written wrong)"
        )
    out, pos, filled = bytearray(raw_size), 0, 0
    for compressed, raw in frames:
        if not (isinstance(compressed, int) and isinstance(raw, int) and compressed > 0 and 0 < raw <= _FRAME):
            raise ChangelogFormatError(f"{name}: a frame of {compressed!r} -> {raw!r} bytes")
        try:
            frame = _codec().decompress(body[pos : pos + compressed], decompressed_size=raw, asbytes=True)
        except (OSError, pa.ArrowException) as e:
            raise ChangelogFormatError(f"{name}: body does not decompress ({e})") from e
        if len(frame) != raw:
            raise ChangelogFormatError(f"{name}: a frame decompresses to {len(frame)} bytes, not {raw}")
        out[filled : filled + raw] = frame  # one frame at a time in memory besides the buffer
        filled += raw
        pos += compressed
    return bytes(out)


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
        state_name = state["name"]
        if not isinstance(state_name, str) or not state_name or state_name == "default" or len(state_name) > 255:
            raise ChangelogFormatError(f"{name}: invalid state name {state_name!r}")
        ranges = []
        for _ in range(int(state["ranges"])):
            lower = take(_U32.unpack(take(4))[0])
            upper = take(_U32.unpack(take(4))[0])
            if lower > upper:
                raise ChangelogFormatError(f"{name}: a range delete of state {state_name!r} ends before it starts")
            ranges.append((lower, upper))
        n = int(state["entries"])
        key_lens = np.frombuffer(take(4 * n), dtype="<u4").astype(np.int64)
        value_lens = np.frombuffer(take(4 * n), dtype="<i4").astype(np.int64)
        if n and value_lens.min() < -1:
            raise ChangelogFormatError(f"{name}: a negative value length in state {state_name!r}")
        keys_blob = take(int(key_lens.sum()))
        values_blob = take(int(value_lens[value_lens > 0].sum()))
        key_ends = np.cumsum(key_lens).tolist()
        value_ends = np.cumsum(np.maximum(value_lens, 0)).tolist()
        entries: list[tuple[bytes, bytes | None]] = []
        k0 = v0 = 0
        for k1, v1, vl in zip(key_ends, value_ends, value_lens.tolist()):
            entries.append((keys_blob[k0:k1], None if vl < 0 else values_blob[v0:v1]))
            k0, v0 = k1, v1
        out.append(StateChanges(state_name, ranges, entries))
    if pos != len(raw):
        raise ChangelogFormatError(f"{name}: {len(raw) - pos} bytes after the last state")
    return out


def replay(db: Rdict, path: Path, ensure_states: Callable[[list[str]], None], *, max_raw: int | None = None) -> int:
    """Apply one changelog file to an open database; returns the number of entries written."""
    sections = read(path, max_raw=max_raw)
    try:
        return _apply(db, sections, ensure_states)
    except Exception as e:
        # rocksdict raises a bare Exception with RocksDB's status text. Anything else is a bug of
        # ours, not a damaged checkpoint: it must not send the job falling back (and discarding).
        if type(e) is not Exception:
            raise
        raise ChangelogFormatError(f"{path.name}: RocksDB refuses its entries ({e})") from e


def _apply(db: Rdict, sections: list[StateChanges], ensure_states: Callable[[list[str]], None]) -> int:
    ensure_states([s.name for s in sections])
    written = 0
    for section in sections:
        cf = db.get_column_family(section.name)
        handle = db.get_column_family_handle(section.name)
        for lower, upper in section.ranges:
            cf.delete_range(lower, upper)
        for i in range(0, len(section.entries), _REPLAY_BATCH):
            batch = rocksdict.WriteBatch(raw_mode=True)
            for key, value in section.entries[i : i + _REPLAY_BATCH]:
                if value is None:
                    batch.delete(key, handle)
                else:
                    batch.put(key, value, handle)
            db.write(batch)
        written += len(section.entries)
    return written
