"""The completed-checkpoint store: every `chk-N/_metadata` of one job directory."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import TypeVar

from sparkpoint.checkpoint.errors import CheckpointNotFound, MetadataError, StorageError
from sparkpoint.checkpoint.metadata import CheckpointMetadata, metadata_path
from sparkpoint.checkpoint.registry import SharedStateRegistry
from sparkpoint.checkpoint.storage import CheckpointStorage

log = logging.getLogger(__name__)
T = TypeVar("T")
MAX_METADATA_BYTES = 64 * 1024 * 1024  # far above any real `_metadata`; a larger one is refused unread
READ_AHEAD = 4  # `_metadata` files read at once by `stream` (their bytes and parses are what a pass holds)


@dataclass
class StoreListing:
    """Readable checkpoints newest first, and the ids whose `_metadata` could not be read."""

    checkpoints: list[CheckpointMetadata]
    unreadable: dict[int, str] = field(default_factory=dict)

    @property
    def ids(self) -> list[int]:
        return [c.checkpoint_id for c in self.checkpoints]


class CompletedCheckpointStore:
    def __init__(self, storage: CheckpointStorage):
        self.storage = storage

    def checkpoint_ids(self) -> list[int]:
        """Ids of completed checkpoints (those with `_metadata`), newest first."""
        return sorted(self.storage.completed_checkpoint_ids(), reverse=True)

    def load(self, checkpoint_id: int) -> CheckpointMetadata:
        return self._parse(checkpoint_id, self._read(checkpoint_id))

    def _read(self, checkpoint_id: int) -> bytes:
        path = metadata_path(checkpoint_id)
        where = f"{self.storage.job_url}/{path}"
        try:
            size = self.storage.info(path).size
            if size > MAX_METADATA_BYTES:
                raise MetadataError(f"{where} is {size} bytes, more than the {MAX_METADATA_BYTES} a _metadata may have")
            return self.storage.read_bytes(path)
        except FileNotFoundError as e:
            raise CheckpointNotFound(
                f"checkpoint {checkpoint_id} does not exist in {self.storage.job_url} (no {path}); "
                f"completed checkpoints: {self.checkpoint_ids() or 'none'}"
            ) from e
        except StorageError as e:  # e.g. chk-N is a link out of the job directory
            raise MetadataError(f"{where} cannot be read: {e}") from e
        except (IsADirectoryError, NotADirectoryError) as e:
            raise MetadataError(
                f"{where} is not a file ({e.strerror}): a _metadata is one file written by sparkpoint; move "
                f"{self.storage.job_url}/chk-{checkpoint_id} aside by hand (until then it blocks every deletion)"
            ) from e

    def _parse(self, checkpoint_id: int, data: bytes) -> CheckpointMetadata:
        where = f"{self.storage.job_url}/{metadata_path(checkpoint_id)}"
        meta = CheckpointMetadata.loads(data, where=where)
        if meta.checkpoint_id != checkpoint_id:
            raise MetadataError(
                f"{where}: field `checkpoint_id` is {meta.checkpoint_id}, the directory says {checkpoint_id}"
            )
        if meta.job_id != self.storage.job_id:
            raise MetadataError(
                f"{where}: field `job_id` is {meta.job_id!r}, the directory belongs to {self.storage.job_id!r}"
            )
        return meta

    def load_all(self) -> StoreListing:
        """Every completed checkpoint; the unreadable ones are named, not skipped. Holds them all:
        a pass that needs one at a time (a rebuild, a sweep) goes through `stream` instead."""
        listing = StoreListing(checkpoints=[])
        for cid, outcome in self.stream():
            if isinstance(outcome, CheckpointMetadata):
                listing.checkpoints.append(outcome)
            else:
                listing.unreadable[cid] = outcome
        return listing

    def stream(self) -> Iterator[tuple[int, CheckpointMetadata | str]]:
        """Every completed checkpoint, newest first, as (id, its metadata or why it cannot be read);
        one gone since the listing is left out. Memory is bounded by a window of `_metadata`, not
        by how many are retained: the window's files are read in parallel, then parsed one after
        the other on this thread (parsing holds the GIL; threads taking turns at it were measured
        ~50% slower than one thread), and each one's bytes go once parsed."""
        ids = self.checkpoint_ids()
        window = max(1, min(READ_AHEAD, self.storage.max_workers))
        for start in range(0, len(ids), window):
            chunk = ids[start:start + window]
            read = self.storage.parallel(lambda cid: _outcome(self._read, cid), chunk)
            for i, cid in enumerate(chunk):
                data, read[i] = read[i], None
                outcome = _outcome(partial(self._parse, data=data), cid) if isinstance(data, bytes) else data
                if outcome is not None:
                    yield cid, outcome

    def latest(self) -> CheckpointMetadata | None:
        """The newest completed checkpoint whose `_metadata` reads; None when there is none.

        A damaged `_metadata` is skipped; an I/O error is raised: a timeout must never quietly
        send a restore back to an older checkpoint."""
        for cid in self.checkpoint_ids():
            try:
                return self.load(cid)
            except (MetadataError, CheckpointNotFound) as e:
                log.warning("skipping checkpoint %s: %s", cid, e)
        return None

    def rebuild(self) -> Rebuilt:
        """The registry recounted from every retained `_metadata` (rule 3), one `_metadata` at a
        time (`stream`): what stays is the registry, each checkpoint's kind, and the newest one.
        An unreadable `_metadata` blocks every deletion: its files may still be needed."""
        registry, kinds, unreadable = SharedStateRegistry(), {}, {}
        unowned: set[str] = set()
        latest: CheckpointMetadata | None = None
        for cid, outcome in self.stream():
            if isinstance(outcome, CheckpointMetadata):
                registry.register_checkpoint(cid, outcome.references())
                kinds[cid] = outcome.kind
                unowned |= outcome.unowned
                latest = latest or outcome
            else:
                unreadable[cid] = outcome
        registry.mark_unowned(unowned)
        for cid, reason in sorted(unreadable.items()):
            registry.block_deletion(f"chk-{cid}/_metadata cannot be read ({reason})")
        return Rebuilt(registry, kinds, unreadable, latest)

    def rebuild_registry(self, listing: StoreListing | None = None) -> SharedStateRegistry:
        """Recount references from every retained `_metadata` (rule 3): from `listing` when the
        caller holds one already, else streamed (`rebuild`).

        An unreadable `_metadata` blocks every deletion: its files may still be needed.
        """
        if listing is None:
            return self.rebuild().registry
        registry = SharedStateRegistry()
        for meta in sorted(listing.checkpoints, key=lambda m: m.checkpoint_id):
            registry.register_checkpoint(meta.checkpoint_id, meta.references())
        for meta in listing.checkpoints:
            registry.mark_unowned(meta.unowned)
        for cid, reason in sorted(listing.unreadable.items()):
            registry.block_deletion(f"chk-{cid}/_metadata cannot be read ({reason})")
        return registry


@dataclass(frozen=True)
class Rebuilt:
    """A streamed rebuild: the registry, each readable checkpoint's kind, why the others cannot be
    read, and the newest readable checkpoint (None: none)."""

    registry: SharedStateRegistry
    kinds: dict[int, str]
    unreadable: dict[int, str]
    latest: CheckpointMetadata | None


def _outcome(step: Callable[[int], T], checkpoint_id: int) -> T | str | None:
    """`step(checkpoint_id)`, or why it failed, or None when the checkpoint is gone."""
    try:
        return step(checkpoint_id)
    except CheckpointNotFound:
        return None  # subsumed by another writer since we listed: it is simply not retained
    except (MetadataError, OSError) as e:
        return str(e)
