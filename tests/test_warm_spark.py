"""The warm local Spark (`sparkpoint.spark.warm`): a Spark Connect server on 127.0.0.1 that the
first run without `master`/`remote` starts and later runs attach to. Real servers, real kills."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sparkpoint.checkpoint.processes import same_process_lives
from sparkpoint.spark.warm import WarmServer, default_spark, read_server, server_key, stop
from tests.support.waiting import wait_for

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.spark

ATTACH = """
import json, sys, time
from sparkpoint.spark.warm import attach, read_server, server_dir
from sparkpoint.spark.session import spark_session
url = attach()
spark = spark_session(remote=url)
n = spark.range(int(sys.argv[1])).count()
server = read_server(server_dir())
print(json.dumps({"count": n, "port": server.port, "jvm_pid": server.jvm_pid, "url": url.split(";")[0]}), flush=True)
time.sleep(float(sys.argv[2]))
"""


def _warm(directory: Path) -> Iterator[dict[str, str]]:
    env = {**os.environ, "SPARKPOINT_WARM_SPARK": "on", "SPARKPOINT_WARM_SPARK_DIR": str(directory),
           "SPARKPOINT_WARM_SPARK_IDLE": "600", "PYTHONPATH": str(ROOT)}
    try:
        yield env
    finally:
        stop(directory=directory)


@pytest.fixture
def warm_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A warm server directory of the test's own: the first run starts its server."""
    yield from _warm(tmp_path / "warm")


@pytest.fixture(scope="module")
def shared_warm_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """One warm server directory for the tests that need a server up, whichever started it (a JVM
    start is 20 s here): the server one test leaves is the next one's."""
    yield from _warm(tmp_path_factory.mktemp("shared") / "warm")


def _attach(env: dict[str, str], rows: int = 5, linger: float = 0.0) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", ATTACH, str(rows), str(linger)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _result(proc: subprocess.Popen[str]) -> dict[str, object]:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return dict(json.loads(out.strip().splitlines()[-1]))


def _server(env: dict[str, str]) -> WarmServer:
    server = read_server(Path(env["SPARKPOINT_WARM_SPARK_DIR"]))
    assert server is not None
    return server


def _starts(env: dict[str, str]) -> int:
    return (Path(env["SPARKPOINT_WARM_SPARK_DIR"]) / "server.log").read_text().count("warm Spark: serving on")


def _any_lives(server: WarmServer) -> bool:
    return any(same_process_lives(pid, started) and _state(pid) != "Z" for pid, started in
               ((server.jvm_pid, server.jvm_start), (server.supervisor_pid, server.supervisor_start)))


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return "gone"


def _non_loopback_address() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: only the route's source address
            address = str(s.getsockname()[0])
        except OSError:
            return None
    return None if address.startswith("127.") else address


def test_two_runs_starting_at_once_start_one_server_which_later_runs_reuse(shared_warm_env: dict[str, str]):
    """The module's first test: it starts the server the tests on `shared_warm_env` share."""
    warm_env = shared_warm_env
    first, second = _attach(warm_env, 5), _attach(warm_env, 7)
    a, b = _result(first), _result(second)
    assert (a["count"], b["count"]) == (5, 7)
    assert a["port"] == b["port"] and a["jvm_pid"] == b["jvm_pid"], "one server for both"
    assert _starts(warm_env) == 1
    started = time.monotonic()
    c = _result(_attach(warm_env, 3))
    assert c["jvm_pid"] == a["jvm_pid"] and _starts(warm_env) == 1, "reused, not started again"
    assert time.monotonic() - started < 60  # a JVM start is 20 s here; an attach about one

    server = _server(warm_env)
    directory = Path(warm_env["SPARKPOINT_WARM_SPARK_DIR"])
    assert oct(directory.stat().st_mode & 0o777) == "0o700"
    assert oct(Path(server.token_file).stat().st_mode & 0o777) == "0o600"
    # Never reached from another address: bound to loopback only.
    other = _non_loopback_address()
    if other is not None:
        with pytest.raises(OSError), socket.create_connection((other, server.port), timeout=5):
            pass
    # Nor by a client without the token.
    probe = ("from sparkpoint.spark.session import spark_session\n"
             f"spark_session(remote='sc://localhost:{server.port}').range(1).count()")
    refused = subprocess.run([sys.executable, "-c", probe], env=warm_env, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0


def _kill_supervisor_and_attach(env: dict[str, str]) -> dict[str, object]:
    old = _server(env)
    os.kill(old.supervisor_pid, signal.SIGKILL)  # kill -9 of the supervisor: its JVM dies with it
    wait_for(lambda: not same_process_lives(old.jvm_pid, old.jvm_start), 30, 0.2, "the JVM to go (none is left behind)")
    return _result(_attach(env))


def test_a_killed_server_is_replaced_by_the_next_run(shared_warm_env: dict[str, str]):
    warm_env = shared_warm_env
    first = _result(_attach(warm_env))
    starts = _starts(warm_env)
    old = _server(warm_env)
    os.kill(old.jvm_pid, signal.SIGKILL)  # kill -9 of the JVM: its supervisor withdraws it
    second = _result(_attach(warm_env))
    assert second["jvm_pid"] != first["jvm_pid"] and second["count"] == 5
    assert not same_process_lives(old.supervisor_pid, old.supervisor_start)
    assert _starts(warm_env) == starts + 1


@pytest.mark.soak  # two more kinds of death, a JVM start each: make soak
def test_soak_a_wedged_server_or_one_whose_supervisor_was_killed_is_replaced_by_the_next_run(
        warm_env: dict[str, str]):
    first = _result(_attach(warm_env))
    old = _server(warm_env)
    os.kill(old.jvm_pid, signal.SIGSTOP)  # wedged: it accepts connections and never answers
    try:
        second = _result(_attach(warm_env))
    finally:
        if same_process_lives(old.jvm_pid, old.jvm_start):
            os.kill(old.jvm_pid, signal.SIGCONT)
    assert second["jvm_pid"] != first["jvm_pid"] and second["count"] == 5
    assert not same_process_lives(old.supervisor_pid, old.supervisor_start)
    third = _kill_supervisor_and_attach(warm_env)
    assert third["jvm_pid"] != second["jvm_pid"] and third["count"] == 5 and _starts(warm_env) == 3


def test_a_server_of_another_venv_or_version_is_never_reused(monkeypatch: pytest.MonkeyPatch):
    mine = server_key()
    monkeypatch.setattr(sys, "prefix", "/some/other/venv")
    assert server_key() != mine
    monkeypatch.undo()
    import sparkpoint

    monkeypatch.setattr(sparkpoint, "__version__", "0.0.0-other")
    assert server_key() != mine


# --- whose server: the token goes only to the JVM we started (DESIGN rule 17) ---------------------


class _Recorder:
    """A foreign gRPC server on an address of the test's choosing: it answers HTTP/2 (as a
    Spark Connect server would) and records every call that reaches it, with its metadata."""

    def __init__(self, address: str) -> None:
        from concurrent import futures

        import grpc

        self.calls: list[tuple[str, dict[str, str]]] = []
        recorder = self

        class Everything(grpc.GenericRpcHandler):  # type: ignore[misc]
            def service(self, details: object) -> None:
                recorder.calls.append((str(getattr(details, "method", "")),
                                       dict(getattr(details, "invocation_metadata", ()) or ())))
                return None  # UNIMPLEMENTED

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        self.server.add_generic_rpc_handlers((Everything(),))
        self.port = self.server.add_insecure_port(address)
        assert self.port, f"could not listen on {address}"
        self.server.start()

    def stop(self) -> None:
        self.server.stop(grace=None)


def test_a_foreign_listener_on_ipv6_loopback_at_the_servers_port_receives_nothing(shared_warm_env: dict[str, str]):
    warm_env = shared_warm_env
    first = _result(_attach(warm_env))
    server = _server(warm_env)
    try:
        foreign = _Recorder(f"[::1]:{server.port}")  # what `localhost` resolves to first
    except (AssertionError, RuntimeError) as e:
        pytest.fail(f"this machine has no IPv6 loopback to listen on: {e}")
    try:
        second = _result(_attach(warm_env, 9))
    finally:
        foreign.stop()
    assert second["count"] == 9 and second["jvm_pid"] == first["jvm_pid"], "the run went to the real server"
    assert foreign.calls == [], f"the foreign listener received {foreign.calls[:2]}"


def test_a_process_that_wins_the_race_for_the_port_gets_no_token_and_the_server_stops_once_idle(
        warm_env: dict[str, str]):
    """Two checks of a server's own start and end, on one JVM start: the port a foreign process
    took first is given up (no token reaches it), and the server stops once idle, never while a
    run is attached."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        taken = s.getsockname()[1]
    env = {**warm_env, "SPARKPOINT_WARM_SPARK_PORT": str(taken), "SPARKPOINT_WARM_SPARK_IDLE": "4"}
    foreign = _Recorder(f"127.0.0.1:{taken}")  # binds the port the supervisor will try first
    try:
        holder = _attach(env, 4, linger=12)  # attached for 12 s, three idle periods
        line = holder.stdout.readline() if holder.stdout else ""
    finally:
        foreign.stop()
    assert json.loads(line)["count"] == 4, holder.stderr.read() if holder.stderr and not line else line
    server = _server(env)
    assert server.port != taken, "the server listens on a port of its own"
    assert foreign.calls == [], f"the process on the port received {foreign.calls[:2]}"
    log = (Path(env["SPARKPOINT_WARM_SPARK_DIR"]) / "server.log").read_text()
    assert f"did not come to listen on port {taken} itself" in log
    # Neither the port nor the token is on the JVM's command line.
    command = Path(f"/proc/{server.jvm_pid}/cmdline").read_bytes().decode(errors="replace")
    token = Path(server.token_file).read_text().strip()
    assert str(server.port) not in command and token not in command

    time.sleep(8)
    assert same_process_lives(server.jvm_pid, server.jvm_start), "a run is attached: not idle"
    holder.communicate(timeout=60)
    wait_for(lambda: not _any_lives(server), 60, 0.5, "the server to stop after the idle period")
    assert read_server(Path(env["SPARKPOINT_WARM_SPARK_DIR"])) is None


# --- the run's environment: a warm server computes what a Spark of the run's own does (rule 16) ---

WEIGHTS = """
import os

WEIGHT = int(os.environ.get("WEIGHT", "1"))  # read once, at import, as real pipelines read settings


def scale(batches):
    for df in batches:
        yield df * WEIGHT
"""

ENV_RUN = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
import logging
logging.basicConfig(level=logging.INFO, format="%(message)s")
import weights
from sparkpoint.spark.session import is_connect, ship_modules, spark_session
spark = spark_session()
ship_modules(spark, [weights.scale])
total = int(spark.range(1, 4).toDF("n").mapInPandas(weights.scale, "n long").toPandas()["n"].sum())
print(json.dumps({"total": total, "connect": is_connect(spark)}), flush=True)
sys.stdin.read()  # attached until the test closes our stdin
"""


def _env_run(env: dict[str, str], module_dir: Path, weight: int | None) -> subprocess.Popen[str]:
    weighted = env if weight is None else {**env, "WEIGHT": str(weight)}
    return subprocess.Popen([sys.executable, "-c", ENV_RUN, str(module_dir)], env=weighted,
                            text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_a_run_computes_with_its_own_environment_on_the_warm_server(tmp_path: Path,
                                                                    shared_warm_env: dict[str, str]):
    """On the module's shared server (its first run has the environment the others attached with);
    it leaves that server replaced by one with another environment, for the module's last test."""
    warm_env = shared_warm_env
    module_dir = tmp_path / "mods"
    module_dir.mkdir()
    (module_dir / "weights.py").write_text(WEIGHTS)
    first = _env_run(warm_env, module_dir, None)
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-3000:]
    assert json.loads(out.splitlines()[-1]) == {"total": 6, "connect": True}
    assert "attached to the warm local Spark on 127.0.0.1:" in err and "started at" in err
    starts = _starts(warm_env)

    # Idle server, another environment: replaced by one that has this run's.
    second = _env_run(warm_env, module_dir, 10)
    line = second.stdout.readline() if second.stdout else ""
    assert json.loads(line) == {"total": 60, "connect": True}, line
    assert _starts(warm_env) == starts + 1

    # Used by a run (the second lingers attached), another environment again: this run gets a
    # Spark of its own and says why, in one line.
    third = _env_run(warm_env, module_dir, 100)
    out, err = third.communicate(timeout=300)
    second.communicate(timeout=120)
    assert third.returncode == 0, err[-3000:]
    assert json.loads(out.splitlines()[-1]) == {"total": 600, "connect": False}
    assert "runs with another environment (WEIGHT differ) and other runs use it" in err
    assert _starts(warm_env) == starts + 1, "the server the second run used was left alone"


def test_what_differs_between_two_tasks_of_an_orchestrator_is_not_the_environment():
    from sparkpoint.spark.warm import environment_digest

    task = {"PATH": "/usr/bin", "WEIGHT": "1", "AIRFLOW_CTX_DAG_RUN_ID": "manual__1", "AIRFLOW_CTX_TASK_ID": "batch",
            "_AIRFLOW_PARSING_CONTEXT_DAG_ID": "sales", "_AIRFLOW_PARSING_CONTEXT_TASK_ID": "batch",
            "PYTEST_CURRENT_TEST": "a", "DAGSTER_HOME": "/h"}
    other = {**task, "AIRFLOW_CTX_DAG_RUN_ID": "manual__2", "AIRFLOW_CTX_TASK_ID": "recover",
             "_AIRFLOW_PARSING_CONTEXT_DAG_ID": "clicks", "_AIRFLOW_PARSING_CONTEXT_TASK_ID": "recover",
             "PYTEST_CURRENT_TEST": "b", "DAGSTER_HOME": "/g"}
    assert environment_digest(task) == environment_digest(other)
    assert environment_digest(task) != environment_digest({**task, "WEIGHT": "2"}), "what a task computes with"


@pytest.mark.parametrize("error, transient", [
    (RuntimeError("<_InactiveRpcError of RPC that terminated with:\n\tstatus = StatusCode.UNAVAILABLE"), True),
    (RuntimeError("status = StatusCode.DEADLINE_EXCEEDED"), True),
    (RuntimeError("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:4: Socket closed"), True),
    (RuntimeError("[SESSION_CLOSED] Session 1234 was closed"), False),
    (RuntimeError("status = StatusCode.UNAUTHENTICATED"), False),
    (ValueError("the code of 'clicks' changed"), False),
])
def test_an_attach_tries_again_only_after_a_transient_rpc_error(error: Exception, transient: bool):
    from sparkpoint.spark.session import _transient

    assert _transient(error) is transient


FLAG_PIPELINE = """
import os

import pandas as pd

from flaghelper import unit  # a helper beside the pipeline's module, found on PYTHONPATH (not shipped)
from sparkpoint import KeyedOperator, Pipeline, StructCodec

# A feature flag a deployment drops where the job runs: read at import, relative to the run's directory.
WEIGHT = unit() * (10.0 if os.path.exists("double.flag") else 1.0)
TOTAL = StructCodec("<d")


def add(batch, state):
    sums = batch.groupby("meter")["kwh"].sum() * WEIGHT
    keys = [str(k) for k in sums.index]
    totals = state.value_state("kwh", TOTAL)
    new = [float(s) + (o[0] if o else 0.0) for s, o in zip(sums, totals.get_many(keys))]
    totals.put_many((k, (v,)) for k, v in zip(keys, new))
    return pd.DataFrame({"meter": keys, "kwh": new, "cwd": [os.getcwd()] * len(keys)})


def export(state):
    rows = [(k.decode(), v[0]) for k, v in state.value_state("kwh", TOTAL).items()]
    return pd.DataFrame(rows, columns=["meter", "kwh"])


meters = KeyedOperator("kwh", key="meter", key_type="string", columns=("kwh",), process=add, export=export,
                       emits=True, schema={"meter": "string", "kwh": "float64", "cwd": "string"})
pipe = Pipeline("flags", [meters], input_url="{root}/in", checkpoints_url="{root}/ckpt", output_url="{root}/out",
                local_dir="{root}/local", parallelism=1)
"""


def test_a_users_pipeline_run_without_a_master_attaches_to_the_warm_server_in_its_own_directory(
        tmp_path: Path, warm_env: dict[str, str], monkeypatch: pytest.MonkeyPatch):
    """`sparkpoint run --pipeline` of a user's pipeline, twice: the first starts the server, the
    second attaches to it; each runs in its own directory with its own Python path. With the warm
    server off, a run's Spark is its own (the decision is checked, without another Spark start)."""
    import pandas as pd

    project = tmp_path / "project"
    (project / "dags").mkdir(parents=True)
    (project / "in").mkdir()
    (project / "dags" / "flagpipe.py").write_text(FLAG_PIPELINE.replace("{root}", str(project)))
    (project / "dags" / "flaghelper.py").write_text("def unit():\n    return 1.0\n")
    (project / "double.flag").write_text("on\n")
    landed = [[("a", 1.0), ("b", 2.0), ("a", 0.5)], [("a", 1.0), ("c", 3.0)]]

    def land(i: int) -> None:
        pd.DataFrame(landed[i], columns=["meter", "kwh"]).to_parquet(project / "in" / f"b{i:02d}.parquet")

    env = {**warm_env, "PYTHONPATH": f"dags{os.pathsep}{ROOT}"}  # relative, as docs/airflow.md shows
    command = [sys.executable, "-m", "sparkpoint.cli", "run", "--pipeline", "flagpipe:pipe"]
    runs = []
    for i in (0, 1):
        land(i)
        run = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        assert "attached to the warm local Spark" in run.stderr, "ran on the warm server"
        runs.append(run)
    assert [line.split()[0] for run in runs for line in run.stdout.splitlines() if line.startswith("chk-")] \
        == ["chk-1", "chk-2"]
    assert _starts(warm_env) == 1, "the second run attached to the server the first started"
    out = pd.read_parquet(project / "out")
    totals = {cid: dict(zip(rows.meter, rows.kwh)) for cid, rows in out.groupby("checkpoint_id")}
    assert totals == {1: {"a": 15.0, "b": 20.0}, 2: {"a": 25.0, "c": 30.0}}, "the flag file in the run's directory"
    assert set(out.cwd) == {str(project)}

    # Off, a run's Spark is `local[2]` in its own process though a server is up (what `run` then
    # starts is the in-process Spark the rest of the suite runs on, with the warm server off).
    monkeypatch.setenv("SPARKPOINT_WARM_SPARK", "off")
    monkeypatch.setenv("SPARKPOINT_WARM_SPARK_DIR", warm_env["SPARKPOINT_WARM_SPARK_DIR"])
    assert default_spark(None, None) == ("local[2]", None)
    assert _starts(warm_env) == 1 and read_server(Path(warm_env["SPARKPOINT_WARM_SPARK_DIR"])) is not None


@pytest.mark.parametrize("command, shown", [
    (["/v/bin/python", "-m", "sparkpoint.cli", "run", "--pipeline", "p:q", "--storage-options", '{"secret": "AK"}'],
     "sparkpoint.cli run"),
    (["/v/bin/sparkpoint", "run", "--storage-options", '{"secret": "AK"}'], "sparkpoint run"),
    (["/v/bin/python3.11", "-c", "import secret_stuff"], "python -c ..."),
    (["/v/bin/dagster", "api", "grpc", "--port", "4000"], "dagster api"),
])
def test_the_server_says_who_started_it_without_their_arguments(command: list[str], shown: str):
    from sparkpoint.spark.warm import _program

    assert _program(command) == shown


# --- `make ui`'s Ctrl-C stops the server it started or found (the module's shared one) ---


def test_ctrl_c_of_make_ui_stops_the_warm_server(tmp_path: Path, shared_warm_env: dict[str, str]):
    """The module's last test: the server it stops is the one the tests above shared (no JVM
    start of its own; a server other tests attach to outside this module is never this one)."""
    import pty

    warm_env = shared_warm_env
    import select
    import urllib.request

    from tests.support.cluster import free_port

    if read_server(Path(warm_env["SPARKPOINT_WARM_SPARK_DIR"])) is None:  # run alone: no test left one
        _result(_attach(warm_env))  # a run of the UI's attached and left: the server stays warm
    server = _server(warm_env)
    port = free_port()
    pid, fd = pty.fork()
    if pid == 0:  # the child: `make ui` at a terminal, as a user runs it
        os.chdir(ROOT)
        # At a user's terminal Ctrl-C is not ignored; a suite started in the background (a shell's
        # `&` without job control) hands its processes SIGINT ignored, and exec keeps that.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.execvpe("make", ["make", "--no-print-directory", "ui", f"UI_PORT={port}",
                            f"DAGSTER_HOME={tmp_path / 'dagster'}"], warm_env)
    output = b""

    def read(seconds: float) -> None:
        nonlocal output
        if select.select([fd], [], [], seconds)[0]:
            with contextlib.suppress(OSError):
                output += os.read(fd, 65536)

    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            read(1)
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=2).close()
                break
            except OSError:
                continue
        else:
            raise AssertionError(output.decode(errors="replace")[-3000:])
        while b"Launching Dagster services" not in output and time.monotonic() < deadline:
            read(1)  # the daemon too is up: a Ctrl-C mid-start is another story
        os.write(fd, b"\x03")  # Ctrl-C
        exited = deadline = time.monotonic() + 120
        while time.monotonic() < deadline and os.waitpid(pid, os.WNOHANG) == (0, 0):
            read(1)
            if time.monotonic() > exited - 60 and b"KeyboardInterrupt" not in output:
                os.write(fd, b"\x03")  # not seen: pressed again, as a user would
                exited = deadline
        read(0.5)
        assert not _any_lives(server), output.decode(errors="replace")[-3000:]
    finally:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    assert "stopped the warm local Spark" in output.decode(errors="replace")
