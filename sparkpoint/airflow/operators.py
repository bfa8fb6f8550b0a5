"""Airflow operators over sparkpoint's orchestrator-neutral seam: a few lines each around
`sparkpoint.pipeline.attempt` (the two halves of a checkpoint) and `sparkpoint.pipeline.maintenance`.

Each takes the pipeline (a `Pipeline`, or `"MODULE:ATTR"` imported where the task runs) and
`overrides`: locations (`input_url`, `checkpoints_url`, `output_url`, `local_dir`, `job_id`) and
settings under our names or Flink's keys, as `sparkpoint run --conf` takes them. Storage
credentials come from an Airflow Connection (`storage_conn_id`): an `aws` connection's login and
password become the key and secret, its `endpoint_url` and `region_name` extras the client's;
any connection's `storage_options` extra (JSON) is passed as it is.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from airflow.sdk import Asset, AssetAlias, BaseHook, BaseOperator, BaseSensorOperator, Context
from airflow.sdk.exceptions import AirflowException, AirflowFailException, AirflowSkipException

from sparkpoint.checkpoint.errors import SparkpointError
from sparkpoint.checkpoint.metadata import CheckpointMetadata
from sparkpoint.checkpoint.savepoint import take_savepoint
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.pipeline import maintenance
from sparkpoint.pipeline.attempt import finish_step, start_steps
from sparkpoint.pipeline.badfiles import bad_file_message, skip_command
from sparkpoint.pipeline.cleanup import InputCleanup
from sparkpoint.pipeline.driver import StatefulPipeline
from sparkpoint.pipeline.runtime import BatchReport, restore_plan
from sparkpoint.pipeline.spec import Pipeline, load_pipeline
from sparkpoint.spark.source import BadInputFile

LOCATIONS = ("input_url", "checkpoints_url", "output_url", "local_dir", "job_id", "storage_options")
INJECT_KEY = "sparkpoint_inject_failure"  # dag_run.conf: before-upload | after-upload | before-commit
DEFAULT_MAX_BATCHES_PER_RUN = 10
COMMITTED_KEY = "committed"  # the batch task's XCom: the event of each checkpoint it committed, pushed as it goes
OUTPUT_EVENT_KEY = "output"  # a committed event's output table event, announced on the table's own asset


class PokeIntervalError(AirflowException, ValueError):
    """A landing sensor's `poke_interval` (with its `mode`) that would not work; raised when the DAG is built."""


MIN_POKE_INTERVAL = 1.0  # seconds: each poke lists the input and reads a _metadata (requests, on object storage)
MIN_RESCHEDULE_POKE_INTERVAL = 60.0  # seconds: measured, the scheduler saw a poke's exit about 5 s after it


def check_poke_interval(poke_interval: float, mode: str, task_id: str) -> None:
    """Refuse a landing sensor's interval that cannot work, when the DAG is built (`PokeIntervalError`)."""
    if poke_interval < MIN_POKE_INTERVAL:
        raise PokeIntervalError(f"{task_id}: poke_interval={poke_interval:g} s is under {MIN_POKE_INTERVAL:g} s: each "
                                "poke lists the input and reads the latest checkpoint; give 1 second or more")
    if mode == "reschedule" and poke_interval < MIN_RESCHEDULE_POKE_INTERVAL:
        raise PokeIntervalError(
            f"{task_id}: mode='reschedule' with poke_interval={poke_interval:g} s: Airflow's scheduler fails a "
            "rescheduled sensor whose next poke falls due before it processed the previous poke's exit "
            f"(apache/airflow#71172); give poke_interval={MIN_RESCHEDULE_POKE_INTERVAL:g} or more, or mode='poke' "
            "(the default), which waits in one task and works at any interval")


def checkpoint_asset(job_id: str) -> Asset:
    """The Airflow asset a job's checkpoints update: `sparkpoint://<job>/checkpoint`.

    Each committed checkpoint is one event on it, its `extra` the checkpoint's id, `_metadata`
    path, sizes and batch (`sparkpoint.pipeline.maintenance.checkpoint_event`).

    Example:
        ```python
        with DAG("report", schedule=[checkpoint_asset("clicks")]):    # runs after each checkpoint of job clicks
            ...
        ```

    Args:
        job_id: the job id (a pipeline's `effective_job_id`).

    Returns:
        An `airflow.sdk.Asset` (named `sparkpoint_<job>_checkpoint`).
    """
    return Asset(uri=f"sparkpoint://{job_id}/checkpoint", name=f"sparkpoint_{job_id}_checkpoint")


def warn_skipped(log: Any, report: BatchReport, meta: CheckpointMetadata) -> None:
    """A warning in the task's log per input file the checkpoint skipped (on_bad_file="skip")."""
    for skipped in report.skipped:
        log.warning("sparkpoint checkpoint %s skipped input file %s", meta.checkpoint_id, skipped.line())


def checkpoint_alias(job_id: str) -> AssetAlias:
    """The outlet of a task that commits any number of checkpoints (the batch task of a backlog, `recover`).

    Through it the task adds one event on `checkpoint_asset` per checkpoint, and none when it
    committed none (a plain asset outlet would get one event whatever happened).

    Example:
        ```python
        SparkpointRecoverOperator(task_id="recover", pipeline=clicks, outlets=[checkpoint_alias("clicks")])
        ```

    Args:
        job_id: the job id (a pipeline's `effective_job_id`).

    Returns:
        An `airflow.sdk.AssetAlias` (named `sparkpoint_<job>_checkpoints`).
    """
    return AssetAlias(name=f"sparkpoint_{job_id}_checkpoints")


def output_asset(url: str) -> Asset:
    """The Airflow asset of a pipeline's output table: its URL (`delta+file:///...`, `delta+s3://...`,
    `iceberg://<catalog>/<namespace>.<table>`).

    Each checkpoint that committed rows to the table is one event on it, its `extra` the
    checkpoint's id, the table version (`table_version`, Delta) or snapshot id (`snapshot_id`,
    Iceberg) it made, the rows and files it added and the table's columns
    (`sparkpoint.pipeline.maintenance.output_event`).

    Example:
        ```python
        with DAG("report", schedule=[output_asset("delta+s3://lake/clicks")]):   # after each table version
            ...
        ```

    Args:
        url: the output table's URL, as `--output` takes it (`sparkpoint.DeltaTable(...).uri`).

    Returns:
        An `airflow.sdk.Asset` whose URI is the table's URL.
    """
    return Asset(uri=url, name=url)


def committed_event(driver: StatefulPipeline, meta: CheckpointMetadata, batch: Any) -> dict[str, Any]:
    """The checkpoint asset's event of a committed checkpoint, with its output table's event under
    `OUTPUT_EVENT_KEY` when the output is a table (`announce` takes it apart)."""
    event = maintenance.checkpoint_event(driver.storage, meta, batch)
    output = maintenance.output_event(driver.sink, meta)
    return {**event, OUTPUT_EVENT_KEY: output} if output is not None else event


def announce(context: Context, job_id: str, events: list[dict[str, Any]], *, alias: bool) -> None:
    """One asset event per committed checkpoint on the job's checkpoint asset, and one on its
    output table's asset when it committed to a table: through the alias (`add`, one event each),
    or, for a task that commits exactly one, as its own outlets' extra."""
    asset = checkpoint_asset(job_id)
    for given in events:
        event = {k: v for k, v in given.items() if k != OUTPUT_EVENT_KEY}
        announced = [(asset, event)]
        if given.get(OUTPUT_EVENT_KEY):
            announced.append((output_asset(given[OUTPUT_EVENT_KEY]["url"]), given[OUTPUT_EVENT_KEY]))
        for target, extra in announced:
            if alias:
                context["outlet_events"][checkpoint_alias(job_id)].add(target, extra=extra)
            else:
                context["outlet_events"][target].extra = extra


def storage_options_from_connection(conn_id: str) -> dict[str, Any]:
    """fsspec storage options from an Airflow Connection."""
    conn = BaseHook.get_connection(conn_id)
    extra = dict(conn.extra_dejson or {})
    options: dict[str, Any] = dict(extra.pop("storage_options", {}) or {})
    if conn.conn_type == "aws":
        if conn.login:
            options.setdefault("key", conn.login)
        if conn.password:
            options.setdefault("secret", conn.password)
        client = dict(options.get("client_kwargs", {}))
        for name in ("endpoint_url", "region_name"):
            if extra.get(name):
                client.setdefault(name, extra[name])
        if client:
            options["client_kwargs"] = client
    return options


def attempt_id_of(context: Context) -> str:
    """The attempt id of this try of the batch task: a plain name for storage, new for every try.
    An attempt id is never reused once an abort claimed it (the abort's claim fences any late
    completer of that attempt for good), so a retry writes its own attempt; the one of the failed
    try is settled by `prune` or `recover` once the checkpoint is past it."""
    run, ti = context["dag_run"], context["ti"]
    run_part = uuid.uuid5(uuid.NAMESPACE_URL, f"airflow:{run.dag_id}/{run.run_id}").hex[:24]
    return f"af-{run_part}-t{ti.try_number}"


def injected(context: Context) -> str | None:
    """The failure asked for in the run's conf, on a task's first try only (a retry then heals)."""
    if context["ti"].try_number > 1:
        return None
    conf = getattr(context.get("dag_run"), "conf", None) or {}
    value = conf.get(INJECT_KEY)
    return str(value) if value else None


class PipelineRef:
    """The pipeline an operator runs: a `Pipeline` or `"MODULE:ATTR"`, its overrides, credentials."""

    def __init__(self, pipeline: Pipeline | str, overrides: Mapping[str, Any] | None, storage_conn_id: str | None):
        self.pipeline, self.overrides, self.storage_conn_id = pipeline, dict(overrides or {}), storage_conn_id
        resolve_pipeline(pipeline, self.overrides)  # a bad reference or setting fails when the DAG is parsed

    def resolved(self) -> Pipeline:
        pipeline = resolve_pipeline(self.pipeline, self.overrides)
        if self.storage_conn_id:
            options = {**pipeline.storage_options, **storage_options_from_connection(self.storage_conn_id)}
            pipeline = pipeline.with_(storage_options=options)
        return pipeline

    def driver(self, spark: Any = None) -> StatefulPipeline:
        pipeline = self.resolved()
        return StatefulPipeline(spark, pipeline.config(), pipeline.operators)

    def skip_command(self, file: str, driver: StatefulPipeline) -> str:
        """`sparkpoint skip` of `file` for this pipeline, with the locations and settings the task
        used (storage credentials by reference only)."""
        config, named = driver.config, isinstance(self.pipeline, str)
        flags = [("--pipeline", str(self.pipeline) if named else "MODULE:ATTR"), ("--input", config.input_url),
                 ("--checkpoints", config.checkpoints_url), ("--job-id", config.job_id)]
        flags += [("--output", config.output_url)] if config.output_url else []
        flags += [("--conf", f"{k}={v}") for k, v in self.overrides.items() if k not in LOCATIONS]
        said = skip_command(file, flags)
        if not named:
            said += f" (MODULE:ATTR: where pipeline {self.resolved().name!r} is defined)"
        return said + (f" with the storage options of connection {self.storage_conn_id!r}" if self.storage_conn_id
                       else "")


def resolve_pipeline(pipeline: Pipeline | str, overrides: Mapping[str, Any]) -> Pipeline:
    base = load_pipeline(pipeline) if isinstance(pipeline, str) else pipeline
    if not isinstance(base, Pipeline):
        raise AirflowException(f"pipeline must be a sparkpoint.Pipeline or 'MODULE:ATTR', got {type(base).__name__}")
    settings = dict(overrides)
    locations = {k: settings.pop(k) for k in LOCATIONS if k in settings}
    base = base.with_(**locations) if locations else base
    return base.with_settings(settings) if settings else base


class SparkpointOperator(BaseOperator):
    """What every sparkpoint operator shares: the pipeline, its overrides, credentials and Spark.

    Not used on its own: `sparkpoint_dag` wires the operators below, or your own DAG uses them.

    Example:
        ```python
        SparkpointSavepointOperator(task_id="savepoint", pipeline="my_project.pipelines:clicks",
                                    overrides={"checkpoints_url": "s3://lake/ckpt"}, storage_conn_id="lake")
        ```

    Args:
        pipeline: a `sparkpoint.Pipeline`, or `"MODULE:ATTR"` naming one (imported when the task runs).
        overrides: locations (`input_url`, `checkpoints_url`, `output_url`, `local_dir`, `job_id`) and
            settings under our names or Flink's keys, on top of the pipeline's.
        storage_conn_id: an Airflow Connection whose credentials become fsspec storage options (an `aws`
            connection: login = key, password = secret, extra `endpoint_url` / `region_name`; any
            connection's extra `storage_options`).
        master: the Spark master URL of a Spark of the task's own (`local[2]`: in the task's process).
        remote: a Spark Connect URL (`sc://host:15002`) to attach to instead of starting Spark.
            Neither: the warm local Spark (`sparkpoint.spark.warm`), started once and kept warm.
        **kwargs: Airflow's `BaseOperator` arguments (`task_id`, `retries`, `outlets`, ...).
    """

    ui_color = "#f4a460"

    def __init__(self, *, pipeline: Pipeline | str, overrides: Mapping[str, Any] | None = None,
                 storage_conn_id: str | None = None, master: str | None = None, remote: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ref = PipelineRef(pipeline, overrides, storage_conn_id)
        self.master, self.remote = master, remote

    def resolved(self) -> Pipeline:
        return self.ref.resolved()

    def driver(self, spark: Any = None) -> StatefulPipeline:
        return self.ref.driver(spark)

    def spark(self) -> Any:
        from sparkpoint.spark.session import session_key, spark_session

        pipeline = self.resolved()
        return spark_session(self.master, app_name=f"sparkpoint-{pipeline.name}", remote=self.remote,
                             share=session_key(pipeline.effective_job_id, pipeline.operators))


class SparkpointUpgradeCheckOperator(SparkpointOperator):
    """The upgrade pre-flight, without Spark: whether the checkpoint the next batch restores maps
    onto this code's operators (by uid), as `sparkpoint check-upgrade` says.

    Fails, naming what would make it work, when the restore would be refused; its XCom says whether
    the code version changed since the previous run (`code_changed`) and carries the plan. The
    `recover` task of `sparkpoint_dag` skips when it refused (nothing ran).

    Example:
        ```python
        check = SparkpointUpgradeCheckOperator(task_id="check_upgrade", pipeline=clicks)
        check >> SparkpointBatchOperator(task_id="batch", pipeline=clicks)
        ```

    Args:
        **kwargs: the arguments every sparkpoint operator takes (`pipeline`, `overrides`,
            `storage_conn_id`, `master`, `remote`: see `SparkpointOperator`) and Airflow's `BaseOperator`'s
            (`task_id`, `retries`, ...).
    """

    def execute(self, context: Context) -> dict[str, Any]:
        pipeline = self.resolved()
        plan = restore_plan(pipeline.config(), pipeline.operators)
        now = pipeline.code_version()
        before = context["ti"].xcom_pull(task_ids=self.task_id, key="code_version", include_prior_dates=True)
        changed = isinstance(before, str) and before != now
        out = {"code_version": now, "code_changed": changed, "ok": plan is None or plan.ok,
               "plan": plan.to_json() if plan is not None else None}
        context["ti"].xcom_push(key="code_version", value=now)
        context["ti"].xcom_push(key="ok", value=out["ok"])  # read by `recover`: nothing ran to recover
        decision = plan.decision() if plan is not None else "no checkpoint to restore: the job starts empty"
        if plan is not None and not plan.ok:
            raise AirflowException(f"sparkpoint upgrade pre-flight: {decision}")
        self.log.info("sparkpoint upgrade pre-flight%s: %s", f" (code version {before} -> {now})" if changed else "",
                      decision)
        return out


class SparkpointBatchOperator(SparkpointOperator):
    """Every unconsumed batch, up to `max_batches_per_run`, each its own checkpoint, on one Spark session.

    Every subtask restores, applies its rows, snapshots and uploads. Every batch but the last is
    completed here (one asset event each, through the `checkpoint_alias` outlet; their events also
    go to XCom `committed` as they commit, so `recover` can announce them should this task fail
    later); the last one's attempt is persisted under this DAG run's id, which goes to XCom (JSON)
    for `SparkpointCheckpointOperator`. Nothing unconsumed: the task is skipped, or with `tick=True`
    a checkpoint of no input is made (processing time passes: due timers fire, TTL state expires).
    Each batch's files are checked before its upload (the first batch's before Spark starts); a
    bad file under `on_bad_file="fail"` fails the task without a retry, the batches before it
    committed.

    Example:
        ```python
        batch = SparkpointBatchOperator(task_id="batch", pipeline=clicks, remote="sc://spark:15002")
        ```

    Args:
        tick: with no unconsumed batch, make a checkpoint of no input instead of skipping.
        max_batches_per_run: the most batches one run takes (None: every unconsumed one).
        **kwargs: the arguments every sparkpoint operator takes (`pipeline`, `overrides`,
            `storage_conn_id`, `master`, `remote`: see `SparkpointOperator`) and Airflow's `BaseOperator`'s
            (`task_id`, `retries`, ...).
    """

    def __init__(self, *, tick: bool = False, max_batches_per_run: int | None = DEFAULT_MAX_BATCHES_PER_RUN,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if max_batches_per_run is not None and max_batches_per_run < 1:
            raise AirflowException(f"max_batches_per_run must be at least 1 (or None: no limit), got "
                                   f"{max_batches_per_run}")
        self.tick, self.max_batches_per_run = tick, max_batches_per_run

    def execute(self, context: Context) -> dict[str, Any]:
        committed: list[dict[str, Any]] = []

        def on_commit(report: BatchReport, meta: CheckpointMetadata) -> None:
            self.log.info("sparkpoint %s", report.line())
            warn_skipped(self.log, report, meta)
            committed.append(committed_event(driver, meta, report.files))
            context["ti"].xcom_push(key=COMMITTED_KEY, value=committed)

        driver = self.driver()
        try:
            # The first batch's checks from its files' footers, before Spark starts (each later
            # batch is checked before its own upload): a bad file under on_bad_file="fail" fails
            # the task, with no retry (the same file fails the same way).
            driver.check_batch(driver.next_batch())
            spark = driver.spark = self.spark()
            try:
                attempt = start_steps(driver, attempt_id_of(context), max_batches=self.max_batches_per_run,
                                      inject_failure=injected(context), tick=self.tick, on_commit=on_commit)
            finally:
                spark.stop()
        except BadInputFile as e:  # `recover` announces the batches committed before it
            context["ti"].xcom_push(key="bad_file", value={"file": e.file, "check": e.check, "reason": e.reason})
            said = bad_file_message(e.file, e.check, e.reason, skip_how=self.ref.skip_command(e.file, driver))
            raise AirflowFailException(f"sparkpoint: {said}") from e
        if driver.rescaling:
            self.log.info("sparkpoint: %s", driver.rescaling)
        for line in driver.changed_skips:  # a skipped file that was still being written
            self.log.warning("sparkpoint: %s", line)
        announce(context, driver.storage.job_id, committed, alias=True)
        out: dict[str, Any] = {COMMITTED_KEY: committed}
        if attempt is None and driver.waiting_for:
            self.log.warning("sparkpoint: %s", driver.waiting_for)
        if attempt is None and not committed:
            raise AirflowSkipException(driver.waiting_for or f"no unconsumed batch in {driver.config.input_url}: "
                                       "no new checkpoint")
        if attempt is not None:
            self.log.info("checkpoint %s uploaded by attempt %s, to be completed", attempt.checkpoint_id,
                          attempt.attempt_id)
            out.update(attempt_id=attempt.attempt_id, checkpoint_id=attempt.checkpoint_id,
                       operators={op.name: attempt.operator_summary(op.uid) for op in driver.operators})
        return out


class SparkpointCheckpointOperator(SparkpointOperator):
    """Completes the checkpoint the batch task uploaded (`_metadata`, registry, retention, sink
    commit), without Spark. Its facts go to the log in one line and to XCom.

    Give it `outlets=[checkpoint_asset(job_id)]` to schedule other DAGs on the job's checkpoints
    (`sparkpoint_dag` does).

    Example:
        ```python
        batch >> SparkpointCheckpointOperator(task_id="checkpoint", pipeline=clicks,
                                              outlets=[checkpoint_asset("clicks")])
        ```

    Args:
        batch_task_id: the task whose XCom holds the attempt to complete.
        **kwargs: the arguments every sparkpoint operator takes (`pipeline`, `overrides`,
            `storage_conn_id`, `master`, `remote`: see `SparkpointOperator`) and Airflow's `BaseOperator`'s
            (`task_id`, `retries`, ...).
    """

    def __init__(self, *, batch_task_id: str = "batch", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.batch_task_id = batch_task_id

    def execute(self, context: Context) -> dict[str, Any]:
        pushed = context["ti"].xcom_pull(task_ids=self.batch_task_id)
        if not isinstance(pushed, dict) or "attempt_id" not in pushed:
            raise AirflowSkipException(f"task {self.batch_task_id!r} pushed no attempt: no new checkpoint")
        driver = self.driver()
        done = finish_step(driver, [str(pushed["attempt_id"])], inject_failure=injected(context))
        if done is None:
            raise AirflowSkipException("the batch task left no pending checkpoint: no new checkpoint")
        report, meta = done
        facts = maintenance.checkpoint_facts(driver.storage, report, meta)
        self.log.info("sparkpoint %s", report.line())
        warn_skipped(self.log, report, meta)
        announce(context, driver.storage.job_id, [committed_event(driver, meta, report.files)], alias=False)
        return {**facts, "rows": report.rows, "batch": list(report.files),
                "skipped_files": [s.to_json() for s in report.skipped]}


class SparkpointRecoverOperator(SparkpointOperator):
    """After a failed batch or checkpoint task of this DAG run: abort its attempt, rebuild the
    registry, verify (falling back loudly), and process the batch again, exactly once.

    Orphans (uploads no attempt record names) are swept only past `orphan_grace_seconds`: another
    writer of the same job (a CLI run) may be uploading right now. Give it the trigger rule
    `one_failed` downstream of the batch and checkpoint tasks. Airflow's `one_failed` also fires
    when they are only `upstream_failed` (a landing sensor or the pre-flight before them failed or
    timed out, and no batch ran): then it skips, saying so. It runs only when one of its upstream
    tasks itself failed.

    Announces what no successful task of the run announced, one asset event each (through the
    `checkpoint_alias` outlet): the checkpoint it commits, one a failed completer had committed
    (settled here), and, when the batch task failed, those it committed before failing (its XCom
    `committed`).

    Example:
        ```python
        recover = SparkpointRecoverOperator(task_id="recover", pipeline=clicks, trigger_rule=TriggerRule.ONE_FAILED)
        [batch, checkpoint] >> recover
        ```

    Args:
        orphan_grace_seconds: uploads younger than this are not swept.
        preflight_task_id: the `SparkpointUpgradeCheckOperator` task: when it refused the restore,
            nothing ran and this task skips.
        batch_task_id: the `SparkpointBatchOperator` task: the checkpoints it committed before it
            failed are announced here; when it failed on a bad input file (before that batch's
            upload), there is nothing to recover.
        **kwargs: the arguments every sparkpoint operator takes (`pipeline`, `overrides`,
            `storage_conn_id`, `master`, `remote`: see `SparkpointOperator`) and Airflow's `BaseOperator`'s
            (`task_id`, `retries`, ...).
    """

    def __init__(self, *, orphan_grace_seconds: float = 3600.0, preflight_task_id: str | None = None,
                 batch_task_id: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.orphan_grace_seconds = orphan_grace_seconds
        self.preflight_task_id = preflight_task_id
        self.batch_task_id = batch_task_id

    def execute(self, context: Context) -> dict[str, Any]:
        if self.preflight_task_id and context["ti"].xcom_pull(task_ids=self.preflight_task_id, key="ok") is False:
            raise AirflowSkipException("the upgrade pre-flight refused the restore: no batch ran, nothing to recover")
        self._skip_unless_an_upstream_task_failed(context)
        bad = context["ti"].xcom_pull(task_ids=self.batch_task_id, key="bad_file") if self.batch_task_id else None
        if isinstance(bad, dict):
            said = (f"the batch failed on bad input file {bad.get('file')} ({bad.get('check')}) before its upload: "
                    "nothing to recover. Land a fixed copy, `sparkpoint skip` it, or set on_bad_file=\"skip\"")
            committed = list(context["ti"].xcom_pull(task_ids=self.batch_task_id, key=COMMITTED_KEY) or [])
            if not committed:
                raise AirflowSkipException(said)
            self.log.warning("sparkpoint: %s", said)  # the batches before it are committed: announced here
            announce(context, self.resolved().storage().job_id, committed, alias=True)
            return {"announced": [e["checkpoint_id"] for e in committed], "summary": said}
        spark = self.spark()
        try:
            driver = self.driver(spark)
            report = maintenance.recover(driver, orphan_grace_seconds=self.orphan_grace_seconds)
        finally:
            spark.stop()
        self.log.info("sparkpoint recovery: %s", report.message)
        if driver.rescaling:
            self.log.info("sparkpoint: %s", driver.rescaling)
        if report.fell_back_from:
            self.log.error("FELL BACK: checkpoints %s failed verification", list(report.fell_back_from))
        events = self._unannounced(context, driver, report)
        announce(context, driver.storage.job_id, events, alias=True)
        return {**report.to_json(), "announced": [e["checkpoint_id"] for e in events]}

    def _skip_unless_an_upstream_task_failed(self, context: Context) -> None:
        """`one_failed` also fires on `upstream_failed`: a sensor or pre-flight that failed (or timed
        out) before any batch ran. Only a batch or checkpoint task that itself failed left something
        to recover."""
        upstream = sorted(self.upstream_task_ids)
        if not upstream:
            return
        run, ti = context["dag_run"], context["ti"]
        got = ti.get_task_states(dag_id=run.dag_id, task_ids=upstream, run_ids=[run.run_id]).get(run.run_id, {})
        if any(str(got.get(task_id)) == "failed" for task_id in upstream):
            return
        said = ", ".join(f"{task_id}: {got.get(task_id)}" for task_id in upstream)
        raise AirflowSkipException(f"no batch task failed ({said}): a task before them failed or timed out, no "
                                   "batch ran, nothing to recover")

    def _unannounced(self, context: Context, driver: StatefulPipeline, report: maintenance.RecoveryReport
                     ) -> list[dict[str, Any]]:
        """The events of the checkpoints this run committed that no task announced, oldest first."""
        events: list[dict[str, Any]] = []
        ti = context["ti"]
        if self.batch_task_id and ti.xcom_pull(task_ids=self.batch_task_id) is None:  # it failed: nothing announced
            events += list(ti.xcom_pull(task_ids=self.batch_task_id, key=COMMITTED_KEY) or [])
        store = CompletedCheckpointStore(driver.storage)
        for outcome in report.found_committed:
            try:
                events.append(committed_event(driver, store.load(outcome.checkpoint_id), outcome.files))
            except SparkpointError as e:  # subsumed meanwhile: nothing left to point at
                self.log.warning("sparkpoint: checkpoint %s is not announced: %s", outcome.checkpoint_id, e)
        if report.batch is not None:
            done, meta = report.batch
            events.append(committed_event(driver, meta, done.files))
        unique = {e["checkpoint_id"]: e for e in events}
        return [unique[cid] for cid in sorted(unique)]


class SparkpointPruneOperator(SparkpointOperator):
    """Retention: subsume beyond `num_retained`, forget attempts that can never complete, sweep
    orphans older than `orphan_grace_seconds`; then the consumed input as the pipeline's
    `input_cleanup` says (`overrides={"input_cleanup": "delete"}`, say).

    Example:
        ```python
        checkpoint >> SparkpointPruneOperator(task_id="prune", pipeline=clicks)
        ```

    Args:
        orphan_grace_seconds: uploads younger than this are not swept.
        **kwargs: the arguments every sparkpoint operator takes (`pipeline`, `overrides`,
            `storage_conn_id`, `master`, `remote`: see `SparkpointOperator`) and Airflow's `BaseOperator`'s
            (`task_id`, `retries`, ...).
    """

    def __init__(self, *, orphan_grace_seconds: float = 3600.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.orphan_grace_seconds = orphan_grace_seconds

    def execute(self, context: Context) -> dict[str, Any]:
        pipeline = self.resolved()
        cleanup = InputCleanup.of(pipeline.config()) if pipeline.input_cleanup != "keep" else None
        report = maintenance.prune(pipeline.storage(), num_retained=pipeline.num_retained,
                                   orphan_grace_seconds=self.orphan_grace_seconds, input_cleanup=cleanup)
        self.log.info("sparkpoint prune: %s", report.message)
        return report.to_json()


class SparkpointVerifyOperator(SparkpointOperator):
    """Every retained checkpoint's files: present, size, CRC32. Fails when one does not verify.

    Example:
        ```python
        checkpoint >> SparkpointVerifyOperator(task_id="verify", pipeline=clicks)
        ```

    Args:
        **kwargs: the arguments every sparkpoint operator takes (`pipeline`, `overrides`,
            `storage_conn_id`, `master`, `remote`: see `SparkpointOperator`) and Airflow's `BaseOperator`'s
            (`task_id`, `retries`, ...).
    """

    def execute(self, context: Context) -> dict[str, Any]:
        report = maintenance.verify_all(self.resolved().storage())
        if not report.ok:
            raise AirflowException(report.message)
        self.log.info("sparkpoint verify: %s", report.message)
        return report.to_json()


class SparkpointSavepointOperator(SparkpointOperator):
    """A self-contained, verified copy of the latest checkpoint that retention never deletes.

    Example:
        ```python
        SparkpointSavepointOperator(task_id="savepoint", pipeline=clicks,
                                    target="s3://archive/savepoints/{{ ds }}")
        ```

    Args:
        target: where (a new directory, laid out as a job directory: `target/chk-<N>/_metadata`);
            default: the job's own directory, as chk-<L+1> for the latest checkpoint L (a run that
            commits L+1 first makes it try again of the new latest).
        **kwargs: the arguments every sparkpoint operator takes (`pipeline`, `overrides`,
            `storage_conn_id`, `master`, `remote`: see `SparkpointOperator`) and Airflow's `BaseOperator`'s
            (`task_id`, `retries`, ...).
    """

    def __init__(self, *, target: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.target = target

    def execute(self, context: Context) -> dict[str, Any]:
        result = take_savepoint(self.resolved().storage(), target=self.target)
        self.log.info("sparkpoint %s (chk-%s)", result.message, result.metadata.checkpoint_id)
        return {"savepoint_id": result.metadata.checkpoint_id, "from_checkpoint": result.source_checkpoint,
                "files": result.files, "path": f"{result.url}/_metadata"}


class SparkpointLandingSensor(BaseSensorOperator):
    """Waits until a batch file no checkpoint consumed is in the pipeline's input.

    Each poke lists the input and reads the latest checkpoint's `_metadata`. In the default mode
    `"poke"` (what `sparkpoint_dag` uses) the task keeps its worker slot and looks every
    `poke_interval` seconds, at least 1. `mode="reschedule"` frees the slot between looks, but
    Airflow 3.3's scheduler fails a rescheduled sensor whose next look falls due before it has
    processed the previous look's exit (the task's log shows no error; apache/airflow#71172): it
    needs `poke_interval` of at least 60 seconds, and a scheduler that lags by more than that
    still fails it.

    Example:
        ```python
        SparkpointLandingSensor(task_id="wait_for_batch", pipeline=clicks, poke_interval=10) >> batch
        ```

    Args:
        pipeline: a `sparkpoint.Pipeline`, or `"MODULE:ATTR"` naming one.
        overrides: locations and settings on top of the pipeline's (as `SparkpointOperator` takes them).
        storage_conn_id: an Airflow Connection whose credentials become fsspec storage options.
        **kwargs: Airflow's `BaseSensorOperator` arguments (`task_id`, `poke_interval`, `mode`,
            `timeout`, ...).

    Raises:
        PokeIntervalError: `poke_interval` under 1 second, or under 60 seconds with `mode="reschedule"`.
    """

    def __init__(self, *, pipeline: Pipeline | str, overrides: Mapping[str, Any] | None = None,
                 storage_conn_id: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        check_poke_interval(self.poke_interval, self.mode, self.task_id)
        self.ref = PipelineRef(pipeline, overrides, storage_conn_id)

    def poke(self, context: Context) -> bool:
        try:
            pending = self.ref.driver().pending_files()
        except SparkpointError as e:  # e.g. the input directory is not there yet
            self.log.warning("sparkpoint: input not readable yet: %s", e)
            return False
        if pending:
            self.log.info("sparkpoint: %s batch file(s) waiting, first %s", len(pending), pending[0])
        return bool(pending)
