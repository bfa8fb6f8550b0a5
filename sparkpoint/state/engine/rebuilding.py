"""The RocksDB steps of a restore, on files already verified against `_metadata`: replaying a
changelog chain into a database, opening an old subtask's files while rescaling, clipping a
database to a key-group range and merging another database's range into it. The local state
(`localstate`) runs them; the restorer (`restoring`) decides which, and never touches RocksDB.

Files that match `_metadata` and that RocksDB reports as corrupt are a bad checkpoint, not a bad
backend: CheckpointCorrupted, and the caller falls back to an older checkpoint. Any other refusal
(a lock held by another process, too many open files, an I/O error of the local disk) is this
machine's: LocalStateError, the task fails and is retried, and no checkpoint or output is touched
(DESIGN rule 10).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from sparkpoint.checkpoint.errors import CheckpointCorrupted, LocalStateError, StateBackendError
from sparkpoint.checkpoint.metadata import SubtaskStateHandle
from sparkpoint.lazy import lazy_module
from sparkpoint.state.engine import changelog
from sparkpoint.state.engine.changelog import ChangelogFormatError
from sparkpoint.state.engine.rocksdb import (
    RocksDBOptions,
    ensure_column_families,
    flush_all,
    is_corruption,
    list_states,
    open_db,
    scan_options,
)
from sparkpoint.state.kinds.base import SIDECAR_KEYS

if TYPE_CHECKING:
    import rocksdict
    from rocksdict import Rdict
else:
    rocksdict = lazy_module("rocksdict")

_MERGE_BATCH = 10_000


def replay_chain(db: Rdict, db_path: Path, source: Path, handle: SubtaskStateHandle, checkpoint_id: int,
                 options: RocksDBOptions, who: str) -> None:
    """Replay `handle`'s changelog chain (its files in `source`) into `db`, in checkpoint order, and
    flush: the marker written next says db/ is the checkpoint, which holds only once the replayed
    entries are in SSTs (there is no WAL)."""
    chain = sorted(f.local_name for f in handle.files() if changelog.is_changelog(f.local_name))
    if not chain:
        return
    ensure = lambda names: ensure_column_families(db, str(db_path), names, options)  # noqa: E731
    limit = changelog.raw_limit(sum(f.size for f in handle.files()))
    try:
        for name in chain:
            changelog.replay(db, source / name, ensure, max_raw=limit)
    except ChangelogFormatError as e:
        raise CheckpointCorrupted(
            f"checkpoint {checkpoint_id} cannot be restored: the changelog of {who} does not decode "
            f"although it matches _metadata ({e}); run `sparkpoint verify`",
            checkpoint_id=checkpoint_id,
        ) from e
    flush_all(db, list_states(str(db_path)))


def replay_in_place(source: Path, handle: SubtaskStateHandle, checkpoint_id: int, options: RocksDBOptions,
                    who: str, refused: Callable[[int | None, BaseException], LocalStateError]) -> None:
    """Apply a rescale source's changelog chain to its own (scratch) directory."""
    if not any(changelog.is_changelog(f.local_name) for f in handle.files()):
        return
    db = open_source(source, options, checkpoint_id, refused, read_only=False)
    try:
        replay_chain(db, source, source, handle, checkpoint_id, options, who)
    finally:
        db.close()


def open_source(source: Path, options: RocksDBOptions, checkpoint_id: int | None,
                refused: Callable[[int | None, BaseException], LocalStateError], *, read_only: bool) -> Rdict:
    """An old subtask's verified directory, opened while rescaling."""
    try:
        return open_db(str(source), [], options, create=False, read_only=read_only)
    except StateBackendError as e:
        if not is_corruption(e):
            raise refused(checkpoint_id, e) from e
        raise CheckpointCorrupted(f"RocksDB refuses a verified subtask directory while rescaling: {e}") from e


def clip(db: Rdict, names: list[str], lower: bytes, upper: bytes) -> None:
    """Delete every entry of the named states outside the key bytes [lower, upper)."""
    for name in names:
        cf = db.get_column_family(name)
        if lower > b"\x00\x00":
            cf.delete_range(b"\x00\x00", lower)
        if upper < b"\x80":  # key groups stop at 0x7fff
            cf.delete_range(upper, b"\x80")


def merge_range(db: Rdict, other: Rdict, names: list[str], lower: bytes, upper: bytes) -> None:
    """Copy the entries of `other`'s named states within [lower, upper), and their sidecar keys, into
    `db` (which has the states' column families)."""
    for name in names:
        handle = db.get_column_family_handle(name)
        opts = scan_options(upper)  # held while the iterator lives: it reads the bound from it
        it = other.get_column_family(name).iter(opts)
        try:
            it.seek(lower)
            batch, n = rocksdict.WriteBatch(raw_mode=True), 0
            while it.valid():
                batch.put(it.key(), it.value(), handle)
                n += 1
                if n % _MERGE_BATCH == 0:
                    db.write(batch)
                    batch = rocksdict.WriteBatch(raw_mode=True)
                it.next()
            it.status()
        finally:
            del it  # a live iterator holds `other` open, even from a traceback
        # A state's format key (its entries carry TTL stamps) lies beyond every key group:
        # the database we grew from may lack the state, or the key, altogether.
        for sidecar in SIDECAR_KEYS:
            stamped = other.get_column_family(name).get(sidecar)
            if stamped is not None:
                batch.put(sidecar, stamped, handle)
        db.write(batch)
