"""Dagster metadata of the pipeline's assets: every size twice, the byte count under a key ending
in `_bytes` (a number: the UI plots it, scripts read it) and beside it the same size for a person
under the key without `_bytes` (`state_size_bytes` 12345678, `state_size` "11.8 MiB"); locations
as path or URL values, `dagster/row_count` where rows are counted, table schemas for exported state
and the sink's output."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import dagster as dg

from sparkpoint.checkpoint.catalog import readable_size
from sparkpoint.checkpoint.metadata import CheckpointMetadata
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.pipeline.driver import StatefulPipeline
from sparkpoint.pipeline.history import NO_RESTORE
from sparkpoint.pipeline.maintenance import checkpoint_facts
from sparkpoint.pipeline.runtime import BatchReport
from sparkpoint.spark.tablesource import TableSource
from sparkpoint.state.eventtime import iso_micros
from sparkpoint.state.operators import KeyedOperator
from sparkpoint.tables.sinks import TABLE_VERSION_KEYS, table_version
from sparkpoint.tables.source import FORMATS
from sparkpoint.tables.spec import DELTA_SCHEME

DATA_VERSION_TAG = "dagster/data_version"


def size_entries(name: str, size: int) -> dict[str, Any]:
    """`<name>_bytes`: the byte count; `<name>`: the same size as a person reads it."""
    return {f"{name}_bytes": size, name: readable_size(size)}


def location(url: str) -> dg.MetadataValue:
    """A local file as a path value (the UI offers to copy it), anything else as a URL (a Delta
    table's by its location, an Iceberg table's as `iceberg://<catalog>/<table>`)."""
    url = url.removeprefix(DELTA_SCHEME)
    if url.startswith("file://"):
        return dg.MetadataValue.path(url.removeprefix("file://"))
    return dg.MetadataValue.url(url)


def input_metadata(pending: Sequence[str], input_url: str) -> dict[str, Any]:
    """What an observation of the input asset says: the batch files no checkpoint consumed yet."""
    return {"files_pending": len(pending), "next_file": pending[0] if pending else "",
            "newest_file": pending[-1] if pending else "", "location": location(input_url)}


def input_data_version(pending: Sequence[str], consumed: Callable[[], Sequence[str]]) -> dg.DataVersion:
    """The newest batch file that landed, consumed or not: it changes when a file lands, not when a
    checkpoint consumes one, so the SSTable assets are in sync once they have read it. (`consumed`
    is asked only when nothing is pending.)"""
    newest = pending[-1] if pending else next(iter(reversed(consumed())), None)
    return dg.DataVersion(newest or "nothing landed")


def observed_input(driver: StatefulPipeline, pending: Sequence[str] | None = None
                   ) -> tuple[dg.DataVersion, dict[str, Any]]:
    """The input asset's data version and metadata now. A table's data version is its newest
    version (Delta) or snapshot id (Iceberg), under `table_version` / `snapshot_id` in the
    metadata too; a directory's is its newest batch file (`input_data_version`). `pending`: the
    files the caller listed just now (else they are listed here)."""
    pending = driver.pending_files() if pending is None else pending
    metadata = input_metadata(pending, driver.config.input_url)
    if not isinstance(driver.source, TableSource):
        return input_data_version(pending, driver.consumed_files), metadata
    version = driver.source.current_version()
    metadata[TABLE_VERSION_KEYS[FORMATS[driver.source.log.format]]] = version
    return dg.DataVersion(str(version) if version is not None else "no table version"), metadata


def input_observation(key: dg.AssetKey, driver: StatefulPipeline, by: str,
                      pending: Sequence[str] | None = None) -> dg.AssetObservation:
    """An observation of the input asset reported outside its own observe step (`by`: who looked)."""
    version, metadata = observed_input(driver, pending)
    count = metadata["files_pending"]
    files = f"{count} batch file{'' if count == 1 else 's'} pending"
    newest = f", newest {metadata['newest_file']}" if count else ""
    return dg.AssetObservation(asset_key=key, description=f"{files}{newest} ({by})", metadata=metadata,
                               tags={DATA_VERSION_TAG: version.value})


def plain(values: dict[str, Any]) -> dict[str, Any]:
    """Lists and dicts become JSON values; numbers and text stay as they are."""
    return {k: dg.MetadataValue.json(v) if isinstance(v, (list, dict)) else v for k, v in values.items()}


def column_schema(columns: Any) -> dg.TableSchema:
    pairs = columns.items() if isinstance(columns, dict) else columns
    return dg.TableSchema(columns=[dg.TableColumn(name, kind) for name, kind in pairs])


def state_schema(operator: KeyedOperator) -> dict[str, Any]:
    """The SSTable asset's definition metadata: the table its `export` makes, when declared."""
    return {"dagster/column_schema": column_schema(operator.schema)} if operator.schema else {}


def checkpoint_metadata(storage: CheckpointStorage, report: BatchReport, meta: CheckpointMetadata, *,
                        prune_due: list[str] | None = None, recovered_run: str | None = None,
                        previous: CheckpointMetadata | None = None,
                        changes: dict[str, dict[str, int]] | None = None) -> dict[str, Any]:
    """The checkpoint asset's materialization: what `sparkpoint run` prints for the checkpoint, and more."""
    facts = checkpoint_facts(storage, report, meta)
    out: dict[str, Any] = {
        "checkpoint_id": facts["checkpoint_id"],
        "summary": (f"chk-{facts['checkpoint_id']}: uploaded {readable_size(facts['checkpointed_size'])} of "
                    f"{readable_size(facts['state_size'])} state ({facts['incremental_ratio']:.1%}); files "
                    f"{facts['files_new']} new, {facts['files_reused']} reused, {facts['files_deleted']} deleted; "
                    f"{report.rows} rows in {facts['duration_s']:.2f} s"),
        "path": location(facts["path"]),
        **size_entries("state_size", facts["state_size"]),
        **size_entries("checkpointed_size", facts["checkpointed_size"]),
        "incremental_ratio": facts["incremental_ratio"],
        "files_new": facts["files_new"],
        "files_reused": facts["files_reused"],
        "files_deleted": facts["files_deleted"],
        "registry_files": facts["registry_files"],
        "retained": dg.MetadataValue.json(facts["retained"]),
        "duration_seconds": facts["duration_s"],
        "batch": dg.MetadataValue.json(list(report.files)),
        "dagster/row_count": report.rows,
        "prune_due": dg.MetadataValue.json(list(prune_due or [])),
    }
    if "watermark" in facts:  # pipelines with an event time
        out["watermark"] = facts["watermark"]
        out["late_rows"] = facts["late_rows"]
    if "skipped_files" in facts:  # input files it consumed without processing them (on_bad_file, skip_file)
        out["skipped_files"] = dg.MetadataValue.json(facts["skipped_files"])
    if "routing" in facts:  # how the batch reached its subtasks (read-all or shuffle), and what that read
        out["routing"] = facts["routing"]
        out.update(size_entries("input_read", facts["input_bytes_read"]))
        out.update(size_entries("batch_size", facts["batch_bytes"]))
        out["read_amplification"] = facts["read_amplification"]
    if "requests" in facts:  # the request ledger: by operation (JSON), and numbers the UI plots
        out["requests"] = dg.MetadataValue.json(facts["requests"])
        out["requests_total"] = sum(facts["requests"].values())
        out["input_requests"] = dg.MetadataValue.json(facts["input"]["requests"])
        out["bytes_up"] = facts["bytes_up"]
        out["bytes_down"] = facts["bytes_down"]
        out["input_bytes"] = facts["input"]["bytes"]
        out["estimated_cost_usd"] = facts["estimated_cost_usd"]
    out.update(history_entries(report))
    if recovered_run:
        out["recovered_run"] = dg.MetadataValue.dagster_run(recovered_run)
    if previous is not None:  # the checkpoint before it, to open beside it (and to diff against)
        out["previous_checkpoint"] = location(f"{storage.job_url}/{previous.metadata_path}")
        out["previous_checkpoint_id"] = previous.checkpoint_id
    if changes:  # per operator, where cheap to know
        out.update(change_entries(changes))
    return out


def change_entries(changes: dict[str, dict[str, int]]) -> dict[str, Any]:
    """`keys_added`, `keys_removed`, `keys_changed`: each operator's count, as JSON entries."""
    return {kind: dg.MetadataValue.json({op: c[kind] for op, c in changes.items()})
            for kind in ("keys_added", "keys_removed", "keys_changed")}


def history_entries(report: BatchReport) -> dict[str, Any]:
    """What `sparkpoint history` shows of a checkpoint beyond its sizes, as numbers the UI plots:
    the subtasks that restored state (not those that went on from their open database) and the
    longest time a subtask spent in each phase (`phase_restore_seconds`, `phase_upload_seconds`, ...)."""
    out: dict[str, Any] = {"restored_subtasks": sum(1 for source in report.restored if source not in NO_RESTORE)}
    for phase, seconds in sorted(report.phase_seconds.items()):
        out[f"phase_{phase.replace(' ', '_')}_seconds"] = seconds
    return out


def sstable_metadata(summary: dict[str, Any]) -> dict[str, Any]:
    """An SSTable asset's materialization: its subtasks' snapshot of this checkpoint."""
    out = {
        "checkpoint_id": summary["checkpoint_id"],
        "subtasks": summary["subtasks"],
        "sst_files_new": summary["sst_files_new"],
        "sst_files_reused": summary["sst_files_reused"],
        **size_entries("uploaded", summary["bytes_uploaded"]),
    }
    if "restore" in summary:  # known to the step that restored (a recovery reports from `_metadata`)
        out["restore"] = summary["restore"]
    if "rows" in summary:
        out["dagster/row_count"] = summary["rows"]
    if "states" in summary:  # what the state holds after this checkpoint (snapshots that record it)
        out["entries"] = summary["entries"]
        out["expired_removed"] = summary["expired_removed"]
        out["timers_pending"] = summary["timers_pending"]
        out["timers_fired"] = summary["timers_fired"]
        if summary["timers_earliest"] is not None:
            out["timers_earliest"] = iso_micros(summary["timers_earliest"])
        out["states"] = dg.MetadataValue.json(summary["states"])
    return plain(out)


def output_metadata(facts: dict[str, Any], checkpoint_id: int) -> dict[str, Any]:
    """The sink's output asset: what this checkpoint made visible. A table's carries its own
    version: `table_version` (Delta) or `snapshot_id` (Iceberg), the one this checkpoint made, and
    `dagster/column_schema` is the table's schema."""
    out: dict[str, Any] = {
        "checkpoint_id": checkpoint_id,
        "location": location(facts["url"]),
        "files": facts["files"],
        "dagster/row_count": facts["rows"],
    }
    if (version := table_version(facts)) is not None:  # a table (None: the checkpoint made no version)
        out[version[0]] = version[1]
        out["rows_added"] = facts["rows"]
    if facts["columns"]:
        out["dagster/column_schema"] = column_schema(facts["columns"])
    if facts["unreadable"]:
        out["unreadable_files"] = dg.MetadataValue.json(facts["unreadable"])
    return out
