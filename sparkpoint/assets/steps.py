"""What the checkpoint job's two steps do, as plain functions of the pipeline driver: the Spark
half of the next batch (`spark_half`), and the commit of the attempt it persisted (`complete`).
The asset bodies (`sparkpoint.assets.build`) only fetch resources and report what these return.
"""

from __future__ import annotations

from collections.abc import Mapping

import dagster as dg

from sparkpoint.assets.committed import Log, Materialized, committed_materializations
from sparkpoint.pipeline.attempt import Overtaken, PendingAttempt, finish_step_or_overtaken, start_step
from sparkpoint.pipeline.badfiles import bad_file_message
from sparkpoint.pipeline.driver import StatefulPipeline
from sparkpoint.resources.scope import INJECT_TAG, TICK_TAG, PipelineScope
from sparkpoint.spark.source import BadInputFile


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


def complete(scope: PipelineScope, driver: StatefulPipeline, run: dg.DagsterRun, log: Log
             ) -> list[Materialized] | Overtaken:
    """Commit the attempt this run (or a run it re-executes) persisted: the checkpoint and the
    output it materializes (none: no attempt was left), or the `Overtaken` another writer made of it."""
    done = finish_step_or_overtaken(driver, run_lineage(run), inject_failure=run.tags.get(INJECT_TAG))
    if done is None:
        log.info("this run's SSTable step left no pending checkpoint: no new checkpoint")
        return []
    if isinstance(done, Overtaken):
        return done
    report, meta = done
    log.info(report.line())
    return committed_materializations(scope, driver, report, meta, log, sstables=False)

