"""The shared-state registry: reference counts of files referenced by retained checkpoints.

Invariants (checked by tests/test_registry_stateful.py against a simple model):

1. Identity is the physical path. An entry is keyed by the file's path relative to the job
   directory, never by the local SST name.
2. `count(path)` equals the number of registered checkpoints whose path set contains `path`.
   A path whose count reaches 0 leaves the registry. `created_by(path)` is the checkpoint that
   uploaded the file (as its handles say), so a rebuild from `_metadata` gives the same entry.
3. `release_checkpoint` returns exactly the paths whose count fell to 0 *and* that the job owns.
   Paths ever registered as unowned (restored in NO_CLAIM mode) are never returned.
4. While deletion is blocked (a retained `_metadata` could not be read), `release_checkpoint`
   raises DeletionBlocked and changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from sparkpoint.checkpoint.errors import DeletionBlocked, UnknownSharedState


@dataclass(slots=True)  # one per shared file: 10^6 of them at the sizes benchmarks/README.md measures
class RegistryEntry:
    path: str
    count: int
    created_by: int
    last_used: int
    owned: bool


class SharedStateRegistry:
    def __init__(self) -> None:
        self._entries: dict[str, RegistryEntry] = {}
        # Per checkpoint its distinct paths, as the entries' own strings: a tuple costs 8 bytes a
        # reference where a frozenset costs ~100, and a parsed `_metadata`'s strings are not kept.
        self._checkpoints: dict[int, tuple[str, ...]] = {}
        self._unowned: set[str] = set()
        self._blocked: list[str] = []

    # --- queries -------------------------------------------------------------------------------

    def count(self, path: str) -> int:
        entry = self._entries.get(path)
        return entry.count if entry else 0

    def entry(self, path: str) -> RegistryEntry | None:
        return self._entries.get(path)

    def is_known(self, path: str) -> bool:
        return path in self._entries

    def owns(self, path: str) -> bool:
        return path not in self._unowned

    def paths(self) -> set[str]:
        return set(self._entries)

    def checkpoint_ids(self) -> list[int]:
        return sorted(self._checkpoints)

    def paths_of(self, checkpoint_id: int) -> frozenset[str]:
        return frozenset(self._checkpoints.get(checkpoint_id, ()))

    @property
    def deletion_blocked(self) -> bool:
        return bool(self._blocked)

    @property
    def blocked_reasons(self) -> list[str]:
        return list(self._blocked)

    # --- transitions ---------------------------------------------------------------------------

    def check_references(self, checkpoint_id: int, referenced: dict[str, int]) -> None:
        """Rule 3: every referenced path must be known, or created by this very checkpoint.

        `referenced` maps path -> the checkpoint that claims to have created it.
        """
        for path, created_by in referenced.items():
            if created_by == checkpoint_id or path in self._entries:
                continue
            raise UnknownSharedState(
                f"checkpoint {checkpoint_id} re-references {path} (created by checkpoint {created_by}), "
                "which no retained checkpoint holds: it may already be deleted. The subtask must "
                "re-upload it; only files of its last confirmed checkpoint may be reused."
            )

    def register_checkpoint(self, checkpoint_id: int, files: Mapping[str, int], *, owned: bool = True) -> None:
        """Add one reference per path for `checkpoint_id`; `files` maps path -> creating checkpoint.

        `owned=False` marks the paths as the job's to read but never to delete (NO_CLAIM restore).
        """
        if checkpoint_id in self._checkpoints:
            raise ValueError(f"checkpoint {checkpoint_id} is registered already")
        # Every checkpoint's `_metadata` is parsed into strings of its own: keep the entry's, so a
        # file shared by many retained checkpoints is one string in memory, not one per checkpoint.
        paths = []
        for path, created_by in files.items():
            entry = self._entries.get(path)
            if entry is None:
                entry = self._entries[path] = RegistryEntry(path, 1, created_by, checkpoint_id, owned)
            else:
                entry.count += 1
                entry.last_used = max(entry.last_used, checkpoint_id)
                entry.created_by = min(entry.created_by, created_by)
            if not owned:
                entry.owned = False
            paths.append(entry.path)
        self._checkpoints[checkpoint_id] = tuple(paths)  # distinct: they are a mapping's keys
        if not owned:
            self._unowned.update(paths)

    def mark_unowned(self, paths: Iterable[str]) -> None:
        """Never return these paths for deletion, whatever their count."""
        for path in paths:
            self._unowned.add(path)
            entry = self._entries.get(path)
            if entry is not None:
                entry.owned = False

    def release_checkpoint(self, checkpoint_id: int) -> set[str]:
        """Drop the references of `checkpoint_id`; return owned paths whose count fell to 0."""
        if self._blocked:
            raise DeletionBlocked(
                "deletion is blocked: "
                + "; ".join(self._blocked)
                + ". Repair or remove that _metadata by hand, then rebuild the registry."
            )
        paths = self._checkpoints.pop(checkpoint_id, None)
        if paths is None:
            return set()
        deletable: set[str] = set()
        for path in paths:
            entry = self._entries[path]
            entry.count -= 1
            if entry.count == 0:
                del self._entries[path]
                if path not in self._unowned:
                    deletable.add(path)
        return deletable

    def block_deletion(self, reason: str) -> None:
        self._blocked.append(reason)
