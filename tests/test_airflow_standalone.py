"""End to end in `airflow standalone` on 127.0.0.1 (SQLite, LocalExecutor, small parallelism): the
two example DAGs side by side. The sample's DAG is triggered through the REST API, a failure is
injected into one run and healed by its `recover` task, a later run succeeds; the clickstream
example's DAG runs by itself when files land (its landing sensor, `@continuous`). Each pipeline's
state equals a recomputation; neither touches the other's checkpoints. A user's DAG behind the
landing sensor at a short poke interval, in the same standalone (its own DAG id and directories),
waits idle without failing a run."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.spark.generate import generate
from sparkpoint.spark.warm import stop as stop_warm_spark
from sparkpoint.state.extract import operator_states, state_table
from sparkpoint.state.sample import user_totals
from tests.support import oracle
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.spark, pytest.mark.e2e]
ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
DONE = {"success", "failed"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Airflow:
    """`airflow standalone` in `root` with `dags` (file name -> source), ready once the DAGs
    `expect` names are parsed."""

    def __init__(self, root: Path, *, dags: dict[str, str], expect: set[str],
                 env: dict[str, str] | None = None) -> None:
        self.dags, self.expect, self.extra_env = dags, expect, env or {}
        self.root, self.port = root, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = root / "standalone.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 300) -> None:
        home, dags = self.root / "airflow-home", self.root / "dags"
        dags.mkdir(parents=True)
        for name, source in self.dags.items():
            (dags / name).write_text(source)
        env = {**os.environ, "AIRFLOW_HOME": str(home), "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
               "AIRFLOW__CORE__LOAD_EXAMPLES": "False", "AIRFLOW__CORE__PARALLELISM": "4",
               "AIRFLOW__API__PORT": str(self.port), "AIRFLOW__API__HOST": "127.0.0.1",
               "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.url}/execution/",
               "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
               # Files are listed every 5 s; each is parsed when first seen and not again: the DAG
               # files never change while it runs (Airflow's default parses each every 30 s).
               "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
               "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "3600",
               "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home}/airflow.db",
               "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "SPARK_LOCAL_IP": "127.0.0.1",
               "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "examples" / "clickstream")]),
               **self.extra_env}
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([str(BIN / "airflow"), "standalone"], cwd=self.root, env=env, stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.wait_for("the DAGs parsed", lambda: self.expect <= self.dag_ids(), timeout)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)

    def api(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"{self.url}/api/v2{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        # A loaded machine: a read may time out once, and a write of the API server may find
        # Airflow's SQLite database locked by the scheduler past its 5 s busy timeout (a 500).
        # Reads and PATCHes (setting a field to a value) are tried again; a POST is not.
        tries = 3 if method in ("GET", "PATCH") else 1
        for attempt in range(tries):
            try:
                with urllib.request.urlopen(req, timeout=60) as r:
                    return json.load(r)
            except (TimeoutError, urllib.error.URLError) as e:
                retryable = method == "GET" or not isinstance(e, urllib.error.HTTPError) or e.code >= 500
                if attempt == tries - 1 or not retryable:
                    raise
                time.sleep(2)

    def dag_ids(self) -> set[str]:
        try:
            return {d["dag_id"] for d in self.api("GET", "/dags")["dags"]}
        except (urllib.error.URLError, ConnectionError, OSError, ValueError):
            return set()

    def trigger(self, dag_id: str, conf: dict[str, Any] | None = None) -> str:
        run = self.api("POST", f"/dags/{dag_id}/dagRuns", {"logical_date": None, "conf": conf or {}})
        return str(run["dag_run_id"])

    def run(self, dag_id: str, run_id: str) -> dict[str, Any]:
        return dict(self.api("GET", f"/dags/{dag_id}/dagRuns/{urllib.request.quote(run_id, safe='')}"))

    def tasks(self, dag_id: str, run_id: str) -> dict[str, str]:
        got = self.api("GET", f"/dags/{dag_id}/dagRuns/{urllib.request.quote(run_id, safe='')}/taskInstances")
        return {t["task_id"]: str(t["state"]) for t in got["task_instances"]}

    def wait_run(self, dag_id: str, run_id: str, timeout: float = 300) -> dict[str, Any]:
        return dict(self.wait_for(f"{dag_id} run {run_id}", lambda: (r if (r := self.run(dag_id, run_id))["state"]
                                                                        in DONE else None), timeout))

    def wait_for(self, what: str, probe: Any, timeout: float) -> Any:
        return wait_for(probe, timeout, 2, what, stop=self.exited, last=self.tail)

    def exited(self) -> str | None:
        return "airflow standalone exited" if self.proc is not None and self.proc.poll() is not None else None

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""

    def why(self, dag_id: str, run_id: str) -> str:
        """A run's task states and, for each task that did not succeed, the end of its last log:
        what a failed assertion shows (standalone's own log tail rarely names the cause)."""
        try:
            states = self.tasks(dag_id, run_id)
        except (urllib.error.URLError, OSError, ValueError) as e:
            return f"task states unreadable ({e}); standalone's log:\n{self.tail()}"
        runs = self.root / "airflow-home" / "logs" / f"dag_id={dag_id}" / f"run_id={run_id}"
        parts = [f"{dag_id} {run_id} tasks: {states}"]
        for task, state in sorted(states.items()):
            if state in ("success", "skipped"):
                continue
            logs = sorted((runs / f"task_id={task}").glob("attempt=*.log"))
            text = logs[-1].read_text(errors="replace")[-3000:] if logs else "(no log)"
            parts.append(f"--- {task} ({state}), {logs[-1].name if logs else ''}:\n{text}")
        return "\n".join(parts) + f"\n--- standalone's log:\n{self.tail()[-1500:]}"


LANDING_DAG = """\
from pathlib import Path
from sparkpoint.airflow import sparkpoint_dag
from tests.support.meters_pipeline import meters

dag = sparkpoint_dag(meters(Path({data!r})), dag_id="meters_landing", on_landing=True, poke_interval=5)
"""


@pytest.fixture(scope="module")
def airflow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Airflow]:
    """One `airflow standalone` for the module (its start is a minute here): the two example DAGs
    and the meters landing DAG, whose data is in `meters-data`. Each test unpauses only its own
    DAGs and pauses them again when it ends; their directories are apart. Its tasks attach to a
    warm local Spark of its own, as a user's Airflow worker does by default (a JVM started once,
    not one per task; a run with an injected failure starts a Spark of its own)."""
    root = tmp_path_factory.mktemp("airflow")
    warm = root / "warm-spark"
    dags = {name: (ROOT / "examples" / "airflow" / name).read_text()
            for name in ("sample_dag.py", "clickstream_dag.py")}
    (root / "meters-data").mkdir()
    dags["meters_landing.py"] = LANDING_DAG.format(data=str(root / "meters-data"))
    server = Airflow(root, dags=dags, expect={"sparkpoint_sparkpoint", "sparkpoint_clicks", "meters_landing"},
                     env={"SPARKPOINT_WARM_SPARK": "on", "SPARKPOINT_WARM_SPARK_DIR": str(warm)})
    try:
        server.start()
        yield server
    finally:
        server.stop()
        stop_warm_spark(directory=warm)


def unpause(airflow: Airflow, request: pytest.FixtureRequest, *dag_ids: str) -> None:
    """`dag_ids` unpaused for the test, paused again at its end: the next test's runs see none of theirs."""
    for dag_id in dag_ids:
        airflow.api("PATCH", f"/dags/{dag_id}", {"is_paused": False})
        request.addfinalizer(lambda dag_id=dag_id: airflow.api("PATCH", f"/dags/{dag_id}", {"is_paused": True}))


def test_two_pipelines_run_fail_and_heal_in_airflow_standalone(airflow: Airflow, request: pytest.FixtureRequest):
    root = airflow.root
    sample_dag, clicks_dag = "sparkpoint_sparkpoint", "sparkpoint_clicks"
    sample_input = str(root / ".sparkpoint" / "demo" / "input")
    stream = {"events_per_batch": 1500, "users": 300, "items": 40, "seed": 2}
    generate(sample_input, batches=1, **stream)
    unpause(airflow, request, sample_dag, clicks_dag)
    sample = CheckpointStorage((root / ".sparkpoint" / "checkpoints").as_uri(), "demo")

    first = airflow.trigger(sample_dag)
    assert airflow.wait_run(sample_dag, first)["state"] == "success", airflow.why(sample_dag, first)
    assert sample.completed_checkpoint_ids() == [1]
    # A backlog of two batches is one run: the first commits in the batch task, the second fails
    # after its upload (the injected failure hits a run's last batch) and `recover` commits it.
    generate(sample_input, batches=2, first=1, **stream)
    failed = airflow.trigger(sample_dag, {"sparkpoint_inject_failure": "after-upload"})
    assert airflow.wait_run(sample_dag, failed)["state"] == "failed"
    tasks = airflow.tasks(sample_dag, failed)
    assert tasks["batch"] == "failed" and tasks["recover"] == "success", tasks
    assert sample.completed_checkpoint_ids() == [2, 3]
    generate(sample_input, batches=1, first=3, **stream)
    later = airflow.trigger(sample_dag)
    assert airflow.wait_run(sample_dag, later)["state"] == "success", airflow.why(sample_dag, later)
    assert sample.completed_checkpoint_ids() == [3, 4]
    latest = CompletedCheckpointStore(sample).latest()
    assert latest is not None
    events = pd.concat(oracle.read_batches(sample_input), ignore_index=True)
    with operator_states(sample, latest, user_totals.name) as backends:
        oracle.assert_totals_equal(pd.concat([user_totals.export(b) for b in backends]), oracle.user_totals(events))

    # The clickstream DAG waits for files (its landing sensor) and runs by itself when they land.
    sys.path.insert(0, str(ROOT / "examples" / "clickstream"))
    try:
        from clickstream.land import land
        from clickstream.operators import clicks_per_user
    finally:
        sys.path.pop(0)
    before = sample.completed_checkpoint_ids()
    land(root / ".sparkpoint" / "clicks" / "input", 2)
    clicks = CheckpointStorage((root / ".sparkpoint" / "clicks" / "checkpoints").as_uri(), "clicks")
    airflow.wait_for("two clicks checkpoints", lambda: clicks.completed_checkpoint_ids() == [1, 2], timeout=300)
    assert sample.completed_checkpoint_ids() == before, "the clicks DAG touched the sample's checkpoints"
    _, state = state_table(clicks, clicks_per_user)
    landed = pd.concat([pd.read_parquet(p) for p in sorted((root / ".sparkpoint" / "clicks" / "input")
                                                           .glob("clicks-*.parquet"))])
    assert dict(zip(state["user"], state["clicks"])) == landed.groupby("user").size().to_dict()
    # Every task of both DAGs, the recovery too, ran on one warm Spark: no task replaced it.
    log = (root / "warm-spark" / "server.log").read_text()
    assert log.count("warm Spark: serving on") == 1, log[-3000:]


def test_a_landing_dag_waits_idle_at_a_short_poke_interval_and_runs_when_a_file_lands(airflow: Airflow,
                                                                                       request: pytest.FixtureRequest):
    """A user's pipeline (smart meters) behind the landing sensor at `poke_interval=5`: idle waits
    fail no run (in reschedule mode Airflow's scheduler failed the sensor when its next poke fell
    due before it saw the previous poke's exit, apache/airflow#71172, and `recover` ran after it),
    and the file that lands is committed by the run that waited for it."""
    from tests.support.meters_pipeline import good, meters, state_of, totals

    data = airflow.root / "meters-data"
    pipeline = meters(data)
    unpause(airflow, request, "meters_landing")
    waiting = airflow.wait_for("the sensor's first poke", lambda: [
        r["dag_run_id"] for r in airflow.api("GET", "/dags/meters_landing/dagRuns")["dag_runs"]
        if airflow.tasks("meters_landing", r["dag_run_id"]).get("wait_for_batch") in (
            "running", "up_for_reschedule")], timeout=180)[0]
    time.sleep(40)  # eight idle intervals
    runs = airflow.api("GET", "/dags/meters_landing/dagRuns")["dag_runs"]
    assert [r["state"] for r in runs] == ["running"], (runs, airflow.tasks("meters_landing", waiting))
    rows = good(data, "r-000.parquet")
    done = airflow.wait_run("meters_landing", waiting)
    tasks = airflow.tasks("meters_landing", waiting)
    assert done["state"] == "success", (tasks, airflow.tail())
    assert tasks["recover"] == "skipped", tasks
    assert state_of(pipeline) == totals([rows])
