"""A materialization in steps: the state of one checkpoint uploaded as SST slices over many.

With the changelog on, a subtask materializes when its chain grows long (`ChangelogOptions`).
Done at once, that checkpoint uploads the whole state while every other uploads one changelog
file: measured, 3-5x the mean upload, and 100x on a large state at 1% churn. In steps, the
checkpoint that calls for a materialization takes a native RocksDB checkpoint of its state (hard
links: no bytes copied) into `<subtask dir>/mat-<N>/snap` and uploads nothing more. Each later
checkpoint still uploads its changelog file, and besides it the next slice of that snapshot: the
entries of one state in key order from where the last slice ended, written with RocksDB's
`SstFileWriter` to `slice-<N>-<seq>.sst`. Its handle lists the slices so far as `staged` (the
registry keeps them; no restore reads them). The slices are paced by the chain: they are all up
once the chain has grown by three quarters of what called for the materialization, so its bytes
spread over three quarters of a cycle and no checkpoint uploads much more than the mean (the
mean itself is as before: one materialization per threshold of growth).

The checkpoint that uploads the last slice *switches*: it ingests the slices into a new local
database (RocksDB moves them in unchanged, under its own file names), takes a native checkpoint
of it, uploads only its small files (CURRENT, MANIFEST, OPTIONS) and lists a plain RocksDB
materialization: those files, the slices already stored (same bytes, same CRC32) under the names
RocksDB gave them, then the chain after N. A restore cannot tell it from any other.

Everything a later process needs to go on is on the local disk (`staging.json`), and it goes on
only when that record agrees with the confirmed checkpoint's handle: N's changelog file is in its
chain and its staged slices are the record's first ones, path, size and CRC32. Anything else
(another machine, a rollback past N, a damaged slice) discards the staging; the chain goes on and
the next checkpoint starts a new one.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sparkpoint.checkpoint.metadata import FileHandle, SubtaskStateHandle
from sparkpoint.checkpoint.paths import CHANGELOG_PREFIX
from sparkpoint.lazy import lazy_module
from sparkpoint.state.engine.localfiles import write_replacing
from sparkpoint.state.engine.rocksdb import (
    SIDECAR_PREFIX,
    RocksDBOptions,
    list_states,
    open_db,
    raw_bytes,
    scan_options,
)
from sparkpoint.state.kinds.base import FORMAT_KEY
from sparkpoint.state.ttl import STAMP

if TYPE_CHECKING:
    import rocksdict
else:
    rocksdict = lazy_module("rocksdict")

log = logging.getLogger(__name__)

RECORD = "staging.json"
DIR_PREFIX = "mat-"
SLICE_PREFIX = "slice-"
# The slices are spread over the chain's growth by this share of the threshold that called for
# the materialization. A materialization per threshold of growth, as at once, keeps the mean; the
# checkpoints that carry slices then upload up to 1/SPREAD of the mean's materialization share
# more than the others: about 1.3x the mean, where a spread of 1/2 came to 1.9-2.4x measured.
SPREAD = 0.75
AHEAD = 1.1
SAMPLE = 1 / 8  # of a subtask's key groups, counted when a materialization in steps starts


def staging_dirs(subtask_dir: Path) -> list[Path]:
    return sorted(p for p in subtask_dir.glob(f"{DIR_PREFIX}*") if p.is_dir() and not p.is_symlink())


def drop_all(subtask_dir: Path, keep: Path | None = None) -> None:
    for d in staging_dirs(subtask_dir):
        if d != keep:
            shutil.rmtree(d, ignore_errors=True)


def changelog_id(local_name: str) -> int | None:
    """changelog-000000000007 -> 7."""
    tail = local_name[len(CHANGELOG_PREFIX):] if local_name.startswith(CHANGELOG_PREFIX) else ""
    return int(tail) if tail.isdigit() else None


@dataclass
class Slice:
    seq: int
    state: str
    last: str  # hex of the last key in it
    raw: int  # bytes of its keys and values
    keys: int = 0  # entries in it
    path: str = ""  # on storage, once uploaded
    size: int = 0
    crc32: int = 0
    created_by: int = 0

    def handle(self, local_name: str) -> FileHandle:
        return FileHandle(local_name, self.path, self.size, self.crc32, self.created_by)


def slice_name(at: int, seq: int) -> str:
    return f"{SLICE_PREFIX}{at:012d}-{seq:06d}.sst"


@dataclass
class Staging:
    """The record of one materialization in steps (see the module's text)."""

    dir: Path
    at: int  # the checkpoint whose state `snap/` holds
    anchor: str  # the storage path of checkpoint `at`'s changelog file
    goal_bytes: float  # the slices are all up once the chain has grown this much since `at` ...
    goal_files: float  # ... or by this many files
    limit_bytes: int  # a chain this long has the materialization done at once (`overdue`)
    limit_files: int
    total: int  # bytes of the snapshot's SSTs: what the slices will about add up to
    raw_total: int = 0  # ... and of the keys and values in them, uncompressed (0: not recorded)
    key_groups: tuple[int, int] = (0, 0)  # the subtask's key-group range [first, last]
    keys_estimate: int = 0  # the snapshot's entries, estimated from a sample of its key groups
    done: bool = False  # every entry is in a slice
    slices: list[Slice] = field(default_factory=list)

    # --- life cycle --------------------------------------------------------------------------

    @classmethod
    def start(cls, subtask_dir: Path, db: Any, at: int, anchor: str, *, chain: tuple[int, int],
              threshold: tuple[float, int], key_groups: tuple[int, int]) -> Staging:
        """Snapshot the working database (flushed: it is checkpoint `at`) into mat-<at>/snap.

        `chain` is (bytes, files) of the chain now, `threshold` the (bytes, files) of growth a
        materialization is paced against (`ChangelogOptions.thresholds`). The slices are paced to
        be up after SPREAD of a threshold of growth, and before the chain has grown by a whole
        threshold more, where it is done at once."""
        drop_all(subtask_dir)
        d = subtask_dir / f"{DIR_PREFIX}{at}"
        _fresh(d)
        d.mkdir(parents=True)
        rocksdict.Checkpoint(db).create_checkpoint(str(d / "snap"))
        total = sum(e.stat().st_size for e in os.scandir(d / "snap") if e.name.endswith(".sst"))
        limit_bytes, limit_files = int(chain[0] + threshold[0]), chain[1] + threshold[1]
        states = list_states(str(d / "snap"))
        staging = cls(
            d, at, anchor,
            goal_bytes=max(1.0, min(SPREAD * threshold[0], 0.8 * (limit_bytes - chain[0]))),
            goal_files=max(1.0, min(SPREAD * threshold[1], 0.8 * (limit_files - chain[1]))),
            limit_bytes=limit_bytes, limit_files=limit_files, total=total, raw_total=raw_bytes(db, states),
            key_groups=key_groups,
            keys_estimate=_count_by_sample(db, states, key_groups),
        )
        staging.save()
        return staging

    def overdue(self, chain_bytes: int, chain_files: int) -> bool:
        return chain_bytes >= self.limit_bytes or chain_files >= self.limit_files

    @classmethod
    def resume(cls, subtask_dir: Path, base: SubtaskStateHandle) -> Staging | None:
        """The staging that goes on from the confirmed `base`, or None (every other one dropped)."""
        found = None
        anchors = {f.path for f in base.shared}
        for d in staging_dirs(subtask_dir):
            try:
                staging = cls.load(d)
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.warning("dropping the unreadable staging record in %s: %s", d, e)
                continue
            if found is None and staging.anchor in anchors and staging.agrees_with(base.staged):
                found = staging
        drop_all(subtask_dir, keep=found.dir if found else None)
        if found is not None and len(found.slices) > len(base.staged):  # a later, aborted checkpoint's
            for s in found.slices[len(base.staged):]:
                (found.dir / found.name_of(s)).unlink(missing_ok=True)
            found.slices = found.slices[: len(base.staged)]
            found.done = False
            found.save()
        return found

    def agrees_with(self, staged: tuple[FileHandle, ...]) -> bool:
        if len(staged) > len(self.slices):
            return False
        for s, f in zip(self.slices, staged):
            if (self.name_of(s), s.path, s.size, s.crc32) != (f.local_name, f.path, f.size, f.crc32):
                return False
            local = self.dir / self.name_of(s)
            if not local.is_file() or local.is_symlink() or local.stat().st_size != s.size:
                return False
        return True

    @classmethod
    def load(cls, d: Path) -> Staging:
        raw = json.loads((d / RECORD).read_text())
        slices = [Slice(**s) for s in raw.pop("slices")]
        raw["key_groups"] = tuple(raw["key_groups"])
        return cls(dir=d, slices=slices, **raw)

    def save(self) -> None:
        data = {k: v for k, v in asdict(self).items() if k not in ("dir", "slices")}
        data["slices"] = [asdict(s) for s in self.slices]
        write_replacing(self.dir / RECORD, json.dumps(data).encode())

    def drop(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def name_of(self, s: Slice) -> str:
        return slice_name(self.at, s.seq)

    def written_ratio(self) -> float | None:
        """What the slices take per raw byte ÷ what the snapshot's SSTs took (below 1: the slices'
        format compresses better), or None when a figure is missing. Per raw byte, so that the
        entries a TTL left out of the slices do not count as the format's saving."""
        size, raw = sum(s.size for s in self.slices), sum(s.raw for s in self.slices)
        if not (size and raw and self.total and self.raw_total):
            return None
        return (size / raw) / (self.total / self.raw_total)

    def staged_handles(self) -> list[FileHandle]:
        return [s.handle(self.name_of(s)) for s in self.slices if s.path]

    # --- slices ------------------------------------------------------------------------------

    def pace(self, since_bytes: int, since_files: int) -> float:
        """The share of the state that should be in slices once the chain has grown this much
        since `at` (1: all of it)."""
        return min(1.0, max(since_bytes / self.goal_bytes, since_files / self.goal_files))

    def write_slices(self, pace: float, options: RocksDBOptions, *, minimum: int,
                     expired_before: Mapping[str, int] | None = None) -> list[Slice]:
        """Write slices up to `pace`, a share of the snapshot's entries (everything left at 1).
        None when what is due comes to less than about `minimum` bytes and more is to come.

        `expired_before` (per state with a TTL, `SubtaskStates.expired_before`) leaves out the
        entries expired now, as Flink's compaction filter does where RocksDB rewrites them:
        the materialization holds only what a read can still return. A state's entries are
        read as stamped only where the snapshot says they are (its TTL format key)."""
        if self.done:
            return []
        written_keys = sum(s.keys for s in self.slices)
        total = max(1.0, float(self.keys_estimate))
        # aim ahead of the pace by the sample's error: what is left at pace 1 all goes into one
        # checkpoint, while running out early costs nothing
        due = math.inf if pace >= 1 else pace * AHEAD * total - written_keys
        if due * self.total / max(total, 1.0) < minimum:
            return []
        last = self.slices[-1] if self.slices else None
        snap = self.dir / "snap"
        db = open_db(str(snap), [], options, create=False, read_only=True)
        written: list[Slice] = []
        try:
            states = list_states(str(snap))
            state, after = (last.state, bytes.fromhex(last.last)) if last else (None, None)
            for name in states if state is None else states[states.index(state):]:
                drop = (expired_before or {}).get(name)
                if drop is not None and db.get_column_family(name).get(FORMAT_KEY) is None:
                    drop = None  # written before the TTL was turned on: not stamped
                piece, exhausted = self._write_one(db, name, after if name == state else None, due, options, drop)
                if piece is not None:
                    written.append(piece)
                    self.slices.append(piece)
                    due -= piece.keys
                if not exhausted:
                    break
            else:
                self.done = True
        finally:
            db.close()
        self.save()
        return written

    def _write_one(self, db: Any, state: str, after: bytes | None, due: float, options: RocksDBOptions,
                   drop_before: int | None = None) -> tuple[Slice | None, bool]:
        """One slice of at most `due` entries of `state` from after the key `after` (those stamped
        before `drop_before` read and left out): (the slice or None, whether the state has no
        entry left)."""
        it = db.get_column_family(state).iter(scan_options())
        seq = len(self.slices)
        path = self.dir / slice_name(self.at, seq)
        path.unlink(missing_ok=True)  # a leftover, or a link planted there: never written through
        writer = None
        raw, last, n = 0, b"", 0
        try:
            if after is None:
                it.seek_to_first()
            else:
                it.seek(after)
                if it.valid() and it.key() == after:
                    it.next()
            while it.valid() and n < due:
                key, value = it.key(), it.value()
                n += 1
                last = key
                if drop_before is not None and key[:2] != SIDECAR_PREFIX and (
                        len(value) >= STAMP.size and STAMP.unpack_from(value)[0] < drop_before):
                    it.next()
                    continue
                if writer is None:
                    writer = rocksdict.SstFileWriter(options=options.build(create=True, materialized=True))
                    writer.open(str(path))
                writer[key] = value
                raw += len(key) + len(value)
                it.next()
            it.status()
            exhausted = not it.valid()
        finally:
            del it  # a live iterator holds the database open
        if writer is None:
            return None, exhausted
        writer.finish()
        return Slice(seq=seq, state=state, last=last.hex(), raw=raw, keys=n), exhausted

    def uploaded(self, handles: list[FileHandle]) -> None:
        by_name = {h.local_name: h for h in handles}
        for s in self.slices:
            h = by_name.get(self.name_of(s))
            if h is not None:
                s.path, s.size, s.crc32, s.created_by = h.path, h.size, h.crc32, h.created_by
        self.save()

    # --- the switch --------------------------------------------------------------------------

    def build(self, options: RocksDBOptions) -> tuple[Path, dict[str, Slice]]:
        """Ingest every slice into a new database and take a native checkpoint of it: returns
        that directory and, for each SST in it, the slice it is (same bytes)."""
        built, final = self.dir / "built", self.dir / "final"
        _fresh(built)
        _fresh(final)
        states = list_states(str(self.dir / "snap"))
        db = open_db(str(built), states, options, create=True)
        names: dict[str, Slice] = {}
        try:
            opts = rocksdict.IngestExternalFileOptions()
            opts.set_move_files(True)
            for s in self.slices:
                link = built.parent / f"ingest-{s.seq}.sst"  # RocksDB moves the link, the slice stays
                link.unlink(missing_ok=True)
                os.link(self.dir / self.name_of(s), link)
                before = {n for n in os.listdir(built) if n.endswith(".sst")}
                db.get_column_family(s.state).ingest_external_file([str(link)], opts)
                link.unlink(missing_ok=True)
                new = {n for n in os.listdir(built) if n.endswith(".sst")} - before
                if len(new) != 1:
                    raise RuntimeError(f"ingesting {self.name_of(s)} added {sorted(new)} to {built}")
                names[new.pop()] = s
            rocksdict.Checkpoint(db).create_checkpoint(str(final))
        finally:
            db.close()
        for name, s in names.items():
            if (final / name).stat().st_size != s.size:
                raise RuntimeError(f"{final / name} is not the slice {self.name_of(s)} it was ingested from")
        return final, names


def _fresh(path: Path) -> None:
    """Nothing at `path`: a link is unlinked (never followed), a directory removed."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def _count_by_sample(db: Any, states: list[str], key_groups: tuple[int, int]) -> int:
    """The entries of `states`: those of the first eighth of the key groups (at least one),
    counted, times eight. Keyed state hashes evenly into key groups, so the sample is off by
    about 1/sqrt(its count); the slices aim 10% ahead of their pace for it."""
    first, last = key_groups
    groups = last - first + 1
    sampled = max(1, round(groups * SAMPLE))
    upper = (first + sampled).to_bytes(2, "big")
    total = 0
    for name in states:
        opts = scan_options(upper)  # held while the iterator lives: it reads the bound from it
        it = db.get_column_family(name).iter(opts)
        try:
            it.seek(first.to_bytes(2, "big"))
            n = 0
            while it.valid():
                n += 1
                it.next()
            it.status()
        finally:
            del it
        total += n
    return round(total * groups / sampled)
