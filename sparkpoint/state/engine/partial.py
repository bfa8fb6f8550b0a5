"""A subtask's state restored with only the SST files a key range needs: the others are placeholders.

Every key of a state starts with its key group (`sparkpoint.state.kinds.base`), and the MANIFEST
a checkpoint ships records each SST's level and its smallest and largest key. So the files that
can hold a key group are known before any of them is read: the level-0 files (each a flush of a
batch's writes: RocksDB opens every one of them for any iterator) and the files of the other
levels whose key range overlaps it. `restore` lays the checkpoint's SSTs out as placeholders
(sparse files of the recorded size: no bytes downloaded or written), downloads the other files
verified (MANIFEST, CURRENT, OPTIONS, and a changelog chain, replayed as a restore replays it),
opens the database (`RocksDBOptions(placeholders=True)`: RocksDB reads no SST at the open), asks
`choose` which files it needs from their ranges, and downloads those verified over their
placeholders.

A placeholder is zeros: RocksDB reading one meets no table magic number and reports corruption
(`rocksdb.is_corruption`), never data. The caller falls back to a whole restore then. Nothing
built on such a database may upload a placeholder: the snapshotter refuses any file it lists
(`Snapshotter.placeholders`), and any SST whose footer is not a table's (`is_table_file`).
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from sparkpoint.checkpoint.errors import OperatorStateMismatch, StateBackendError
from sparkpoint.checkpoint.files import download_verified
from sparkpoint.checkpoint.metadata import CheckpointMetadata, FileHandle, SubtaskStateHandle
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.state.engine.rocksdb import DEFAULT_CF, RocksDBOptions, list_states, open_db

if TYPE_CHECKING:
    from rocksdict import Rdict

    from sparkpoint.state.engine.localstate import LocalState

_FILE_NUMBER = re.compile(r"^\s*(\d+):", re.MULTILINE)  # a file of "rocksdb.sstables": " 12:3456[...]"
_TABLE_MAGIC = (0x88E241B785F4CFF7).to_bytes(8, "little")  # the last 8 bytes of every block-based table


class PartialRestoreRefused(StateBackendError):
    """This subtask's state cannot be restored in part (blob files, a rescaled range, files that
    can hold the keys making most of it): the caller restores it whole."""


class PlaceholderReached(StateBackendError):
    """A placeholder came near what is written: RocksDB did not rewrite a file that held an
    erased entry (a compaction that meets a placeholder fails without a word), the entries it
    moved differ, or a placeholder was about to be uploaded. Nothing was uploaded. `wanted`: per
    column family, the key ranges whose files a new attempt should download too (empty: restore
    the state whole instead); `downloaded_bytes`: what this attempt read."""

    def __init__(self, message: str, wanted: Mapping[str, list[tuple[bytes, bytes]]] | None = None,
                 downloaded_bytes: int = 0):
        super().__init__(message)
        self.wanted = dict(wanted or {})
        self.downloaded_bytes = downloaded_bytes


@dataclass(frozen=True)
class SstRange:
    """One live SST of a database as its MANIFEST records it: level and key range (`end` included)."""

    name: str  # its local name (000012.sst)
    column_family: str
    level: int
    start: bytes
    end: bytes
    size: int

    def overlaps(self, lower: bytes, upper: bytes) -> bool:
        """Whether its range meets [lower, upper)."""
        return self.start < upper and self.end >= lower


@dataclass(frozen=True)
class PartialRestore:
    """What `restore` did: the handle restored, every live SST's range (the flush of a replayed
    changelog chain too), the SSTs of the handle it downloaded and those left placeholders."""

    handle: SubtaskStateHandle
    ranges: Mapping[str, SstRange]
    fetched: frozenset[str]
    placeholders: frozenset[str]
    downloaded_bytes: int

    @property
    def real(self) -> list[SstRange]:
        """The live SSTs that are no placeholder, by name."""
        return [r for n, r in sorted(self.ranges.items()) if n not in self.placeholders]


def is_sst(f: FileHandle) -> bool:
    return f.local_name.endswith(".sst")


def refusal(handle: SubtaskStateHandle) -> str | None:
    """Why `handle` cannot be restored in part (None: it can)."""
    names = [f.local_name for f in handle.files()]
    if any(n.endswith(".blob") for n in names):
        return "its state has blob files"
    return None


def ranges_of(db: Rdict, column_families: Iterable[str]) -> dict[str, SstRange]:
    """Every live SST of `db` (of `column_families`, "default" too) by local name, from its MANIFEST
    (no SST is read)."""
    family: dict[int, str] = {}
    for name in {DEFAULT_CF, *column_families}:
        cf = db if name == DEFAULT_CF else db.get_column_family(name)
        listing = cf.property_value("rocksdb.sstables") or ""
        family.update((int(number), name) for number in _FILE_NUMBER.findall(listing))
        del cf
    out = {}
    for f in db.live_files():
        name = str(f["name"]).lstrip("/")
        number = int(name.split(".")[0])
        if number not in family:
            raise StateBackendError(f"RocksDB lists {name} in no column family of {sorted(column_families)}")
        out[name] = SstRange(name, family[number], int(f["level"]), bytes(f["start_key"]), bytes(f["end_key"]),
                             int(f["size"]))
    return out


def needed(ranges: Iterable[SstRange], spans: Iterable[tuple[bytes, bytes]]) -> set[str]:
    """The files a read of `spans` ([lower, upper) each) can touch: every level-0 file, and the
    files of the other levels whose range overlaps a span."""
    spans = list(spans)
    return {r.name for r in ranges if r.level == 0 or any(r.overlaps(lo, hi) for lo, hi in spans)}


def lay_out(storage: CheckpointStorage, handle: SubtaskStateHandle, checkpoint_id: int, target: Path) -> int:
    """`handle`'s files in the new directory `target`: the small ones downloaded and verified, a
    placeholder for each SST. Returns the bytes downloaded."""
    small = replace(handle, shared=tuple(f for f in handle.shared if not is_sst(f)),
                    private=tuple(f for f in handle.private if not is_sst(f)))
    downloaded = download_verified(storage, small, checkpoint_id, target)
    for f in handle.files():
        if is_sst(f):
            with open(target / f.local_name, "wb") as out:
                out.truncate(f.size)
    return downloaded


def fetch(storage: CheckpointStorage, handle: SubtaskStateHandle, checkpoint_id: int, names: Iterable[str],
          directory: Path) -> int:
    """Download `names` of `handle`'s SSTs verified and put each over its placeholder in `directory`."""
    wanted = set(names)
    files = tuple(f for f in handle.files() if f.local_name in wanted)
    if not files:
        return 0
    scratch = directory.parent / f"download-{uuid.uuid4().hex[:8]}"
    # download_verified checks a RocksDB directory's shape: the small files ride along (a few KB)
    small = tuple(f for f in handle.files() if not is_sst(f))
    try:
        downloaded = download_verified(storage, replace(handle, shared=files + small, private=()), checkpoint_id,
                                       scratch)
        for f in files:
            os.replace(scratch / f.local_name, directory / f.local_name)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return downloaded - sum(f.size for f in small)


def restore(local: LocalState, storage: CheckpointStorage, checkpoint: CheckpointMetadata,
            choose: Callable[[Mapping[str, SstRange]], set[str]]) -> PartialRestore:
    """Make `local`'s working database `checkpoint`'s state of its subtask with only the SSTs
    `choose` names (from every SST's range) downloaded; its options must say `placeholders`. A
    changelog chain is downloaded whole and replayed (its entries flushed into level-0 files)."""
    if not local.options.placeholders:
        raise ValueError("a partial restore opens its database with RocksDBOptions(placeholders=True)")
    op = checkpoint.operators.get(local.operator)
    if op is None:
        raise OperatorStateMismatch(f"checkpoint {checkpoint.checkpoint_id} holds no state of {local.operator!r}")
    handles = [h for h in op.subtasks if h.key_group_range == local.key_group_range]
    if len(handles) != 1 or op.max_parallelism != local.max_parallelism:
        raise PartialRestoreRefused(f"{local.operator} subtask {local.subtask}'s key-group range is not one subtask "
                                    f"of checkpoint {checkpoint.checkpoint_id}")
    handle = handles[0]
    why = refusal(handle)
    if why:
        raise PartialRestoreRefused(f"{local.operator} subtask {local.subtask} of checkpoint "
                                    f"{checkpoint.checkpoint_id}: {why}")
    cid = checkpoint.checkpoint_id
    local.dir.mkdir(parents=True, exist_ok=True)
    local.forget_working()
    local.drop_local_checkpoints(keep=set())
    target = local.dir / f"download-{uuid.uuid4().hex[:8]}"
    try:
        downloaded = lay_out(storage, handle, cid, target)
        local.install(target, handle, cid)
    finally:
        shutil.rmtree(target, ignore_errors=True)
    assert local.db is not None
    ranges = ranges_of(local.db, local.state_names())
    chosen = choose(ranges)
    unknown = chosen - set(ranges)
    if unknown:
        raise ValueError(f"not live SSTs of the database: {sorted(unknown)}")
    local.close()
    downloaded += fetch(storage, handle, cid, chosen, local.db_path)
    local.open_db()
    ssts = {f.local_name for f in handle.files() if is_sst(f)}
    return PartialRestore(handle, ranges, frozenset(chosen & ssts), frozenset(ssts - chosen), downloaded)


def read_ranges(storage: CheckpointStorage, handle: SubtaskStateHandle, checkpoint_id: int, work: Path
                ) -> dict[str, SstRange]:
    """Every SST of `handle` with its level and key range, from its MANIFEST: no SST is downloaded."""
    target = work / f"ranges-{uuid.uuid4().hex[:8]}"
    try:
        lay_out(storage, handle, checkpoint_id, target)
        db = open_db(str(target), [], RocksDBOptions(placeholders=True), create=False, read_only=True)
        try:
            return ranges_of(db, list_states(str(target)))
        finally:
            db.close()
    finally:
        shutil.rmtree(target, ignore_errors=True)


def is_table_file(path: Path) -> bool:
    """Whether `path` ends as a block-based table does (a placeholder is zeros)."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() < len(_TABLE_MAGIC):
            return False
        f.seek(-len(_TABLE_MAGIC), os.SEEK_END)
        return f.read() == _TABLE_MAGIC
