"""The RocksDB keyed-state backend of one (operator, subtask): snapshot, confirm, restore.

Local layout, under `<local_dir>/<job_id>/<operator>/<subtask>/`:

    db/            the working database
    chk-<N>/       RocksDB native checkpoint N (hard links): pending until confirmed; the latest
                   confirmed one stays as the task-local copy for local recovery
    working.json   written right after snapshot N: "db/ holds exactly checkpoint N"; removed by
                   the first write after it. A later process that is told N completed reopens
                   db/ as it is, with no copy at all.

Invariants:

1. Only the last *confirmed* checkpoint's shared files are re-referenced (rule 2); pending
   checkpoints never see each other's uploads.
2. Every upload gets a fresh unique name under `shared/<operator>/<subtask>/` or
   `chk-<N>/<operator>/<subtask>/<attempt>/` (rule 1), so racing attempts never overwrite or
   delete each other's files.
3. Nothing is opened by RocksDB before every file was checked against `_metadata` (rule 7): its
   size, and its CRC32 unless it is a task-local SST whose inode is unchanged since its content
   was last checksummed (`restore`); RocksDB's own block checksums cover such a file on every read.
4. With the changelog on (see `changelog`), a checkpoint that only writes a changelog file
   builds on the confirmed base, and only when the changes logged since are exactly the
   changes since that base; anything else materializes. Such handles hold no private files:
   everything a later checkpoint re-references lives under `shared/`.
"""

from __future__ import annotations

from sparkpoint.state.restoring import RestoreResult, Restoring, restore_with_fallback
from sparkpoint.state.snapshotting import Snapshotting, take_checkpoint
from sparkpoint.state.subtask import handle_digest

__all__ = ["RestoreResult", "RocksDBStateBackend", "handle_digest", "restore_with_fallback", "take_checkpoint"]


class RocksDBStateBackend(Restoring, Snapshotting):
    """One subtask's keyed state in RocksDB: the `state` an operator's functions receive.

    sparkpoint makes one per (operator, subtask) and hands it to `process(batch, state)`,
    `export(state)`, `on_timer(fired, state)` and `bootstrap(table, state)`; it holds the states of
    that subtask's key-group range, restores them from a checkpoint and snapshots them into the
    next one. An operator opens its states by name: each name is one state of one kind, kept
    across batches and checkpoints.

    Example:
        ```python
        def process(batch, state):
            counts = batch.groupby("user").size()
            state.value_state("clicks", StructCodec("<q")).update_many(
                counts.index.tolist(), lambda k, old: ((old[0] if old else 0) + int(counts[k]),))
        ```
    """
