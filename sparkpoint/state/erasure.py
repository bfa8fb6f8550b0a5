"""Erasing keys from one subtask's state in a checkpoint, and proving they are gone.

A key lives in one key group, and every entry of it sits behind that group's two-byte prefix
(`sparkpoint.state.kinds.base`), in one of four layouts:

    value, reducing (TTL'd or not):  kg | key                         -> value
    map, list:                       kg | len(key) | key | element    -> value
    timers by key (`__timers__`):    kg | "k" | len(key) | key | clock | time
    timers by time (`__timers__`):   kg | "t" | clock | time | key

So only the subtask whose key-group range holds the key's group can hold it, and in it only the
SSTs whose key range (the MANIFEST records it) overlaps that group, besides the level-0 files
(each a batch's flush, over every group). `erase_subtask` restores that subtask of a checkpoint
into a scratch directory with only those files downloaded, the others placeholders
(`erase_key_group_files`, `sparkpoint.state.engine.partial`; the backend cuts its files at about
a key group's bytes, so they are about 1/max_parallelism of the state whatever the parallelism),
deletes the key's entries of every state (each state's declared kind says which layouts apply; an
undeclared state gets both), has RocksDB compact the deleted span down to its last level
(tombstones and the values they shadow are dropped there, so the key's bytes are in no file; only
the files overlapping it are rewritten), and snapshots the result as checkpoint `new_id` against
the restored handle: the SSTs compaction did not touch are referenced as they are (no copy), the
new ones are uploaded under fresh names. A changelog chain, which holds the key's writes too, is
read and replayed whole, and not carried over: the snapshot materializes it. When RocksDB would
need a file it was not given (a compaction stops there), a new attempt downloads it too; a
savepoint's subtask (its SSTs are its own, copied whole anyway), or keys whose files are most of
the subtask, are read whole (`erase_whole_subtask`; the report says why).

The proof reads files, not RocksDB: `find_in_files` downloads every SST and changelog file of a
subtask whose range holds the key's group, but the SSTs its MANIFEST places outside the key's
group, and reads each key in it (`engine.sstfile`, `engine.changelog`), tombstones and range
deletions included; `state_digest` is a SHA-256 over every entry of a subtask but the erased
keys' (over the span the erase read, with the checks of `PartialProof`, for one erased by its key
groups' files), compared before and after.
"""

from __future__ import annotations

import hashlib
import logging
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
from sparkpoint.state.engine.partial import (
    PartialRestore,
    PartialRestoreRefused,
    PlaceholderReached,
    SstRange,
    is_sst,
    needed,
    ranges_of,
    read_ranges,
    refusal,
)
from sparkpoint.state.engine.rocksdb import RocksDBOptions, is_corruption, list_states
from sparkpoint.state.engine.sstfile import (
    PUT,
    entry_type,
    read_sst_entries,
    read_sst_keys,
    sequence,
)
from sparkpoint.state.keygroups import key_group_of_raw
from sparkpoint.state.kinds.base import LEN, next_prefix
from sparkpoint.state.timers import TIMERS

log = logging.getLogger(__name__)

WHOLE = "whole_subtask"
KEY_GROUP_FILES = "key_group_files"
MIN_CUT = 1024  # bytes: the least size the erase's compaction cuts its files at (`_cut_small`)
ATTEMPTS = 3  # partial erases of one subtask, each downloading what the last one found it lacked
MOST = 0.5  # a partial restore that would read more than this share of a subtask's SSTs reads it whole
Spans = list[tuple[bytes, bytes]]  # disjoint [lower, upper) key ranges, in order
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


def delete_entries(db: Rdict, found: Mapping[str, list[bytes]], *, per_group: bool = False) -> None:
    """Delete the entries `found`, then compact each column family over the span they covered
    down to the last level, so that neither their values nor the tombstones stay in a file.
    `per_group`: each key group's entries apart, deleted, flushed and compacted over their own
    span (a leveled compaction rewrites only the files overlapping its span, and a flush of
    every group's tombstones would be one file over all of them)."""
    if not per_group:
        _delete_and_compact(db, found)
        return
    groups: dict[bytes, dict[str, list[bytes]]] = {}
    for name, stored in found.items():
        for k in stored:
            groups.setdefault(k[:2], {}).setdefault(name, []).append(k)
    for _, entries in sorted(groups.items()):
        _delete_and_compact(db, entries)


def _delete_and_compact(db: Rdict, found: Mapping[str, list[bytes]]) -> None:
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


def state_digest(db: Rdict, column_families: Iterable[str], keys: Sequence[ErasedKey], kinds: Mapping[str, str],
                 spans: Mapping[str, Spans] | None = None) -> tuple[str, int]:
    """(SHA-256 over every entry of the database but `keys`' entries, in order; entries hashed).
    With `spans`, over the entries of each column family in its spans ([lower, upper) each) only."""
    digest = hashlib.sha256()
    count = 0
    erased = KeyMatcher(keys)
    for name, span in ((n, s) for n in sorted(column_families) for s in (spans.get(n, []) if spans else [None])):
        cf = db.get_column_family(name)
        opts = ReadOptions()
        if span is not None:
            opts.set_iterate_upper_bound(span[1])
        it = cf.iter(opts)
        try:
            if span is None:
                it.seek_to_first()
            else:
                it.seek(span[0])
            while it.valid():
                k, v = it.key(), it.value()
                if not erased(name, k, kinds.get(name)):
                    for part in (name.encode(), k, v):
                        digest.update(len(part).to_bytes(8, "big") + part)
                    count += 1
                it.next()
            it.status()
        finally:
            del it, cf, opts
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
    digest: str  # `state_digest` of the rest of the state (in `span` only, by key group files), before
    entries_kept: int
    # How it was read: "key_group_files" (only the SSTs that can hold the keys' groups, `PartialProof`)
    # or "whole_subtask" (every file; `fallback` says why when the other was tried or refused)
    route: str = WHOLE
    fallback: str | None = None
    proof: PartialProof | None = None

    def to_json(self) -> dict[str, Any]:
        out = {"operator": self.operator, "subtask": self.subtask, "entries_removed": self.entries_removed,
               "files_read": self.files_read, "bytes_read": self.bytes_read,
               "files_rewritten": list(self.files_rewritten), "files_written": list(self.files_written),
               "bytes_written": self.bytes_written, "rest_digest": self.digest, "entries_kept": self.entries_kept,
               "route": self.route, "fallback": self.fallback}
        if self.proof is not None:
            out.update(self.proof.to_json())
        return out


@dataclass(frozen=True)
class PartialProof:
    """What a subtask erased by its key groups' files is checked against, recorded when it was
    rewritten: `digest` (of `SubtaskErasure`) covers the entries of each column family in its span
    (`spans`: the keys' groups and every file read above level 0), read through RocksDB; every SST
    of the original but `files_rewritten` is in the copy unchanged (`kept_digest`: path, size and
    CRC32 of each); and the puts of the rewritten level-0 files outside the spans are the puts of
    the new files outside them (`moved_digest`), RocksDB having moved them a level down."""

    spans: dict[str, Spans]
    files_kept: int
    kept_digest: str
    moved_digest: str
    moved_entries: int

    def to_json(self) -> dict[str, Any]:
        return {"ranges": {cf: [[lo.hex(), hi.hex()] for lo, hi in spans] for cf, spans in sorted(self.spans.items())},
                "files_kept": self.files_kept,
                "kept_digest": self.kept_digest, "moved_digest": self.moved_digest,
                "moved_entries": self.moved_entries}


def opened(backend: RocksDBStateBackend) -> tuple[Rdict, list[str]]:
    """A restored backend's database and the names of its states."""
    assert backend.db is not None
    return backend.db, list_states(str(backend.db_path))


def _backend(storage: CheckpointStorage, meta: CheckpointMetadata, operator: str, subtask: int,
             workdir: Path, options: RocksDBOptions | None = None) -> RocksDBStateBackend:
    op = meta.operators[operator]
    return RocksDBStateBackend(storage, operator, subtask, parallelism=op.parallelism,
                               max_parallelism=op.max_parallelism, local_dir=workdir, local_recovery=False,
                               options=options)


def erase_subtask(storage: CheckpointStorage, meta: CheckpointMetadata, operator: str, subtask: int,
                  keys: Sequence[ErasedKey], new_id: int, workdir: Path) -> SubtaskErasure | None:
    """Restore subtask `subtask` of `operator` in `meta`, delete `keys`' entries and snapshot it as
    checkpoint `new_id` (uploading only the files that changed). None: it holds none of them.

    First with only the SSTs that can hold the keys' groups (`erase_key_group_files`), again with
    the files an attempt found it lacked; when that cannot be done (a savepoint's own files, files
    that can hold the keys making most of the state, RocksDB still reaching a file it was not
    given), with the whole subtask, and `fallback` says why."""
    handle = meta.operators[operator].subtasks[subtask]
    why = refusal(handle) or _own_files(handle)
    wanted: dict[str, Spans] = {}
    wasted = 0  # bytes read by attempts that gave up
    for _ in range(ATTEMPTS if why is None else 0):
        try:
            done = erase_key_group_files(storage, meta, operator, subtask, keys, new_id, workdir / "groups", wanted)
            return None if done is None else replace(done, bytes_read=done.bytes_read + wasted)
        except PartialRestoreRefused as e:
            why = str(e)
            break
        except Exception as e:  # rocksdict raises bare Exception; reading a placeholder is "Corruption: ..."
            if not isinstance(e, PlaceholderReached) and not is_corruption(e):
                raise
            why = f"a file it was not given was reached ({e})"
            if not isinstance(e, PlaceholderReached) or not e.wanted:
                break
            wasted += e.downloaded_bytes
            for cf, more in e.wanted.items():
                wanted.setdefault(cf, []).extend(more)
    log.warning("%s subtask %s of chk-%s is erased reading every file: %s", operator, subtask, meta.checkpoint_id, why)
    done = erase_whole_subtask(storage, meta, operator, subtask, keys, new_id, workdir / "whole")
    return None if done is None else replace(done, fallback=why, bytes_read=done.bytes_read + wasted)


def _own_files(handle: SubtaskStateHandle) -> str | None:
    """Why a snapshot of `handle` cannot share its SSTs: they are its checkpoint's own (a
    savepoint's), copied whole by any copy of it."""
    if any(is_sst(f) for f in handle.private):
        return "its SSTs are its savepoint's own files (a copy copies them all)"
    return None


def erase_whole_subtask(storage: CheckpointStorage, meta: CheckpointMetadata, operator: str, subtask: int,
                        keys: Sequence[ErasedKey], new_id: int, workdir: Path) -> SubtaskErasure | None:
    """`erase_subtask` reading every file of the subtask."""
    handle = meta.operators[operator].subtasks[subtask]
    keys = keys_of(handle, keys)
    kinds = state_kinds(meta, operator)
    backend = _backend(storage, meta, operator, subtask, workdir)
    try:
        result = backend.restore(meta)
        db, names = opened(backend)
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


# --- one subtask, by its key groups' files -----------------------------------------------------


def group_spans(keys: Iterable[ErasedKey]) -> list[tuple[bytes, bytes]]:
    """[lower, upper) of every key group of `keys`: every stored key of theirs lies in one."""
    return [(g.to_bytes(2, "big"), (g + 1).to_bytes(2, "big")) for g in sorted({k.key_group for k in keys})]


def merged(spans: Iterable[tuple[bytes, bytes]], ranges: Iterable[SstRange] = ()) -> Spans:
    """The union of `spans` and of the files' key ranges, as disjoint spans in order."""
    bounds = sorted([*spans, *((r.start, r.end + b"\x00") for r in ranges)])
    out: Spans = []
    for lo, hi in bounds:
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def inside(key: bytes, spans: Spans) -> bool:
    return any(lo <= key < hi for lo, hi in spans)


def closed_over(ranges: Mapping[str, SstRange], spans: Spans,
                wanted: Mapping[str, Spans] | None = None) -> set[str]:
    """The SSTs a partial erase of `spans` downloads: those that can hold them (`needed`), and in
    each column family those overlapping what an earlier attempt found it lacked (`wanted`), then
    in each column family every file above level 0 overlapping the union of its files chosen so
    far, until none is added: what the proof reads of each (`proof_spans`) is then covered by
    downloaded files only. Refused when that is most of the state."""
    wanted = wanted or {}
    chosen = needed(ranges.values(), spans)
    for cf in sorted({r.column_family for r in ranges.values()}):
        mine = [r for r in ranges.values() if r.column_family == cf]
        chosen |= needed(mine, wanted.get(cf, []))
        while True:
            more = needed(mine, merged(spans, (r for r in mine if r.name in chosen and r.level > 0)))
            if more <= chosen:
                break
            chosen |= more
    total = sum(r.size for r in ranges.values())
    if total and sum(ranges[n].size for n in chosen) > MOST * total:
        raise PartialRestoreRefused(f"the files that can hold the keys' groups are {len(chosen)} of {len(ranges)}, "
                                    f"more than {MOST:.0%} of its bytes")
    return chosen


def proof_spans(ranges: Iterable[SstRange], spans: Spans, column_families: Iterable[str]) -> dict[str, Spans]:
    """Per column family, the union of `spans` and of its files above level 0 among `ranges`."""
    ranges = list(ranges)
    return {cf: merged(spans, (r for r in ranges if r.column_family == cf and r.level > 0))
            for cf in sorted({*column_families, *(r.column_family for r in ranges)})}


def needed_in(ranges: Mapping[str, SstRange], spans: Mapping[str, Spans]) -> set[str]:
    """Every level-0 file, and each file above whose range overlaps one of its column family's spans."""
    return {n for n, r in ranges.items()
            if r.level == 0 or any(r.overlaps(lo, hi) for lo, hi in spans.get(r.column_family, []))}


def erase_key_group_files(storage: CheckpointStorage, meta: CheckpointMetadata, operator: str, subtask: int,
                          keys: Sequence[ErasedKey], new_id: int, workdir: Path,
                          wanted: Mapping[str, Spans] | None = None) -> SubtaskErasure | None:
    """`erase_subtask` downloading only the SSTs that can hold the keys' groups (the others are
    placeholders, `sparkpoint.state.engine.partial`): delete, compact the keys' entries down (RocksDB
    rewrites the files that overlap them, level by level), snapshot against the original so every
    other file is referenced as it is. Raises PartialRestoreRefused or PlaceholderReached (the
    caller erases the subtask whole then)."""
    handle = meta.operators[operator].subtasks[subtask]
    keys = keys_of(handle, keys)
    kinds = state_kinds(meta, operator)
    spans = group_spans(keys)
    backend = _backend(storage, meta, operator, subtask, workdir, RocksDBOptions(placeholders=True))
    try:
        done = backend.restore_partial(meta, lambda ranges: closed_over(ranges, spans, wanted))
        db, names = opened(backend)
        found = key_entries(db, names, keys, kinds)
        if not found:
            return None
        fetched = done.real  # and the flush of a replayed changelog chain
        span = proof_spans(fetched, spans, names)
        digest, kept = state_digest(db, names, keys, kinds, span)
        level0 = {r.name: _outside(backend.db_path / r.name, span) for r in fetched if r.level == 0}
        _cut_small(db, names, fetched, len(handle.key_group_range))
        delete_entries(db, found, per_group=True)
        after = ranges_of(db, names)
        rewritten = set(done.ranges) - set(after)
        try:
            _check_rewritten(done, after, found, span)
        except PlaceholderReached as e:
            raise PlaceholderReached(str(e), _stuck(done, after, found), done.downloaded_bytes) from None
        moved_before = _merged(level0[n] for n in sorted(rewritten) if n in level0)
        moved_after = _merged(_outside(backend.db_path / n, span) for n in sorted(set(after) - set(done.ranges)))
        if moved_before != moved_after:
            raise PlaceholderReached(f"the level-0 entries outside the keys' files moved as {moved_after[1]} puts, "
                                     f"not {moved_before[1]}")
        backend.partial_facts = _facts_without(done.handle.facts, found)
        new = backend.snapshot(new_id)
    finally:
        backend.dispose()
    files = list(handle.files())
    now = {f.path for f in new.stored()}
    old = sorted(f.path for f in handle.stored() if _holds_entries(f) and f.path not in now)
    written = [f for f in new.stored() if _holds_entries(f) and f.path not in {g.path for g in handle.stored()}]
    kept_files = [f for f in files if is_sst(f) and f.local_name not in rewritten]
    proof = PartialProof(span, len(kept_files), files_digest(kept_files), *moved_before)
    read = len(done.fetched) + sum(1 for f in files if not is_sst(f))
    return SubtaskErasure(
        operator, subtask, new, sum(len(v) for v in found.values()), read, done.downloaded_bytes, tuple(old),
        tuple(f.path for f in written), sum(f.size for f in written), digest, kept, KEY_GROUP_FILES, None, proof)


def _cut_small(db: Rdict, names: Iterable[str], fetched: Sequence[SstRange], key_groups: int) -> None:
    """How the compaction cuts its outputs, per state. A level-0 file's entries go to level 1
    first, all of them, and only the level-1 file that holds an erased key goes down to join the
    files near it: cut at about a quarter of a key group's worth of the level-0 entries, it spans
    about a quarter of a key group of the state, within the files read (else RocksDB would reach
    a placeholder and the erase reads the subtask whole). Further down the cut grows, reaching
    about the files' own size at the bottom level."""
    for name in names:
        mine = [r for r in fetched if r.column_family == name]
        level0 = sum(r.size for r in mine if r.level == 0)
        lower = sorted(r.size for r in mine if r.level > 0) or [MIN_CUT * 32]
        bottom = lower[len(lower) // 2]
        base = max(MIN_CUT, level0 // (4 * max(1, key_groups)) if level0 else bottom // 32)
        multiplier = max(2, round((bottom / base) ** (1 / 5)))
        cf = db.get_column_family(name)
        cf.set_options({"target_file_size_base": str(base), "target_file_size_multiplier": str(multiplier)})
        del cf


def _check_rewritten(done: PartialRestore, after: Mapping[str, SstRange], found: Mapping[str, list[bytes]],
                     spans: Mapping[str, Spans]) -> None:
    """Every file of a column family whose range holds an erased entry was rewritten, no
    placeholder was, and every file rewritten above level 0 lies in its column family's span."""
    for name, r in done.ranges.items():
        stored = found.get(r.column_family)
        if name in after and stored and any(r.start <= k <= r.end for k in stored):
            raise PlaceholderReached(f"{name} holds an erased entry and was not rewritten (the compaction stopped)")
        if name in after:
            continue
        if name in done.placeholders:
            raise PlaceholderReached(f"{name}, a placeholder, was rewritten")
        if r.level > 0 and not any(lo <= r.start and r.end < hi for lo, hi in spans[r.column_family]):
            raise PlaceholderReached(f"{name} was rewritten but lies outside the range the proof reads")


def _stuck(done: PartialRestore, after: Mapping[str, SstRange], found: Mapping[str, list[bytes]]
           ) -> dict[str, list[tuple[bytes, bytes]]]:
    """Per column family, the key ranges of the files the compaction wrote above the bottom level
    that still hold an erased entry: it stopped there, at files of the levels below not given."""
    out: dict[str, list[tuple[bytes, bytes]]] = {}
    bottom = max((r.level for r in done.ranges.values()), default=0)
    for name, r in after.items():
        stored = found.get(r.column_family, [])
        if name not in done.ranges and 0 < r.level < bottom and any(r.start <= k <= r.end for k in stored):
            out.setdefault(r.column_family, []).append((r.start, r.end + b"\x00"))
    return out


Moved = dict[tuple[str, bytes], tuple[int, int, bytes]]


def _outside(path: Path, spans: Mapping[str, Spans]) -> Moved:
    """The entries of SST `path` outside its column family's spans: (column family, key) ->
    (sequence, type, value)."""
    read = read_sst_entries(path)
    if read.ranges:
        raise PlaceholderReached(f"{path.name} holds range deletions")
    mine = spans.get(read.column_family, [])
    out: Moved = {}
    for ikey, value in read.entries:
        key = ikey[:-8]
        if inside(key, mine):
            continue
        kind = entry_type(ikey)
        if kind not in (0, PUT):
            raise PlaceholderReached(f"{path.name} holds an entry of type {kind}")
        seq = sequence(ikey)
        if out.get((read.column_family, key), (-1,))[0] < seq:
            out[(read.column_family, key)] = (seq, kind, value)
    return out


def _merged(files: Iterable[Moved]) -> tuple[str, int]:
    """(SHA-256 over the newest put of each key of `files`, in order; puts): what a key reads
    from them. Deletions are left out: RocksDB drops one where no older file can hold its key."""
    newest: Moved = {}
    for entries in files:
        for k, v in entries.items():
            if newest.get(k, (-1,))[0] < v[0]:
                newest[k] = v
    digest = hashlib.sha256()
    count = 0
    for (cf, key), (_, kind, value) in sorted(newest.items()):
        if kind == PUT:
            for part in (cf.encode(), key, value):
                digest.update(len(part).to_bytes(8, "big") + part)
            count += 1
    return digest.hexdigest(), count


def files_digest(files: Iterable[FileHandle]) -> str:
    """SHA-256 over the path, size and CRC32 of each file, in path order."""
    return hashlib.sha256("\n".join(sorted(f"{f.path}:{f.size}:{f.crc32}" for f in files)).encode()).hexdigest()


def _facts_without(facts: dict[str, Any] | None, found: Mapping[str, list[bytes]]) -> dict[str, Any] | None:
    """The restored subtask's facts less the erased entries (counting would read every file)."""
    if not facts or not isinstance(facts.get("states"), dict):
        return facts
    states = {name: ({**d, "entries": max(0, int(d["entries"]) - len(found.get(name, ())))}
                     if isinstance(d, dict) and isinstance(d.get("entries"), int) else d)
              for name, d in facts["states"].items()}
    timers = facts.get("timers")
    if isinstance(timers, dict) and isinstance(timers.get("pending"), int) and TIMERS in found:
        timers = {**timers, "pending": max(0, timers["pending"] - len(found[TIMERS]) // 2)}
    return {**facts, "states": states, "timers": timers}


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


def count_entries(storage: CheckpointStorage, meta: CheckpointMetadata, operator: str, subtask: int,
                  keys: Sequence[ErasedKey], workdir: Path) -> int:
    """The entries of `keys` subtask `subtask` of `operator` holds in `meta` (what a dry run
    reports): read from the SSTs that can hold their groups (`needed`: a read needs no more), or
    from the whole subtask when those cannot be restored alone."""
    handle = meta.operators[operator].subtasks[subtask]
    keys = keys_of(handle, keys)
    kinds = state_kinds(meta, operator)
    if refusal(handle) is None:
        backend = _backend(storage, meta, operator, subtask, workdir / "groups", RocksDBOptions(placeholders=True))
        try:
            backend.restore_partial(meta, lambda ranges: needed(ranges.values(), group_spans(keys)))
            return sum(len(v) for v in key_entries(*opened(backend), keys, kinds).values())
        except PartialRestoreRefused:
            pass
        except Exception as e:  # rocksdict raises bare Exception; reading a placeholder is "Corruption: ..."
            if not is_corruption(e):
                raise
        finally:
            backend.dispose()
    backend = _backend(storage, meta, operator, subtask, workdir / "whole")
    try:
        backend.restore(meta)
        return sum(len(v) for v in key_entries(*opened(backend), keys, kinds).values())
    finally:
        backend.dispose()


def rest_digest(storage: CheckpointStorage, meta: CheckpointMetadata, operator: str, subtask: int,
                keys: Sequence[ErasedKey], workdir: Path) -> tuple[str, int, int]:
    """(`state_digest` of the subtask as committed in `meta`, entries hashed, entries of `keys` it holds)."""
    keys = keys_of(meta.operators[operator].subtasks[subtask], keys)
    kinds = state_kinds(meta, operator)
    backend = _backend(storage, meta, operator, subtask, workdir)
    try:
        backend.restore(meta)
        db, names = opened(backend)
        left = sum(len(v) for v in key_entries(db, names, keys, kinds).values())
        digest, kept = state_digest(db, names, keys, kinds)
        return digest, kept, left
    finally:
        backend.dispose()


def partial_rest(storage: CheckpointStorage, meta: CheckpointMetadata, erased: SubtaskErasure,
                 keys: Sequence[ErasedKey], workdir: Path) -> tuple[str, int, int, list[str]]:
    """The proof of a subtask erased by its key groups' files (`PartialProof`), read from the copy
    `meta` as committed: (`state_digest` of its entries in the recorded span, entries hashed,
    entries of `keys` it holds, what differs from the record besides)."""
    proof = erased.proof
    assert proof is not None
    handle = meta.operators[erased.operator].subtasks[erased.subtask]
    keys = keys_of(handle, keys)
    kinds = state_kinds(meta, erased.operator)
    written = set(erased.files_written)
    problems = []
    kept = [f for f in handle.files() if is_sst(f) and f.path not in written]
    if files_digest(kept) != proof.kept_digest:
        problems.append(f"{erased.operator} subtask {erased.subtask}: its {len(kept)} files not rewritten are not the "
                        f"original's {proof.files_kept} (path, size, CRC32)")
    new_names = {f.local_name for f in handle.files() if f.path in written}
    backend = _backend(storage, meta, erased.operator, erased.subtask, workdir, RocksDBOptions(placeholders=True))
    try:
        backend.restore_partial(meta, lambda ranges: needed_in(ranges, proof.spans) | (new_names & set(ranges)))
        db, names = opened(backend)
        left = sum(len(v) for v in key_entries(db, names, keys, kinds).values())
        digest, count = state_digest(db, names, keys, kinds, {n: proof.spans.get(n, []) for n in names})
        moved = _merged(_outside(backend.db_path / n, proof.spans) for n in sorted(new_names))
    finally:
        backend.dispose()
    if moved != (proof.moved_digest, proof.moved_entries):
        problems.append(f"{erased.operator} subtask {erased.subtask}: the entries moved out of the rewritten "
                        f"level-0 files are {moved[1]} puts hashed {moved[0][:12]}, not {proof.moved_entries} hashed "
                        f"{proof.moved_digest[:12]}")
    return digest, count, left, problems


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
    ruled_out: int = 0  # SSTs whose key range (in the MANIFEST) lies outside every key group of the keys


def find_in_files(storage: CheckpointStorage, handle: SubtaskStateHandle, keys: Sequence[ErasedKey],
                  kinds: Mapping[str, str], workdir: Path) -> FilesChecked:
    """Read every SST and changelog file `handle` lists (staged slices too) that can hold an
    entry of `keys` and count their entries in each: puts, tombstones and range deletions that
    start inside a key. An SST whose key range, as the subtask's MANIFEST records it (the record
    RocksDB itself reads a key by), lies outside every key group of the keys cannot hold one
    and is not read: every level-0 file is, and every file of a subtask with a changelog chain."""
    keys = keys_of(handle, keys)
    files = [f for f in handle.stored() if _holds_entries(f) and not f.local_name.endswith(".blob")]
    workdir.mkdir(parents=True, exist_ok=True)
    ruled_out = 0
    if refusal(handle) is None:
        ranges = read_ranges(storage, handle, handle.checkpoint_id, workdir)
        can = needed(ranges.values(), group_spans(keys))
        kept = [f for f in files if not is_sst(f) or f.local_name in can or f.local_name not in ranges]
        files, ruled_out = kept, len(files) - len(kept)
    erased = KeyMatcher(keys)
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
    return FilesChecked(len(files), total, tuple(findings), ruled_out)


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
