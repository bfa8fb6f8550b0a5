"""What the checkpoint job's two steps do, as plain functions of the pipeline driver: the Spark
half of the next batch (`spark_half`), and the commit of the attempt it persisted (`complete`),
whose materializations go out at the commit; what the step does after them (`after_commit`: the
keys changed since the previous checkpoint, the prune when one is due) waits for nobody. The
asset bodies (`sparkpoint.assets.build`) only fetch resources and report what these return.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import dagster as dg

from sparkpoint.assets.committed import Log, Materialized, committed_materializations, key_changes_observation
from sparkpoint.checkpoint.errors import SparkpointError
from sparkpoint.checkpoint.metadata import CheckpointMetadata
from sparkpoint.pipeline import maintenance
from sparkpoint.pipeline.attempt import Overtaken, PendingAttempt, finish_step_or_overtaken, start_step
from sparkpoint.pipeline.badfiles import bad_file_message
from sparkpoint.pipeline.cleanup import InputCleanup
from sparkpoint.pipeline.driver import StatefulPipeline
from sparkpoint.pipeline.maintenance import prune_reason
from sparkpoint.pipeline.settings import parse_input_cleanup
from sparkpoint.resources.fields import json_object
from sparkpoint.resources.scope import INJECT_TAG, PRUNED_TAG, TICK_TAG, PipelineScope
from sparkpoint.spark.source import BadInputFile
from sparkpoint.tables.spec import ParquetDirectory, table_of, table_url


def skip_job_how(scope: PipelineScope, file: str, input_url: str) -> str:
    """How to skip bad file `file` in Dagster: the pipeline's own skip job, reading the input the
    run that met it read."""
    return (f"launch the {scope.name('skip_file')} job with config file: {file!r} and a reason, its input resource "
            f"reading {input_url} as this run's did (or `sparkpoint skip --pipeline MODULE:ATTR --input {input_url} "
            f"...`, MODULE:ATTR naming pipeline {scope.pipeline.name!r})")


def run_lineage(run: dg.DagsterRun) -> list[str]:
    """This run and the runs it re-executes: the SSTable step may have run in one of them."""
    ids = [run.run_id, run.parent_run_id, run.root_run_id]
    return [i for i in dict.fromkeys(ids) if i]


def spark_half(scope: PipelineScope, driver: StatefulPipeline, run_id: str, tags: Mapping[str, str], log: Log
               ) -> PendingAttempt | None:
    """Run the Spark half of the next unconsumed batch under attempt id `run_id` and persist its
    attempt. With no batch: the options' `land_batch` lands one first, if set; a run tagged as a
    tick makes a checkpoint of no input. None (said in `log`): nothing to checkpoint."""
    inject = tags.get(INJECT_TAG)
    attempt = _start(scope, driver, run_id, inject)
    land = scope.options.land_batch
    if attempt is None and land is not None and land(driver.config.input_url, driver.consumed_files()):
        attempt = _start(scope, driver, run_id, inject)
    if attempt is None and tags.get(TICK_TAG, "").lower() == "true":
        log.info("no unconsumed batch: a tick (a checkpoint of no input: due timers fire, TTL expires)")
        attempt = _start(scope, driver, run_id, inject, tick=True)
    for line in driver.changed_skips:  # a skipped file that was still being written
        log.warning(line)
    if attempt is None:
        _say_no_batch(driver, log)
    elif driver.rescaling:  # the parallelism set in the resource's config differs from the checkpoint's
        log.info(driver.rescaling)
    return attempt


def _start(scope: PipelineScope, driver: StatefulPipeline, run_id: str, inject: str | None, tick: bool = False
           ) -> PendingAttempt | None:
    try:
        return start_step(driver, run_id, inject_failure=inject, tick=tick)
    except BadInputFile as e:  # say the way on in this UI: the pipeline's own skip job
        raise bad_file_message(e.file, e.check, e.reason,
                               skip_how=skip_job_how(scope, e.file, driver.config.input_url)) from None


def _say_no_batch(driver: StatefulPipeline, log: Log) -> None:
    if driver.waiting_for:
        log.warning(f"{driver.waiting_for}: no new checkpoint, nothing materialized")
        return
    log.info(f"no unconsumed batch in {driver.config.input_url}: no new checkpoint, nothing materialized")
    empty = driver.source.nothing_to_read()
    if empty:
        log.warning(empty)


@dataclass(frozen=True)
class Completed:
    """What the checkpoint step committed: its materializations (reported at once), the
    checkpoint's `_metadata` and what its metadata said a prune would do (`prune_due`)."""

    materialized: list[Materialized]
    meta: CheckpointMetadata
    prune_due: tuple[str, ...]


def complete(scope: PipelineScope, driver: StatefulPipeline, run: dg.DagsterRun, log: Log
             ) -> Completed | Overtaken | None:
    """Commit the attempt this run (or a run it re-executes) persisted: the checkpoint and the
    output it materializes (None: no attempt was left), or the `Overtaken` another writer made of
    it. The materializations leave out what changed since the previous checkpoint (a diff that
    reads state, seconds on a large batch): the step reports it after them (`after_commit`)."""
    done = finish_step_or_overtaken(driver, run_lineage(run), inject_failure=run.tags.get(INJECT_TAG))
    if done is None:
        log.info("this run's SSTable step left no pending checkpoint: no new checkpoint")
        return None
    if isinstance(done, Overtaken):
        return done
    report, meta = done
    log.info(report.line())
    made = committed_materializations(scope, driver, report, meta, log, sstables=False, changes=False)
    entry = next((m.metadata.get("prune_due") for m in made if m.key == scope.checkpoint_key), None)
    due = entry.value if isinstance(entry, dg.JsonMetadataValue) else entry
    return Completed(made, meta, tuple(due) if isinstance(due, list) else ())


def after_commit(scope: PipelineScope, driver: StatefulPipeline, done: Completed, context: Any) -> None:
    """What the checkpoint step does once its materializations are out: the keys changed since the
    previous checkpoint (an observation of the checkpoint asset), then the prune, when one is due
    (`prune_in_run`), so no prune run of its own waits in front of the next landed file."""
    changed = key_changes_observation(scope, driver, done.meta, context.log)
    if changed is not None:
        context.log_event(changed)
    prune_in_run(scope, driver, done, context)


def prune_in_run(scope: PipelineScope, driver: StatefulPipeline, done: Completed, context: Any) -> None:
    """Prune the job when `prune_reason` says so (what the checkpoint said is due, or the orphan
    sweep past its grace since the pipeline's last prune, by a prune run or a checkpoint run), as
    the prune job would, and tag the run `sparkpoint/pruned` (the retention sensor then launches no
    prune for it). The checkpoint is committed and reported: a failure is a warning, and the
    retention sensor prunes instead."""
    registry = scope.registry(context)
    now = time.time()
    because = prune_reason(done.prune_due, last_pruned(scope, context.instance), now, registry.orphan_grace_seconds)
    if because is None:
        return
    try:
        report = maintenance.prune(driver.storage, num_retained=registry.num_retained,
                                   orphan_grace_seconds=registry.orphan_grace_seconds,
                                   input_cleanup=input_cleanup_of(scope, context))
    except (SparkpointError, OSError) as e:
        context.log.warning(f"the prune after chk-{done.meta.checkpoint_id} ({because}) failed: {e}; "
                            "the retention sensor will prune")
        return
    context.instance.add_run_tags(context.run.run_id, {PRUNED_TAG: scope.pipeline.name})
    context.log.info(f"pruned after chk-{done.meta.checkpoint_id} ({because}): {report.message} "
                     f"in {time.time() - now:.2f} s")


def last_pruned(scope: PipelineScope, instance: dg.DagsterInstance) -> float | None:
    """When the pipeline's job was last pruned, as the instance knows: its newest successful prune
    run, or its newest checkpoint run that pruned (None: never)."""
    filters = (dg.RunsFilter(job_name=scope.name("prune"), statuses=[dg.DagsterRunStatus.SUCCESS]),
               dg.RunsFilter(tags={PRUNED_TAG: scope.pipeline.name}))
    times = [r.create_timestamp.timestamp() for f in filters for r in instance.get_run_records(filters=f, limit=1)]
    return max(times, default=None)


def input_cleanup_of(scope: PipelineScope, context: Any) -> InputCleanup | None:
    """The prune's input cleanup from the input resource (None: `keep`, nothing to open)."""
    source = scope.source(context)
    if source.input_cleanup == "keep":
        return None
    table = not isinstance(table_of(source.input_url), ParquetDirectory)
    return InputCleanup(parse_input_cleanup(source.input_cleanup), table_url(source.input_url),
                        json_object(source.input_options, "input: input_options"), table)
