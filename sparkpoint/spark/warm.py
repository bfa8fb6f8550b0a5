"""A warm local Spark: the Spark Connect server a run without `master` or `remote` attaches to.

A Spark of the run's own costs a JVM and its Python workers at every start (10-35 s a landed file
in Dagster, measured); attached to a Spark that is already up, a checkpoint costs 1.2-1.7 s. So a
run that names no Spark attaches to a local Spark Connect server that sparkpoint starts on first
use and keeps warm, one per machine user, virtual environment and sparkpoint version:

* it listens on 127.0.0.1 only, on a free port, and asks a token of every client (read from a
  file only its user can read), so neither another host nor another user reaches it;
* the token goes only to that server, proven (`sparkpoint.spark.loopback`): runs connect to the
  exact address it bound, once the kernel shows that our JVM holds the listening socket there, and
  each call checks the JVM still lives; the port and the token are on no command line (the port
  is in a properties file in this user's private directory, the token in the JVM's environment);
* it computes what a Spark of the run's own computes (DESIGN rule 16): its Python workers inherit
  the environment of the run that started it, so a run whose environment differs (a variable a
  module reads at import, credentials) replaces an idle server, or runs on a Spark of its own
  while other runs use it, saying so in one line; every run says which server it attached to;
* its Python workers run this interpreter (`PYSPARK_PYTHON`): the venv that has sparkpoint;
* a supervisor process (`python -m sparkpoint.spark.warm`) owns its JVM, records both in
  `server.json`, and stops the JVM once no run has been attached for `idle` seconds (the JVM
  dies with the supervisor);
* task-local state stays where each run puts it (the pipeline's `local_dir`), so it outlives the
  server's restarts.

The directory (`SPARKPOINT_WARM_SPARK_DIR`, default `$XDG_CACHE_HOME/sparkpoint/warm-spark/<key>`,
the key naming the venv, sparkpoint's and pyspark's versions; this user's, mode 0700) holds:

    lock         held exclusively by whoever reads, starts or replaces the server, and by the
                 supervisor while it stops it: two runs starting at once start one server
    in-use       every attached run holds a shared lock on it for as long as its process lives
    last-attach  its mtime: the last time a run attached
    server.json  the address, the token's file, the supervisor's and the JVM's pids with their
                 start times, versions, who started it and a digest of its environment; written
                 by the supervisor once the server answers from a socket its JVM holds
    spark.properties  the JVM's settings, its port among them (off every command line)
    server.log   what the supervisor and the JVM wrote

No check-then-act between processes (DESIGN rule 9): a run decides under `lock` and takes its
shared `in-use` lock before releasing `lock`; the supervisor stops the server only while it holds
`lock` *and* an exclusive `in-use` lock, so it never stops a server a run is attached to or about
to attach to. A server whose processes are gone, or whose JVM does not answer (a wedged or
stopped JVM), is replaced by the next run that looks.

`SPARKPOINT_WARM_SPARK=off` turns it off: a run without `master` then starts Spark in its own
process (`local[2]`), as an explicit `master="local[2]"` always does.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

from sparkpoint.checkpoint.errors import SparkpointError
from sparkpoint.checkpoint.processes import boot_id, process_start, same_process_lives
from sparkpoint.spark.loopback import holding_inodes, listening_inodes, listens_on, proc_available

log = logging.getLogger(__name__)

WARM_ENV = "SPARKPOINT_WARM_SPARK"  # "off": no warm server, a run without master starts local[2]
IDLE_ENV = "SPARKPOINT_WARM_SPARK_IDLE"  # seconds without an attached run before the server stops
DIR_ENV = "SPARKPOINT_WARM_SPARK_DIR"
PORT_ENV = "SPARKPOINT_WARM_SPARK_PORT"  # the port a new server tries first (default: a free one)
IN_PROCESS_MASTER = "local[2]"  # the master of a run when the warm server is off
DEFAULT_IDLE = 300.0
START_TIMEOUT = 180.0
ANSWER_TIMEOUT = 10.0  # a JVM that does not complete a gRPC handshake in this long is wedged ...
WEDGED_AFTER = 60.0  # ... unless runs are attached to it: then in this long
POLL = 1.0
SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"
FORMAT = 2
# Variables that differ between two shells or processes of one user without changing what a task
# computes: not part of the environment a run must share with the server it attaches to.
VOLATILE_ENV = frozenset({
    "_", "OLDPWD", "PWD", "SHLVL", "TERM", "COLORTERM", "TERM_PROGRAM", "TERM_PROGRAM_VERSION", "TERM_SESSION_ID",
    "COLUMNS", "LINES", "PS1", "PS2", "PS4", "PROMPT_COMMAND", "HISTFILE", "HISTSIZE", "HISTCONTROL", "LS_COLORS",
    "TMUX", "TMUX_PANE", "STY", "WINDOW", "SSH_TTY", "SSH_CLIENT", "SSH_CONNECTION", "SSH_AUTH_SOCK",
    "SSH_AGENT_PID", "DISPLAY", "WINDOWID", "XDG_SESSION_ID", "XDG_VTNR", "XDG_SESSION_TYPE", "GPG_TTY",
    "MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKE_TERMOUT", "MAKE_TERMERR", "INVOCATION_ID", "JOURNAL_STREAM",
    "SPARKPOINT_LOCAL_DIR", "PYTEST_CURRENT_TEST", "PYTEST_XDIST_WORKER", "PYTEST_XDIST_TESTRUNUID",
    "PYTEST_XDIST_WORKER_COUNT", "SPARKPOINT_VERBOSE", "DAGSTER_HOME",
})
# Airflow puts the task run's ids in its task's environment (AIRFLOW_CTX_DAG_RUN_ID, ...; Airflow 3
# also the DAG and task it parses, _AIRFLOW_PARSING_CONTEXT_DAG_ID and _TASK_ID): each task run
# would otherwise differ from the last and replace the server.
VOLATILE_PREFIXES = ("SPARKPOINT_WARM_SPARK", "COV_CORE_", "AIRFLOW_CTX_", "_AIRFLOW_PARSING_CONTEXT_")
QUIET_LOG4J = Path(__file__).with_name("log4j2-quiet.properties")


class WarmSparkError(SparkpointError):
    """The warm local Spark could not be started or reached; the message says why and what to do."""


class WarmSparkElsewhere(WarmSparkError):
    """The warm local Spark runs with another environment and other runs are attached to it: this
    run cannot use it (it would compute with the other environment) and may not replace it."""


@dataclass(frozen=True)
class WarmServer:
    """`server.json`: where the server listens and which processes are it."""

    port: int
    token_file: str
    supervisor_pid: int
    supervisor_start: str | None
    jvm_pid: int
    jvm_start: str | None
    boot: str | None
    key: str
    started_at: float
    started_by: str  # the pid and command line of the run that started it
    environment: dict[str, str]  # variable -> digest of its value, as its Python workers see them
    format: int = FORMAT

    @property
    def url(self) -> str:
        """The client URL, at the exact address bound (never `localhost`: gRPC tries `::1` first,
        where anyone may listen); the token is read from its file (only this user may)."""
        token = Path(self.token_file).read_text().strip()
        return f"sc://127.0.0.1:{self.port}/;token={token}"

    def lives(self) -> bool:
        return (self.boot == boot_id() and same_process_lives(self.supervisor_pid, self.supervisor_start)
                and same_process_lives(self.jvm_pid, self.jvm_start))

    def proven(self) -> bool:
        """Whether the server lives and its JVM is what listens on 127.0.0.1:`port`."""
        return self.lives() and listens_on(self.jvm_pid, self.port)

    def guard(self) -> Callable[[], bool]:
        """A check for every call of a client, made once the server is proven: the JVM lives and
        the very socket it was proven to hold still listens on the port (a JVM shutting down
        closes its listener first, and the port is then anyone's). Reads /proc/net/tcp6, not
        the JVM's open files: cheap enough for each call."""
        held = holding_inodes(self.jvm_pid, self.port)

        def still_ours() -> bool:
            return bool(held & listening_inodes(self.port)) and self.lives()

        return still_ours

    def environment_differs(self, environment: dict[str, str]) -> list[str]:
        """The variables whose values differ between `environment` (digests) and the server's."""
        return sorted(k for k in self.environment.keys() | environment.keys()
                      if self.environment.get(k) != environment.get(k))

    def describe(self) -> str:
        started = time.strftime("%H:%M:%S", time.localtime(self.started_at))
        return (f"the warm local Spark on 127.0.0.1:{self.port} (JVM pid {self.jvm_pid}), started at {started} "
                f"by {self.started_by}")


def environment_digest(environ: dict[str, str] | None = None) -> dict[str, str]:
    """What of a process's environment a run must share with the server its tasks run on, as
    digests (the values, credentials among them, are never written down)."""
    environ = _absolute_pythonpath(dict(os.environ if environ is None else environ))
    return {k: hashlib.sha256(v.encode("utf-8", "surrogateescape")).hexdigest()[:16]
            for k, v in sorted(environ.items())
            if k not in VOLATILE_ENV and not k.startswith(VOLATILE_PREFIXES)}


def _absolute_pythonpath(environ: dict[str, str]) -> dict[str, str]:
    """`environ` with its PYTHONPATH's entries made absolute against this process's working
    directory (`PYTHONPATH=dags` names another directory from another one)."""
    if environ.get("PYTHONPATH"):
        entries = environ["PYTHONPATH"].split(os.pathsep)
        environ["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in entries if p)
    return environ


def enabled() -> bool:
    return os.environ.get(WARM_ENV, "on").strip().lower() not in ("off", "0", "false", "no")


def default_spark(master: str | None, remote: str | None) -> tuple[str | None, str | None]:
    """(master, remote) for a run that may name neither: the warm server's URL, or `local[2]` in
    the run's own process when the warm server is off, when a crash point is armed (a test's
    SIGKILL must reach the Spark of the run it kills), when this system cannot prove whose server
    answers (no /proc), or when the warm server runs with another environment and other runs use
    it (said in one line)."""
    if remote or master:
        return master, remote
    from sparkpoint.checkpoint.crash import CRASH_AT

    if not enabled() or os.environ.get(CRASH_AT):
        return IN_PROCESS_MASTER, None
    if not proc_available():
        log.warning("sparkpoint: the warm local Spark needs /proc to prove its server is ours; this run starts "
                    "Spark in its own process (set %s=off to say so)", WARM_ENV)
        return IN_PROCESS_MASTER, None
    try:
        return None, attach()
    except WarmSparkElsewhere as e:
        log.warning("sparkpoint: %s", e)
        return IN_PROCESS_MASTER, None


def idle_seconds() -> float:
    raw = os.environ.get(IDLE_ENV, "")
    try:
        idle = float(raw) if raw.strip() else DEFAULT_IDLE
    except ValueError:
        raise WarmSparkError(f"{IDLE_ENV}={raw!r}: give the idle period in seconds, e.g. {int(DEFAULT_IDLE)}") from None
    if not 0 < idle < float("inf"):
        raise WarmSparkError(f"{IDLE_ENV}={raw!r}: the idle period must be a positive number of seconds")
    return idle


def server_key() -> str:
    """One server per virtual environment and sparkpoint and pyspark version: a server of another
    version or venv (whose workers would import other code) is never reused."""
    import pyspark

    from sparkpoint import __version__

    text = json.dumps([os.path.realpath(sys.prefix), os.path.realpath(sys.executable), __version__,
                       pyspark.__version__, str(_sparkpoint_root())])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _sparkpoint_root() -> Path:
    """The directory this sparkpoint package is imported from (an install or a checkout)."""
    import sparkpoint

    return Path(sparkpoint.__file__).resolve().parent.parent


def server_dir() -> Path:
    explicit = os.environ.get(DIR_ENV)
    if explicit:
        return Path(explicit)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "sparkpoint" / "warm-spark" / server_key()


def _private_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = path.stat()
    if st.st_uid != os.getuid():
        raise WarmSparkError(f"{path} belongs to another user: set {DIR_ENV} to a directory of yours")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


@contextlib.contextmanager
def _flock(path: Path, mode: int, timeout: float | None = None) -> Iterator[IO[bytes] | None]:
    """`path` locked with `mode` (LOCK_EX / LOCK_SH); with `timeout` 0, yields None when it is
    taken elsewhere; otherwise waits up to `timeout` seconds (None: for ever)."""
    f = open(path, "a+b")  # noqa: SIM115 - held across the yield
    try:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(f, mode | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if deadline is not None and time.monotonic() >= deadline:
                    if timeout == 0:
                        yield None
                        return
                    raise WarmSparkError(f"waited {timeout:.0f}s for {path}: another process holds it") from None
                time.sleep(0.05)
        yield f
    finally:
        f.close()  # releases the lock


def read_server(directory: Path) -> WarmServer | None:
    """`server.json`, or None when there is none or it is not one this code wrote."""
    try:
        raw = json.loads((directory / "server.json").read_text())
        server = WarmServer(**raw)
    except (OSError, ValueError, TypeError):
        return None
    return server if server.format == FORMAT else None


def answers(port: int, timeout: float = ANSWER_TIMEOUT) -> bool:
    """Whether a gRPC server on 127.0.0.1:`port` completes an HTTP/2 handshake in time: a JVM
    that is stopped or wedged accepts the TCP connection (the kernel does) but never this."""
    import grpc

    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout)
        return True
    except grpc.FutureTimeoutError:
        return False
    finally:
        channel.close()


# --- the client side ------------------------------------------------------------------------------

_attached: dict[str, IO[bytes]] = {}  # directory -> this process's shared `in-use` lock
_proven: dict[str, WarmServer] = {}  # URL -> the server `attach` proved it names


def attach(*, idle: float | None = None, timeout: float = START_TIMEOUT) -> str:
    """The URL of this user's warm local Spark Connect server, started if none is up (or the one
    up is gone, wedged, or runs with another environment and no run is attached to it); this
    process stays attached (the server keeps running) until it exits.

    Args:
        idle: seconds without an attached run after which a server this call starts stops
            (default `SPARKPOINT_WARM_SPARK_IDLE`, else 300: five minutes).
        timeout: how long to wait for a new server to answer.

    Returns:
        An `sc://127.0.0.1:P` URL with the server's token, for `spark_session(remote=...)`.

    Raises:
        WarmSparkElsewhere: the server runs with another environment and other runs use it.
        WarmSparkError: the server could not be started (the message has its log's last lines).
    """
    directory = _private_dir(server_dir())
    idle = idle_seconds() if idle is None else idle
    environment = environment_digest()
    with _flock(directory / "lock", fcntl.LOCK_EX, timeout=timeout + 60):
        server = read_server(directory)
        if server is not None and not (server.proven() and _answers_patiently(directory, server)):
            log.warning("the warm local Spark (pid %d) is gone or does not answer: starting another", server.jvm_pid)
            stop(server)
            server = None
        if server is not None and (differs := server.environment_differs(environment)):
            _replace_unless_used(directory, server, differs)
            server = None
        if server is None:
            (directory / "server.json").unlink(missing_ok=True)
            server = _start(directory, idle, timeout)
        if not server.proven():
            raise WarmSparkError(f"what listens on 127.0.0.1:{server.port} is not the warm local Spark's JVM "
                                 f"(pid {server.jvm_pid}): its token was not sent; see {directory / 'server.log'}")
        _hold(directory)
        (directory / "last-attach").touch()
    log.info("sparkpoint: attached to %s", server.describe())
    url = server.url
    _proven[url] = server
    return url


def _replace_unless_used(directory: Path, server: WarmServer, differs: list[str]) -> None:
    """Stop `server`, which runs with another environment, unless another run is attached to it
    (then `WarmSparkElsewhere`). Called under `lock`: no run attaches meanwhile."""
    shown = ", ".join(differs[:5]) + (f" and {len(differs) - 5} more" if len(differs) > 5 else "")
    mine = _attached.pop(str(directory), None)
    if mine is not None:
        mine.close()  # this process's own attachment does not count as another run's
    with _flock(directory / "in-use", fcntl.LOCK_EX, timeout=0) as alone:
        used = alone is None
    if used:
        if mine is not None:
            _hold(directory)
        raise WarmSparkElsewhere(
            f"{server.describe()} runs with another environment ({shown} differ) and other runs use it: this run "
            f"starts a Spark of its own, which computes with this run's environment")
    log.warning("sparkpoint: %s runs with another environment (%s differ): starting one with this run's",
                server.describe(), shown)
    stop(server)


def attached_here() -> bool:
    """Whether this process is attached to a warm local Spark (its tasks run there)."""
    return bool(_attached)


def proven_server(url: str) -> WarmServer | None:
    """The warm server `url` (as `attach` gave it) names, proven to hold its address now; None for
    a URL that is not a warm server's.

    Raises:
        WarmSparkError: it is a warm server's URL but that server is gone or another process
            listens at its address: the token must not be sent.
    """
    server = _proven.get(url)
    if server is None:
        on_disk = read_server(server_dir()) if url.startswith("sc://127.0.0.1:") else None
        with contextlib.suppress(OSError):
            if on_disk is not None and on_disk.url == url:
                server = on_disk
    if server is None:
        return None
    if not server.proven():
        raise WarmSparkError(f"the warm local Spark at 127.0.0.1:{server.port} is gone, or another process listens "
                             "at its address: its token was not sent; run again to start another")
    return server


def _answers_patiently(directory: Path, server: WarmServer) -> bool:
    """Whether the server answers; a busy one (other runs attached: a loaded machine, a long GC)
    is given `WEDGED_AFTER` seconds before it is taken for wedged and its runs lose their Spark."""
    if answers(server.port):
        return True
    with _flock(directory / "in-use", fcntl.LOCK_EX, timeout=0) as alone:
        if alone is not None:
            return False
    return answers(server.port, timeout=WEDGED_AFTER - ANSWER_TIMEOUT)


def _hold(directory: Path) -> None:
    if str(directory) in _attached:
        return
    f = open(directory / "in-use", "a+b")  # noqa: SIM115 - held until this process exits
    fcntl.flock(f, fcntl.LOCK_SH)  # never waits long: the supervisor takes it only while holding `lock`
    _attached[str(directory)] = f


def detach() -> None:
    """This process no longer keeps the warm server up (it still does until its own exit
    otherwise)."""
    while _attached:
        _, f = _attached.popitem()
        f.close()


def _start(directory: Path, idle: float, timeout: float) -> WarmServer:
    """Spawn the supervisor (in a session of its own: a Ctrl-C of this run does not reach it) and
    wait for its `server.json`."""
    log_path = directory / "server.log"
    with open(log_path, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "sparkpoint.spark.warm", str(directory), "--idle", str(idle)],
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=directory, env=_absolute_pythonpath(dict(os.environ)))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        server = read_server(directory)
        if server is not None and server.supervisor_pid == proc.pid:
            return server
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    else:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    raise WarmSparkError(
        f"the warm local Spark did not start (see {log_path}); its last lines:\n{_tail(log_path)}\n"
        f"Set {WARM_ENV}=off to run Spark in each run's own process instead")


def stop(server: WarmServer | None = None, directory: Path | None = None) -> bool:
    """Stop a warm server (by default this user's for this venv): its supervisor and JVM. True if
    one was running. Callers hold `lock`, or accept that a run attached now loses its Spark."""
    directory = directory or server_dir()
    server = server or read_server(directory)
    if server is None:
        return False
    stopped = False
    processes = ((server.supervisor_pid, server.supervisor_start), (server.jvm_pid, server.jvm_start))
    for pid, started in processes:
        if same_process_lives(pid, started):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)  # each leads a process group: its children go too
            stopped = True
    deadline = time.monotonic() + 10  # gone when this returns: SIGKILL takes effect a moment later
    while any(same_process_lives(pid, started) for pid, started in processes) and time.monotonic() < deadline:
        time.sleep(0.05)
    with contextlib.suppress(OSError):
        if read_server(directory) == server:
            (directory / "server.json").unlink()
    return stopped


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# --- the supervisor -------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _first_port() -> int:
    raw = os.environ.get(PORT_ENV, "").strip()
    if not raw:
        return _free_port()
    try:
        port = int(raw)
    except ValueError:
        port = 0
    if not 0 < port < 65536:
        print(f"warm Spark: {PORT_ENV}={raw!r} is no port number; taking a free port", flush=True)
        return _free_port()
    return port


def _die_with_parent() -> None:
    """In the JVM's child before exec: SIGKILL when the supervisor dies, however it dies."""
    import ctypes

    prctl = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)  # Linux only
    if prctl is not None:
        prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _jvm_command(properties: Path) -> list[str]:
    from pyspark.find_spark_home import _find_spark_home

    spark_home = _find_spark_home()
    return [os.path.join(spark_home, "bin", "spark-submit"), "--class", SERVER_CLASS, "--master", "local[*]",
            "--driver-java-options", f"-Dlog4j2.configurationFile={QUIET_LOG4J.as_uri()}",
            "--properties-file", str(properties), "spark-internal"]


def _write_properties(directory: Path, port: int) -> Path:
    """The JVM's settings in a file only this user reads: the port stays off every command line.
    No retry on another port (`spark.port.maxRetries` 0): a port taken between our pick and the
    JVM's bind fails the JVM, and the supervisor picks again, instead of the JVM serving on P+1."""
    settings = {
        "spark.connect.grpc.binding.port": str(port), "spark.connect.grpc.binding.address": "127.0.0.1",
        "spark.port.maxRetries": "0", "spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1",
        "spark.ui.enabled": "false", "spark.sql.session.timeZone": "UTC",
        "spark.sql.execution.arrow.pyspark.enabled": "true",
    }
    path = directory / "spark.properties"
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.writelines(f"{key}={value}\n" for key, value in settings.items())
    return path


def _started_by() -> str:
    """The run that spawned this supervisor, as a shared server says whose it is: its pid and
    program (`sparkpoint run`, `python -m dagster ...`), never its arguments (they may hold a
    storage option's secret, and other runs' logs show this)."""
    parent = os.getppid()
    try:
        words = [w.decode(errors="replace") for w in Path(f"/proc/{parent}/cmdline").read_bytes().split(b"\0") if w]
    except OSError:
        words = []
    return f"pid {parent}" + (f" ({_program(words)})" if words else "")


def _program(words: list[str]) -> str:
    """`python -m sparkpoint.cli run --pipeline ...` -> `sparkpoint.cli run`; `/venv/bin/sparkpoint
    run ...` -> `sparkpoint run`: the program and its subcommand, not its arguments."""
    rest = words[1:] if os.path.basename(words[0]).startswith("python") and len(words) > 1 else words
    if rest[0] == "-m" and len(rest) > 1:
        name, rest = rest[1], rest[2:]
    elif rest[0] == "-c":
        return "python -c ..."
    else:
        name, rest = os.path.basename(rest[0]), rest[1:]
    if rest and rest[0].replace("-", "").replace("_", "").isalpha():
        name += f" {rest[0]}"
    return name[:80]


def serve(directory: Path, idle: float) -> int:
    """The supervisor: start the JVM, record it, stop it after `idle` seconds without a run."""
    environment = environment_digest()  # the run's that spawned us: its workers inherit it
    started_by = _started_by()
    token_file = directory / "token"
    with open(os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.write(secrets.token_hex(24))
    from pyspark.find_spark_home import _find_spark_home

    env = {**os.environ, "SPARK_HOME": _find_spark_home(), "SPARK_LOCAL_IP": "127.0.0.1",
           "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable,
           "SPARK_CONNECT_AUTHENTICATE_TOKEN": token_file.read_text().strip(),
           "PYTHONWARNINGS": "ignore::FutureWarning"}
    env.pop("SPARKPOINT_LOCAL_DIR", None)  # task-local state goes where each run says
    # Its Python workers import this sparkpoint first, then what the run's own PYTHONPATH holds
    # (a helper module beside the pipeline's, as a Spark of the run's own would find it; part of
    # the environment a run must share to attach); the operators' modules also reach them as
    # each run's artifacts.
    own = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]  # absolute: see `_start`
    env["PYTHONPATH"] = os.pathsep.join([str(_sparkpoint_root()), *own])
    for attempt in range(3):  # the free port may be taken between its pick and the JVM's bind
        port = _first_port() if attempt == 0 else _free_port()
        jvm = subprocess.Popen(_jvm_command(_write_properties(directory, port)), env=env, stdin=subprocess.DEVNULL,
                               cwd=directory, start_new_session=True, preexec_fn=_die_with_parent)
        if _wait_answering(jvm, port):
            break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(jvm.pid, signal.SIGKILL)
        jvm.wait()
        print(f"warm Spark: the JVM did not come to listen on port {port} itself (attempt {attempt + 1}; "
              "another process may have taken the port)", flush=True)
    else:
        return 1
    me = os.getpid()
    server = WarmServer(port=port, token_file=str(token_file), supervisor_pid=me, supervisor_start=process_start(me),
                        jvm_pid=jvm.pid, jvm_start=process_start(jvm.pid), boot=boot_id(), key=directory.name,
                        started_at=time.time(), started_by=started_by, environment=environment)
    tmp = directory / f"server.json.{me}"
    tmp.write_text(json.dumps(asdict(server)))
    os.replace(tmp, directory / "server.json")
    print(f"warm Spark: serving on 127.0.0.1:{port} (JVM pid {jvm.pid}), stopping after {idle:.0f}s idle", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        return _watch(directory, jvm, idle)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(jvm.pid, signal.SIGTERM)
        try:
            jvm.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(jvm.pid, signal.SIGKILL)
        # Gone on its own (or SIGTERM): withdrawn under `lock`, so never a successor's record.
        with contextlib.suppress(OSError, WarmSparkError), _flock(directory / "lock", fcntl.LOCK_EX, timeout=30):
            current = read_server(directory)
            if current is not None and current.supervisor_pid == me:
                (directory / "server.json").unlink()


def _wait_answering(jvm: subprocess.Popen[bytes], port: int) -> bool:
    """Whether our JVM comes to answer on 127.0.0.1:`port` from a socket it holds itself: a
    process that bound the port first and answers there is never taken for it."""
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline and jvm.poll() is None:
        if listens_on(jvm.pid, port):
            if answers(port, timeout=1.0):
                return True
        else:
            time.sleep(0.25)
    return False


def _watch(directory: Path, jvm: subprocess.Popen[bytes], idle: float) -> int:
    busy_at = time.time()
    while jvm.poll() is None:
        time.sleep(POLL)
        with _flock(directory / "in-use", fcntl.LOCK_EX, timeout=0) as free:
            if free is None:  # a run is attached
                busy_at = time.time()
                continue
        if time.time() - max(busy_at, _mtime(directory / "last-attach")) < idle:
            continue
        # Stop only while no run can be attaching (`lock`) or attached (`in-use`).
        with _flock(directory / "lock", fcntl.LOCK_EX, timeout=0) as locked:
            if locked is None:
                continue
            with _flock(directory / "in-use", fcntl.LOCK_EX, timeout=0) as free:
                if free is None or time.time() - _mtime(directory / "last-attach") < idle:
                    continue
                (directory / "server.json").unlink(missing_ok=True)
                print(f"warm Spark: no run for {idle:.0f}s, stopping", flush=True)
                return 0
    print(f"warm Spark: the JVM exited with {jvm.returncode}", flush=True)
    return 1


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def describe() -> dict[str, Any]:
    """What `sparkpoint spark` shows: the directory, and the server if one is up."""
    directory = server_dir()
    server = read_server(directory)
    return {"directory": str(directory), "running": bool(server and server.lives()),
            "port": server.port if server else None, "jvm_pid": server.jvm_pid if server else None,
            "started_at": server.started_at if server else None,
            "started_by": server.started_by if server else None}


def main(argv: list[str] | None = None) -> int:
    """`python -m sparkpoint.spark.warm DIR --idle S`: the supervisor (sparkpoint starts it);
    `python -m sparkpoint.spark.warm --stop`: stop this venv's warm server (`make ui` on Ctrl-C)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m sparkpoint.spark.warm",
                                     description="the warm local Spark's supervisor (started by sparkpoint)")
    parser.add_argument("directory", type=Path, nargs="?")
    parser.add_argument("--idle", type=float, default=DEFAULT_IDLE)
    parser.add_argument("--stop", action="store_true", help="stop this venv's warm server, if one runs")
    args = parser.parse_args(argv)
    if args.stop or args.directory is None:
        directory = server_dir()
        if not directory.is_dir():
            return 0
        with _flock(_private_dir(directory) / "lock", fcntl.LOCK_EX, timeout=60):
            if stop(directory=directory):
                print("sparkpoint: stopped the warm local Spark")
        return 0
    return serve(args.directory, args.idle)


if __name__ == "__main__":
    sys.exit(main())
