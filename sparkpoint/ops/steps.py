"""What the pipeline's ops do, as functions of the pipeline driver and plain values: recover a
failed run, take a savepoint, skip a file, follow the input. The op bodies
(`sparkpoint.ops.jobs`) fetch resources and log what these return; every committed checkpoint
becomes materializations through `sparkpoint.assets.committed`, as in the checkpoint job.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import dagster as dg

from sparkpoint.assets.checks import check_event, registry_matches, skipped_files, verifies
from sparkpoint.assets.committed import Log, committed_materializations
from sparkpoint.assets.metadata import location, plain, size_entries
from sparkpoint.assets.steps import run_lineage
from sparkpoint.checkpoint.savepoint import take_savepoint
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.pipeline import maintenance
from sparkpoint.pipeline.driver import StatefulPipeline
from sparkpoint.pipeline.follow import FollowOptions, check_follow_options, follow
from sparkpoint.pipeline.runtime import PipelineError
from sparkpoint.pipeline.skipping import skip_file
from sparkpoint.resources.scope import RECOVERED_BY_TAG, PipelineScope

RECOVERY_RUN = "recovery_run"  # the metadata entry of the failed run's event that links its recovery
Event = dg.AssetMaterialization | dg.AssetCheckEvaluation


def link_to_recovery(instance: dg.DagsterInstance, failed: dg.DagsterRun, recovery_run_id: str) -> None:
    """The failed run's way to its recovery: the tag `sparkpoint/recovered-by` (runs are filtered
    by it) and, since the UI renders no tag as a link, an event in the failed run's own log whose
    `recovery_run` opens the recovery run in one click."""
    from dagster._core.events import EngineEventData  # Dagster exports no public way to write this event

    instance.add_run_tags(failed.run_id, {RECOVERED_BY_TAG: recovery_run_id})
    instance.report_engine_event(
        f"sparkpoint: run {recovery_run_id} recovers this run", dagster_run=failed,
        engine_event_data=EngineEventData(metadata={RECOVERY_RUN: dg.MetadataValue.dagster_run(recovery_run_id)}),
    )


def recover(driver: StatefulPipeline, instance: dg.DagsterInstance, failed_id: str, run_id: str,
            orphan_grace_seconds: float) -> maintenance.RecoveryReport:
    """Recover failed run `failed_id` (may be "") in run `run_id`, linking the failed run to it. The
    failed run's attempts (its own id and those of the runs it re-executed) are fenced before the
    sweep that takes what it uploaded: a zombie of it can never commit then."""
    failed = instance.get_run_record_by_id(failed_id) if failed_id else None
    if failed is not None:  # the link back: the failed run names the run that heals it
        link_to_recovery(instance, failed.dagster_run, run_id)
    return maintenance.recover(
        driver, failed_before=failed.end_time if failed and failed.end_time else None,
        failed_attempts=tuple(run_lineage(failed.dagster_run)) if failed else (),
        orphan_grace_seconds=orphan_grace_seconds, attempt_id=run_id,
    )


def recovery_events(scope: PipelineScope, driver: StatefulPipeline, report: maintenance.RecoveryReport,
                    failed_id: str, log: Log) -> list[Event]:
    """The checkpoint a recovery made, on the pipeline's assets (the output heals too), and the
    checkpoint's checks after it."""
    events: list[Event] = []
    if report.batch is not None:
        batch, meta = report.batch
        why = f"re-processed by the recovery of run {failed_id}" if failed_id else "re-processed by recovery"
        made = committed_materializations(scope, driver, batch, meta, log, description=why,
                                          recovered_run=failed_id or None)
        events += [m.event() for m in made]
    return events + [check_event(verifies(scope, driver.storage)), check_event(registry_matches(scope, driver.storage))]


def skip(scope: PipelineScope, driver: StatefulPipeline, file: str, reason: str, log: Log
         ) -> tuple[int, list[Event]]:
    """Consume input file `file` without processing it (`sparkpoint skip`): the checkpoint's id,
    its materialization and the input's skipped-files check after it."""
    driver.check_start()
    report, meta = skip_file(driver, file, reason)
    log.warning(f"{file} consumed as skipped by checkpoint {meta.checkpoint_id}: {reason}")
    made = committed_materializations(scope, driver, report, meta, log, sstables=False, output=False,
                                      description=f"skipped input file {file}")
    return meta.checkpoint_id, [*(m.event() for m in made), check_event(skipped_files(scope, driver.storage))]


def savepoint(scope: PipelineScope, storage: CheckpointStorage, diff_against: str) -> dict[str, Any]:
    """Take a savepoint of the latest checkpoint; its facts as metadata, with `diff_against` (a
    savepoint or checkpoint URL) what changed per operator since that one."""
    result = take_savepoint(storage)
    facts: dict[str, Any] = {
        "savepoint_id": result.metadata.checkpoint_id,
        **size_entries("state_size", result.metadata.stats.state_size),
        "from_checkpoint": result.source_checkpoint, "files": result.files,
        "path": location(f"{result.url}/_metadata"),
    }
    if diff_against:
        from sparkpoint.state.diff import diff_snapshots, locate

        before = locate(diff_against, storage, storage.storage_options)
        after = locate(result.url, None, storage.storage_options)
        changes = {op.name: diff_snapshots(before, after, op).counts() for op in scope.pipeline.operators
                   if op.uid in before.meta.operators}
        facts["diff_against"] = location(diff_against)
        for kind, column in (("keys_added", "added"), ("keys_removed", "removed"), ("keys_changed", "changed")):
            facts[kind] = {op: c[column] for op, c in changes.items()}
    return plain(facts)


def follow_options(checkpoint_interval: float, poll_seconds: float, idle_seconds: float | None) -> FollowOptions:
    """The follow job's config as the loop's options (refused as `sparkpoint run --follow` refuses them)."""
    options = FollowOptions(checkpoint_interval=checkpoint_interval, poll_seconds=poll_seconds,
                            idle_seconds=idle_seconds)
    problems = check_follow_options(options)
    if problems:
        raise PipelineError("; ".join(problems))
    return options


def follow_events(scope: PipelineScope, driver: StatefulPipeline, options: FollowOptions, run_id: str,
                  max_batches: int | None, log: Log) -> Iterator[list[dg.AssetMaterialization]]:
    """Checkpoint each batch as it lands (`sparkpoint run --follow`) until a stop condition; each
    committed checkpoint as the checkpoint job's two steps materialize it."""
    if max_batches is not None:
        driver.config = replace(driver.config, max_batches=max_batches)
    for committed in follow(driver, options, attempt_id=run_id):
        log.info(committed.report.line())
        made = committed_materializations(scope, driver, committed.report, committed.metadata, log,
                                          attempt=committed.attempt)
        yield [m.event() for m in made]
