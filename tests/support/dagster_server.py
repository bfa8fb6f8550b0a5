"""A real `dagster dev` (webserver + daemon) on 127.0.0.1 for the end-to-end and UI tests.

It runs in its own process group (stopped by signalling the group) from a temporary working
directory, so the resources' embedded defaults (`.sparkpoint/checkpoints`, `.sparkpoint/demo/input`,
relative to the working directory) land there and never touch the checkout's `.sparkpoint`.
"""

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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.ops.instance import prepare_dagster_home
from sparkpoint.spark.warm import stop as stop_warm_spark
from tests.support.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PREFIX = "sparkpoint"
ASSET_NAMES = ("user_totals", "item_reach", "checkpoint", "output")
CHECKS = ("checkpoint_verifies", "registry_matches_metadata")
INJECT_TAG = "sparkpoint/inject-failure"
RECOVERS_TAG = "sparkpoint/recovers"
OVERTAKEN_TAG = "sparkpoint/overtaken"
# A Dagster instance as a user has it, without sparkpoint's pool config (sparkpoint.ops.instance):
# the pipelines' own sensors must keep their runs apart, and the code location says, once, at load:
NO_POOLS = "run_queue:\n  dequeue_interval_seconds: 1\ntelemetry:\n  enabled: false\n"
POOL_WARNING = "gives pool 'clicks' no limit"
DONE = {"SUCCESS", "FAILURE", "CANCELED"}

WORKSPACE = """\
  - python_module:
      module_name: {module}
      attribute: {attribute}
      working_directory: {repo}
"""

LAUNCH = """
mutation Launch($p: ExecutionParams!) { launchRun(executionParams: $p) { __typename
  ... on LaunchRunSuccess { run { runId } }
  ... on PythonError { message }
  ... on RunConfigValidationInvalid { errors { message } }
  ... on InvalidSubsetError { message }
  ... on PipelineNotFoundError { message } } }
"""

RUN = """
query Run($id: ID!) { runOrError(runId: $id) { __typename
  ... on Run { runId jobName status tags { key value } stepStats { stepKey status } } } }
"""

RUNS = """
query Runs($filter: RunsFilter) { runsOrError(filter: $filter, limit: 50) { __typename
  ... on Runs { results { runId jobName status startTime endTime tags { key value } } } } }
"""

ENTRIES = """metadataEntries { __typename label
    ... on IntMetadataEntry { intValue intRepr }
    ... on FloatMetadataEntry { floatValue }
    ... on TextMetadataEntry { text }
    ... on JsonMetadataEntry { jsonString }
    ... on PathMetadataEntry { path } }"""

MATERIALIZATIONS = """
query Mats($key: AssetKeyInput!) { assetOrError(assetKey: $key) { __typename
  ... on Asset { assetMaterializations(limit: 50) { runId timestamp """ + ENTRIES + " } } } }"

OBSERVATIONS = """
query Obs($key: AssetKeyInput!) { assetOrError(assetKey: $key) { __typename
  ... on Asset { assetObservations(limit: 50) { runId timestamp """ + ENTRIES + " } } } }"

TICKS = """
query Ticks($s: SensorSelector!) { sensorOrError(sensorSelector: $s) { __typename
  ... on Sensor { sensorState { ticks(limit: 5) { timestamp status skipReason } } } } }
"""

SENSOR = """
query Sensor($s: SensorSelector!) { sensorOrError(sensorSelector: $s) { __typename
  ... on Sensor { name minIntervalSeconds sensorState { status } } } }
"""

REPOSITORIES = """
{ repositoriesOrError { __typename ... on RepositoryConnection { nodes { name location { name }
  assetNodes { assetKey { path } } sensors { name sensorState { status } } } } } }
"""


def land_clicks(into: Path, batches: int) -> list[Path]:
    """Land click batches as the example project's `clickstream.land` does (the test process does
    not have the example on its path; `dagster dev` does)."""
    sys.path.insert(0, str(REPO / "examples" / "clickstream"))
    try:
        from clickstream.land import land
    finally:
        sys.path.pop(0)
    return land(into, batches)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def entry_value(entry: dict[str, Any]) -> Any:
    """A GraphQL metadata entry's value as Python."""
    kind = entry["__typename"]
    if kind == "IntMetadataEntry":
        return entry["intValue"] if entry["intValue"] is not None else int(entry["intRepr"])
    if kind == "FloatMetadataEntry":
        return entry["floatValue"]
    if kind == "TextMetadataEntry":
        return entry["text"]
    if kind == "JsonMetadataEntry":
        return json.loads(entry["jsonString"])
    if kind == "PathMetadataEntry":
        return entry["path"]
    return entry


class DagsterServer:
    """`dagster dev -w workspace.yaml -h 127.0.0.1 -p PORT` in `root`, stopped by process group,
    serving `module`'s `attribute` (the tests' location by default) with `env` added, on an
    instance configured by sparkpoint's `dagster.yaml` or by `instance_yaml`. `more_modules`: more
    code locations beside it (their `attribute` too), each a code server of its own; `location`
    and `repository` stay `module`'s."""

    def __init__(self, root: Path, *, module: str = "tests.support.ui_location", attribute: str = "defs",
                 env: dict[str, str] | None = None, instance_yaml: str | None = None,
                 more_modules: tuple[str, ...] = ()) -> None:
        self.root = root
        self.module, self.attribute, self.extra_env = module, attribute, dict(env or {})
        self.modules = (module, *more_modules)
        if instance_yaml is not None:
            (root / "dagster-home").mkdir(parents=True, exist_ok=True)
            (root / "dagster-home" / "dagster.yaml").write_text(instance_yaml)
        self.home = prepare_dagster_home(root / "dagster-home")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = root / "dagster-dev.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.location = ""
        self.repository = ""

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, timeout: float = 120.0) -> None:
        (self.root / "workspace.yaml").write_text("load_from:\n" + "".join(
            WORKSPACE.format(module=m, attribute=self.attribute, repo=REPO) for m in self.modules))
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [str(BIN / "dagster"), "dev", "-w", "workspace.yaml", "-h", "127.0.0.1", "-p", str(self.port)],
                cwd=self.root, env=self.env(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        wait_for(self._serving, timeout, 1, "dagster dev to answer", stop=self._exited, last=self.log_tail)

    def _serving(self) -> bool:
        """The webserver answers with every location loaded (`module`'s location and repository
        name kept)."""
        try:
            with urllib.request.urlopen(f"{self.url}/server_info", timeout=5) as r:
                if r.status != 200:
                    return False
            repos = self.gql(REPOSITORIES)["repositoriesOrError"]
        except (urllib.error.URLError, ConnectionError, OSError, AssertionError):
            return False
        if repos["__typename"] != "RepositoryConnection" or len(repos["nodes"]) < len(self.modules):
            return False
        node = next((n for n in repos["nodes"] if n["location"]["name"] == self.module), repos["nodes"][0])
        self.location, self.repository = node["location"]["name"], node["name"]
        return True

    def _exited(self) -> str | None:
        if self.proc is None or self.proc.poll() is None:
            return None
        return f"dagster dev exited with {self.proc.returncode}"

    def env(self) -> dict[str, str]:
        """The environment `dagster dev` runs in, and the `dagster` commands a user types beside it."""
        env = {**os.environ, "DAGSTER_HOME": str(self.home), "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
               "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "examples" / "clickstream")]),
               "SPARK_LOCAL_IP": "127.0.0.1", **self.extra_env}
        env.pop("SPARKPOINT_CHECKPOINT_CRON", None)
        return env

    def dagster(self, *args: str, timeout: float = 120.0) -> str:
        """`dagster ARGS -w workspace.yaml` on this instance, as a user types it beside the UI; its output."""
        done = subprocess.run([str(BIN / "dagster"), *args, "-w", "workspace.yaml"], cwd=self.root, env=self.env(),
                              capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        assert done.returncode == 0, f"dagster {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
        return done.stdout + done.stderr

    def stop(self) -> None:
        """SIGTERM to the whole process group; once `dagster dev` has shut its services down (or
        after 20 s), SIGKILL to whatever is left of the group (a code server respawned meanwhile)."""
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
        left = subprocess.run(["ps", "-o", "pid,stat,etime,args", "-g", str(proc.pid)], capture_output=True,
                              text=True, check=False).stdout
        if len(left.splitlines()) > 1:
            with open(self.log, "a") as log:
                log.write(f"--- left in the process group after SIGTERM, sending SIGKILL ---\n{left}")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        if proc.poll() is None:
            proc.wait(timeout=10)

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "--- dagster dev log (tail) ---\n" + "\n".join(text[-lines:])

    # -- GraphQL ---------------------------------------------------------------------------
    def gql(self, query: str, variables: dict[str, Any] | None = None) -> dict[str, Any]:
        body = json.dumps({"query": query, "variables": variables or {}}).encode()
        req = urllib.request.Request(f"{self.url}/graphql", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            answer = json.load(r)
        if answer.get("errors"):
            raise AssertionError(f"GraphQL errors: {answer['errors']}")
        return dict(answer["data"])

    def launch_all_assets(self, tags: dict[str, str] | None = None) -> str:
        """What the UI's "Materialize all" does: `__ASSET_JOB` over every asset and its checks."""
        keys = [{"path": [PREFIX, name]} for name in ASSET_NAMES]
        checks = [{"assetKey": {"path": [PREFIX, "checkpoint"]}, "name": name} for name in CHECKS]
        params = {
            "selector": {"repositoryLocationName": self.location, "repositoryName": self.repository,
                         "jobName": "__ASSET_JOB", "assetSelection": keys, "assetCheckSelection": checks},
            "executionMetadata": {"tags": [{"key": k, "value": v} for k, v in (tags or {}).items()]},
        }
        result = self.gql(LAUNCH, {"p": params})["launchRun"]
        assert result["__typename"] == "LaunchRunSuccess", result
        return str(result["run"]["runId"])

    def launch_job(self, job_name: str, tags: dict[str, str] | None = None) -> str:
        params = {
            "selector": {"repositoryLocationName": self.location, "repositoryName": self.repository,
                         "jobName": job_name},
            "executionMetadata": {"tags": [{"key": k, "value": v} for k, v in (tags or {}).items()]},
        }
        result = self.gql(LAUNCH, {"p": params})["launchRun"]
        assert result["__typename"] == "LaunchRunSuccess", result
        return str(result["run"]["runId"])

    def run(self, run_id: str) -> dict[str, Any]:
        run = self.gql(RUN, {"id": run_id})["runOrError"]
        assert run["__typename"] == "Run", run
        return dict(run)

    def runs(self, tags: dict[str, str] | None = None) -> list[dict[str, Any]]:
        flt = {"tags": [{"key": k, "value": v} for k, v in tags.items()]} if tags else None
        result = self.gql(RUNS, {"filter": flt})["runsOrError"]
        assert result["__typename"] == "Runs", result
        return list(result["results"])

    def sensor(self, name: str) -> dict[str, Any]:
        selector = {"repositoryLocationName": self.location, "repositoryName": self.repository, "sensorName": name}
        sensor = self.gql(SENSOR, {"s": selector})["sensorOrError"]
        assert sensor["__typename"] == "Sensor", sensor
        return dict(sensor)

    def ticks(self, name: str) -> list[dict[str, Any]]:
        """The sensor's latest ticks, newest first: {"timestamp", "status", "skipReason"}."""
        selector = {"repositoryLocationName": self.location, "repositoryName": self.repository, "sensorName": name}
        sensor = self.gql(TICKS, {"s": selector})["sensorOrError"]
        assert sensor["__typename"] == "Sensor", sensor
        return list(sensor["sensorState"]["ticks"])

    def wait_for(self, what: str, probe: Callable[[], Any], timeout: float,
                 last: Callable[[], Any] | None = None) -> Any:
        """Poll `probe` until it returns something truthy; fail with the last state and the log tail."""
        return wait_for(probe, timeout, 2, what, stop=self._exited,
                        last=lambda: f"{last() if last is not None else None}\n{self.log_tail()}")

    def wait_run(self, run_id: str, timeout: float = 180.0) -> dict[str, Any]:
        """The run once it is finished (SUCCESS, FAILURE or CANCELED)."""
        return dict(self.wait_for(
            f"run {run_id} to finish", lambda: (r if (r := self.run(run_id))["status"] in DONE else None),
            timeout, last=lambda: self.run(run_id),
        ))

    def pipeline_runs(self, jobs: tuple[str, ...]) -> list[dict[str, Any]]:
        """The runs of `jobs`, newest first, with their start and end times, tags as a dict."""
        return [{**r, "tags": {t["key"]: t["value"] for t in r["tags"]}} for r in self.runs() if r["jobName"] in jobs]

    def wait_recovered(self, jobs: tuple[str, ...], checkpoints: str, job_id: str, files: list[str],
                       failed_id: str, timeout: float = 300) -> list[dict[str, Any]]:
        """`pipeline_runs(jobs)` once the latest checkpoint has consumed `files`, the failed run
        `failed_id` has its recovery run and none of them is in flight."""
        store = CompletedCheckpointStore(CheckpointStorage(checkpoints, job_id))

        def settled() -> list[dict[str, Any]] | None:
            latest = store.latest()
            seen = self.pipeline_runs(jobs)
            if latest is None or latest.source_offsets["source"]["consumed"] != files:
                return None
            if not any(r["tags"].get(RECOVERS_TAG) == failed_id for r in seen):
                return None
            return None if any(r["status"] not in DONE for r in seen) else seen

        return list(self.wait_for("every file committed and no run in flight", settled, timeout,
                                  last=lambda: [(r["jobName"], r["status"]) for r in self.pipeline_runs(jobs)][:8]))

    def materializations(self, name: str, prefix: str = PREFIX) -> list[dict[str, Any]]:
        """Newest first: {"runId", "timestamp", "metadata": {label: value}}."""
        return self._asset_events(MATERIALIZATIONS, "assetMaterializations", name, prefix)

    def observations(self, name: str, prefix: str = PREFIX) -> list[dict[str, Any]]:
        """Newest first, as `materializations` (a sensor's observations have no run: runId "")."""
        return self._asset_events(OBSERVATIONS, "assetObservations", name, prefix)

    def _asset_events(self, query: str, field: str, name: str, prefix: str) -> list[dict[str, Any]]:
        asset = self.gql(query, {"key": {"path": [prefix, name]}})["assetOrError"]
        if asset["__typename"] != "Asset":
            return []
        return [{"runId": m["runId"], "timestamp": m["timestamp"],
                 "metadata": {e["label"]: entry_value(e) for e in m["metadataEntries"]}}
                for m in asset[field]]

    def checkpoint_ids(self, prefix: str = PREFIX) -> list[int]:
        return sorted(int(m["metadata"]["checkpoint_id"]) for m in self.materializations("checkpoint", prefix))

    def ensure_checkpoint(self) -> None:
        """At least one checkpoint materialized (the UI test may run without the e2e test)."""
        if not self.checkpoint_ids():
            run = self.wait_run(self.launch_all_assets())
            assert run["status"] == "SUCCESS", f"{run}\n{self.log_tail()}"

    @property
    def checkpoints_url(self) -> str:
        return (self.root / ".sparkpoint" / "checkpoints").resolve().as_uri()


@pytest.fixture(scope="module")
def dagster_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DagsterServer]:
    """One webserver + daemon for a module's end-to-end or UI tests, stopped with the module (an
    idle `dagster dev` ticks at about 5 CPU seconds a minute: kept for the session, it cost the
    suite minutes). Its runs attach to a warm local Spark of its own, as `make ui`'s do (a JVM
    started once, not one per run). Its instance has no pool config (`NO_POOLS`), as most
    existing ones: the harder case for one run of a pipeline at a time; sparkpoint's own
    `dagster.yaml` is the soak variant of tests/test_dagster_one_run.py."""
    root = tmp_path_factory.mktemp("dagster-e2e")
    warm = root / "warm-spark"
    server = DagsterServer(root, instance_yaml=NO_POOLS,
                           env={"SPARKPOINT_WARM_SPARK": "on", "SPARKPOINT_WARM_SPARK_DIR": str(warm)})
    try:
        server.start()
        yield server
    finally:
        server.stop()
        stop_warm_spark(directory=warm)
