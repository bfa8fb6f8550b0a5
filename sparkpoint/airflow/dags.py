"""`sparkpoint_dag`: a pipeline as an Airflow DAG.

    check_upgrade >> wait_for_batch (with on_landing) >> batch >> checkpoint >> [prune, verify]
                                                        [batch, checkpoint] >> recover (when one of them failed)

`check_upgrade` is the upgrade pre-flight, without Spark: it fails the run before any batch when
the checkpoint's state would not map onto the operators (by uid), saying what would make it work
(then `recover` skips: nothing ran); its XCom says whether the code version changed since the
previous run.

`batch` takes every unconsumed batch up to `max_batches_per_run`, each its own checkpoint, on
one Spark session: it completes all but the last itself and persists the last one's attempt
under the DAG run's id; `checkpoint` completes that one; `prune` applies retention; `verify`
checks every retained checkpoint's files. `recover` runs only when `batch` or `checkpoint` itself
failed (trigger rule `one_failed`, and it skips when they are only `upstream_failed`: the landing
sensor or the pre-flight failed or timed out and no batch ran): it aborts this run's attempt and
processes the failed batch again, so each batch is committed exactly once (batches before a failed
one stay committed; the run is still marked failed: it did fail, and the log says how it healed).
A retried `batch` task aborts its own earlier attempt first. One run at a time.

Every committed checkpoint is exactly one event on the asset `sparkpoint://<job>/checkpoint`
(`checkpoint_asset`), so downstream DAGs can be scheduled on new checkpoints; its `extra` holds
`checkpoint_id`, `path` (its `_metadata`), `state_size`, `checkpointed_size` (bytes) and `batch`
(the input files). `checkpoint` has the asset as its outlet; `batch` and `recover`, which commit
any number, add one event each through the alias `sparkpoint_<job>_checkpoints`
(`checkpoint_alias`). A task that fails announces nothing, so `recover` announces what the run
committed and no successful task did: its own checkpoint, the failed batch task's earlier ones.
An output table (Delta, Iceberg) gets the same: one event per checkpoint that committed to it on
the asset of its URL (`output_asset`), its `extra` the table version or snapshot id it made.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from airflow.sdk import DAG, BaseOperator, TriggerRule

from sparkpoint.airflow.operators import (
    DEFAULT_MAX_BATCHES_PER_RUN,
    PipelineRef,
    SparkpointBatchOperator,
    SparkpointCheckpointOperator,
    SparkpointLandingSensor,
    SparkpointPruneOperator,
    SparkpointRecoverOperator,
    SparkpointUpgradeCheckOperator,
    SparkpointVerifyOperator,
    checkpoint_alias,
    checkpoint_asset,
    output_asset,
)
from sparkpoint.pipeline.spec import Pipeline
from sparkpoint.tables.spec import ParquetDirectory, table_of

__all__ = ["checkpoint_alias", "checkpoint_asset", "output_asset", "sparkpoint_dag"]


def sparkpoint_dag(
    pipeline: Pipeline | str,
    *,
    dag_id: str | None = None,
    schedule: Any = None,
    on_landing: bool = False,
    verify: bool = True,
    overrides: Mapping[str, Any] | None = None,
    storage_conn_id: str | None = None,
    master: str | None = None,
    remote: str | None = None,
    poke_interval: float = 10.0,
    orphan_grace_seconds: float = 3600.0,
    tick: bool = False,
    max_batches_per_run: int | None = DEFAULT_MAX_BATCHES_PER_RUN,
    **dag_kwargs: Any,
) -> DAG:
    """The DAG of `pipeline`: upgrade pre-flight, batch, checkpoint, prune, verify and recover tasks.

    Tasks: `check_upgrade` → (`wait_for_batch` with `on_landing`) → `batch` → `checkpoint` →
    `prune` and `verify`; `recover` runs when `batch` or `checkpoint` itself failed (not when the
    sensor or the pre-flight failed before them). One run at a time
    (`max_active_runs=1`), no catch-up. A run takes every unconsumed batch up to
    `max_batches_per_run`, each its own checkpoint, as `sparkpoint run` does (a backlog of N files
    needs one run, not N); every committed checkpoint is one event on `checkpoint_asset(job_id)`.

    Example:
        ```python
        # dags/clicks.py
        from sparkpoint.airflow import sparkpoint_dag
        from my_project.pipelines import clicks

        dag = sparkpoint_dag(clicks, schedule="*/10 * * * *")            # or on_landing=True
        ```

    Args:
        pipeline: a `sparkpoint.Pipeline`, or `"MODULE:ATTR"` naming one.
        dag_id: default `sparkpoint_<name>`.
        schedule: any Airflow schedule; with `on_landing` and no schedule, `@continuous`.
        on_landing: wait for a batch file first (a sensor); without a schedule the DAG runs
            continuously (the next run starts when one ends, and waits for the next file).
        verify: add the `verify` task after each checkpoint.
        overrides: locations and settings on top of the pipeline's (our names or Flink's keys).
        storage_conn_id: an Airflow Connection whose credentials become fsspec storage options.
        master: the Spark master URL of a Spark of the batch and recover tasks' own (`local[2]`: in
            the task's process).
        remote: a Spark Connect URL to attach those tasks to instead. Neither: the warm local Spark.
        poke_interval: seconds between the landing sensor's looks, at least 1. The sensor waits in
            one task (mode `"poke"`: it keeps a worker slot while it waits).
        orphan_grace_seconds: uploads younger than this are never swept (prune, recover).
        tick: a run that finds no unconsumed batch makes a checkpoint of no input instead of
            skipping, so processing time passes on the schedule: due timers fire, TTL state expires.
        max_batches_per_run: the most batches one run takes (None: every unconsumed one).
        **dag_kwargs: passed to `DAG` (defaults: `max_active_runs=1`, `catchup=False`, a fixed past
            `start_date`, tag `sparkpoint`).

    Returns:
        The `airflow.sdk.DAG`.

    Raises:
        PokeIntervalError: with `on_landing`, a `poke_interval` under 1 second.
        PipelineError: a pipeline reference that does not import, or an unknown setting.
    """
    ref = PipelineRef(pipeline, overrides, storage_conn_id)
    resolved = ref.resolved()
    if on_landing and schedule is None:
        schedule = "@continuous"
    _set_dag_defaults(dag_kwargs, resolved.name)
    tasks = _Tasks(job=resolved.effective_job_id, output=_output_assets(resolved),
                   orphan_grace_seconds=orphan_grace_seconds,
                   common={"pipeline": pipeline, "overrides": overrides, "storage_conn_id": storage_conn_id},
                   spark={"master": master, "remote": remote})
    with DAG(dag_id or f"sparkpoint_{resolved.name}", schedule=schedule, **dag_kwargs) as dag:
        batch, checkpoint = tasks.batch_and_checkpoint(tick=tick, max_batches_per_run=max_batches_per_run,
                                                       verify=verify)
        [batch, checkpoint] >> tasks.recover()
        tasks.preflight(on_landing=on_landing, poke_interval=poke_interval) >> batch
    return dag


def _output_assets(pipeline: Pipeline) -> list[Any]:
    """The asset of the pipeline's output when it is a table (Delta, Iceberg), as the tasks see it."""
    output = pipeline.config().output_url
    return [output_asset(output)] if output and not isinstance(table_of(output), ParquetDirectory) else []


def _set_dag_defaults(dag_kwargs: dict[str, Any], name: str) -> None:
    """The `DAG` arguments a caller left out: one run at a time, no catch-up, a fixed past start."""
    dag_kwargs.setdefault("max_active_runs", 1)  # one run of a pipeline at a time
    dag_kwargs.setdefault("catchup", False)
    dag_kwargs.setdefault("start_date", datetime(2026, 1, 1, tzinfo=UTC))
    dag_kwargs.setdefault("tags", ["sparkpoint"])
    dag_kwargs.setdefault("description", f"sparkpoint pipeline {name!r}: batch, checkpoint, retention")


@dataclass(frozen=True)
class _Tasks:
    """Makes the tasks of one pipeline's DAG (inside its `with DAG`), each with the pipeline's
    arguments (`common`) and the Spark of the tasks that run one (`spark`)."""

    job: str
    output: list[Any]  # the output table's asset (none for a directory)
    orphan_grace_seconds: float
    common: dict[str, Any]
    spark: dict[str, Any]

    def batch_and_checkpoint(self, *, tick: bool, max_batches_per_run: int | None,
                             verify: bool) -> tuple[BaseOperator, BaseOperator]:
        """`batch` >> `checkpoint` >> `prune` (and `verify`); returns (`batch`, `checkpoint`)."""
        batch = SparkpointBatchOperator(task_id="batch", tick=tick, max_batches_per_run=max_batches_per_run,
                                        outlets=[checkpoint_alias(self.job)], **self.common, **self.spark)
        checkpoint = SparkpointCheckpointOperator(task_id="checkpoint", batch_task_id="batch",
                                                  outlets=[checkpoint_asset(self.job), *self.output], **self.common)
        prune = SparkpointPruneOperator(task_id="prune", orphan_grace_seconds=self.orphan_grace_seconds,
                                        **self.common)
        batch >> checkpoint >> prune
        if verify:
            checkpoint >> SparkpointVerifyOperator(task_id="verify", **self.common)
        return batch, checkpoint

    def recover(self) -> BaseOperator:
        """`recover`: runs when `batch` or `checkpoint` itself failed (`one_failed`)."""
        return SparkpointRecoverOperator(task_id="recover", trigger_rule=TriggerRule.ONE_FAILED,
                                         orphan_grace_seconds=self.orphan_grace_seconds,
                                         preflight_task_id="check_upgrade", batch_task_id="batch",
                                         outlets=[checkpoint_alias(self.job)], **self.common, **self.spark)

    def preflight(self, *, on_landing: bool, poke_interval: float) -> BaseOperator:
        """`check_upgrade` (>> `wait_for_batch` with `on_landing`): returns the task `batch` follows."""
        check_upgrade = SparkpointUpgradeCheckOperator(task_id="check_upgrade", **self.common)
        if not on_landing:
            return check_upgrade
        # Poke mode: one task waits and looks every poke_interval. Reschedule mode freed the
        # slot between looks, but Airflow's scheduler failed the sensor whenever its next look
        # fell due before it saw the previous look's exit (every idle wait at 5 s).
        wait_for_batch = SparkpointLandingSensor(task_id="wait_for_batch", poke_interval=poke_interval, mode="poke",
                                                 **self.common)
        check_upgrade >> wait_for_batch
        return wait_for_batch
