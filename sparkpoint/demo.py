"""`make run`: the sample pipeline materialized through Dagster on embedded defaults.

Local Spark, `file://` checkpoint storage under `.sparkpoint/`, a Dagster instance (SQLite)
under `.sparkpoint/dagster`. Each run materializes the SSTable and checkpoint assets for a few
batches (each lands the next batch of the sample stream when none is unconsumed), one of them
with an injected `after-upload` failure that the recovery sensor's run heals; then it prints the
checkpoint table (sizes in the unit style of the lines above it) and compares the latest
checkpoint's state with a plain recomputation over every consumed file. The sample's output is a
Delta table (`.sparkpoint/demo/output`, one table version per checkpoint); the demo reads it back
with delta-rs and prints each checkpoint's rows beside a recomputation of what its batch changed.
Its last line says where to look next (`make ui`, and the exact `sparkpoint list ...` of its job).
Runs again and again: each resumes from the latest completed checkpoint.
"""

import os
import shlex
import shutil
import signal
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import dagster as dg
import numpy as np
import pandas as pd

from sparkpoint.checkpoint.catalog import readable_size
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.definitions import sample_defs
from sparkpoint.ops.instance import prepare_dagster_home
from sparkpoint.pipeline.maintenance import interruption_summary
from sparkpoint.pipeline.spec import Pipeline
from sparkpoint.resources import SparkResource
from sparkpoint.resources.scope import INJECT_TAG
from sparkpoint.sample import pipeline
from sparkpoint.spark.session import interrupted, request_interrupt, stop_quietly
from sparkpoint.state.extract import operator_states
from sparkpoint.state.sample import item_reach, user_totals

QUIET = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}
RUNS: list[dict[str, str]] = [{}, {INJECT_TAG: "after-upload"}, {}]


WORKER = "SPARKPOINT_DEMO_WORKER"
INPUT = Path(pipeline.location("input"))
OUTPUT = Path(pipeline.output_table().url)  # type: ignore[union-attr]  # the sample has an output
SHOWN = 6  # checkpoints whose rows the demo prints (it checks them all)


def main() -> int:
    """The demo runs in a child process of its own session; this process only waits for it.

    A Ctrl-C at the terminal reaches the whole foreground process group: Dagster's compute-log
    helpers, Spark's workers and the JVM would each print their own trace, and Dagster turns the
    interrupt of a run into a failed run that the demo would go on to heal. Here it reaches this
    process only, which asks the child to stop (SIGUSR1): the child cancels the Spark job, lets the
    run fail, starts nothing more and prints one line."""
    if os.environ.get(WORKER) == "1":
        return run_demo()
    child = subprocess.Popen([sys.executable, "-m", "sparkpoint.demo"], env={**os.environ, WORKER: "1"},
                             start_new_session=True)
    try:
        return child.wait()
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # one Ctrl-C is enough
        child.send_signal(signal.SIGUSR1)
        try:
            return child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            print("sparkpoint demo: interrupted; it did not stop within 30 s and was killed; a rerun resumes "
                  "from the latest completed checkpoint", file=sys.stderr)
            return 130


def run_demo() -> int:
    signal.signal(signal.SIGUSR1, lambda signum, frame: request_interrupt())
    if (earlier := earlier_parquet_output()) is not None:
        print(earlier, file=sys.stderr)
        return 1
    os.environ["DAGSTER_HOME"] = str(prepare_dagster_home(".sparkpoint/dagster"))
    # Dagster 1.13 warns that sensors' `owners` is beta when it copies a run-failure sensor (we set none).
    warnings.filterwarnings("ignore", category=dg.BetaWarning)
    # The code location's sample pipeline, with one JVM for the whole demo.
    sample = sample_defs(resources={"spark": SparkResource(app_name=pipeline.name, stop_on_teardown=False)})
    defs, scope = sample.definitions(), sample.scope
    storage: CheckpointStorage = pipeline.storage()
    print(f"sparkpoint demo: input {INPUT.resolve()}, checkpoints {storage.job_url}, "
          f"Dagster instance {os.environ['DAGSTER_HOME']}", flush=True)
    try:
        with dg.DagsterInstance.get() as instance:
            for tags in RUNS:
                result = defs.resolve_job_def(scope.name("checkpoint")).execute_in_process(
                    instance=instance, tags=tags, run_config=QUIET, raise_on_error=False)
                if interrupted():  # Dagster turns the Ctrl-C into a failed run: stop, heal nothing
                    raise KeyboardInterrupt
                _report("materialize" + (f" [{tags[INJECT_TAG]}]" if tags else ""), result)
                if not result.success:
                    _heal(instance, result, defs, scope.name)
                    if interrupted():
                        raise KeyboardInterrupt
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C does not break the clean-up
        _stop_spark()
        print(f"sparkpoint demo: {interruption_summary(storage)}", file=sys.stderr)
        return 130
    _stop_spark()
    _table(storage)
    status = check_latest(storage) | check_output(storage)
    print(next_steps(pipeline))
    return status


def earlier_parquet_output() -> str | None:
    """What to do when `.sparkpoint/` holds an earlier demo's output, a directory of Parquet part
    files where the demo now keeps a Delta table (its checkpoints name those files: a resume
    cannot commit them to a table)."""
    if not OUTPUT.is_dir() or (OUTPUT / "_delta_log").exists() or not any(OUTPUT.glob("part-*.parquet")):
        return None
    return (f"sparkpoint demo: {OUTPUT} holds Parquet files an earlier sparkpoint demo wrote; the demo now writes "
            "a Delta table there, and its checkpoints name those files. Start afresh: `rm -rf .sparkpoint`, then "
            "`make run` again")


def _stop_spark() -> None:
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is None:
        return
    if interrupted():
        stop_quietly(active)
    else:
        active.stop()

def _heal(instance: dg.DagsterInstance, failed: dg.ExecuteInProcessResult, defs: dg.Definitions,
          name: Callable[[str], str]) -> None:
    """What the daemon does on a failed run: evaluate the recovery sensor, launch its request."""
    recovery_sensor = defs.resolve_sensor_def(name("recovery_sensor"))
    recover_job = defs.resolve_job_def(name("recover"))
    request = recovery_sensor(dg.build_sensor_context(instance=instance))
    if not isinstance(request, dg.RunRequest):
        print(f"  recovery sensor: {request.skip_message if isinstance(request, dg.SkipReason) else 'nothing'}")
        return
    print(f"  recovery sensor: launching `{recover_job.name}` (run key {request.run_key})")
    run = recover_job.execute_in_process(run_config={**request.run_config, **QUIET}, tags=request.tags,
                                         instance=instance, raise_on_error=False)
    _report("recover", run)


def _report(what: str, result: dg.ExecuteInProcessResult) -> None:
    """A run's line, out at once (a pipe, `make run | tee`, sees each run as it ends)."""
    done = [e.materialization for e in result.get_asset_materialization_events()
            if e.materialization.asset_key.path[-1] == "checkpoint"]
    if not result.success:
        failure = next((e for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE), None)
        cause = failure.step_failure_data.error.cause if failure and failure.step_failure_data.error else None
        message = ((cause.message if cause else failure.message if failure else None) or "?").strip().splitlines()[0]
        print(f"{what}: run {result.run_id[:8]} FAILED: {message}", flush=True)
    for m in done:
        v = {k: x.value for k, x in m.metadata.items()}
        print(f"{what}: run {result.run_id[:8]} -> {v['summary']}; retained {v['retained']}", flush=True)
    if result.success and not done:
        print(f"{what}: run {result.run_id[:8]} made no new checkpoint", flush=True)


def _table(storage: CheckpointStorage) -> None:
    """The retained checkpoints, sizes in the unit style of the lines above (`readable_size`)."""
    print(f"{'checkpoint':>10} {'kind':>10} {'state':>10} {'uploaded':>10} {'files':>6} {'batches':>7}")
    for meta in CompletedCheckpointStore(storage).load_all().checkpoints:
        consumed = len(meta.source_offsets["source"]["consumed"])
        print(f"{meta.checkpoint_id:>10} {meta.kind:>10} {readable_size(meta.stats.state_size):>10} "
              f"{readable_size(meta.stats.checkpointed_size):>10} {len(meta.paths()):>6} {consumed:>7}")


def next_steps(demo: Pipeline) -> str:
    """The demo's last line: where to look next, with the exact command for its job."""
    command = shlex.join([_sparkpoint_command(), "list", "--checkpoints", demo.location("checkpoints"),
                          "--job-id", demo.effective_job_id])
    return (f"next: `make ui` shows these runs, checkpoints and checks in the Dagster UI; `{command}` lists "
            "the retained checkpoints")


def _sparkpoint_command() -> str:
    """`sparkpoint` when it is on PATH, else the script beside this Python (`.venv/bin/sparkpoint`)."""
    script = Path(sys.executable).parent / "sparkpoint"
    found = shutil.which("sparkpoint")
    if not script.exists() or (found is not None and Path(found).resolve() == script.resolve()):
        return "sparkpoint"
    relative = os.path.relpath(script)
    return relative if not relative.startswith("..") else str(script)


def check_latest(storage: CheckpointStorage) -> int:
    store = CompletedCheckpointStore(storage)
    meta = store.load(store.checkpoint_ids()[0])
    consumed = meta.source_offsets["source"]["consumed"]
    events = pd.concat([pd.read_parquet(INPUT / name) for name in consumed], ignore_index=True)
    ok = True
    for op, expected in [(user_totals, _totals(events)), (item_reach, _reach(events))]:
        with operator_states(storage, meta, op.uid) as backends:
            got = pd.concat([op.export(b) for b in backends]).sort_values(op.key).reset_index(drop=True)
        same = _same(got, expected)
        ok &= same
        print(f"chk-{meta.checkpoint_id} {op.name}: {len(got)} keys, {'matches' if same else 'DIFFERS FROM'} "
              f"a recomputation over {len(consumed)} files")
    return 0 if ok else 1


def check_output(storage: CheckpointStorage) -> int:
    """Read the output Delta table back (delta-rs, as a user would) and compare each checkpoint's
    rows with a recomputation: the users its batch changed, with their totals over every batch up
    to it (each checkpoint consumed one batch file, in the order the latest `_metadata` lists them)."""
    from deltalake import DeltaTable as Table

    table = Table(str(OUTPUT))
    rows = table.to_pandas()
    versions = {c["sparkpoint.checkpoint-id"]: c["version"] for c in table.history() if "sparkpoint.checkpoint-id" in c}
    store = CompletedCheckpointStore(storage)
    consumed = store.load(store.checkpoint_ids()[0]).source_offsets["source"]["consumed"]
    ids = sorted(int(i) for i in rows["checkpoint_id"].unique())
    print(f"output: Delta table {OUTPUT.resolve()} at version {table.version()}, {len(rows)} rows of "
          f"{len(ids)} checkpoints (read with deltalake.DeltaTable(path).to_pandas())")
    ok, seen = len(ids) == len(consumed), pd.DataFrame()
    if not ok:
        print(f"output: {len(ids)} checkpoints in the table, DIFFERS FROM the {len(consumed)} batches consumed")
    for i, (cid, name) in enumerate(zip(ids, consumed)):
        batch = pd.read_parquet(INPUT / name)
        seen = pd.concat([seen, batch], ignore_index=True)
        totals = _totals(seen)
        expected = totals[totals["user_id"].isin(set(batch["user_id"]))]
        got = rows[rows["checkpoint_id"] == cid][list(expected.columns)].sort_values("user_id").reset_index(drop=True)
        same = _same(got, expected)
        ok &= same
        if i >= len(ids) - SHOWN or not same:
            print(f"  chk-{cid}: {len(got)} rows in table version {versions.get(cid, '?')}, "
                  f"{'equal to' if same else 'DIFFERENT FROM'} a recomputation over {i + 1} batch file(s)")
    return 0 if ok else 1


def _totals(events: pd.DataFrame) -> pd.DataFrame:
    return events.groupby("user_id").agg(
        count=("event_id", "size"), amount_sum=("amount", "sum"), amount_min=("amount", "min"),
        amount_max=("amount", "max"), last_ts=("ts", "max"),
    ).reset_index()


def _reach(events: pd.DataFrame) -> pd.DataFrame:
    reach = events.groupby("item_id").agg(events=("event_id", "size"), distinct_users=("user_id", "nunique"))
    return reach.reset_index()


def _same(got: pd.DataFrame, expected: pd.DataFrame) -> bool:
    expected = expected.sort_values(expected.columns[0]).reset_index(drop=True)
    if list(got.columns) != list(expected.columns) or len(got) != len(expected):
        return False
    for column in got.columns:
        a, b = got[column], expected[column]
        if column == "amount_sum":
            if not np.allclose(a.to_numpy(float), b.to_numpy(float), rtol=1e-9):
                return False
        elif column == "last_ts":
            if not (pd.to_datetime(a, utc=True) == pd.to_datetime(b, utc=True)).all():
                return False
        elif list(a.astype(str)) != list(b.astype(str)):
            return False
    return True


if __name__ == "__main__":
    sys.exit(main())
