"""What an operator looks at: the checkpoint list, one `_metadata` described, the registry.

Each function returns plain data (lists of dicts of str/int/bool/None); the CLI prints it as a
table or JSON and `sparkpoint.api` turns it into pandas DataFrames, so both show the same.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Any

import fsspec

from sparkpoint.checkpoint.errors import CheckpointNotFound, MetadataError, StorageError
from sparkpoint.checkpoint.metadata import CheckpointMetadata, FileHandle, iso_micros, state_facts
from sparkpoint.checkpoint.paths import checkpoint_id_of_dir, is_changelog_name, is_plain_name
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import MAX_METADATA_BYTES, CompletedCheckpointStore, StoreListing

LIST_COLUMNS = ("checkpoint_id", "kind", "created_at", "state_size", "checkpointed_size", "files",
                "restored_from", "claim_mode", "operators", "skipped_files")
REGISTRY_COLUMNS = ("path", "kind", "size", "count", "created_by", "last_used", "owned")


def readable_size(size: float) -> str:
    """A size for people, in one unit style wherever sparkpoint prints one: `512 B`, `12.3 KiB`,
    `4.0 MiB` (powers of 1024)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def existing_store(storage: CheckpointStorage) -> CompletedCheckpointStore:
    """The job's store; a job directory that does not exist is named, with what to check."""
    if not storage.job_dir_exists():
        raise CheckpointNotFound(
            f"no job directory {storage.job_url}: check --checkpoints and --job-id (`sparkpoint list` needs the "
            "URL the job was run with and its job id)"
        )
    return CompletedCheckpointStore(storage)


def checkpoint_rows(storage: CheckpointStorage) -> tuple[list[dict[str, Any]], dict[int, str]]:
    """Every retained checkpoint, newest first, as rows of LIST_COLUMNS; and the unreadable ids."""
    listing = existing_store(storage).load_all()
    return [checkpoint_row(m) for m in listing.checkpoints], dict(sorted(listing.unreadable.items()))


def checkpoint_row(meta: CheckpointMetadata) -> dict[str, Any]:
    return {
        "checkpoint_id": meta.checkpoint_id,
        "kind": meta.kind,
        "created_at": meta.created_at,
        "state_size": meta.stats.state_size,
        "checkpointed_size": meta.stats.checkpointed_size,
        "files": len(meta.paths()),
        "restored_from": meta.lineage.restored_from if meta.lineage else None,
        "claim_mode": meta.lineage.claim_mode if meta.lineage else None,
        "operators": {name: op.parallelism for name, op in sorted(meta.operators.items())},
        # The input files this checkpoint consumed without processing them (`inspect` lists those
        # it carries from older checkpoints too).
        "skipped_files": [s.to_json() for s in meta.newly_skipped()],
    }


# --- inspect ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LocatedCheckpoint:
    meta: CheckpointMetadata
    url: str  # of the `_metadata` file
    storage: CheckpointStorage | None  # its job directory, when the path has Flink's layout


def load_checkpoint_at(path: str, storage_options: dict[str, Any] | None = None) -> LocatedCheckpoint:
    """A `_metadata` by URL: the file itself or its `chk-N` directory, on any fsspec filesystem.

    A path of the form `<checkpoints-dir>/<job-id>/chk-<N>[/_metadata]` is read through the job's
    store (which also checks that the file's job id and checkpoint id match its place); any other
    path to a file is read as it is.
    """
    trimmed = path.rstrip("/")
    directory = trimmed[: -len("/_metadata")] if trimmed.endswith("/_metadata") else trimmed
    parent, _, chk = directory.rpartition("/")
    base, _, job_id = parent.rpartition("/")
    cid = checkpoint_id_of_dir(chk)
    if cid is not None and is_plain_name(job_id) and base:
        storage = CheckpointStorage(base, job_id, storage_options)
        meta = existing_store(storage).load(cid)
        return LocatedCheckpoint(meta, f"{storage.job_url}/{meta.metadata_path}", storage)
    try:
        fs, local = fsspec.core.url_to_fs(trimmed, **(storage_options or {}))
    except (ValueError, ImportError) as e:
        raise StorageError(f"cannot open {path!r}: {e}. Give an fsspec URL such as file:///data/ckpt/job/chk-7") from e
    if fs.isdir(local):
        local = posixpath.join(local, "_metadata")
    url = str(fs.unstrip_protocol(local))
    try:
        size = int(fs.info(local).get("size") or 0)
    except FileNotFoundError:
        raise CheckpointNotFound(
            f"no _metadata at {url}: give a checkpoint directory (…/<job-id>/chk-<N>) or its _metadata file"
        ) from None
    if size > MAX_METADATA_BYTES:
        raise MetadataError(f"{url} is {size} bytes, more than the {MAX_METADATA_BYTES} a _metadata may have")
    return LocatedCheckpoint(CheckpointMetadata.loads(bytes(fs.cat_file(local)), where=url), url, None)


def describe_checkpoint(located: LocatedCheckpoint) -> dict[str, Any]:
    """One `_metadata` in full, in its own field names (`key_group_range`, `shared`, `private`, each
    file's `size` and `created_by`), with each file's kind (`rocksdb` or `changelog`) and each
    subtask's size added."""
    meta = located.meta
    operators = {}
    for name, op in sorted(meta.operators.items()):
        subtasks = [
            {
                "subtask": h.subtask,
                "key_group_range": h.key_group_range.to_json(),
                "state_size": sum(f.size for f in h.files()),
                "shared": [_file(f) for f in h.shared],
                "private": [_file(f) for f in h.private],
                "staged": [_file(f) for f in h.staged],
                **({"facts": h.facts} if h.facts is not None else {}),
            }
            for h in op.subtasks
        ]
        operators[name] = {"name": meta.operator_name(name), "max_parallelism": op.max_parallelism,
                           "parallelism": op.parallelism,
                           "subtasks": subtasks, **state_facts(op.subtasks)}
    return {
        "path": located.url,
        **checkpoint_row(meta),
        "job_id": meta.job_id,
        "files_new": meta.stats.files_new,
        "files_reused": meta.stats.files_reused,
        "source_offsets": meta.source_offsets,
        "watermark": _watermark(meta),
        "read": meta.read(),  # the route its batch took to the subtasks, and the bytes that read
        # the storage requests it made up to its commit and their cost (checkpoints since the ledger)
        **(meta.stats.ledger.to_json() if meta.stats.ledger is not None else {}),
        "estimated_cost_usd": meta.stats.estimated_cost_usd,
        "unowned": sorted(meta.unowned),
        "operators": operators,
        "skipped_files": [s.to_json() for s in meta.skipped_files],  # up to this checkpoint, oldest first
    }


def _watermark(meta: CheckpointMetadata) -> str | None:
    """The watermark the checkpoint recorded, ISO 8601 UTC (None: the pipeline has no event time)."""
    raw = meta.source_offsets.get("watermark") if isinstance(meta.source_offsets, dict) else None
    if not isinstance(raw, int) or isinstance(raw, bool):
        return None
    return iso_micros(raw)


def _file(f: FileHandle) -> dict[str, Any]:
    return {**f.to_json(), "kind": "changelog" if is_changelog_name(f.local_name) else "rocksdb"}


# --- registry --------------------------------------------------------------------------------------


def registry_rows(storage: CheckpointStorage) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The shared-state registry rebuilt from every retained `_metadata`, as rows of REGISTRY_COLUMNS
    (sorted by path), and its totals. A registry with deletion blocked says why in the totals."""
    store = existing_store(storage)
    listing: StoreListing = store.load_all()
    registry = store.rebuild_registry(listing)
    sizes = {f.path: f.size for m in listing.checkpoints for f in m.files()}
    rows: list[dict[str, Any]] = []
    for path in sorted(registry.paths()):
        entry = registry.entry(path)
        assert entry is not None
        rows.append({
            "path": path,
            "kind": _kind_of(path),
            "size": sizes.get(path, _metadata_size(storage, path)),
            "count": entry.count, "created_by": entry.created_by, "last_used": entry.last_used, "owned": entry.owned,
        })
    totals = {
        "checkpoints": listing.ids,
        "files": len(rows),
        "bytes": sum(r["size"] for r in rows),
        "references": sum(r["count"] for r in rows),
        "shared_files": sum(1 for r in rows if r["kind"] == "shared"),
        "owned_files": sum(1 for r in rows if r["owned"]),
        "owned_bytes": sum(r["size"] for r in rows if r["owned"]),
        "deletion_blocked": registry.blocked_reasons,
    }
    return rows, totals


def _kind_of(path: str) -> str:
    if path.startswith("shared/"):
        return "shared"
    return "metadata" if path.endswith("/_metadata") else "private"


def _metadata_size(storage: CheckpointStorage, path: str) -> int:
    try:
        return storage.info(path).size
    except (FileNotFoundError, StorageError):
        return 0
