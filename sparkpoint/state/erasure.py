"""Erasing keys from one subtask's state in a checkpoint, and proving they are gone.

A key lives in one key group, and every entry of it sits behind that group's two-byte prefix
(`sparkpoint.state.kinds.base`), in one of four layouts:

    value, reducing (TTL'd or not):  kg | key                         -> value
    map, list:                       kg | len(key) | key | element    -> value
    timers by key (`__timers__`):    kg | "k" | len(key) | key | clock | time
    timers by time (`__timers__`):   kg | "t" | clock | time | key

So only the subtask whose key-group range holds the key's group can hold it. `erase_subtask`
restores that subtask of a checkpoint into a scratch directory, deletes the key's entries of every
state (each state's declared kind says which layouts apply; an undeclared state gets both), has
RocksDB compact the deleted span down to its last level (tombstones and the values they shadow
are dropped there, so the key's bytes are in no file), and snapshots the result as checkpoint
`new_id` against the restored handle: the SSTs compaction did not touch are referenced as they
are (no copy), the new ones are uploaded under fresh names. A changelog chain, which holds the
key's writes too, is not carried over: the snapshot materializes it.

The proof reads files, not RocksDB: `find_in_files` downloads every SST and changelog file of a
subtask whose range holds the key's group and reads each key in it (`engine.sstfile`,
`engine.changelog`), tombstones and range deletions included; `state_digest` is a SHA-256 over
every entry of a subtask but the erased keys', compared before and after.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rocksdict import BottommostLevelCompaction, CompactOptions, Rdict, ReadOptions, WriteBatch

from sparkpoint.checkpoint.metadata import CheckpointMetadata, FileHandle, SubtaskStateHandle
from sparkpoint.checkpoint.paths import is_changelog_name, private_dir
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.state.backend import RocksDBStateBackend
from sparkpoint.state.engine import changelog
from sparkpoint.state.engine.rocksdb import list_states
from sparkpoint.state.engine.sstfile import read_sst_keys
from sparkpoint.state.keygroups import key_group_of_raw
from sparkpoint.state.kinds.base import LEN, next_prefix
from sparkpoint.state.timers import TIMERS

EXACT_KINDS = ("value", "reducing")  # kg | key
PREFIX_KINDS = ("map", "list")  # kg | len(key) | key | element
_BY_TIME_KEY_AT = 2 + 1 + 1 + 8  # kg, "t", clock, time: the key follows


@dataclass(frozen=True)
class ErasedKey:
    """One key to erase, as the state stores it: its bytes and its key group."""

    raw: bytes
    key_group: int

    @property
    def prefix(self) -> bytes:
        return self.key_group.to_bytes(2, "big")

    def exact(self) -> bytes:
        return self.prefix + self.raw

    def element_prefix(self) -> bytes:
        return self.prefix + LEN.pack(len(self.raw)) + self.raw

    def timer_prefix(self) -> bytes:
        return self.prefix + b"k" + LEN.pack(len(self.raw)) + self.raw


class KeyMatcher:
    """Whether a stored key of a column family (a state of a declared kind, or None: undeclared)
    is an entry of one of the erased keys. By set lookups: a stored key's own length field says
    which key's prefix it could start with, so the cost per entry does not grow with the keys."""

    def __init__(self, keys: Iterable[ErasedKey]):
        keys = list(keys)
        self._exact = {k.exact() for k in keys}
        self._elements = {k.element_prefix() for k in keys}
        self._timers = {k.timer_prefix() for k in keys}
        self._by_time = {k.prefix + k.raw for k in keys}

    def __call__(self, column_family: str, key: bytes, kind: str | None) -> bool:
        if column_family == TIMERS:
            return (_length_prefixed(key, 3) in self._timers
                    or (key[2:3] == b"t" and key[:2] + key[_BY_TIME_KEY_AT:] in self._by_time))
        exact = kind not in PREFIX_KINDS and key in self._exact
        return exact or (kind not in EXACT_KINDS and _length_prefixed(key, 2) in self._elements)


def _length_prefixed(key: bytes, at: int) -> bytes | None:
    """`key` up to the end of the length-prefixed key that starts at `at` (None: too short for one)."""
    if len(key) < at + LEN.size:
        return None
    end = at + LEN.size + LEN.unpack_from(key, at)[0]
    return key[:end] if len(key) >= end else None


def erased_keys(raws: Iterable[bytes], max_parallelism: int) -> list[ErasedKey]:
    return [ErasedKey(raw, key_group_of_raw(raw, max_parallelism)) for raw in dict.fromkeys(raws)]


def holders(handles: Sequence[SubtaskStateHandle], keys: Sequence[ErasedKey]) -> list[SubtaskStateHandle]:
    """The subtasks whose key-group range holds one of `keys`' groups: the only ones that can hold them."""
    return [h for h in handles if any(k.key_group in h.key_group_range for k in keys)]


def keys_of(handle: SubtaskStateHandle, keys: Sequence[ErasedKey]) -> list[ErasedKey]:
    """The keys of `keys` whose group lies in `handle`'s key-group range: the only ones it can hold."""
    return [k for k in keys if k.key_group in handle.key_group_range]


def state_kinds(meta: CheckpointMetadata, operator: str) -> dict[str, str]:
    """The declared kind of each state of `operator` in `meta` (undeclared states are absent)."""
    states = meta.operators[operator].states or {}
    return {name: str(d.get("kind")) for name, d in states.items() if isinstance(d, Mapping)}


# --- reading and deleting a key's entries in a database ---------------------------------------


def _scan(cf: Rdict, lower: bytes, upper: bytes) -> Iterator[bytes]:
    opts = ReadOptions()
    opts.set_iterate_upper_bound(upper)
    it = cf.iter(opts)
    try:
        it.seek(lower)
        while it.valid():
            yield it.key()
            it.next()
        it.status()
    finally:
        del it


def key_entries(db: Rdict, column_families: Iterable[str], keys: Sequence[ErasedKey], kinds: Mapping[str, str]
                ) -> dict[str, list[bytes]]:
    """Every stored key of `keys`' entries, by column family: point reads and bounded scans of
    the keys' own prefixes (a timer's by-time entry is derived from its by-key entry)."""
    found: dict[str, list[bytes]] = {}
    for name in column_families:
        cf = db.get_column_family(name)
        kind = kinds.get(name)
        hits: list[bytes] = []
        for key in keys:
            if name == TIMERS:
                for k in _scan(cf, key.timer_prefix(), next_prefix(key.timer_prefix())):
                    clock_time = k[len(key.timer_prefix()):]
                    hits += [k, key.prefix + b"t" + clock_time + key.raw]
                continue
            if kind not in PREFIX_KINDS and cf.get(key.exact()) is not None:
                hits.append(key.exact())
            if kind not in EXACT_KINDS:
                hits += _scan(cf, key.element_prefix(), next_prefix(key.element_prefix()))
        if hits:
            found[name] = sorted(set(hits))
        del cf
    return found


def delete_entries(db: Rdict, found: Mapping[str, list[bytes]]) -> None:
    """Delete the entries `found`, then compact each column family over the span they covered
    down to the last level, so that neither their values nor the tombstones stay in a file."""
    batch = WriteBatch(raw_mode=True)
    for name, stored in found.items():
        handle = db.get_column_family_handle(name)
        for k in stored:
            batch.delete(k, handle)
    db.write(batch)
    db.flush()
    compact = CompactOptions()
    compact.set_bottommost_level_compaction(BottommostLevelCompaction.force())
    compact.set_exclusive_manual_compaction(True)
    for name, stored in found.items():
        cf = db.get_column_family(name)
        cf.flush()
        cf.compact_range(stored[0], stored[-1] + b"\x00", compact)
        del cf


def state_digest(db: Rdict, column_families: Iterable[str], keys: Sequence[ErasedKey], kinds: Mapping[str, str]
                 ) -> tuple[str, int]:
    """(SHA-256 over every entry of the database but `keys`' entries, in order; entries hashed)."""
    digest = hashlib.sha256()
    count = 0
    erased = KeyMatcher(keys)
    for name in sorted(column_families):
        cf = db.get_column_family(name)
        it = cf.iter(ReadOptions())
        try:
            it.seek_to_first()
            while it.valid():
                k, v = it.key(), it.value()
                if not erased(name, k, kinds.get(name)):
                    for part in (name.encode(), k, v):
                        digest.update(len(part).to_bytes(8, "big") + part)
                    count += 1
                it.next()
            it.status()
        finally:
            del it, cf
    return digest.hexdigest(), count


# --- one subtask of one checkpoint -------------------------------------------------------------


@dataclass(frozen=True)
class SubtaskErasure:
    """What erasing the keys from one subtask of a checkpoint did."""

    operator: str
    subtask: int
    handle: SubtaskStateHandle  # the new checkpoint's
    entries_removed: int
    files_read: int
    bytes_read: int
    files_rewritten: tuple[str, ...]  # the old SST and changelog files the new snapshot no longer lists
    files_written: tuple[str, ...]  # the SST files it uploaded instead (MANIFEST, CURRENT, OPTIONS left out)
    bytes_written: int
    digest: str  # `state_digest` of the rest of the state, before
    entries_kept: int

    def to_json(self) -> dict[str, Any]:
        return {"operator": self.operator, "subtask": self.subtask, "entries_removed": self.entries_removed,
                "files_read": self.files_read, "bytes_read": self.bytes_read,
                "files_rewritten": list(self.files_rewritten), "files_written": list(self.files_written),
                "bytes_written": self.bytes_written, "rest_digest": self.digest, "entries_kept": self.entries_kept}


def _backend(storage: CheckpointStorage, meta: CheckpointMetadata, operator: str, subtask: int,
             workdir: Path) -> RocksDBStateBackend:
    op = meta.operators[operator]
    return RocksDBStateBackend(storage, operator, subtask, parallelism=op.parallelism,
                               max_parallelism=op.max_parallelism, local_dir=workdir, local_recovery=False)


def erase_subtask(storage: CheckpointStorage, meta: CheckpointMetadata, operator: str, subtask: int,
                  keys: Sequence[ErasedKey], new_id: int, workdir: Path) -> SubtaskErasure | None:
    """Restore subtask `subtask` of `operator` in `meta`, delete `keys`' entries and snapshot it as
    checkpoint `new_id` (uploading only the files that changed). None: it holds none of them."""
    handle = meta.operators[operator].subtasks[subtask]
    keys = keys_of(handle, keys)
    kinds = state_kinds(meta, operator)
    backend = _backend(storage, meta, operator, subtask, workdir)
    try:
        result = backend.restore(meta)
        db = backend.db
        assert db is not None
        names = list_states(str(backend.db_path))
        found = key_entries(db, names, keys, kinds)
        if not found:
            return None
        digest, kept = state_digest(db, names, keys, kinds)
        delete_entries(db, found)
        new = backend.snapshot(new_id)
    finally:
        backend.dispose()
    old_paths = {f.path for f in handle.stored() if _holds_entries(f)}  # a savepoint's SSTs are private
    written = [f for f in new.stored() if _holds_entries(f) and f.path not in old_paths]
    return SubtaskErasure(
        operator, subtask, new, sum(len(v) for v in found.values()), result.files or len(list(handle.files())),
        result.downloaded_bytes or sum(f.size for f in handle.files()),
        tuple(sorted(old_paths - {f.path for f in new.stored()})), tuple(f.path for f in written),
        sum(f.size for f in written), digest, kept)


def _holds_entries(f: FileHandle) -> bool:
    """An SST or a changelog file: what holds entries (not MANIFEST, CURRENT, OPTIONS, ...)."""
    return f.local_name.endswith((".sst", ".blob")) or is_changelog_name(f.local_name)


def carry_subtask(storage: CheckpointStorage, handle: SubtaskStateHandle, new_id: int) -> SubtaskStateHandle:
    """`handle` as a subtask of checkpoint `new_id`: the same shared files, its private files
    (MANIFEST, CURRENT, OPTIONS: a few KB) copied under the new checkpoint's directory, since a
    checkpoint's private files are its own."""
    prefix = f"{private_dir(new_id, handle.operator, handle.subtask)}/{uuid.uuid4().hex[:12]}"
    private = []
    for f in handle.private:
        path = f"{prefix}/{f.local_name}"
        storage.write_bytes(path, storage.read_bytes(f.path))
        private.append(FileHandle(f.local_name, path, f.size, f.crc32, new_id))
    return replace(handle, checkpoint_id=new_id, private=tuple(private))


def rest_digest(storage: CheckpointStorage, meta: CheckpointMetadata, operator: str, subtask: int,
                keys: Sequence[ErasedKey], workdir: Path) -> tuple[str, int, int]:
    """(`state_digest` of the subtask as committed in `meta`, entries hashed, entries of `keys` it holds)."""
    keys = keys_of(meta.operators[operator].subtasks[subtask], keys)
    kinds = state_kinds(meta, operator)
    backend = _backend(storage, meta, operator, subtask, workdir)
    try:
        backend.restore(meta)
        db = backend.db
        assert db is not None
        names = list_states(str(backend.db_path))
        left = sum(len(v) for v in key_entries(db, names, keys, kinds).values())
        digest, kept = state_digest(db, names, keys, kinds)
        return digest, kept, left
    finally:
        backend.dispose()


# --- the proof: reading files ------------------------------------------------------------------


@dataclass(frozen=True)
class FileFinding:
    """Entries of an erased key found in one stored file."""

    path: str
    entries: int

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "entries": self.entries}


@dataclass(frozen=True)
class FilesChecked:
    files: int
    bytes: int
    findings: tuple[FileFinding, ...]


def find_in_files(storage: CheckpointStorage, handle: SubtaskStateHandle, keys: Sequence[ErasedKey],
                  kinds: Mapping[str, str], workdir: Path) -> FilesChecked:
    """Read every SST and changelog file `handle` lists (staged slices too) and count the
    entries of `keys` in each: puts, tombstones and range deletions that start inside a key."""
    files = [f for f in handle.stored() if _holds_entries(f) and not f.local_name.endswith(".blob")]
    erased = KeyMatcher(keys_of(handle, keys))
    workdir.mkdir(parents=True, exist_ok=True)
    findings = []
    total = 0
    for f in files:
        local = workdir / f"{uuid.uuid4().hex}-{f.local_name}"
        storage.download([(f.path, str(local))])
        try:
            total += os.path.getsize(local)
            n = _count_in_file(local, f.local_name, erased, kinds)
        finally:
            local.unlink(missing_ok=True)
        if n:
            findings.append(FileFinding(f.path, n))
    shutil.rmtree(workdir, ignore_errors=True)
    return FilesChecked(len(files), total, tuple(findings))


def _count_in_file(local: Path, name: str, erased: KeyMatcher, kinds: Mapping[str, str]) -> int:
    if is_changelog_name(name):
        n = 0
        for section in changelog.read(local):
            kind = kinds.get(section.name)
            n += sum(1 for k, _ in section.entries if erased(section.name, k, kind))
            n += sum(1 for lo, _ in section.ranges if erased(section.name, lo, kind))
        return n
    sst = read_sst_keys(local)
    kind = kinds.get(sst.column_family)
    hits = sum(1 for k in sst.keys if erased(sst.column_family, k, kind))
    return hits + sum(1 for lo, _ in sst.ranges if erased(sst.column_family, lo, kind))
