"""What the maintenance ops say about the results of `sparkpoint.pipeline.maintenance`: the
lines of the run's log, the op's output metadata, the failures. The one place in Dagster code
that reads those results' fields."""

from __future__ import annotations

from typing import Any

import dagster as dg

from sparkpoint.assets.committed import Log
from sparkpoint.checkpoint.catalog import readable_size
from sparkpoint.pipeline.maintenance import PruneReport, RecoveryReport, RegistryCounts, VerifyReport


def recovery_said(report: RecoveryReport, failed_id: str, log: Log) -> dict[str, Any]:
    """Say a recovery in the run's log; returns the op's output metadata."""
    summary = report.summary("run")
    log.info(f"recovery of run {failed_id or '?'}: {summary}")
    if report.overtaken is not None:
        log.warning(f"the re-processed checkpoint was {report.overtaken.line('run')}")
    if report.fell_back_from:
        log.error(f"FELL BACK: checkpoints {list(report.fell_back_from)} failed verification")
    facts: dict[str, Any] = {"summary": summary}
    if report.failed_batch_committed is not None:  # another writer committed the failed batch first
        facts["failed_batch_committed_by"] = report.failed_batch_committed.checkpoint_id
    if report.overtaken is not None:
        facts["overtaken_by"] = report.overtaken.by_checkpoint
    return facts


def pruned(report: PruneReport) -> dict[str, Any]:
    """A prune's output metadata."""
    return {**_metadata(report.to_json()), "orphan_size": readable_size(report.orphan_bytes)}


def verified(report: VerifyReport) -> dict[str, Any]:
    """A verification's output metadata; `dg.Failure` when a checkpoint does not verify."""
    if not report.ok:
        raise dg.Failure(report.message, metadata={"problems": dg.MetadataValue.json(report.problems_json())})
    return _metadata(report.to_json())


def rebuilt(built: RegistryCounts, counted: RegistryCounts) -> dict[str, Any]:
    """A registry rebuild's output metadata; `dg.Failure` when it differs from a recount."""
    if (built.files, built.references) != (counted.files, counted.references):
        raise dg.Failure(f"registry {built} differs from a recount of _metadata {counted}")
    return _metadata(built.to_json())


def _metadata(values: dict[str, Any]) -> dict[str, Any]:
    """A report's JSON as output metadata: lists and objects as JSON values."""
    return {k: dg.MetadataValue.json(v) if isinstance(v, (list, dict)) else v for k, v in values.items()}
