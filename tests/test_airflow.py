"""The Airflow provider with `dag.test()` (Airflow 3, SQLite, tasks in this process): several
batches, a failure injected at each point the Dagster tag knows, healed by the DAG's `recover`
task; the state equals a recomputation and the sink holds every batch exactly once. Also: the
provider is registered, the DAG's shape, credentials from a Connection, clear errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

# Airflow reads its home and database when first imported: a throwaway one for this module.
_HOME = tempfile.mkdtemp(prefix="sparkpoint-airflow-")
os.environ["AIRFLOW_HOME"] = _HOME
os.environ["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] = f"sqlite:///{_HOME}/airflow.db"
os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
os.environ["AIRFLOW__CORE__DAGS_FOLDER"] = f"{_HOME}/dags"  # dag.test() syncs the DAG from its file
Path(_HOME, "dags").mkdir()
os.environ["AIRFLOW__CORE__UNIT_TEST_MODE"] = "False"

import pandas as pd  # noqa: E402

from sparkpoint.checkpoint.storage import CheckpointStorage  # noqa: E402
from sparkpoint.checkpoint.store import CompletedCheckpointStore  # noqa: E402
from sparkpoint.sample import pipeline as sample  # noqa: E402
from sparkpoint.spark.generate import generate  # noqa: E402
from sparkpoint.state.extract import operator_states, state_table  # noqa: E402
from sparkpoint.state.sample import item_reach, user_totals  # noqa: E402
from tests.support import oracle  # noqa: E402
from tests.support.helpers import empty_checkpoint  # noqa: E402

pytestmark = pytest.mark.spark
ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module", autouse=True)
def airflow_db() -> None:
    done = subprocess.run([str(BIN / "airflow"), "db", "migrate"], capture_output=True, text=True,
                          env={**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def pipeline_at(tmp_path: Path):  # type: ignore[no-untyped-def]
    return sample.with_(name="sample_af", job_id="job", input_url=str(tmp_path / "in"),
                        checkpoints_url=str(tmp_path / "ckpt"), output_url=str(tmp_path / "out"),
                        local_dir=str(tmp_path / "local"))


def dag_from_file(name: str, text: str):  # type: ignore[no-untyped-def]
    """`text` as the DAG file `<name>.py` in the DAGs folder (as a user writes one); its `dag`,
    imported from the file (`dag.test()` needs the DAG in a file there)."""
    import importlib.util

    path = Path(_HOME, "dags", f"{name}.py")
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.dag


def dag_file(name: str, tmp_path: Path, **factory: object):  # type: ignore[no-untyped-def]
    """The DAG of the sample pipeline at `tmp_path`, from its file in the DAGs folder."""
    return dag_from_file(name, (
        "from sparkpoint.airflow import sparkpoint_dag\n"
        "from sparkpoint.sample import pipeline\n"
        f"dag = sparkpoint_dag(pipeline.with_(name='sample_af', job_id='job', input_url={str(tmp_path / 'in')!r}, "
        f"checkpoints_url={str(tmp_path / 'ckpt')!r}, output_url={str(tmp_path / 'out')!r}, "
        f"local_dir={str(tmp_path / 'local')!r}), dag_id={name!r}, **{factory!r})\n"
    ))


def states(run) -> dict[str, str]:  # type: ignore[no-untyped-def]
    return {ti.task_id: str(ti.state) for ti in run.get_task_instances()}


# The failure after the upload (the one that leaves the most to heal) in make test; before the
# upload and before the commit too in make soak. A run after a recovered one is the backlog test's
# (`later`, after `recover` committed a batch).
EACH_POINT = ("before-upload", "after-upload", "before-commit")


@pytest.mark.parametrize("points", [("after-upload",), pytest.param(EACH_POINT, marks=pytest.mark.soak)],
                         ids=["after-upload", "each"])
def test_batches_an_injected_failure_at_each_point_and_recovery_exactly_once(tmp_path: Path, points: tuple[str, ...]):
    generate(str(tmp_path / "in"), batches=1 + len(points), events_per_batch=1500, users=300, items=40, seed=9)
    dag = dag_file("sample_af", tmp_path, max_batches_per_run=1)  # one batch a run: a failure at each point
    storage = CheckpointStorage(f"file://{tmp_path}/ckpt", "job")

    first = dag.test()
    assert states(first) == {"check_upgrade": "success", "batch": "success", "checkpoint": "success",
                             "prune": "success", "verify": "success", "recover": "skipped"}, states(first)
    assert storage.completed_checkpoint_ids() == [1]
    for cid, point in enumerate(points, start=2):
        run = dag.test(run_conf={"sparkpoint_inject_failure": point})
        got = states(run)
        assert got["recover"] == "success", (point, got)
        assert "failed" in (got["batch"], got["checkpoint"]), (point, got)
        assert str(run.state) == "failed", "the run did fail; its batch is healed"
        assert max(storage.completed_checkpoint_ids()) == cid, point
    nothing = dag.test()
    assert states(nothing)["batch"] == "skipped", "no unconsumed batch: nothing to do"

    latest = CompletedCheckpointStore(storage).latest()
    ids = list(range(1, 2 + len(points)))
    assert latest is not None and latest.checkpoint_id == ids[-1]
    batches = oracle.read_batches(str(tmp_path / "in"))
    events = pd.concat(batches, ignore_index=True)
    with operator_states(storage, latest, user_totals.name) as backends:
        oracle.assert_totals_equal(pd.concat([user_totals.export(b) for b in backends]), oracle.user_totals(events))
    with operator_states(storage, latest, item_reach.name) as backends:
        oracle.assert_reach_equal(pd.concat([item_reach.export(b) for b in backends]), oracle.item_reach(events))
    output = pd.read_parquet(tmp_path / "out")
    assert sorted(output["checkpoint_id"].unique()) == ids
    for cid, expected in zip(ids, oracle.sink_rows(batches)):
        oracle.assert_totals_equal(output[output["checkpoint_id"] == cid].drop(columns="checkpoint_id"), expected)
    pending = tmp_path / "ckpt" / "job" / "_pending"
    assert not pending.exists() or not [p for p in pending.iterdir() if p.suffix == ".json"]


def test_a_retried_batch_task_commits_its_batch_once(tmp_path: Path):
    """An after-upload failure on the first try; the retry writes an attempt of its own (the
    failed try's is aborted and fenced for good) and its checkpoint commits; `recover` stays out."""
    generate(str(tmp_path / "in"), batches=2, events_per_batch=1500, users=300, items=40, seed=4)
    dag = dag_file("sample_af_retry", tmp_path, default_args={"retries": 1, "retry_delay": 0}, max_batches_per_run=1)
    storage = CheckpointStorage(f"file://{tmp_path}/ckpt", "job")
    run = dag.test(run_conf={"sparkpoint_inject_failure": "after-upload"})
    got = states(run)
    assert got["batch"] == "success" and got["checkpoint"] == "success" and got["recover"] == "skipped", got
    assert storage.completed_checkpoint_ids() == [1]
    run = dag.test()
    assert states(run)["checkpoint"] == "success" and storage.completed_checkpoint_ids() == [2, 1][::-1]
    pending = tmp_path / "ckpt" / "job" / "_pending"
    assert not pending.exists() or not [p for p in pending.iterdir() if p.suffix == ".json"], \
        "the failed try's attempt was settled by prune"
    batches = oracle.read_batches(str(tmp_path / "in"))
    output = pd.read_parquet(tmp_path / "out")
    for cid, expected in zip([1, 2], oracle.sink_rows(batches)):
        oracle.assert_totals_equal(output[output["checkpoint_id"] == cid].drop(columns="checkpoint_id"), expected)


def test_a_ticking_dag_makes_a_checkpoint_of_no_input_when_nothing_landed(tmp_path: Path):
    """`sparkpoint_dag(..., tick=True)`: on its schedule time passes without data (processing-time
    timers fire, TTL expires in a checkpoint of no input) instead of the batch task skipping."""
    generate(str(tmp_path / "in"), batches=1, events_per_batch=300, users=50, items=10, seed=5)
    dag = dag_file("sample_af_tick", tmp_path, tick=True)
    storage = CheckpointStorage(f"file://{tmp_path}/ckpt", "job")
    assert states(dag.test())["checkpoint"] == "success"
    ticked = dag.test()
    assert states(ticked)["batch"] == "success" and states(ticked)["checkpoint"] == "success", states(ticked)
    assert storage.completed_checkpoint_ids() == [1, 2]
    facts = next(ti for ti in ticked.get_task_instances() if ti.task_id == "checkpoint").xcom_pull(
        task_ids="checkpoint")
    assert facts["batch"] == [] and facts["rows"] == 0 and facts["checkpoint_id"] == 2
    output = pd.read_parquet(tmp_path / "out")
    assert sorted(output["checkpoint_id"].unique()) == [1], "the sample emits nothing without rows"


def test_the_provider_is_registered_and_the_dag_has_its_shape(tmp_path: Path):
    from sparkpoint.airflow import get_provider_info, sparkpoint_dag

    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    listed = subprocess.run([str(BIN / "airflow"), "providers", "list"], capture_output=True, text=True, env=env,
                            timeout=300)
    assert "sparkpoint" in listed.stdout, listed.stdout[-2000:] + listed.stderr[-2000:]
    assert get_provider_info()["package-name"] == "sparkpoint"

    (tmp_path / "in").mkdir()
    dag = sparkpoint_dag(pipeline_at(tmp_path), on_landing=True)
    assert dag.dag_id == "sparkpoint_sample_af" and dag.max_active_runs == 1
    assert set(dag.task_ids) == {"check_upgrade", "wait_for_batch", "batch", "checkpoint", "prune", "verify",
                                 "recover"}
    outlets = dag.get_task("checkpoint").outlets
    assert [a.uri for a in outlets] == ["sparkpoint://job/checkpoint"]
    # The tasks that commit any number of checkpoints add one event each through an alias.
    assert [a.name for a in dag.get_task("batch").outlets] == ["sparkpoint_job_checkpoints"]
    assert [a.name for a in dag.get_task("recover").outlets] == ["sparkpoint_job_checkpoints"]
    assert dag.get_task("batch").max_batches_per_run == 10  # type: ignore[attr-defined]
    assert dag.get_task("recover").trigger_rule == "one_failed"  # a str enum
    assert dag.get_task("batch").upstream_task_ids == {"wait_for_batch"}
    assert dag.get_task("wait_for_batch").upstream_task_ids == {"check_upgrade"}, "the pre-flight comes first"


def test_credentials_come_from_an_airflow_connection(monkeypatch: pytest.MonkeyPatch):
    import json

    from sparkpoint.airflow.operators import storage_options_from_connection

    monkeypatch.setenv("AIRFLOW_CONN_LAKE", json.dumps({
        "conn_type": "aws", "login": "AKIA", "password": "s3cret",
        "extra": {"endpoint_url": "http://127.0.0.1:9000", "region_name": "eu-west-1"}}))
    assert storage_options_from_connection("lake") == {
        "key": "AKIA", "secret": "s3cret",
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:9000", "region_name": "eu-west-1"}}


def test_bad_pipeline_references_and_settings_fail_when_the_dag_is_parsed(tmp_path: Path):
    from sparkpoint.airflow import sparkpoint_dag
    from sparkpoint.pipeline.runtime import PipelineError

    with pytest.raises(PipelineError, match="cannot import 'no_such_module'"):
        sparkpoint_dag("no_such_module:pipeline")
    with pytest.raises(PipelineError, match="unknown setting 'state.nope'"):
        sparkpoint_dag(pipeline_at(tmp_path), overrides={"state.nope": 1})
    dag = sparkpoint_dag(pipeline_at(tmp_path), overrides={"state.checkpoints.num-retained": "4"})
    assert dag.get_task("prune").ref.resolved().num_retained == 4  # type: ignore[attr-defined]


def test_overrides_take_the_two_restore_settings_and_the_preflight_stops_a_refused_upgrade_first(tmp_path: Path):
    from sparkpoint.airflow.operators import PipelineRef
    ref = PipelineRef(pipeline_at(tmp_path), {"allow_new_operators": True,
                                              "execution.state-recovery.ignore-unclaimed-state": "true"}, None)
    config = ref.resolved().config()
    assert config.allow_new_operators and config.allow_non_restored_state

    storage = CheckpointStorage(f"file://{tmp_path}/ckpt", "job")  # both operators' state, without Spark
    empty_checkpoint(storage, (user_totals, item_reach), 2, tmp_path / "w")
    generate(str(tmp_path / "in"), batches=1, events_per_batch=100, users=10, items=5, seed=1)
    dropped = dag_from_file("sample_af_dropped", (
        "from sparkpoint.airflow import sparkpoint_dag\n"
        "from sparkpoint.sample import pipeline\n"
        "from sparkpoint.state.sample import user_totals\n"
        f"dag = sparkpoint_dag(pipeline.with_(name='sample_af', job_id='job', operators=(user_totals,), "
        f"input_url={str(tmp_path / 'in')!r}, checkpoints_url={str(tmp_path / 'ckpt')!r}, "
        f"local_dir={str(tmp_path / 'local')!r}), dag_id='sample_af_dropped')\n"
    ))
    run = dropped.test()
    got = states(run)
    assert got["check_upgrade"] == "failed" and got["batch"] == "upstream_failed", got
    assert got["recover"] == "skipped", "nothing ran, nothing to recover"
    assert storage.completed_checkpoint_ids() == [1]


def test_the_landing_sensor_waits_in_one_task_and_refuses_an_interval_that_cannot_work(tmp_path: Path):
    """`sparkpoint_dag(on_landing=True, poke_interval=5)` waits in poke mode (in reschedule mode
    Airflow's scheduler failed every idle wait at 5 s, apache/airflow#71172: see the standalone
    test); an interval under 1 s, or a reschedule-mode sensor under 60 s, is refused when the DAG
    is built, naming the bound."""
    from sparkpoint.airflow import SparkpointLandingSensor, sparkpoint_dag
    from sparkpoint.airflow.operators import PokeIntervalError
    from tests.support.meters_pipeline import meters

    pipeline = meters(tmp_path)
    sensor = sparkpoint_dag(pipeline, on_landing=True, poke_interval=5).get_task("wait_for_batch")
    assert (sensor.mode, sensor.poke_interval) == ("poke", 5)  # type: ignore[attr-defined]
    with pytest.raises(PokeIntervalError, match=r"poke_interval=0.5 s is under 1 s"):
        sparkpoint_dag(pipeline, on_landing=True, poke_interval=0.5)
    with pytest.raises(PokeIntervalError, match=r"mode='reschedule' with poke_interval=5 s.*poke_interval=60 or more"):
        SparkpointLandingSensor(task_id="wait", pipeline=pipeline, mode="reschedule", poke_interval=5)
    assert SparkpointLandingSensor(task_id="wait", pipeline=pipeline, mode="reschedule", poke_interval=60).reschedule


def test_a_landing_sensor_that_times_out_fails_its_run_without_running_recover(tmp_path: Path):
    """A user's pipeline (smart meters) waiting for a file that never lands: the sensor times out,
    the run fails, and `recover` skips (no batch task failed: they are `upstream_failed`) instead
    of starting Spark to recover a batch that never ran."""
    from tests.support.meters_pipeline import meters

    meters(tmp_path)
    run = dag_from_file("meters_af_idle", (
        "from pathlib import Path\n"
        "from sparkpoint.airflow import sparkpoint_dag\n"
        "from tests.support.meters_pipeline import meters\n"
        f"dag = sparkpoint_dag(meters(Path({str(tmp_path)!r})), dag_id='meters_af_idle', on_landing=True, "
        "poke_interval=1, default_args={'timeout': 0})\n"
    )).test()
    got = states(run)
    assert got["wait_for_batch"] == "failed" and got["batch"] == "upstream_failed", got
    assert got["recover"] == "skipped", got
    assert str(run.state) == "failed"
    assert not (tmp_path / "ckpt").exists(), "nothing ran"


def meters_dag(name: str, tmp_path: Path, **overrides: object):  # type: ignore[no-untyped-def]
    """A DAG file for the smart-meters pipeline (tests.support.meters_pipeline) at `tmp_path`; its DAG."""
    return dag_from_file(name, (
        "from pathlib import Path\n"
        "from sparkpoint.airflow import sparkpoint_dag\n"
        "from tests.support.meters_pipeline import meters\n"
        f"dag = sparkpoint_dag(meters(Path({str(tmp_path)!r})), dag_id={name!r}, overrides={overrides!r})\n"
    ))


def test_a_bad_file_fails_the_batch_before_spark_or_is_skipped_with_a_warning(tmp_path: Path, caplog, capfd):
    """Issue 34, item 2: under "fail" the batch task fails naming the file (no Spark, no retry,
    `recover` skips); with `overrides={"on_bad_file": "skip"}` the run consumes it and the task
    that committed its checkpoint (the batch task: the run takes the backlog) logs a warning naming
    it, no row of it in the state, the good file after it processed."""
    from sparkpoint.pipeline.driver import StatefulPipeline
    from tests.support.meters_pipeline import bad, good, meters, state_of, totals

    pipeline = meters(tmp_path)
    bad(tmp_path, "r-000.parquet", "null keys")
    rows = good(tmp_path, "r-001.parquet")
    caplog.set_level("WARNING")
    failing = meters_dag("meters_af_fail", tmp_path).test()
    assert states(failing)["batch"] == "failed" and states(failing)["recover"] == "skipped", states(failing)
    assert not (tmp_path / "local").exists() and not list((tmp_path / "ckpt").rglob("*.sst"))
    said = caplog.text + "".join(capfd.readouterr())  # the way on: a skip where the task read the file
    assert (f"`sparkpoint skip --pipeline MODULE:ATTR --input file://{tmp_path}/in --checkpoints file://{tmp_path}"
            "/ckpt --job-id meters --output") in said and "(MODULE:ATTR: where pipeline 'meters' is defined)" in said
    caplog.clear()
    run = meters_dag("meters_af_skip", tmp_path, on_bad_file="skip").test()  # takes both files: two checkpoints
    assert states(run)["checkpoint"] == "success", states(run)
    said = caplog.text + "".join(capfd.readouterr())
    assert "sparkpoint checkpoint 1 skipped input file r-000.parquet (null_keys: input file" in said
    assert state_of(pipeline) == totals([rows]), "only the good file's rows"
    store = CompletedCheckpointStore(pipeline.storage())
    assert [s.file for s in store.load(1).skipped_files] == ["r-000.parquet"] and store.load(1).source_offsets
    assert [s.file for s in store.latest().skipped_files] == ["r-000.parquet"]  # carried on
    assert StatefulPipeline(None, pipeline.config(), pipeline.operators).pending_files() == []


# --- a backlog in one run, and one asset event per committed checkpoint (issue 34, items 11, 12) ---

CLICKSTREAM = ROOT / "examples" / "clickstream"


def clicks_dag_file(name: str, tmp_path: Path, **factory: object):  # type: ignore[no-untyped-def]
    """The DAG of the clickstream example's own `clicks` pipeline (not the sample's) at `tmp_path`."""
    return dag_from_file(name, (
        "import sys\n"
        f"sys.path.insert(0, {str(CLICKSTREAM)!r})\n"
        "from clickstream.pipelines import clicks\n"
        "from sparkpoint.airflow import sparkpoint_dag\n"
        f"dag = sparkpoint_dag(clicks.with_(input_url={str(tmp_path / 'in')!r}, "
        f"checkpoints_url={str(tmp_path / 'ckpt')!r}, output_url={str(tmp_path / 'out')!r}, "
        f"local_dir={str(tmp_path / 'local')!r}), dag_id={name!r}, **{factory!r})\n"
    ))


def downstream_dag_file(name: str, seen: Path):  # type: ignore[no-untyped-def]
    """A user's DAG scheduled on the clicks job's checkpoint asset: it writes down the checkpoint
    ids of the asset events that triggered its run."""
    return dag_from_file(name, (
        "import json\n"
        "from datetime import UTC, datetime\n"
        "from airflow.sdk import DAG, task\n"
        "from sparkpoint.airflow import checkpoint_asset\n"
        f"with DAG({name!r}, schedule=[checkpoint_asset('clicks')], start_date=datetime(2026, 1, 1, tzinfo=UTC), "
        "catchup=False) as dag:\n"
        "    @task\n"
        "    def record(triggering_asset_events=None):\n"
        "        extras = [e.extra for events in triggering_asset_events.values() for e in events]\n"
        f"        open({str(seen)!r}, 'w').write(json.dumps(extras))\n"
        "    record()\n"
    ))


def checkpoint_events(uri: str) -> list[tuple[str, dict]]:  # type: ignore[type-arg]
    """(the task that emitted it, its extra) of every asset event on `uri`, oldest first."""
    from airflow.models.asset import AssetEvent, AssetModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        events = session.scalars(select(AssetEvent).join(AssetModel, AssetEvent.asset_id == AssetModel.id)
                                 .where(AssetModel.uri == uri).order_by(AssetEvent.id)).all()
        return [(str(e.source_task_id), dict(e.extra)) for e in events]


def deploy(dag_id: str) -> None:
    """What the DAG processor and a user switching a DAG on do: the DAGs folder parsed into the
    database, and `dag_id` unpaused (asset events queue runs of unpaused DAGs only)."""
    from airflow.dag_processing.bundles.manager import DagBundlesManager
    from airflow.dag_processing.dagbag import BundleDagBag, sync_bag_to_db
    from airflow.models.dag import DagModel
    from airflow.utils.session import create_session
    from sqlalchemy import update

    manager = DagBundlesManager()
    manager.sync_bundles_to_db()
    for bundle in manager.get_all_dag_bundles():
        if not bundle.is_initialized:
            bundle.initialize()
        sync_bag_to_db(BundleDagBag(dag_folder=bundle.path, bundle_path=bundle.path, bundle_name=bundle.name),
                       bundle.name, bundle.version)
    with create_session() as session:
        assert session.execute(update(DagModel).where(DagModel.dag_id == dag_id).values(is_paused=False)).rowcount == 1


def run_asset_triggered(dag) -> None:  # type: ignore[no-untyped-def]
    """What the scheduler does for a DAG scheduled on assets (its own code): create the run the
    queued asset events ask for, then run that run's tasks in this process, as `dag.test()` does."""
    from airflow.jobs.job import Job
    from airflow.jobs.scheduler_job_runner import SchedulerJobRunner
    from airflow.models.dag import DagModel
    from airflow.models.dagbag import DBDagBag
    from airflow.models.dagrun import DagRun
    from airflow.sdk.definitions.dag import _run_task
    from airflow.utils.session import create_session
    from airflow.utils.state import DagRunState, TaskInstanceState
    from airflow.utils.types import DagRunType
    from sqlalchemy import select

    with create_session() as session:
        query, triggered = DagModel.dags_needing_dagruns(session)
        due = [d for d in query.all() if d.dag_id in triggered]
        assert dag.dag_id in {d.dag_id for d in due}, "the asset events queued no run of the downstream DAG"
        SchedulerJobRunner(job=Job())._create_dag_runs_asset_triggered(
            dag_models=[d for d in due if d.dag_id == dag.dag_id], session=session)
    with create_session() as session:
        run = session.scalars(select(DagRun).where(DagRun.dag_id == dag.dag_id,
                                                   DagRun.run_type == DagRunType.ASSET_TRIGGERED)).one()
        run.dag = DBDagBag().get_dag_for_run(run, session=session)
        run.state = DagRunState.RUNNING
        session.commit()
        while run.state == DagRunState.RUNNING:
            session.expire_all()
            schedulable, _ = run.update_state(session=session)
            for ti in schedulable:
                ti.try_number += 1
                ti.state = TaskInstanceState.SCHEDULED
            session.commit()
            for ti in [t for t in run.get_task_instances(session=session) if t.state == TaskInstanceState.SCHEDULED]:
                _run_task(ti=ti, task=dag.task_dict[ti.task_id])
        assert str(run.state) == "success", run.state


def test_a_backlog_is_one_run_and_every_checkpoint_one_asset_event_recovered_ones_too(tmp_path: Path):
    """Three clicks files in one run (`max_batches_per_run=3`), the third failing after its upload:
    batches 1 and 2 stay committed, `recover` commits the third, and each of the three is one
    asset event (announced by `recover`: the failed batch task announced nothing), which starts
    a downstream DAG scheduled on the asset. The next run takes the two files left, one
    checkpoint each: one event from the batch task, one from the checkpoint task."""
    sys.path.insert(0, str(CLICKSTREAM))
    try:
        from clickstream.land import land
    finally:
        sys.path.pop(0)
    files = [p.name for p in land(tmp_path / "in", 4)]
    seen = tmp_path / "seen.json"
    downstream = downstream_dag_file("after_clicks", seen)
    dag = clicks_dag_file("clicks_af", tmp_path, max_batches_per_run=3)
    deploy(downstream.dag_id)
    storage = CheckpointStorage(f"file://{tmp_path}/ckpt", "clicks")

    failed = dag.test(run_conf={"sparkpoint_inject_failure": "after-upload"})
    got = states(failed)
    assert got["batch"] == "failed" and got["checkpoint"] == "upstream_failed" and got["recover"] == "success", got
    assert max(storage.completed_checkpoint_ids()) == 3, "batches 1 and 2 committed, the third recovered"
    events = checkpoint_events("sparkpoint://clicks/checkpoint")
    assert [(task, e["checkpoint_id"], e["batch"]) for task, e in events] == [
        ("recover", 1, [files[0]]), ("recover", 2, [files[1]]), ("recover", 3, [files[2]])]
    for _, extra in events:
        assert extra["path"] == f"{storage.job_url}/chk-{extra['checkpoint_id']}/_metadata"
        assert extra["state_size"] > 0 and 0 < extra["checkpointed_size"] <= extra["state_size"]
    latest = CompletedCheckpointStore(storage).load(3)
    assert (events[-1][1]["state_size"], events[-1][1]["checkpointed_size"]) == (
        latest.stats.state_size, latest.stats.checkpointed_size)

    run_asset_triggered(downstream)
    # The scheduler gives a run the events up to the one that queued it (later ones go to the
    # next run); each event is listed under the asset and under the alias that added it.
    triggered = {e["checkpoint_id"]: e for e in json.loads(seen.read_text())}
    assert triggered and sorted(triggered) == [1, 2, 3][:len(triggered)], triggered
    assert triggered[1] == events[0][1], "the downstream run read the recovered run's checkpoint from its event"

    land(tmp_path / "in", 1)  # two files pending now: one run takes both
    later = dag.test()
    assert states(later)["batch"] == "success" and states(later)["checkpoint"] == "success", states(later)
    assert states(later)["recover"] == "skipped"
    events = checkpoint_events("sparkpoint://clicks/checkpoint")
    assert [(task, e["checkpoint_id"]) for task, e in events][3:] == [("batch", 4), ("checkpoint", 5)]
    assert sorted(e["checkpoint_id"] for _, e in events) == [1, 2, 3, 4, 5], "exactly one event a checkpoint"

    sys.path.insert(0, str(CLICKSTREAM))
    try:
        from clickstream.operators import clicks_per_user
    finally:
        sys.path.pop(0)
    landed = pd.concat([pd.read_parquet(p) for p in sorted((tmp_path / "in").glob("clicks-*.parquet"))])
    _, table = state_table(storage, clicks_per_user)
    assert dict(zip(table["user"], table["clicks"])) == landed.groupby("user").size().to_dict()
    output = pd.read_parquet(tmp_path / "out")
    assert sorted(output["checkpoint_id"].unique()) == [1, 2, 3, 4, 5], "each batch's output committed once"


def test_a_delta_output_gets_one_asset_event_per_checkpoint_with_the_table_version_it_made(tmp_path: Path):
    """The clickstream example's own pipeline into a Delta table: two files in one run, the batch
    task commits the first (through the alias) and the checkpoint task the second; each is one
    event on the table's asset (`output_asset`, the table's URL), its extra the table version that
    checkpoint made and the rows it added."""
    from deltalake import DeltaTable as Table

    from sparkpoint import DeltaTable
    from sparkpoint.airflow import output_asset

    sys.path.insert(0, str(CLICKSTREAM))
    try:
        from clickstream.land import land
    finally:
        sys.path.pop(0)
    land(tmp_path / "in", 2)
    url = DeltaTable(str(tmp_path / "table")).uri
    dag = dag_from_file("clicks_af_delta", (
        "import sys\n"
        f"sys.path.insert(0, {str(CLICKSTREAM)!r})\n"
        "from clickstream.pipelines import clicks\n"
        "from sparkpoint.airflow import sparkpoint_dag\n"
        f"dag = sparkpoint_dag(clicks.with_(input_url={str(tmp_path / 'in')!r}, "
        f"checkpoints_url={str(tmp_path / 'ckpt')!r}, output_url={url!r}, "
        f"local_dir={str(tmp_path / 'local')!r}), dag_id='clicks_af_delta')\n"
    ))
    run = dag.test()
    assert states(run)["batch"] == "success" and states(run)["checkpoint"] == "success", states(run)
    table = Table(str(tmp_path / "table"))
    rows = table.to_pandas()
    versions = {c["sparkpoint.checkpoint-id"]: c["version"] for c in table.history() if "sparkpoint.checkpoint-id" in c}
    events = checkpoint_events(output_asset(url).uri)
    assert [(task, e["checkpoint_id"], e["table_version"]) for task, e in events] == [
        ("batch", 1, versions[1]), ("checkpoint", 2, versions[2])]
    for _, extra in events:
        assert extra["url"] == url and "checkpoint_id" in extra["columns"]
        assert extra["rows"] == int((rows["checkpoint_id"] == extra["checkpoint_id"]).sum()) > 0
