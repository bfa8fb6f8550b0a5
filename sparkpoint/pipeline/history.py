"""A job's checkpoint history for people: the record a completer keeps of each checkpoint
(`history_record`, stored by `sparkpoint.checkpoint.history`), merged with the retained
`_metadata` into one row per checkpoint (`history_rows`: what `sparkpoint history`,
`sparkpoint.history()` and the Dagster checkpoint asset show), and its picture (`plot_history`).

The request ledger (`_metadata`'s `stats.requests`, `bytes_up`, `bytes_down`,
`estimated_cost_usd`) is shown where a checkpoint recorded it; elsewhere the row holds None.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from sparkpoint.checkpoint.catalog import existing_store
from sparkpoint.checkpoint.history import read_history
from sparkpoint.checkpoint.metadata import CheckpointMetadata, utc_now_iso
from sparkpoint.checkpoint.paths import is_changelog_name
from sparkpoint.checkpoint.phases import Phase
from sparkpoint.checkpoint.storage import CheckpointStorage

if TYPE_CHECKING:
    from sparkpoint.pipeline.runtime import BatchReport

HISTORY_COLUMNS = (
    "checkpoint_id", "kind", "completed_at", "seconds", "state_size", "checkpointed_size", "files_new",
    "files_reused", "files_deleted", "rows", "requests", "bytes_up", "bytes_down", "estimated_cost_usd",
    "restored", "restore_seconds", "materialized", "retained", "phase_seconds",
)
LEDGER = ("requests", "bytes_up", "bytes_down", "estimated_cost_usd")  # `_metadata`'s stats, when recorded
NO_RESTORE = ("working", "empty")  # a subtask that went on from its open database, or started empty


class SubtaskFacts(Protocol):
    """How one subtask ran (`sparkpoint.pipeline.attempt.record.SubtaskRun` is one)."""

    @property
    def operator(self) -> str: ...
    @property
    def subtask(self) -> int: ...
    @property
    def restore(self) -> str: ...
    @property
    def rows(self) -> int: ...
    @property
    def phases(self) -> tuple[Phase, ...]: ...


class RunFacts(Protocol):
    """What the Spark half of a checkpoint says of itself (`PendingAttempt` is one)."""

    @property
    def job_id(self) -> str: ...
    @property
    def attempt_id(self) -> str: ...
    @property
    def started_at(self) -> float: ...
    @property
    def files(self) -> tuple[str, ...]: ...
    @property
    def rows(self) -> int: ...
    @property
    def base(self) -> int | None: ...
    @property
    def source_offsets(self) -> dict[str, Any]: ...
    @property
    def subtasks(self) -> Sequence[SubtaskFacts]: ...


def ledger(meta: CheckpointMetadata) -> dict[str, Any]:
    """The request ledger `_metadata`'s stats carry (only the keys present)."""
    stats = meta.stats.to_json()
    return {k: stats[k] for k in LEDGER if k in stats}


def phase_seconds(phases: Iterable[Iterable[Phase]]) -> dict[str, float]:
    """The longest time any subtask spent in each phase (the phases of one subtask each)."""
    out: dict[str, float] = {}
    for subtask in phases:
        for name, _, start, end in subtask:
            out[name] = max(out.get(name, 0.0), round(end - start, 4))
    return out


def rocksdb_files_new(meta: CheckpointMetadata) -> int:
    """The RocksDB files (not changelog files, not the slices of a materialization in steps) this
    checkpoint uploaded: with a changelog, a checkpoint that has any materialized its state (at
    once, or by switching to the slices uploaded before)."""
    cid = meta.checkpoint_id
    return sum(1 for f in meta.restored_files() if f.created_by == cid and not is_changelog_name(f.local_name))


def history_record(attempt: RunFacts, meta: CheckpointMetadata, report: BatchReport) -> dict[str, Any]:
    """What the history keeps of a checkpoint that stands: a few hundred bytes."""
    restored: dict[str, int] = {}
    for s in attempt.subtasks:
        if s.restore not in NO_RESTORE:
            restored[s.restore] = restored.get(s.restore, 0) + 1
    return {
        "checkpoint_id": meta.checkpoint_id, "kind": meta.kind, "attempt_id": attempt.attempt_id,
        "created_at": meta.created_at, "completed_at": utc_now_iso(), "seconds": round(report.seconds, 3),
        "state_size": meta.stats.state_size, "checkpointed_size": meta.stats.checkpointed_size,
        "files_new": meta.stats.files_new, "files_reused": meta.stats.files_reused,
        "files_deleted": report.files_deleted, "rows": report.rows, "input_files": len(report.files),
        "restored": restored, "phase_seconds": dict(report.phase_seconds),
        "rocksdb_files_new": rocksdb_files_new(meta), "changelog": meta.has_changelog(),
        **ledger(meta),
    }


def _row_of_record(record: Mapping[str, Any]) -> dict[str, Any]:
    phases = record.get("phase_seconds") or {}
    return {
        **{k: record.get(k) for k in HISTORY_COLUMNS},
        "completed_at": record.get("completed_at") or record.get("created_at"),
        "restored": dict(record.get("restored") or {}),
        "restore_seconds": phases.get("restore"),
        "phase_seconds": dict(phases),
    }


def _row_of_metadata(meta: CheckpointMetadata) -> dict[str, Any]:
    """A retained checkpoint the history has no record of (taken before it was kept, or a savepoint)."""
    return {
        **dict.fromkeys(HISTORY_COLUMNS), "checkpoint_id": meta.checkpoint_id, "kind": meta.kind,
        "completed_at": meta.created_at, "state_size": meta.stats.state_size,
        "checkpointed_size": meta.stats.checkpointed_size, "files_new": meta.stats.files_new,
        "files_reused": meta.stats.files_reused, "restored": {}, "phase_seconds": {},
        "rocksdb_files_new": rocksdb_files_new(meta), "changelog": meta.has_changelog(), **ledger(meta),
    }


def history_rows(storage: CheckpointStorage, *, limit: int | None = None) -> tuple[list[dict[str, Any]], list[str]]:
    """One row per checkpoint the history recorded or the job retains, oldest first (the newest
    `limit` of them), with HISTORY_COLUMNS; and what could not be read. `materialized`: a
    checkpoint of a job with a changelog that materialized its state (`rocksdb_files_new`)."""
    listing = existing_store(storage).load_all()
    history = read_history(storage)
    retained = {m.checkpoint_id: m for m in listing.checkpoints}
    rows: dict[int, dict[str, Any]] = {cid: {**_row_of_record(r), "rocksdb_files_new": r.get("rocksdb_files_new"),
                                              "changelog": r.get("changelog")}
                                       for cid, r in history.records.items()}
    for cid, meta in retained.items():
        if cid not in rows:
            rows[cid] = _row_of_metadata(meta)
        rows[cid].update({k: v for k, v in ledger(meta).items() if rows[cid].get(k) is None})
    with_changelog = any(r.get("changelog") for r in rows.values())
    out = []
    for cid in sorted(rows)[-limit:] if limit else sorted(rows):
        row = rows[cid]
        row["retained"] = cid in retained
        row["materialized"] = bool(with_changelog and row.pop("rocksdb_files_new", 0))
        row.pop("changelog", None)
        out.append(row)
    unreadable = [*history.unreadable, *(f"chk-{cid}/_metadata: {why}" for cid, why in listing.unreadable.items())]
    return out, unreadable


def total_requests(row: Mapping[str, Any]) -> int | None:
    """Every storage request of a checkpoint (None: its ledger was not recorded)."""
    requests = row.get("requests")
    return sum(int(n) for n in requests.values()) if isinstance(requests, dict) else None


def plot_history(rows: list[dict[str, Any]], path: str, *, title: str) -> None:
    """The history's picture into `path` (PNG): state and uploaded sizes over checkpoints (top),
    durations (bottom); materializations marked with a triangle, restores with a cross."""
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("a history plot needs matplotlib: pip install 'sparkpoint[monitoring]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ids = [r["checkpoint_id"] for r in rows]
    mib = 1024 * 1024
    fig, (sizes, times) = plt.subplots(2, 1, sharex=True, figsize=(9, 5.5), layout="constrained")
    try:
        sizes.plot(ids, [(r["state_size"] or 0) / mib for r in rows], label="state size", color="tab:blue")
        sizes.plot(ids, [(r["checkpointed_size"] or 0) / mib for r in rows], label="uploaded",
                   color="tab:orange", marker=".")
        sizes.set_ylabel("MiB")
        timed = [r for r in rows if r["seconds"] is not None]
        times.plot([r["checkpoint_id"] for r in timed], [r["seconds"] for r in timed], label="duration",
                   color="tab:green", marker=".")
        times.set_ylabel("seconds")
        times.set_xlabel("checkpoint")
        _mark(sizes, [r for r in rows if r["materialized"]], "checkpointed_size", mib, "^", "materialization")
        _mark(sizes, [r for r in rows if r["restored"]], "state_size", mib, "x", "restore")
        _mark(times, [r for r in timed if r["materialized"]], "seconds", 1, "^", "materialization")
        _mark(times, [r for r in timed if r["restored"]], "seconds", 1, "x", "restore")
        for axes in (sizes, times):
            axes.grid(alpha=0.3)
            axes.legend(loc="upper left", fontsize="small")
        sizes.set_title(title)
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)


def _mark(axes: Any, rows: list[dict[str, Any]], key: str, unit: float, marker: str, label: str) -> None:
    if rows:
        axes.scatter([r["checkpoint_id"] for r in rows], [(r[key] or 0) / unit for r in rows], marker=marker,
                     color="black", zorder=3, label=label)
