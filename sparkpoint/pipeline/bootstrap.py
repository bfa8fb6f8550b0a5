"""Initial state: a savepoint written from a table, which a job starts from (`sparkpoint bootstrap`).

Flink's State Processor API writes savepoints from DataSets; Spark's `transformWithState` takes an
initial-state DataFrame. Here an operator declares `bootstrap=fn(table, state)`, and

    plan = plan_bootstrap(pipeline, "balances", "file:///data/balances.parquet", "file:///sp/balances-0")
    result = plan.run(spark)        # or bootstrap_savepoint(spark, pipeline, ...) in one call
    # sparkpoint run --pipeline M:A --from-checkpoint <result.url>

runs one Spark job at the pipeline's parallelism (or `parallelism`), in which each task keeps
its subtask's key groups' rows of the table, calls `bootstrap` over an empty state and takes a
full snapshot; the driver commits `_metadata` (kind `savepoint`) into the new directory `target`,
laid out as a job directory whose job id is the directory's name, as `sparkpoint savepoint --to`
lays one out. So:

- every operator of the pipeline is in it, the others with empty state: the job starts from it
  without `--allow-new-operators` (Flink's State Processor API writes only the operators you
  bootstrap);
- it consumed no input: the job then reads all of its input;
- it is self-contained: full snapshots, no changelog, nothing outside its directory; a job
  restores it at any parallelism (key groups), in CLAIM or NO_CLAIM mode, and never deletes it.

Every check that needs no Spark is made by `plan_bootstrap`, before Spark starts. The target is
claimed by an exclusive `_claim.json` (what it was made from; `savepoint --to` claims its target
the same way) before anything is written into it, so two bootstraps, or a bootstrap and a
savepoint, into one directory cannot mix; a failed bootstrap removes what it wrote.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.metadata import CheckpointMetadata, SubtaskStateHandle, utc_now_iso
from sparkpoint.checkpoint.savepoint import TARGET_CLAIM, claim_target, new_savepoint_storage
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.pipeline.runtime import DEFAULT_PARALLELISM, PipelineError, operator_functions
from sparkpoint.pipeline.spec import Pipeline
from sparkpoint.spark.bootstrap import (
    BOOTSTRAP_SCHEMA,
    BootstrapSpec,
    InitialTable,
    bootstrap_slots,
    check_initial_table,
)
from sparkpoint.spark.offsets import SourceOffsets
from sparkpoint.state.keygroups import check_parallelism

SAVEPOINT_ID = 1  # the savepoint's `chk-<N>`: the first checkpoint of a job that never ran
CLAIM_FILE = TARGET_CLAIM


class BootstrapError(PipelineError):
    """The operator cannot be bootstrapped as asked (no such operator, no `bootstrap` function)."""


@dataclass(frozen=True)
class BootstrapResult:
    url: str  # the savepoint's `chk-<N>` directory: what `run --from-checkpoint` takes
    metadata: CheckpointMetadata
    operator: str
    rows: int  # rows of the initial table, over every subtask
    files: int
    bytes: int

    def to_json(self) -> dict[str, Any]:
        return {"savepoint": self.url, "checkpoint_id": self.metadata.checkpoint_id, "kind": self.metadata.kind,
                "operator": self.operator, "rows": self.rows, "parallelism": len(
                    self.metadata.operators[self.operator].subtasks), "files": self.files, "bytes": self.bytes}


@dataclass(frozen=True)
class BootstrapPlan:
    """A bootstrap checked and ready to run: `run(spark)` does the Spark job and the commit."""

    pipeline: Pipeline
    operator: str
    table: InitialTable
    target: CheckpointStorage
    parallelism: int
    source_options: dict[str, Any]
    creates_target: bool = True  # False: the target is an empty directory that was there already

    def run(self, spark: Any) -> BootstrapResult:
        """Write the savepoint (see the module's docstring). Raises CheckpointAlreadyExists when
        another writer claimed the target first; on any failure removes what this run wrote."""
        self._claim()
        try:
            return self._write(spark)
        except BaseException:
            _remove_everything(self.target, job_dir=self.creates_target)
            raise

    def _claim(self) -> None:
        claim = {"format": "sparkpoint-bootstrap", "version": 1, "pipeline": self.pipeline.name,
                 "operator": self.operator, "table": self.table.url, "files": list(self.table.files),
                 "rows": self.table.rows, "parallelism": self.parallelism, "created_at": utc_now_iso()}
        claim_target(self.target, claim)

    def _write(self, spark: Any) -> BootstrapResult:
        pipeline = self.pipeline
        operators = pipeline.operators
        spec = BootstrapSpec(
            checkpoint_id=SAVEPOINT_ID, savepoint_url=self.target.url, job_id=self.target.job_id,
            storage_options=self.target.storage_options, operators=operators,
            bootstrapped=[op.name for op in operators].index(self.operator), table_urls=self.table.files,
            table_options=self.source_options, parallelism=self.parallelism,
            max_parallelism=pipeline.max_parallelism, local_dir=pipeline.config().local_dir,
            rocksdb=pipeline.rocksdb, time_us=int(time.time() * 1_000_000), event_time=pipeline.event_time is not None,
        )
        rows = _run_spark(spark, spec)
        coordinator = CheckpointCoordinator(self.target)
        pending = coordinator.trigger(kind="savepoint", expected={op.uid: self.parallelism for op in operators},
                                      checkpoint_id=SAVEPOINT_ID, names={op.uid: op.name for op in operators})
        for row in rows:
            coordinator.acknowledge(pending.checkpoint_id, SubtaskStateHandle.loads(row["handle"]))
        # No input consumed, no output committed, no watermark: the job starts at the beginning.
        done = coordinator.complete(pending.checkpoint_id, source_offsets={"source": SourceOffsets(()).to_json(),
                                                                           "sink": []})
        meta = done.metadata
        return BootstrapResult(
            url=f"{self.target.job_url}/{meta.directory}", metadata=meta, operator=self.operator,
            rows=sum(int(r["rows"]) for r in rows), files=len(meta.paths()), bytes=sum(f.size for f in meta.files()),
        )


def plan_bootstrap(
    pipeline: Pipeline, operator: str, source_url: str, target_url: str, *, parallelism: int | None = None,
    storage_options: dict[str, Any] | None = None, source_options: dict[str, Any] | None = None,
) -> BootstrapPlan:
    """Check a bootstrap without Spark: `operator` is one of the pipeline's and has `bootstrap`;
    `source_url` is a Parquet file or a directory of them, with rows, the operator's key column
    and (where the footers tell) no null key; `target_url` is a new (or empty) directory. `storage_options`
    (the target's) and `source_options` default to the pipeline's storage and input options.

    Raises:
        BootstrapError: no such operator (its names are listed), or it has no `bootstrap`.
        SourceError: the table is missing, empty, not Parquet, or has null keys.
        SourceSchemaError: a file of the table lacks the key column.
        CheckpointAlreadyExists: `target_url` exists already (an empty directory is taken).
        PipelineError: `parallelism` does not fit the pipeline's max parallelism.
    """
    names = [op.name for op in pipeline.operators]
    if operator not in names:
        raise BootstrapError(f"pipeline {pipeline.name!r} has no operator {operator!r}; it has: {', '.join(names)}")
    op = pipeline.operator(operator)
    if op.bootstrap is None:
        raise BootstrapError(
            f"operator {operator!r} of pipeline {pipeline.name!r} has no bootstrap function: give its KeyedOperator "
            "bootstrap=fn(table, state), which writes a subtask's rows of the initial table into its state")
    chosen = next(p for p in (parallelism, pipeline.parallelism, DEFAULT_PARALLELISM) if p is not None)
    try:
        check_parallelism(chosen, pipeline.max_parallelism)
    except ValueError as e:
        raise PipelineError(f"--parallelism {chosen}: {e}") from e
    options = dict(storage_options if storage_options is not None else pipeline.storage_options)
    inputs = dict(source_options if source_options is not None else pipeline.config().input_options)
    table = check_initial_table(source_url, inputs, op.key, op.name)
    target = new_savepoint_storage(target_url, options, allow_empty=True)
    return BootstrapPlan(pipeline, operator, table, target, chosen, inputs, not target.job_dir_exists())


def bootstrap_savepoint(
    spark: Any, pipeline: Pipeline, operator: str, source_url: str, target_url: str, *,
    parallelism: int | None = None, storage_options: dict[str, Any] | None = None,
    source_options: dict[str, Any] | None = None,
) -> BootstrapResult:
    """Write a savepoint at `target_url` holding `operator`'s state bootstrapped from the table at
    `source_url` (and the pipeline's other operators empty); a job starts from `result.url`.

    Example:
        result = bootstrap_savepoint(spark, pipeline, "balances", "file:///data/opening/",
                                     "file:///data/savepoints/balances-0")
        StatefulPipeline(spark, pipeline.with_(from_checkpoint=result.url).config(), pipeline.operators).run()

    Args:
        spark: a SparkSession (classic or Spark Connect).
        pipeline: the pipeline the savepoint is for (its operators, max parallelism, options).
        operator: the name of the operator whose `bootstrap(table, state)` runs.
        source_url: a Parquet file or a directory of them (any fsspec URL or local path).
        target_url: a new (or empty) directory; its name becomes the savepoint's job id.
        parallelism: subtasks per operator (default: the pipeline's, or 2); a job may restore the
            savepoint at any other.
        storage_options: fsspec options of the target (default: the pipeline's).
        source_options: fsspec options of the table (default: the pipeline's input options).

    Returns:
        The savepoint: `url` (`<target>/chk-1`, what `--from-checkpoint` takes), its metadata, the
        rows bootstrapped, its files and bytes.

    Raises:
        what `plan_bootstrap` raises, before any Spark work; after it, a Spark task's error (the
        bootstrap function's, or null keys the footers did not show), with the target removed.
    """
    plan = plan_bootstrap(pipeline, operator, source_url, target_url, parallelism=parallelism,
                          storage_options=storage_options, source_options=source_options)
    return plan.run(spark)


def _run_spark(spark: Any, spec: BootstrapSpec) -> list[dict[str, Any]]:
    from sparkpoint.spark.session import job_group, ship_modules  # pyspark: only where Spark runs

    ship_modules(spark, operator_functions(spec.operators))

    def run(ids):  # type: ignore[no-untyped-def]  # Spark infers UDF kinds from hints: keep none
        return bootstrap_slots(spec, ids)

    job = spark.range(0, spec.parallelism, 1, spec.parallelism).mapInPandas(run, BOOTSTRAP_SCHEMA)
    with job_group(spark, f"sparkpoint-bootstrap-{spec.job_id}", f"sparkpoint bootstrap {spec.job_id}"):
        rows = [r.asDict() for r in job.collect()]
    expected = len(spec.operators) * spec.parallelism
    if len(rows) != expected:
        raise PipelineError(f"expected {expected} subtask results, Spark returned {len(rows)}")
    return rows


def _remove_everything(target: CheckpointStorage, *, job_dir: bool) -> None:
    """Best effort: every file in the target directory this run claimed (only it writes there),
    the claim last, then the directories (the target too when this run made it); one by one,
    never a pattern (DESIGN rule 11)."""
    try:
        files = [f.path for top in ("shared", f"chk-{SAVEPOINT_ID}") for f in target.walk(top) if not f.symlink]
        target.delete(files)
        target.delete([CLAIM_FILE])
        target.remove_created_dirs([*files, CLAIM_FILE], job_dir=job_dir)
    except Exception:  # what is left is the user's to remove (the message of the error says where)
        pass

