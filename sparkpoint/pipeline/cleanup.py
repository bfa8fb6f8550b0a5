"""Consumed input cleaned up (Spark's `cleanSource`): `input_cleanup = keep | archive:<url> | delete`.

`prune` (the retention sensor's run, `sparkpoint prune`, Airflow's prune task) applies it after
retention, to the input files that EVERY retained checkpoint and savepoint of the job has consumed:
no retained checkpoint, and so no restore, fallback or rollback to one, would read them again.
Never a file of a persisted attempt (a step between its two halves), and nothing at all when a
check fails: a `_metadata` or an attempt record that cannot be read, offsets that are not a
directory's, retention blocked. The decision is `cleanable`, a pure function; `clean_input` gathers
its facts and acts.

A name is a name (DESIGN rule 11): the files are the input directory's entries, each joined to the
directory and handed to single-file calls (`info`, `open`, `rm_file`) or to `delete_exact`; never
a pattern, never recursive. `archive:<url>` copies each file to `<url>/<name>` (through a
`.sparkpoint-partial` name, then moved into place), checks the copy's size and CRC32 against the
file, and only then deletes the file (in bulk). A kill between the copy and the delete loses
nothing: the file is still there, still consumed, and the next cleanup finds its copy in the
archive, checks it the same way and deletes the file. An archive that already holds a different
file of that name is never overwritten: the file is kept and reported.

The cleanup writes nothing into the job directory (it reads `_metadata` and `_pending/`, and writes
only the input and the archive): it takes no id there (DESIGN rule 14). What it relies on is that
every checkpoint a restore, fallback or rollback can reach later is retained now or descends from
one retained now; the interleaving checker runs it beside a rollback and a run
(`rollback-vs-run-vs-input-cleanup`).
"""

from __future__ import annotations

import logging
import posixpath
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sparkpoint.checkpoint.crash import crash_point
from sparkpoint.checkpoint.deletes import DeleteFailure, delete_exact
from sparkpoint.checkpoint.errors import SparkpointError
from sparkpoint.checkpoint.storage import CheckpointStorage, crc32, modified_time, move_file, storage_url
from sparkpoint.pipeline.attempt import list_attempts
from sparkpoint.pipeline.settings import INPUT_CLEANUPS, parse_input_cleanup
from sparkpoint.spark.listing import is_partition

if TYPE_CHECKING:
    from sparkpoint.spark.offsets import SourceOffsets

log = logging.getLogger(__name__)

KEEP, DELETE, ARCHIVE = INPUT_CLEANUPS
PARTIAL = ".sparkpoint-partial"  # an archive copy under way
_CHUNK = 4 << 20


class InputCleanupRefused(SparkpointError):
    """`input_cleanup` cannot apply to this job's input (a table); the message says what to set."""


def archive_url(policy: str) -> str | None:
    """The archive's URL of an `archive:<url>` policy (None for keep and delete)."""
    mode, _, url = policy.partition(":")
    return url if mode == ARCHIVE else None


def cleanable(names: Iterable[str], retained: Sequence[SourceOffsets], pending: Iterable[str],
              landed: Mapping[str, float] | None = None, oldest: float | None = None) -> list[str]:
    """The input files a cleanup may take: consumed by every retained checkpoint and savepoint
    (`retained`: their offsets; none retained, none cleanable) and in no pending attempt's batch.

    A name the offsets hold only through their floor (`SourceOffsets.names` is false for each)
    was either consumed long ago or landed late, under the floor, and was refused unread: it is
    taken only when it landed (`landed`: modification times) before the oldest retained
    checkpoint was created (`oldest`), which a late file cannot have; without both, never."""
    if not retained:
        return []
    busy = set(pending)

    def consumed(name: str) -> bool:
        if not all(offsets.includes(name) for offsets in retained):
            return False
        if any(offsets.names(name) for offsets in retained):
            return True
        return landed is not None and oldest is not None and landed.get(name, float("inf")) < oldest

    return sorted(n for n in names if n not in busy and consumed(n))


@dataclass(frozen=True)
class CleanupReport:
    """What a cleanup did: the policy, the files archived or deleted, the input files it kept
    (not consumed by every retained checkpoint), those that failed and why, and why it did
    nothing at all (`blocked`)."""

    policy: str
    cleaned: tuple[str, ...] = ()
    kept: int = 0
    failed: tuple[DeleteFailure, ...] = ()
    blocked: str = ""
    requests: int = 0  # delete requests sent

    @property
    def message(self) -> str:
        if self.policy == KEEP:
            return "input kept (input_cleanup=keep)"
        if self.blocked:
            return f"input cleanup skipped: {self.blocked}"
        verb = "archived" if self.policy.startswith(ARCHIVE) else "deleted"
        said = f"{len(self.cleaned)} consumed input files {verb}, {self.kept} kept"
        if self.failed:
            said += "; failed: " + "; ".join(f"{f.path} ({f.reason})" for f in self.failed[:5])
        return said

    def to_json(self) -> dict[str, Any]:
        return {"policy": self.policy, "cleaned": list(self.cleaned), "kept": self.kept, "blocked": self.blocked,
                "failed": [{"file": f.path, "reason": f.reason} for f in self.failed]}


@dataclass(frozen=True)
class InputCleanup:
    """A job's input as its cleanup needs it: the policy, the input directory (or table) and the
    fsspec options of the input (the archive's too)."""

    policy: str
    input_url: str
    input_options: Mapping[str, Any] = field(default_factory=dict)
    table: bool = False  # the input is a table: its files are the table's

    @classmethod
    def of(cls, config: Any) -> InputCleanup:
        """From a `PipelineConfig` (its `input_cleanup`, input URL and options)."""
        return cls(parse_input_cleanup(config.input_cleanup), config.input_url, dict(config.input_options or {}),
                   config.input_table is not None)

    def refuse_table(self) -> None:
        if self.table and self.policy != KEEP:
            raise InputCleanupRefused(
                f"input_cleanup={self.policy} cannot apply to input table {self.input_url}: its files are the "
                "table's (clean them with the table's own tools: Delta's VACUUM, Iceberg's expire_snapshots). Set "
                "input_cleanup=keep for this job")


def clean_input(storage: CheckpointStorage, cleanup: InputCleanup) -> CleanupReport:
    """Apply `cleanup.policy` to the consumed input files no retained checkpoint or savepoint of the
    job in `storage` would read again (see the module's docstring). Raises InputCleanupRefused for
    a table input; a failed check is a report that did nothing (`blocked`), never a guess."""
    cleanup.refuse_table()
    if cleanup.policy == KEEP:
        return CleanupReport(KEEP)
    retained, oldest, blocked = _retained_offsets(storage)
    pending, why = _pending_files(storage)
    blocked = blocked or why
    if blocked:
        log.warning("input cleanup skipped: %s", blocked)
        return CleanupReport(cleanup.policy, blocked=blocked)
    fs, root = _open(cleanup.input_url, cleanup.input_options)
    landed = _names(fs, root)
    names = sorted(landed)
    chosen = cleanable(names, retained, pending, landed, oldest)
    paths = {name: posixpath.join(root, name) for name in chosen}
    failed: list[DeleteFailure] = []
    url = archive_url(cleanup.policy)
    if url is not None:
        archive_fs, archive_root = _open(url, cleanup.input_options)
        archive_fs.makedirs(archive_root, exist_ok=True)
        for name in chosen:
            why_not = archive_one(fs, paths[name], archive_fs, posixpath.join(archive_root, name))
            if why_not is not None:
                failed.append(DeleteFailure(name, why_not))
                del paths[name]
            crash_point("after-archive-copy")
    report = delete_exact(fs, list(paths.values()))
    by_path = {path: name for name, path in paths.items()}
    failed += [DeleteFailure(by_path.get(f.path, f.path), f.reason) for f in report.failed]
    gone = {f.path for f in failed}
    cleaned = tuple(n for n in paths if n not in gone)
    return CleanupReport(cleanup.policy, cleaned, len(names) - len(chosen), tuple(failed), requests=report.requests)


def archive_one(fs: Any, path: str, archive_fs: Any, target: str) -> str | None:
    """Copy input file `path` to `target` and check the copy (size and CRC32) against the file:
    None when the archive holds it (copied now, or by an earlier cleanup killed before its
    delete), else why not (the file is then kept)."""
    try:
        size, crc = _size_and_crc(fs, path)
        held = _stat_copy(archive_fs, target)
        if held is None:
            partial = target + PARTIAL
            _copy(fs, path, archive_fs, partial)
            move_file(archive_fs, partial, target)
            held = _stat_copy(archive_fs, target)
        elif held != (size, crc):
            return (f"the archive already holds a different file named {target} ({held[0]} bytes, CRC32 "
                    f"{held[1]:08x}; this one {size} bytes, CRC32 {crc:08x}): kept, move one of them by hand")
    except OSError as e:
        return f"archiving to {target} failed ({type(e).__name__}: {e}); kept, tried again by the next prune"
    if held != (size, crc):
        return f"the copy at {target} does not match the file (size or CRC32): kept, tried again by the next prune"
    return None


def _size_and_crc(fs: Any, path: str) -> tuple[int, int]:
    size, value = 0, 0
    with fs.open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            size, value = size + len(chunk), crc32(chunk, value)
    return size, value


def _stat_copy(fs: Any, path: str) -> tuple[int, int] | None:
    try:
        fs.info(path)
    except FileNotFoundError:
        return None
    return _size_and_crc(fs, path)


def _copy(fs: Any, path: str, archive_fs: Any, target: str) -> None:
    with fs.open(path, "rb") as source, archive_fs.open(target, "wb") as out:
        while chunk := source.read(_CHUNK):
            out.write(chunk)


def _open(url: str, options: Mapping[str, Any]) -> tuple[Any, str]:
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(storage_url(url), **dict(options))
    except (ValueError, ImportError) as e:
        raise InputCleanupRefused(f"input cleanup: cannot open {url!r}: {e}") from e
    return fs, root.rstrip("/") or "/"


def _names(fs: Any, root: str) -> dict[str, float]:
    """The input directory's file names, with when each was last modified: its entries and those
    of its date partitions (`date=YYYY-MM-DD/<file>`, named so as batches are), literally (`ls`,
    never a glob)."""
    found: dict[str, float] = {}
    for entry in _entries(fs, root):
        name = posixpath.basename(entry["name"].rstrip("/"))
        if entry.get("type") != "directory":
            found[name] = modified_time(entry)
        elif is_partition(name):
            for inner in _entries(fs, posixpath.join(root, name)):
                if inner.get("type") != "directory":
                    found[f"{name}/{posixpath.basename(inner['name'].rstrip('/'))}"] = modified_time(inner)
    return found


def _entries(fs: Any, directory: str) -> list[dict[str, Any]]:
    fs.invalidate_cache(directory)
    return list(fs.ls(directory, detail=True))


def _retained_offsets(storage: CheckpointStorage) -> tuple[list[SourceOffsets], float | None, str]:
    """The source offsets of every retained checkpoint and savepoint and when the oldest was
    created (seconds since the epoch), or why they cannot be known."""
    from sparkpoint.checkpoint.store import CompletedCheckpointStore
    from sparkpoint.spark.offsets import SourceOffsets

    out, oldest = [], None
    for cid, meta in CompletedCheckpointStore(storage).stream():  # one `_metadata` held at a time
        if isinstance(meta, str):
            return [], None, f"chk-{cid}/_metadata cannot be read ({meta})"
        raw = meta.source_offsets
        try:
            offsets = SourceOffsets.from_json(raw.get("source") if isinstance(raw, dict) else raw)
        except SparkpointError as e:
            return [], None, f"chk-{cid}'s source offsets cannot be read ({e})"
        if offsets.table is not None:
            return [], None, f"chk-{cid}'s source offsets are a table's, not a directory's"
        out.append(offsets)
        created = _epoch(meta.created_at)
        oldest = created if oldest is None or created is None else min(oldest, created)
    return out, oldest, ""


def _epoch(created_at: str) -> float | None:
    try:
        return datetime.fromisoformat(created_at.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _pending_files(storage: CheckpointStorage) -> tuple[set[str], str]:
    """The batch files of every persisted attempt, or why they cannot be known."""
    listing = list_attempts(storage)
    if listing.unreadable:
        return set(), f"pending attempt records cannot be read: {', '.join(sorted(listing.unreadable))}"
    return {name for attempt in listing.attempts for name in attempt.files}, ""
