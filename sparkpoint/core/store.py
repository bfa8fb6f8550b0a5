"""The completed-checkpoint store: every `chk-N/_metadata` of one job directory."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from sparkpoint.core.errors import CheckpointNotFound, MetadataError
from sparkpoint.core.metadata import CheckpointMetadata, metadata_path
from sparkpoint.core.registry import SharedStateRegistry
from sparkpoint.core.storage import CheckpointStorage

log = logging.getLogger(__name__)


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
        path = metadata_path(checkpoint_id)
        where = f"{self.storage.job_url}/{path}"
        try:
            data = self.storage.read_bytes(path)
        except FileNotFoundError as e:
            raise CheckpointNotFound(
                f"checkpoint {checkpoint_id} does not exist in {self.storage.job_url} (no {path}); "
                f"completed checkpoints: {self.checkpoint_ids() or 'none'}"
            ) from e
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
        listing = StoreListing(checkpoints=[])
        for cid in self.checkpoint_ids():
            try:
                listing.checkpoints.append(self.load(cid))
            except (MetadataError, CheckpointNotFound, OSError) as e:
                listing.unreadable[cid] = str(e)
        return listing

    def latest(self) -> CheckpointMetadata | None:
        """The newest completed checkpoint whose `_metadata` reads; None when there is none."""
        for cid in self.checkpoint_ids():
            try:
                return self.load(cid)
            except (MetadataError, OSError) as e:
                log.warning("skipping checkpoint %s: %s", cid, e)
        return None

    def rebuild_registry(self, listing: StoreListing | None = None) -> SharedStateRegistry:
        """Recount references from every retained `_metadata` (rule 3).

        An unreadable `_metadata` blocks every deletion: its files may still be needed.
        """
        listing = listing or self.load_all()
        registry = SharedStateRegistry()
        for meta in sorted(listing.checkpoints, key=lambda m: m.checkpoint_id):
            registry.register_checkpoint(meta.checkpoint_id, meta.paths() | {meta.metadata_path})
        for meta in listing.checkpoints:
            registry.mark_unowned(meta.unowned)
        for cid, reason in sorted(listing.unreadable.items()):
            registry.block_deletion(f"chk-{cid}/_metadata cannot be read ({reason})")
        return registry
