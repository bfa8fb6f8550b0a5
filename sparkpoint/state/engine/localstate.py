"""One subtask's local RocksDB state: its directory, the working database and its column
families, the marker that says which checkpoint the working database holds, the task-local copies
of checkpoints and their clean-up. The restorer and the snapshotter work on it; the backend
holds all three.

Local layout, under `<local_dir>/<job_id>/<operator>/<subtask>/`:

    db/            the working database
    chk-<N>/       RocksDB native checkpoint N (hard links): pending until confirmed; the latest
                   confirmed one stays as the task-local copy for local recovery
    working.json   written right after snapshot N: "db/ holds exactly checkpoint N"; removed by
                   the first write after it. A later process that is told N completed reopens
                   db/ as it is, with no copy at all.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import threading
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sparkpoint.checkpoint.crash import crash_point
from sparkpoint.checkpoint.errors import CheckpointCorrupted, LocalStateError, StateBackendError
from sparkpoint.checkpoint.interleave import storage_step
from sparkpoint.checkpoint.metadata import KeyGroupRange, SubtaskStateHandle
from sparkpoint.checkpoint.paths import checkpoint_id_of_dir
from sparkpoint.checkpoint.storage import fsync_dir
from sparkpoint.lazy import lazy_module
from sparkpoint.state.engine import changelog, staging
from sparkpoint.state.engine.changelog import ChangeLog
from sparkpoint.state.engine.localfiles import write_replacing
from sparkpoint.state.engine.rebuilding import clip, merge_range, open_source, replay_chain, replay_in_place
from sparkpoint.state.engine.restore import materialize
from sparkpoint.state.engine.rocksdb import (
    EXACT_UP_TO,
    RocksDBOptions,
    compact_all,
    ensure_column_families,
    entry_count,
    flush_all,
    is_corruption,
    list_states,
    open_db,
)
from sparkpoint.state.engine.stores import ColumnFamilyStore
from sparkpoint.state.kinds.base import key_group_bounds

if TYPE_CHECKING:
    import rocksdict
    from rocksdict import Rdict
else:
    rocksdict = lazy_module("rocksdict")

log = logging.getLogger(__name__)

MARKER = "working.json"
# Present while the confirmed base's RocksDB files may be another database's than db/ (a
# materialization in steps switched to a database built from its slices): a snapshot of db/ then
# reuses no file of the base by name. Gone once db/ is rebuilt from a checkpoint's files, or a
# snapshot of db/'s own files is confirmed.
SWITCHED = "base-built-elsewhere"
_TRASH = "trash-"  # a local directory on its way out (`_delete_in_background`)


def handle_digest(handle: SubtaskStateHandle) -> str:
    """Identifies one acknowledged snapshot: same digest, same files."""
    parts = sorted(f"{f.path}:{f.size}:{f.crc32}" for f in handle.stored())
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def marker_for(checkpoint_id: int, handle: SubtaskStateHandle, job_url: str) -> dict[str, Any]:
    """What `working.json` says when db/ holds exactly `handle` of checkpoint `checkpoint_id` of job `job_url`."""
    return {"job": job_url, "checkpoint_id": checkpoint_id, "digest": handle_digest(handle)}


class LocalState:
    """The local files and the RocksDB instance of one (operator, subtask) over its key-group range.

    `log` is the subtask's changelog (None: it keeps none); every write through a `store` goes to it.
    It is the `StateStores` the subtask's states are opened over, and the `RestoreTarget` the
    restorer makes into a checkpoint's state.
    """

    def __init__(self, directory: Path, *, operator: str, subtask: int, key_group_range: KeyGroupRange,
                 max_parallelism: int, options: RocksDBOptions, log: ChangeLog | None):
        self.dir = directory
        self.operator = operator
        self.subtask = subtask
        self.key_group_range = key_group_range
        self.max_parallelism = max_parallelism
        self.options = options
        self.log = log
        self.db: Rdict | None = None
        self.clean = False  # db/ equals the checkpoint named in working.json

    def __repr__(self) -> str:
        return f"RocksDBStateBackend({self.operator}/{self.subtask}, kg={self.key_group_range}, dir={self.dir})"

    @property
    def db_path(self) -> Path:
        return self.dir / "db"

    def copy_dir(self, checkpoint_id: int | None) -> Path:
        """Where the task-local copy of a checkpoint lives (`chk-<N>/`)."""
        return self.dir / f"chk-{checkpoint_id}"

    # --- the working database ----------------------------------------------------------------

    def open_db(self, *, create: bool = False) -> Rdict:
        if self.db is None:
            if not create and not self.db_path.exists():
                raise StateBackendError(f"{self}: call restore() first (with None to start empty)")
            groups = self.key_group_range.end - self.key_group_range.start + 1
            self.db = open_db(str(self.db_path), [], self.options, create=create, key_groups=groups)
        return self.db

    def state_names(self) -> list[str]:
        return list_states(str(self.db_path)) if self.db_path.exists() else []

    def ensure_states(self, names: list[str]) -> None:
        """Create the column families of the named states that the working database lacks."""
        ensure_column_families(self.open_db(), str(self.db_path), names, self.options)

    def store(self, name: str) -> ColumnFamilyStore:
        """State `name`'s column family as a `StateStore`: its writes mark db/ changed and go to the changelog."""
        return ColumnFamilyStore(self.open_db(), name, on_write=self.before_write, log=self.log)

    def entry_count(self, name: str, *, exact_up_to: int = EXACT_UP_TO) -> int:
        """State `name`'s entries: counted up to `exact_up_to`, RocksDB's estimate beyond (`rocksdb.entry_count`)."""
        return entry_count(self.open_db().get_column_family(name), exact_up_to=exact_up_to)

    def flush(self) -> list[str]:
        """Flush every state's memtable (db/ on disk is then the state now); returns the states' names."""
        names = self.state_names()
        flush_all(self.open_db(), names)
        return names

    def native_checkpoint(self, target: Path) -> None:
        """A RocksDB checkpoint of db/ into `target`: hard links to its SSTs, copies of the rest."""
        rocksdict.Checkpoint(self.open_db()).create_checkpoint(str(target))

    def live_bytes(self) -> int:
        """The bytes of db/'s live SST files (flushed: the state now)."""
        return sum(int(f["size"]) for f in self.open_db().live_files())

    def oldest_run_bytes(self) -> int:
        """The bytes of db/'s oldest sorted run: its SSTs on the deepest level, where a full
        compaction puts the whole state below the newer runs since (whose overwritten entries it
        drops); with every SST still on level 0 (each a run of its own), the largest."""
        files = self.open_db().live_files()
        deepest = max((int(f["level"]) for f in files), default=0)
        if deepest == 0:
            return max((int(f["size"]) for f in files), default=0)
        return sum(int(f["size"]) for f in files if int(f["level"]) == deepest)

    def compact(self) -> None:
        db = self.open_db()
        self.before_write()
        compact_all(db, self.state_names())

    def close(self) -> None:
        """Close db/ (flushed, and every store released, by the caller)."""
        if self.db is not None:
            self.db.close()
            self.db = None

    def close_unflushed(self) -> None:
        """Close db/ without flushing anything: it is about to be thrown away."""
        if self.db is not None:
            db, self.db = self.db, None
            try:
                db.close()
            except Exception as e:  # noqa: BLE001  rocksdict raises bare Exception; the files go anyway
                log.warning("closing the corrupt database of %s: %s", self, e)

    def forget_log(self) -> None:
        if self.log is not None:
            self.log.clear()

    # --- the RocksDB steps of a restore (the restorer decides which) -------------------------------

    def open_working(self) -> None:
        """Open db/ as it is: its marker names the checkpoint being restored."""
        self.open_db()
        self.clean = True

    def create_empty(self) -> None:
        self.open_db(create=True)

    def install(self, source: Path, handle: SubtaskStateHandle, checkpoint_id: int) -> None:
        """Make db/ the state of `handle` from its verified files in `source`: the materialized
        RocksDB files, then the changelog chain replayed in checkpoint order."""
        names = [f.local_name for f in handle.files()]
        materialize(source, self.db_path, [n for n in names if not changelog.is_changelog(n)])
        crash_point("mid-restore")
        db = self._open_restored(checkpoint_id)
        try:
            replay_chain(db, self.db_path, source, handle, checkpoint_id, self.options, self._who)
        except CheckpointCorrupted:
            self.close()
            self.forget_working()
            raise

    def install_rescaled(self, sources: list[Path], handles: list[SubtaskStateHandle], checkpoint_id: int) -> None:
        """Make db/ this key-group range of old subtasks' verified files (`handles`, each in the
        directory of `sources` at its index; Flink's rescaling): the first grows into db/, clipped to
        the range, and each other's entries in the range are merged in."""
        self.install(sources[0], handles[0], checkpoint_id)
        db = self.open_db()
        for source, h in zip(sources[1:], handles[1:]):
            replay_in_place(source, h, checkpoint_id, self.options, self._who, self._refused)
        lower, upper = key_group_bounds(self.key_group_range)
        clip(db, self.state_names(), lower, upper)
        for source in sources[1:]:
            other = open_source(source, self.options, None, self._refused, read_only=True)
            try:
                names = list_states(str(source))
                self.ensure_states(names)
                merge_range(db, other, names, lower, upper)
            finally:
                other.close()
        compact_all(db, self.state_names())  # drop the clipped ranges before the first upload

    @property
    def _who(self) -> str:
        return f"{self.operator} subtask {self.subtask}"

    def _open_restored(self, checkpoint_id: int) -> Rdict:
        """db/ of verified files: RocksDB's refusal is a bad checkpoint when it reports corruption,
        else this machine's trouble (`rebuilding`)."""
        try:
            return self.open_db()
        except StateBackendError as e:
            if not is_corruption(e):
                raise self._refused(checkpoint_id, e) from e
            self.forget_working()
            raise CheckpointCorrupted(
                f"checkpoint {checkpoint_id} cannot be restored: RocksDB refuses the files of {self.operator} "
                f"subtask {self.subtask} although they match _metadata ({e}); run `sparkpoint verify` to find a "
                "checkpoint that verifies",
                checkpoint_id=checkpoint_id,
            ) from e

    def _refused(self, checkpoint_id: int | None, error: BaseException) -> LocalStateError:
        """RocksDB cannot open this subtask's files for a reason that is not corruption."""
        which = f" for checkpoint {checkpoint_id}" if checkpoint_id is not None else ""
        return LocalStateError(
            f"RocksDB cannot open the local state of {self.operator} subtask {self.subtask}{which}, "
            f"for a reason that is not corruption ({error}); the task fails and is retried, and "
            "every checkpoint and its output are kept. Look at the local disk of this machine (space, open-file "
            "limit, another process holding the database)"
        )

    # --- the marker: which checkpoint db/ holds ------------------------------------------------

    def before_write(self) -> None:
        # The first write after a snapshot makes db/ differ from that checkpoint. The unlink is
        # made durable before the write: RocksDB may persist an SST of this batch at any moment.
        if self.clean:
            self.clean = False
            (self.dir / MARKER).unlink(missing_ok=True)
            fsync_dir(str(self.dir))

    def holds(self, checkpoint_id: int, handle: SubtaskStateHandle, job_url: str) -> bool:
        """Whether working.json says db/ is exactly `handle` of checkpoint `checkpoint_id`."""
        return self._read_marker() == marker_for(checkpoint_id, handle, job_url) and self.db_path.is_dir()

    def _read_marker(self) -> dict[str, Any] | None:
        try:
            data = json.loads((self.dir / MARKER).read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def write_marker(self, checkpoint_id: int, handle: SubtaskStateHandle, job_url: str) -> None:
        write_replacing(self.dir / MARKER, json.dumps(marker_for(checkpoint_id, handle, job_url)).encode())
        self.clean = True

    @property
    def switched(self) -> bool:
        """Whether the confirmed base's RocksDB files are another database's than db/ (`SWITCHED`)."""
        return (self.dir / SWITCHED).exists()

    def mark_switched(self, checkpoint_id: int) -> None:
        write_replacing(self.dir / SWITCHED, str(checkpoint_id).encode())

    def unmark_switched(self) -> None:
        (self.dir / SWITCHED).unlink(missing_ok=True)

    # --- local files ---------------------------------------------------------------------------

    def forget_working(self) -> None:
        """db/ no longer counts as any checkpoint: the marker goes, and db/ is moved out of the way."""
        (self.dir / MARKER).unlink(missing_ok=True)
        self.unmark_switched()  # the next db/ is made from a checkpoint's files
        self.clean = False
        if self.db_path.exists():
            # Out of the way at once, deleted in the background: freeing the blocks of a working
            # database that ran ahead (a compaction's fresh output) took 0.5 s per GB measured,
            # on the critical path of every restore that cannot reuse it.
            trash = self.dir / f"{_TRASH}{uuid.uuid4().hex[:8]}"
            self.db_path.rename(trash)
            _delete_in_background(trash)

    def discard(self) -> None:
        """Forget db/, every task-local copy and any materialization in steps (`staging`: made of
        the same files), without flushing anything (the caller released every store first)."""
        self.close_unflushed()
        self.forget_working()
        self.drop_local_checkpoints(keep=set())
        # A materialization in steps going on: its snapshot is hard links to db/'s SSTs of then,
        # and its slices were read from them. Kept, the next snapshot would read the same bad
        # block again, and every checkpoint after it fail the same way.
        staging.drop_all(self.dir)

    def drop_local_checkpoints(self, *, keep: set[int]) -> None:
        for entry in self.dir.iterdir() if self.dir.exists() else []:
            cid = checkpoint_id_of_dir(entry.name)
            if cid is not None and cid not in keep:
                storage_step("delete", str(entry))  # a task-local copy
                shutil.rmtree(entry, ignore_errors=True)

    def drop_leftovers(self) -> None:
        """Scratch directories of a process that died mid-restore."""
        for entry in self.dir.iterdir():
            if entry.name.startswith(_TRASH):
                _delete_in_background(entry)
            elif entry.name.startswith(("download-", "rescale-")) or ".tmp-" in entry.name:
                shutil.rmtree(entry, ignore_errors=True)


_deleting: set[Path] = set()


_deleting_lock = threading.Lock()


def _delete_in_background(path: Path) -> None:
    """Delete the directory `path` on a daemon thread, once per process. One left over by a process
    that died first is found by the next restore (`drop_leftovers`)."""
    with _deleting_lock:
        if path in _deleting:
            return
        _deleting.add(path)

    def delete() -> None:
        try:
            if path.is_symlink():  # the link goes, never what it points to
                path.unlink(missing_ok=True)
            shutil.rmtree(path, ignore_errors=True)
        finally:
            with _deleting_lock:
                _deleting.discard(path)

    threading.Thread(target=delete, name=f"sparkpoint-delete-{path.name}", daemon=True).start()
