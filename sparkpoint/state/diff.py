"""The state of one operator in two snapshots, compared key by key (`sparkpoint diff`, `diff_state`).

Two ways, the first whenever it is correct:

- **changed files**: both snapshots are checkpoints of one job directory with the same key-group
  layout and share files. A key can differ only if it has an entry (a put, a delete, or under a
  range delete) in a file one snapshot lists and the other does not: the SSTs and changelog
  files that differ. Those files alone are read whole (`sstfile`, `changelog`); the files both
  list are only opened by RocksDB for point reads of those keys, from a verified task-local copy
  when the job's local directory holds one (else downloaded once, for both sides). Each side's
  entries of the keys found are copied into a small scratch database, which the operator's own
  `export` turns into rows, and those rows are compared.
- **full**: anything else (a savepoint or another job's checkpoint: no shared files; a rescale:
  another key-group layout; a state with a TTL, whose entries expire without any write; a
  snapshot without state declarations; an SST this reader does not know). Both snapshots are
  exported whole and compared. Always correct, it costs two exports.

Each side is read through the operator's code as a restore by that code reads it: its declared
states opened as declared (`state.declared(name)` works in `export`), each in the fields that
side recorded (a `RecordCodec`'s entries rewritten in the code's fields, as the restore migrates
them). A diff across an upgrade thus compares both snapshots in the newer version's shape; code
that cannot restore a side (an older version that would narrow a field) is refused, saying so.

The result has the export's columns and `change` (`added`, `removed`, `changed`). Each row is as
the snapshot that has it shows it: `to` for added and changed rows, `from` for removed ones;
changed rows also carry their `from` values in `<column>_old` (null on other rows). Rows are
identified by the operator's key column (else the export's first column); when that column is
not unique in an export, whole rows are compared and no row is `changed`.
"""

from __future__ import annotations

import math
import os
import shutil
import struct
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import pandas as pd
from rocksdict import Rdict, WriteBatch

from sparkpoint.checkpoint.catalog import existing_store, load_checkpoint_at
from sparkpoint.checkpoint.errors import CheckpointCorrupted, CheckpointNotFound, SparkpointError
from sparkpoint.checkpoint.files import check_handle_shape, mismatch
from sparkpoint.checkpoint.metadata import CheckpointMetadata, FileHandle, SubtaskStateHandle
from sparkpoint.checkpoint.paths import checkpoint_id_of_dir, is_changelog_name
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.state.backend import RocksDBStateBackend
from sparkpoint.state.engine import changelog
from sparkpoint.state.engine.changelog import ChangelogFormatError
from sparkpoint.state.engine.restore import local_copy_matches, materialize
from sparkpoint.state.engine.rocksdb import RocksDBOptions, ensure_column_families, list_states, open_db, scan_options
from sparkpoint.state.engine.sstfile import SstFormatError, read_sst_keys
from sparkpoint.state.extract import export_table, operator_state_of, operator_states
from sparkpoint.state.kinds.base import next_prefix
from sparkpoint.state.operators import KeyedOperator
from sparkpoint.state.schema import StateSchemaIncompatible
from sparkpoint.state.timers import TIMERS

CHANGES = ("added", "removed", "changed")
CHANGED_FILES, FULL = "changed files", "full"
_LEN = struct.Struct(">I")
_SIDECAR = b"\xff\xff"
_PREFIXED_KINDS = ("map", "list")  # kg | len(key) | key | ...
_PLAIN_KINDS = ("value", "reducing")  # kg | key


@dataclass(frozen=True)
class Snapshot:
    """One side of a diff: a completed checkpoint or savepoint and the job directory it lives in."""

    storage: CheckpointStorage
    meta: CheckpointMetadata

    @property
    def url(self) -> str:
        return f"{self.storage.job_url}/{self.meta.directory}"


@dataclass
class StateDiff:
    """What `diff_snapshots` found, and what it read to find it."""

    table: pd.DataFrame
    operator: str
    source: Snapshot
    target: Snapshot
    method: str  # CHANGED_FILES | FULL
    reason: str  # why FULL (empty for CHANGED_FILES)
    bytes_read: int = 0  # downloaded from checkpoint storage
    bytes_local: int = 0  # hard-linked from verified task-local copies instead
    bytes_scanned: int = 0  # read whole to find the keys that may differ (CHANGED_FILES)
    changed_bytes: int = 0  # of the SSTs and changelog files one snapshot lists and the other does not
    shared_bytes: int = 0  # of the files both list
    candidate_keys: int = 0  # keys looked up in both (CHANGED_FILES)
    seconds: float = 0.0

    def counts(self) -> dict[str, int]:
        change = self.table["change"] if "change" in self.table else pd.Series([], dtype=object)
        return {c: int((change == c).sum()) for c in CHANGES}

    def summary(self) -> dict[str, Any]:
        """The diff's facts as plain data (the CLI's JSON, without the rows)."""
        return {
            "operator": self.operator,
            "from": {"checkpoint_id": self.source.meta.checkpoint_id, "kind": self.source.meta.kind,
                     "url": self.source.url},
            "to": {"checkpoint_id": self.target.meta.checkpoint_id, "kind": self.target.meta.kind,
                   "url": self.target.url},
            "method": self.method, "reason": self.reason, "changes": self.counts(),
            "bytes_read": self.bytes_read, "bytes_local": self.bytes_local, "bytes_scanned": self.bytes_scanned,
            "changed_bytes": self.changed_bytes, "shared_bytes": self.shared_bytes,
            "candidate_keys": self.candidate_keys, "seconds": round(self.seconds, 3),
        }


def locate(ref: int | str, storage: CheckpointStorage | None, storage_options: dict[str, Any] | None = None
           ) -> Snapshot:
    """A snapshot named by a checkpoint id of `storage`'s job, or by the URL of a checkpoint or
    savepoint directory (`<checkpoints-dir>/<job-id>/chk-<N>`, or its `_metadata`)."""
    text = str(ref).strip()
    if isinstance(ref, int) or text.isdigit() or (text.startswith("chk-") and "/" not in text):
        cid = int(text.removeprefix("chk-"))
        if storage is None:
            raise CheckpointNotFound(f"checkpoint id {text} needs the job's storage (or give a checkpoint URL)")
        return Snapshot(storage, existing_store(storage).load(cid))
    located = load_checkpoint_at(text, storage_options if storage_options is not None else (
        storage.storage_options if storage is not None else None))
    if located.storage is None:
        raise CheckpointNotFound(
            f"{text!r} is not laid out as <checkpoints-dir>/<job-id>/chk-<N>: its files cannot be found")
    return Snapshot(located.storage, located.meta)


def diff_snapshots(
    source: Snapshot, target: Snapshot, operator: KeyedOperator, *, local_dir: str | os.PathLike[str] | None = None,
    work_dir: str | None = None, method: str | None = None,
) -> StateDiff:
    """The rows of `operator`'s export that differ from `source` to `target` (see the module).

    `local_dir` is the job's local directory: its verified task-local copies stand in for
    downloads. `method` forces FULL (or CHANGED_FILES, which raises when it cannot be used).
    Raises StateSchemaIncompatible when `operator`'s declared states cannot read a side."""
    started = time.monotonic()
    operator_state_of(source.meta, operator.uid)  # an operator one side lacks is named, with what it has
    operator_state_of(target.meta, operator.uid)
    reason = "forced" if method == FULL else cheap_path_refusal(source, target, operator.uid)
    scratch = Path(tempfile.mkdtemp(prefix="sparkpoint-diff-", dir=work_dir))
    try:
        result = None
        if reason is None:
            try:
                result = _by_changed_files(source, target, operator, scratch, local_dir)
            except (SstFormatError, ChangelogFormatError, _Refused) as e:
                reason = f"the changed files cannot be read key by key ({e})"
        if result is None:
            if method == CHANGED_FILES:
                raise SparkpointError(f"the diff cannot go by changed files: {reason}")
            result = _full(source, target, operator, scratch, reason or "")
    except StateSchemaIncompatible as e:
        raise StateSchemaIncompatible(
            f"{e}. The diff reads both snapshots through {operator.name}'s code, each in the fields it recorded, "
            "as a restore does: give code that restores both (across an upgrade, the newer version)") from e
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    result.seconds = time.monotonic() - started
    return result


class _Refused(Exception):
    """The changed-files path meets something it cannot decide on its own."""


def cheap_path_refusal(source: Snapshot, target: Snapshot, operator: str) -> str | None:
    """Why the changed-files path does not apply (None: it does)."""
    a, b = source.meta.operators[operator], target.meta.operators[operator]
    if source.storage.job_url != target.storage.job_url:
        return "the snapshots live in different job directories (a savepoint, or another job): they share no file"
    if a.max_parallelism != b.max_parallelism or [h.key_group_range for h in a.subtasks] != [
            h.key_group_range for h in b.subtasks]:
        return "the key-group layout differs (a rescale)"
    if not {f.path for h in a.subtasks for f in h.files()} & {f.path for h in b.subtasks for f in h.files()}:
        return "the snapshots share no file"
    for h in [*a.subtasks, *b.subtasks]:
        states = (h.facts or {}).get("states")
        if not isinstance(states, dict):
            return f"chk-{h.checkpoint_id} records no state declarations (written before sparkpoint recorded them)"
        for name, declared in states.items():
            if isinstance(declared, dict) and declared.get("ttl"):
                return f"state {name!r} has a TTL: its entries expire without a write"
            if not isinstance(declared, dict) or declared.get("kind") not in (*_PREFIXED_KINDS, *_PLAIN_KINDS):
                return f"state {name!r} is of a kind the diff cannot read key by key"
    return None


# --- full: export both, compare -------------------------------------------------------------------


def _full(source: Snapshot, target: Snapshot, op: KeyedOperator, scratch: Path, reason: str) -> StateDiff:
    tables = []
    read = 0
    for side in (source, target):
        handles = side.meta.operators[op.uid].subtasks
        read += sum(f.size for h in handles for f in h.files())
        with operator_states(side.storage, side.meta, op.uid, work_dir=str(scratch), code=op) as backends:
            tables.append(export_table(op, backends))
    return StateDiff(compare_tables(tables[0], tables[1], _key_column(op, *tables)), op.name, source, target, FULL,
                     reason, bytes_read=read)


# --- changed files ----------------------------------------------------------------------------------


class _Files:
    """Each file of one job directory on local disk once, for both sides: a hard link of a verified
    task-local copy when there is one, else a verified download."""

    def __init__(self, storage: CheckpointStorage, directory: Path, local: dict[str, Path]):
        self.storage, self.dir, self.local = storage, directory, local
        self.have: dict[str, Path] = {}
        self.downloaded = self.linked = 0
        directory.mkdir(parents=True)

    def fetch(self, files: Iterable[FileHandle], checkpoint_id: int) -> None:
        wanted = {f.path: f for f in files if f.path not in self.have}
        pulls = []
        for f in wanted.values():
            target = self.dir / f"{len(self.have)}-{f.local_name}"
            copy = self.local.get(f.path)
            if copy is not None and _link(copy, target) and target.stat().st_size == f.size:
                self.have[f.path] = target
                self.linked += f.size
                continue
            target.unlink(missing_ok=True)
            self.have[f.path] = target
            pulls.append((f, target))
        if not pulls:
            return
        try:
            written = self.storage.download([(f.path, str(t)) for f, t in pulls])
        except FileNotFoundError as e:
            raise CheckpointCorrupted(f"checkpoint {checkpoint_id}: a file it lists is missing ({e}); run "
                                      "`sparkpoint verify`", checkpoint_id=checkpoint_id) from e
        for (f, _), (size, crc) in zip(pulls, written):
            problem = mismatch(f, size, (lambda known: lambda: known)(crc))
            if problem:
                raise CheckpointCorrupted(f"checkpoint {checkpoint_id}: {f.path} {problem}; run `sparkpoint verify`",
                                          checkpoint_id=checkpoint_id, path=f.path)
            self.downloaded += f.size

    def __getitem__(self, f: FileHandle) -> Path:
        return self.have[f.path]


def _link(source: Path, target: Path) -> bool:
    try:
        os.link(source, target)
    except OSError:
        try:
            shutil.copyfile(source, target)
        except OSError:
            return False
    return True


def task_local_copies(snapshot: Snapshot, operator: str, local_dir: str | os.PathLike[str] | None) -> dict[str, Path]:
    """path -> local file, for every file of a task-local copy under `local_dir` that verifies
    against its checkpoint's `_metadata` (size, and CRC32 unless its fingerprint vouches for it)."""
    out: dict[str, Path] = {}
    base = Path(local_dir) / snapshot.storage.job_id / operator if local_dir is not None else None
    if base is None or not base.is_dir():
        return out
    store = existing_store(snapshot.storage)
    for subtask_dir in base.iterdir():
        for copy in subtask_dir.iterdir() if subtask_dir.is_dir() and subtask_dir.name.isdigit() else []:
            cid = checkpoint_id_of_dir(copy.name)
            if cid is None or not copy.is_dir():
                continue
            try:
                op = store.load(cid).operators.get(operator)
            except SparkpointError:  # subsumed since, or unreadable: the copy is not used
                continue
            handles = [h for h in op.subtasks if h.subtask == int(subtask_dir.name)] if op else []
            if handles and not local_copy_matches(copy, handles[0]):
                out.update({f.path: copy / f.local_name for f in handles[0].files()})
    return out


def _by_changed_files(source: Snapshot, target: Snapshot, op: KeyedOperator, scratch: Path,
                      local_dir: str | os.PathLike[str] | None) -> StateDiff:
    files = _Files(source.storage, scratch / "files", task_local_copies(target, op.uid, local_dir))
    a_op, b_op = source.meta.operators[op.uid], target.meta.operators[op.uid]
    kinds = _kinds([*a_op.subtasks, *b_op.subtasks])
    tables: tuple[list[pd.DataFrame], list[pd.DataFrame]] = ([], [])
    changed = shared = scanned = candidates = 0
    for ha, hb in zip(a_op.subtasks, b_op.subtasks):
        in_a, in_b = {f.path: f for f in ha.files()}, {f.path: f for f in hb.files()}
        differing = [f for p, f in in_a.items() if p not in in_b] + [f for p, f in in_b.items() if p not in in_a]
        data = [f for f in differing if f.local_name.endswith(".sst") or is_changelog_name(f.local_name)]
        changed += sum(f.size for f in data)  # MANIFEST, CURRENT, OPTIONS: every checkpoint has its own
        shared += sum(f.size for p, f in in_a.items() if p in in_b)
        files.fetch(data, target.meta.checkpoint_id)
        keys, ranges = _written_keys(data, files)
        scanned += sum(f.size for f in data)
        if not keys and not ranges:
            continue
        dbs = []
        try:
            for side, handle in ((source, ha), (target, hb)):
                files.fetch(handle.files(), side.meta.checkpoint_id)
                dbs.append(_open_side(handle, files, scratch / f"{side.meta.checkpoint_id}-{handle.subtask}",
                                      side.meta.checkpoint_id))
            wanted = _operator_keys(keys, ranges, kinds, dbs)
            candidates += len(wanted)
            for i, (side, handle) in enumerate(((source, ha), (target, hb))):
                tables[i].append(_restricted_export(op, side, handle, dbs[i], kinds, wanted,
                                                    scratch / f"export-{i}-{handle.subtask}"))
        finally:
            for db in dbs:
                db.close()
    old, new = (_concat(t, op) for t in tables)
    if not len(old.columns) and not len(new.columns):  # nothing differs: the export's columns, no row
        old = new = _empty_export(op, target, scratch / "empty")
    return StateDiff(compare_tables(old, new, _key_column(op, old, new)), op.name, source, target, CHANGED_FILES, "",
                     bytes_read=files.downloaded, bytes_local=files.linked, bytes_scanned=scanned,
                     changed_bytes=changed, shared_bytes=shared, candidate_keys=candidates)


def _concat(frames: list[pd.DataFrame], op: KeyedOperator) -> pd.DataFrame:
    frames = [f for f in frames if len(f.columns)]
    if not frames:
        return pd.DataFrame()
    table = pd.concat(frames, ignore_index=True)
    return table.sort_values(op.key, kind="stable").reset_index(drop=True) if op.key in table.columns else table


def _kinds(handles: list[SubtaskStateHandle]) -> dict[str, str]:
    kinds: dict[str, str] = {TIMERS: "timers"}
    for h in handles:
        for name, declared in ((h.facts or {}).get("states") or {}).items():
            if kinds.setdefault(name, declared["kind"]) != declared["kind"]:
                raise _Refused(f"state {name!r} is a {kinds[name]} in one snapshot, a {declared['kind']} in the other")
    return kinds


def _written_keys(differing: list[FileHandle], files: _Files
                  ) -> tuple[dict[str, set[bytes]], dict[str, list[tuple[bytes, bytes]]]]:
    """Per state, the keys the differing files hold entries for, and their range deletes."""
    keys: dict[str, set[bytes]] = defaultdict(set)
    ranges: dict[str, list[tuple[bytes, bytes]]] = defaultdict(list)
    limit = changelog.raw_limit(sum(f.size for f in differing))
    for f in differing:
        if f.local_name.endswith(".sst"):
            found = read_sst_keys(files[f])
            keys[found.column_family].update(found.keys)
            ranges[found.column_family].extend(found.ranges)
        elif is_changelog_name(f.local_name):
            for section in changelog.read(files[f], max_raw=limit):
                keys[section.name].update(k for k, _ in section.entries)
                ranges[section.name].extend(section.ranges)
    keys.pop("default", None)
    ranges.pop("default", None)
    return keys, ranges


def _open_side(handle: SubtaskStateHandle, files: _Files, work: Path, checkpoint_id: int) -> Rdict:
    """The subtask's state at the checkpoint as a scratch database: its files linked, the changelog
    chain replayed (what a restore does, without verifying twice what `_Files` verified)."""
    check_handle_shape(handle, checkpoint_id)
    src = work / "files"
    src.mkdir(parents=True)
    for f in handle.files():
        _link(files[f], src / f.local_name)
    names = [f.local_name for f in handle.files()]
    materialize(src, work / "db", [n for n in names if not is_changelog_name(n)])
    options = RocksDBOptions()
    db = open_db(str(work / "db"), [], options, create=False)
    limit = changelog.raw_limit(sum(f.size for f in handle.files()))
    def ensure(states: list[str]) -> None:
        ensure_column_families(db, str(work / "db"), states, options)

    try:
        for name in sorted(n for n in names if is_changelog_name(n)):
            changelog.replay(db, src / name, ensure, max_raw=limit)
    except BaseException:
        db.close()
        raise
    return db


def _key_of(raw: bytes, kind: str) -> tuple[bytes, bytes] | None:
    """(key-group prefix, the operator's key) of a RocksDB key of a state of `kind`."""
    if raw[:2] == _SIDECAR or len(raw) < 2:
        return None
    if kind in _PLAIN_KINDS:
        return raw[:2], raw[2:]
    if kind in _PREFIXED_KINDS:
        n = _LEN.unpack_from(raw, 2)[0]
        return raw[:2], raw[6 : 6 + n]
    if kind == "timers":  # kg | "k" | len | key | ...  or  kg | "t" | clock | time(8) | key
        if raw[2:3] == b"k":
            n = _LEN.unpack_from(raw, 3)[0]
            return raw[:2], raw[7 : 7 + n]
        return raw[:2], raw[12:]
    raise _Refused(f"a state of kind {kind!r}")


def _scan(cf: Rdict, lower: bytes, upper: bytes | None) -> list[tuple[bytes, bytes]]:
    opts = scan_options(upper)
    it = cf.iter(opts)
    out = []
    try:
        it.seek(lower)
        while it.valid():
            out.append((it.key(), it.value()))
            it.next()
        it.status()
    finally:
        del it
    return out


def _operator_keys(keys: dict[str, set[bytes]], ranges: dict[str, list[tuple[bytes, bytes]]], kinds: dict[str, str],
                   dbs: list[Rdict]) -> set[tuple[bytes, bytes]]:
    """The operator keys (with their key-group prefix) whose entries may differ."""
    wanted: set[tuple[bytes, bytes]] = set()
    for name in {*keys, *ranges}:
        kind = kinds.get(name)
        if kind is None:
            raise _Refused(f"state {name!r} is declared in neither snapshot")
        raws = set(keys.get(name, ()))
        for lower, upper in ranges.get(name, ()):
            for db in dbs:
                if name in _states_of(db):
                    raws.update(k for k, _ in _scan(db.get_column_family(name), lower, upper))
        wanted.update(k for raw in raws if (k := _key_of(raw, kind)) is not None)
    return wanted


def _states_of(db: Rdict) -> list[str]:
    return list_states(db.path())


def _entries_of(cf: Rdict, kind: str, wanted: set[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """Every entry of `cf` that belongs to one of the `wanted` keys, and its sidecar keys."""
    out = _scan(cf, _SIDECAR, None)
    if kind in _PLAIN_KINDS:
        raws = sorted(p + k for p, k in wanted)
        for start in range(0, len(raws), 4096):
            chunk = raws[start : start + 4096]
            found = cast(list[bytes | None], cf.get(cast(Any, chunk)))
            out += [(k, v) for k, v in zip(chunk, found) if v is not None]
        return out
    for p, k in sorted(wanted):
        if kind in _PREFIXED_KINDS:
            prefix = p + _LEN.pack(len(k)) + k
            out += _scan(cf, prefix, next_prefix(prefix))
        else:  # timers: both indexes of the key's timers, from its by-key index
            prefix = p + b"k" + _LEN.pack(len(k)) + k
            for raw, value in _scan(cf, prefix, next_prefix(prefix)):
                when = raw[len(prefix):]  # clock(1) | time(8)
                out += [(raw, value), (p + b"t" + when + k, b"")]
    return out


def _restricted_export(op: KeyedOperator, side: Snapshot, handle: SubtaskStateHandle, db: Rdict,
                       kinds: dict[str, str], wanted: set[tuple[bytes, bytes]], work: Path) -> pd.DataFrame:
    """`op.export` of a scratch state holding only the `wanted` keys' entries of `db`, opened as a
    restore of `side` by `op`'s code opens it: its declared states, read in the fields `side`
    recorded."""
    op_state = side.meta.operators[op.uid]
    backend = RocksDBStateBackend(side.storage, op.uid, handle.subtask, parallelism=op_state.parallelism,
                                  max_parallelism=op_state.max_parallelism, local_dir=work, local_recovery=False,
                                  states=op.states, key_type=op.key_type)

    def fill(target: Rdict) -> None:
        names = _states_of(db)
        ensure_column_families(target, str(backend.db_path), names, backend.options)
        for name in names:
            entries = _entries_of(db.get_column_family(name), kinds.get(name, "value"), wanted)
            handle_cf = target.get_column_family_handle(name)
            for start in range(0, len(entries), 10_000):
                batch = WriteBatch(raw_mode=True)
                for k, v in entries[start : start + 10_000]:
                    batch.put(k, v, handle_cf)
                target.write(batch)

    try:
        backend.restore_entries(side.meta, fill)
        return op.export(backend)
    finally:
        backend.discard_local_state()  # a scratch state: closed without flushing what it holds


def _empty_export(op: KeyedOperator, side: Snapshot, work: Path) -> pd.DataFrame:
    with RocksDBStateBackend(side.storage, op.uid, 0, parallelism=1, max_parallelism=1, local_dir=work,
                             local_recovery=False, states=op.states, key_type=op.key_type) as backend:
        backend.restore(None)
        return op.export(backend)


# --- comparing two exports ------------------------------------------------------------------------


def _key_column(op: KeyedOperator, *tables: pd.DataFrame) -> str | None:
    columns = [c for t in tables for c in t.columns]
    if op.key in columns:
        return op.key
    return columns[0] if columns else None


def compare_tables(old: pd.DataFrame, new: pd.DataFrame, key: str | None) -> pd.DataFrame:
    """The rows that differ between two exports (see the module for the columns)."""
    columns = list(new.columns) + [c for c in old.columns if c not in new.columns]
    if key is None or key not in columns:
        return pd.DataFrame(columns=[*columns, "change"])
    old, new = old.reindex(columns=columns), new.reindex(columns=columns)
    values = [c for c in columns if c != key]
    out_columns = [*columns, "change", *(f"{c}_old" for c in values)]
    if not (old[key].is_unique and new[key].is_unique):
        return _compare_rows(old, new, columns, out_columns, key)
    old_keys = {_norm(k): i for i, k in enumerate(old[key].tolist())}
    new_keys = {_norm(k): i for i, k in enumerate(new[key].tolist())}
    added = [i for k, i in new_keys.items() if k not in old_keys]
    removed = [i for k, i in old_keys.items() if k not in new_keys]
    both = [(old_keys[k], i) for k, i in new_keys.items() if k in old_keys]
    changed = _differing(old, new, both, values)
    parts = []
    if added:
        parts.append(new.iloc[added].assign(change="added"))
    if removed:
        parts.append(old.iloc[removed].assign(change="removed"))
    if changed:
        rows = new.iloc[[j for _, j in changed]].assign(change="changed")
        for c in values:
            rows[f"{c}_old"] = old[c].iloc[[i for i, _ in changed]].to_numpy()
        parts.append(rows)
    return _finish(parts, out_columns, key)


def _differing(old: pd.DataFrame, new: pd.DataFrame, pairs: list[tuple[int, int]], values: list[str]
               ) -> list[tuple[int, int]]:
    if not pairs:
        return []
    i, j = np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs])
    differs = np.zeros(len(pairs), dtype=bool)
    for c in values:
        a, b = old[c].iloc[i].reset_index(drop=True), new[c].iloc[j].reset_index(drop=True)
        if a.dtype != object and b.dtype != object and a.dtype == b.dtype:
            try:
                same = ((a == b) | (a.isna() & b.isna())).to_numpy(dtype=bool)
                differs |= ~same
                continue
            except (TypeError, ValueError):
                pass
        differs |= np.array([_norm(x) != _norm(y) for x, y in zip(a.tolist(), b.tolist())], dtype=bool)
    return [p for p, d in zip(pairs, differs.tolist()) if d]


def _compare_rows(old: pd.DataFrame, new: pd.DataFrame, columns: list[str], out_columns: list[str], key: str
                  ) -> pd.DataFrame:
    """Whole rows as multisets, for exports with several rows per key."""
    def rows(t: pd.DataFrame) -> dict[tuple[Any, ...], list[int]]:
        out: dict[tuple[Any, ...], list[int]] = defaultdict(list)
        for i, row in enumerate(t[columns].itertuples(index=False, name=None)):
            out[tuple(_norm(v) for v in row)].append(i)
        return out

    a, b = rows(old), rows(new)
    removed = [i for r, idx in a.items() for i in idx[len(b.get(r, ())):]]
    added = [i for r, idx in b.items() for i in idx[len(a.get(r, ())):]]
    parts = []
    if added:
        parts.append(new.iloc[added].assign(change="added"))
    if removed:
        parts.append(old.iloc[removed].assign(change="removed"))
    return _finish(parts, out_columns, key)


def _finish(parts: list[pd.DataFrame], out_columns: list[str], key: str) -> pd.DataFrame:
    if not parts:
        return pd.DataFrame(columns=out_columns)
    table = pd.concat(parts, ignore_index=True).reindex(columns=out_columns)
    keys = [_sort_key(k) for k in table[key].tolist()]
    order = sorted(range(len(table)), key=keys.__getitem__)
    return table.iloc[order].reset_index(drop=True)


def _sort_key(value: Any) -> tuple[str, Any]:
    v = _norm(value)
    return (type(v).__name__, v) if isinstance(v, (int, float, str, bytes)) else (type(v).__name__, repr(v))


def _norm(value: Any) -> Any:
    """A hashable, comparable form of one cell: missing values alike, arrays and lists as tuples."""
    if value is None or value is pd.NA or value is pd.NaT:
        return None
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, np.generic):
        return _norm(value.item())
    if isinstance(value, (list, tuple, np.ndarray)):
        return tuple(_norm(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), _norm(v)) for k, v in value.items()))
    return value


__all__ = ["CHANGED_FILES", "FULL", "Snapshot", "StateDiff", "compare_tables", "diff_snapshots", "locate"]
