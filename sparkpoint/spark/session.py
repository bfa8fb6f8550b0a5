"""A Spark session set up for sparkpoint: Arrow for pandas, UTC, quiet.

Quiet by default: the JVM starts with `log4j2-quiet.properties` (errors only) and a local master
binds to 127.0.0.1, so Spark's start-up chatter (log4j WARN lines, the note that the hostname
resolves to a loopback address, the JVM's incubator-module warning) never reaches the terminal;
any other line the JVM writes to standard error is passed through. `verbose=True` (or the
environment variable SPARKPOINT_VERBOSE=1, which `sparkpoint --verbose` sets) keeps Spark's own
logging as it is.

On Spark Connect, the runs of one pipeline share a server session (`share=`, `session_key`): a
session's Python workers are its own (its artifacts are on their path), so a new session per run
started new workers, whose imports cost about two seconds of every checkpoint on this machine.
The session's id is derived from the job and the bytes of the operators' code: a run of changed
code gets a session, and workers, of its own, never modules another version imported.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import warnings
import zipfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import pandas as pd
from pyspark.sql import SparkSession

from sparkpoint.checkpoint.crash import kill_with_this_process
from sparkpoint.checkpoint.errors import SparkpointError
from sparkpoint.spark.classcache import ClassArchive
from sparkpoint.spark.faults import arm_crash_points
from sparkpoint.spark.loopback import verified_channel_builder
from sparkpoint.spark.properties import spark_defaults
from sparkpoint.spark.warm import IN_PROCESS_MASTER, QUIET_LOG4J, WarmServer, default_spark, proven_server

log = logging.getLogger(__name__)
# What the JVM prints before log4j is configured, or outside it.
_CHATTER = re.compile(
    r"^(WARNING: Using incubator modules|Using Spark's default log4j profile|Setting default log level to"
    r"|To adjust logging level use|\d\d/\d\d/\d\d \d\d:\d\d:\d\d (WARN|INFO) )"
)


def verbose_from_env() -> bool:
    return os.environ.get("SPARKPOINT_VERBOSE", "").strip().lower() in ("1", "true", "yes", "on")


def spark_session(
    master: str | None = None, *, app_name: str = "sparkpoint", ui: bool = False, verbose: bool | None = None,
    remote: str | None = None, share: str | None = None,
) -> SparkSession:
    """A classic session on `master` (the JVM in this process's tree), or, with `remote` (or a
    master `sc://host:port`), a Spark Connect client of a Spark that is already up: no JVM starts
    here, and the server's executors run the pipeline's tasks; with `share` (a `session_key`) in
    the server session every run with that key attaches to. With neither: the warm local Spark
    (`sparkpoint.spark.warm`), or `local[2]` here when it is off."""
    verbose = verbose_from_env() if verbose is None else verbose
    master, remote = default_spark(master, remote)
    master = master or IN_PROCESS_MASTER
    if remote or master.startswith("sc://"):
        connected: SparkSession = connect_session(remote or master, app_name=app_name, verbose=verbose, share=share)
        return connected  # the Connect client's SparkSession has the classic one's DataFrame API
    # pandas 3 works for what sparkpoint asks of PySpark (Arrow batches in and out); PySpark 4.3
    # warns on every UDF all the same.
    warnings.filterwarnings("ignore", message="PySpark does not yet fully support pandas", category=FutureWarning)
    os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
    # Executors run the same Python as the driver (and so find sparkpoint installed).
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    local = master.startswith("local")
    settings = {
        "spark.ui.enabled": str(ui).lower(),
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.session.timeZone": "UTC",
        "spark.sql.execution.arrow.pyspark.enabled": "true",
    }
    if local:  # nothing outside this machine needs to reach the driver
        settings.update({"spark.driver.bindAddress": "127.0.0.1", "spark.driver.host": "127.0.0.1"})
    # Tests only: named crash points reach the executors (set before the JVM starts: it inherits them).
    settings.update({f"spark.executorEnv.{k}": v for k, v in arm_crash_points().items()})
    if not verbose:
        _quiet_python_loggers()
    launched = _launch_gateway(master, app_name, settings, quiet=not verbose)
    try:
        builder = SparkSession.builder.master(master).appName(app_name)
        for key, value in settings.items():
            builder = builder.config(key, value)
        spark = builder.getOrCreate()
        if not verbose:
            spark.sparkContext.setLogLevel("ERROR")
            _interrupt_cleanly(spark)
    except BaseException:  # a start cut short (Ctrl-C, a Dagster interrupt, Spark refusing its settings)
        if launched:
            _abandon_start()
        raise
    return spark


def connect_session(url: str, *, app_name: str = "sparkpoint", verbose: bool = False,
                    share: str | None = None) -> Any:
    """A Spark Connect session (`sc://host:port[/;params]`), checked before use: a wrong URL is a
    SparkConnectionError naming it, not a gRPC trace. The server must run this Python with
    sparkpoint installed (its Python workers run the tasks); the user's own modules are shipped
    as artifacts (`ship_modules`). With `share`, the server session whose id `share` gives (a
    URL that names a `session_id` keeps it): stopping this client leaves it, and its warm Python
    workers, to the next run; one the server has closed (idle past its timeout) is skipped."""
    warnings.filterwarnings("ignore", message="PySpark does not yet fully support pandas", category=FutureWarning)
    if not verbose:
        _quiet_python_loggers()
    check_reachable(url)
    peer = proven_server(url)  # the warm local Spark: proven ours before its token is sent
    deadline = time.monotonic() + (ATTACH_RETRY_SECONDS if peer is not None else 0.0)
    pause = 0.5
    while True:
        try:
            spark = _open_connect_session(url, app_name, share, peer)
            break
        except ImportError as e:
            raise SparkConnectionError(
                f"Spark Connect needs pyspark's connect extra ({e}): pip install 'pyspark[connect]'") from e
        except Exception as e:
            # A loaded machine makes a live server miss a call now and then: tried again while
            # its JVM lives (and still holds its address), for up to a minute.
            if peer is not None and _transient(e) and time.monotonic() < deadline and peer.proven():
                log.info("the warm local Spark did not answer (%s); trying again", _first_line(e))
                time.sleep(pause)
                pause = min(pause * 2, 5.0)
                continue
            raise SparkConnectionError(
                f"cannot reach the Spark Connect server at {_shown(url)}: {_first_line(e)}") from e
    _connect_sessions[:] = [spark]
    if not verbose:
        _interrupt_cleanly(spark)
    return spark


ATTACH_RETRY_SECONDS = 60.0
_TRANSIENT = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "failed to connect", "Connection reset", "Socket closed",
              "Connection refused", "keepalive")


def _transient(e: BaseException) -> bool:
    import grpc

    code = getattr(e, "code", None)
    if isinstance(e, grpc.RpcError) and callable(code):
        return code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    text = str(e)
    return any(marker in text for marker in _TRANSIENT)


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _open_connect_session(url: str, app_name: str, share: str | None, peer: WarmServer | None) -> Any:
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    guard = peer.guard() if peer is not None else None

    def builder(target: str) -> Any:
        if guard is None:
            return ConnectSession.builder.remote(target)
        return ConnectSession.builder.channelBuilder(verified_channel_builder(target, guard))

    if share and "session_id=" not in url:
        return _shared_session(builder, url, share)
    spark = builder(url).appName(app_name).getOrCreate()
    _first_call(spark)
    return spark


# A shared session the server has closed (idle past its timeout) keeps its id closed for as long
# as the server runs: the next generation's id is tried. Ids start again each UTC day, so a
# pipeline idle for hours every day uses up no more than a day's worth of them.
SHARED_SESSION_GENERATIONS = 32


def _first_call(spark: Any) -> None:
    for key, value in (("spark.sql.session.timeZone", "UTC"), ("spark.sql.execution.arrow.pyspark.enabled", "true")):
        spark.conf.set(key, value)  # the first call: reaches the server or fails here


def _shared_session(builder: Callable[[str], Any], url: str, share: str) -> Any:
    """The first session of the ids `share` gives that the server has not closed."""
    base = url if "/;" in url else url.rstrip("/") + "/"
    for generation in range(SHARED_SESSION_GENERATIONS):
        session_id = shared_session_id(share, generation)
        # No builder options: create() would send them at once, outside the try, and leave the
        # refused session the process's active one.
        spark = builder(f"{base};session_id={session_id}").create()
        spark.release_session_on_close = False  # stop() closes this client only
        try:
            _first_call(spark)
            return spark
        except Exception as e:
            spark.stop()
            if "SESSION_CLOSED" not in str(e):
                raise
    log.warning("every shared Spark Connect session id of today is closed on %s; this run uses a session of "
                "its own (its Python workers start cold)", _shown(url))
    spark = builder(url).create()
    _first_call(spark)
    return spark


def shared_session_id(share: str, generation: int = 0, day: str | None = None) -> str:
    day = day or time.strftime("%Y-%m-%d", time.gmtime())
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"sparkpoint/{share}/{day}/{generation}"))


def session_key(job_id: str, operators: Iterable[Any], settings: Mapping[str, Any] | None = None) -> str:
    """What the runs that may share a Spark Connect session have in common: the job, and the
    bytes of the files the operators' functions come from (their top-level packages whole,
    sparkpoint's own included). Any change to that code gives another key, so a session's
    workers never run modules another version imported, and the session never holds an
    artifact of the same name with other bytes. `settings`: the Spark settings a run puts on the
    session, which stay on it (other settings get a session of their own). The working directory
    too: on the warm local Spark a session's workers run in the directory of its runs (a module
    that reads a relative path at import reads it there once)."""
    digest = hashlib.sha256(job_id.encode())
    try:
        here = os.getcwd()
    except OSError:  # the directory was removed under the process: no directory to share
        here = ""
    digest.update(here.encode("utf-8", "surrogateescape"))
    digest.update(json.dumps({str(k): str(v) for k, v in (settings or {}).items()}, sort_keys=True).encode())
    functions = [fn for op in operators for fn in (op.process, op.export)]
    roots = dict(code_roots(functions))
    if "sparkpoint" not in roots:
        roots["sparkpoint"] = Path(__file__).parent.parent / "__init__.py"
    for root, path in sorted(roots.items()):
        for f in _module_files(path):
            digest.update(f"\0{root}/{f.relative_to(path.parent).as_posix()}\0".encode())
            try:
                digest.update(f.read_bytes())
            except OSError:  # a module imported from a zip: its name stands for it
                digest.update(b"unreadable")
    return digest.hexdigest()[:32]


def _module_files(path: Path) -> list[Path]:
    """A module's file, or every file of its package but compiled ones (`__pycache__` changes
    with whichever Python imported it last)."""
    if path.name != "__init__.py":
        return [path]
    return sorted(f for f in path.parent.rglob("*")
                  if f.is_file() and "__pycache__" not in f.parts and f.suffix not in (".pyc", ".pyo"))


def _zip_package(init: Path, root: str) -> Path:
    """The package as a zip whose bytes depend only on its files' names and bytes (the same
    artifact every run, as a shared session requires)."""
    target = Path(tempfile.mkdtemp(prefix="sparkpoint-ship-")) / f"{root}.zip"
    with zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as archive:  # no compressor's version in the bytes
        for f in _module_files(init):
            info = zipfile.ZipInfo(f"{root}/{f.relative_to(init.parent).as_posix()}", date_time=(1980, 1, 1, 0, 0, 0))
            info.create_system, info.external_attr = 3, 0o644 << 16
            archive.writestr(info, f.read_bytes(), zipfile.ZIP_STORED)
    return target


def _shown(url: str) -> str:
    """The URL as messages show it: `sc://host:port`, without its parameters (`;token=...`)."""
    return "sc://" + url.removeprefix("sc://").split("/", 1)[0].split(";", 1)[0]


def check_reachable(url: str, timeout: float = 10.0) -> None:
    """A Spark Connect URL, and a server listening there: fail fast on one that is not there
    (the gRPC client retries for minutes)."""
    if not url.startswith("sc://"):
        raise SparkConnectionError(f"a Spark Connect URL must start with sc://, e.g. sc://127.0.0.1:15002 "
                                   f"(got one starting {url.split(':', 1)[0]!r})")
    address = _shown(url).removeprefix("sc://")
    host, _, port = address.rpartition(":") if ":" in address.lstrip("[").split("]")[-1] else (address, "", "15002")
    try:
        with socket.create_connection((host.strip("[]") or "localhost", int(port)), timeout=timeout):
            pass
    except (OSError, ValueError) as e:
        raise SparkConnectionError(f"cannot reach the Spark Connect server at {_shown(url)}: {e}") from e


class SparkConnectionError(SparkpointError):
    """The Spark this run should attach to cannot be reached."""


def is_connect(spark: Any) -> bool:
    """Whether `spark` is a Spark Connect client (no SparkContext, no RDDs, artifacts for modules)."""
    module = type(spark).__module__
    return module.startswith("pyspark.sql.connect")


@contextlib.contextmanager
def job_group(spark: Any, group: str, description: str) -> Iterator[None]:
    """Spark jobs started inside are found (and cancelled) by `group`: a job group on a classic
    session, a tag on Spark Connect."""
    if is_connect(spark):
        spark.addTag(group)
        spark.addTag(CLIENT_TAG)  # what a Ctrl-C interrupts: this client's operations, not the session's
        try:
            yield
        except BaseException:
            # A Ctrl-C, a terminated step, a timeout: the session outlives this client (shared),
            # so its job must not run on. pyspark's client releases an execution it abandons; the
            # tag makes sure, whatever way out, from the thread whose tags the job carries.
            with contextlib.suppress(Exception):
                spark.interruptTag(CLIENT_TAG)
            raise
        finally:
            spark.removeTag(CLIENT_TAG)
            spark.removeTag(group)
        return
    sc = spark.sparkContext
    previous = {k: sc.getLocalProperty(k) for k in ("spark.jobGroup.id", "spark.job.description")}
    sc.setJobGroup(group, description)
    try:
        yield
    finally:
        for key, value in previous.items():
            sc.setLocalProperty(key, value)  # None removes it


def one_task_per_index(spark: Any, count: int, run: Callable[[Iterator[pd.DataFrame]], Iterator[pd.DataFrame]],
                       schema: str) -> list[dict[str, Any]]:
    """A Spark job of `count` tasks, task i mapping a frame with the one row `id` = i through
    `run`; the rows of every frame it yields, as dicts in `schema`'s columns.

    On a classic session through the RDD API: a DataFrame's `mapInPandas` plans a query and
    sends each frame through Arrow both ways, which cost about 70 ms of every job on `local[2]`
    (0.16 against 0.09 s for a job of two tiny tasks, measured in one warm session): what a
    checkpoint of a small batch costs in a long-running `run --follow`. On Spark Connect, which
    has no RDDs, and in a session with Spark's UDF profiler on (`spark.sql.pyspark.udf.profiler`,
    which profiles SQL UDFs only): `range` with `count` slices (exactly one index in each
    partition) and `mapInPandas`."""
    if is_connect(spark) or spark.conf.get("spark.sql.pyspark.udf.profiler", None):
        # Spark Connect, or a session whose UDF profiler is on (it sees SQL UDFs, not RDD functions).
        job = spark.range(0, count, 1, count).mapInPandas(run, schema)
        return [r.asDict() for r in job.collect()]

    def task(ids: Iterator[int]) -> Iterator[dict[str, Any]]:
        for frame in run(iter([pd.DataFrame({"id": list(ids)}, dtype="int64")])):
            yield from frame.to_dict("records")

    result: list[dict[str, Any]] = spark.sparkContext.parallelize(range(count), count).mapPartitions(task).collect()
    return result


def _interrupt_cleanly(spark: Any) -> None:
    """PySpark's SIGINT handler cancels the jobs through py4j from inside the call it interrupts
    (a reentrant call: py4j logs a page of traces). Ours cancels them from another thread and
    raises KeyboardInterrupt in the driver, which stops at once."""
    if threading.current_thread() is not threading.main_thread():
        return

    def on_interrupt(signum: int, frame: object) -> None:
        request_interrupt()
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_interrupt)
    _keep_interrupts_out_of_finalizers()


def _keep_interrupts_out_of_finalizers() -> None:
    """A KeyboardInterrupt raised while a finalizer runs (a file object closing as it is
    collected) cannot propagate: Python prints it with a traceback and drops it. Ours deliver
    SIGINT again a moment later instead, and print nothing."""
    if getattr(sys.unraisablehook, "_sparkpoint", False):
        return
    default = sys.unraisablehook

    def on_unraisable(unraisable: Any) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT)).start()
            return
        default(unraisable)

    on_unraisable._sparkpoint = True  # type: ignore[attr-defined]
    sys.unraisablehook = on_unraisable


def request_interrupt() -> None:
    """Mark the process interrupted and cancel the running Spark jobs, from a thread of its own
    (safe in a signal handler: no py4j call is made on the interrupted thread)."""
    _interrupted.set()

    def cancel() -> None:
        # Every py4j call here may meet a JVM the driver is already stopping (the session lookup
        # too: it asks the JVM): nothing of it may print, the driver is stopping anyway.
        try:
            connect = _connect_active()
            if connect is not None:  # the server and the session go on; only this client's operations stop
                connect.interruptTag(CLIENT_TAG)
                return
            active = SparkSession.getActiveSession()
            if active is not None:
                active.sparkContext.cancelAllJobs()
        except Exception:
            pass

    threading.Thread(target=cancel, daemon=True, name="spark-cancel").start()


def _connect_active() -> Any:
    """The Connect session this process made last (the cancel thread runs apart from the thread
    that made it, and pyspark's active session is per thread)."""
    return _connect_sessions[-1] if _connect_sessions else None


def _quiet_python_loggers() -> None:
    for name in ("py4j", "pyspark"):  # their errors surface as our exceptions; their traces are noise
        logging.getLogger(name).setLevel(logging.CRITICAL)
    root = logging.getLogger()
    if not any(isinstance(f, _NotFromPy4j) for f in root.filters):
        root.addFilter(_NotFromPy4j())  # py4j logs some of its errors on the root logger


class _NotFromPy4j(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return f"{os.sep}py4j{os.sep}" not in record.pathname


_muted = threading.Event()
_interrupted = threading.Event()
STOP_GRACE_SECONDS = 5.0  # how long an interrupted Spark may take to stop in order
# The JVM `_launch_gateway` started, if any: known from the moment it is spawned.
_launched_jvm: subprocess.Popen[bytes] | None = None
_launched_jvm_group = False  # whether that JVM leads a process group of its own
_launch_muted = threading.Event()  # that JVM's output is no longer passed on (quiet mode)
# This process's operations on a Spark Connect session that other runs may share.
CLIENT_TAG = f"sparkpoint-client-{uuid.uuid4().hex}"
_connect_sessions: list[Any] = []  # the last one is what a Ctrl-C interrupts


def interrupted() -> bool:
    """Whether a Ctrl-C reached the driver: any error after it (a py4j call cut in the middle
    fails on its own) is part of the interruption, not a failure of its own."""
    return _interrupted.is_set()


def stop_quietly(spark: SparkSession, grace: float = STOP_GRACE_SECONDS) -> None:
    """Stop Spark after a Ctrl-C without its complaints about the job it was told to drop (the
    JVM's standard error is no longer passed on; py4j's and PySpark's are swallowed).

    A Ctrl-C stops within seconds: when Spark has not stopped in order after `grace` seconds (a
    task that does not answer its cancellation, a JVM starved of CPU), the JVM this process
    started is killed with its Python workers, as a crash would: the uploads of the interrupted
    checkpoint are recovery's or the orphan sweep's either way, and nothing committed depends on
    the JVM."""
    _muted.set()
    started = time.monotonic()
    stopped = threading.Event()

    def stop() -> None:
        try:
            spark.stop()
        except Exception:  # the JVM may be gone already
            pass
        stopped.set()

    with contextlib.redirect_stderr(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PySpark warns that it could not shut the JVM down cleanly
        threading.Thread(target=stop, daemon=True, name="spark-stop").start()
        if not stopped.wait(grace) and _kill_launched_jvm(grace):
            stopped.wait(grace)  # py4j's calls fail at once on the closed socket
    log.debug("Spark stopped after the interrupt in %.1f s%s", time.monotonic() - started,
              "" if stopped.is_set() else " (its stop did not return)")


def _kill_launched_jvm(grace: float) -> bool:
    """SIGKILL the JVM `_launch_gateway` started (its process group, when it has one of its own)
    and the groups of the Python daemons it forked (PySpark's daemon leads a group of its own,
    with its workers); wait for the JVM to be gone. Whether there was one to kill."""
    launched = _launched_jvm
    if launched is None or launched.poll() is not None:
        return False
    log.info("Spark did not stop within %.0f s of the interrupt: its JVM is killed", grace)
    return _kill_jvm(launched, own_group=_launched_jvm_group, grace=grace)


def _kill_jvm(jvm: subprocess.Popen[bytes], *, own_group: bool, grace: float) -> bool:
    """SIGKILL `jvm` (its process group when it leads one: the launcher script and the JVM it
    runs) and the groups PySpark's daemons lead; wait up to `grace` seconds for it to be gone.
    Whether it was still there to kill."""
    daemons = _groups_led_by_children_of(jvm.pid)
    try:
        if own_group:
            os.killpg(jvm.pid, signal.SIGKILL)
        else:
            jvm.kill()
    except ProcessLookupError:  # it ended in between
        return False
    for group in daemons:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        jvm.wait(grace)
    return True


def _abandon_start() -> None:
    """A start that did not finish: the JVM it launched is killed and waited for, and PySpark
    forgets it, so that nothing of the start outlives it and a later start in this process
    launches a JVM of its own. Interrupts wait until this is done (a second Ctrl-C must not cut
    the kill short)."""
    global _launched_jvm
    from pyspark import SparkContext

    with _interrupts_held():
        _launch_muted.set()
        jvm, _launched_jvm = _launched_jvm, None
        if jvm is not None and jvm.poll() is None:
            log.debug("the Spark start was cut short: its JVM (pid %d) is killed", jvm.pid)
            with contextlib.suppress(OSError):
                _kill_jvm(jvm, own_group=_launched_jvm_group, grace=STOP_GRACE_SECONDS)
        with SparkContext._lock:
            gateway, context = SparkContext._gateway, SparkContext._active_spark_context
            SparkContext._gateway = SparkContext._jvm = None
        if context is not None:  # a context made before the start was cut: its JVM is gone
            with contextlib.suppress(Exception), contextlib.redirect_stderr(io.StringIO()), \
                    warnings.catch_warnings():
                warnings.simplefilter("ignore")  # PySpark warns that it could not shut the JVM down cleanly
                context.stop()  # its Python side (the accumulator server); the call to the JVM fails
            with SparkContext._lock:
                SparkContext._active_spark_context = None  # stop() leaves it when that call fails
        SparkSession._instantiatedSession = SparkSession._activeSession = None
        if gateway is not None:
            with contextlib.suppress(Exception):
                gateway.close()


@contextlib.contextmanager
def _interrupts_held() -> Iterator[None]:
    """SIGINT and SIGTERM (Dagster maps it to its SIGINT handler) take effect when the block is
    done, not inside it: an interrupt raised between a fork and the line that records the
    child's pid would lose the child. Only Python handlers are held (they run on the main thread
    alone, so nothing interrupts another thread this way)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous: dict[int, Any] = {}
    for number in (signal.SIGINT, signal.SIGTERM):
        if callable(signal.getsignal(number)):
            previous[number] = signal.signal(number, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        for restored, handler in previous.items():
            signal.signal(restored, handler)
        for arrived in dict.fromkeys(held):
            signal.raise_signal(arrived)  # its own handler runs now, as if it had just arrived


def _groups_led_by_children_of(pid: int) -> list[int]:
    """The process groups that children of `pid` lead (Linux's /proc; none elsewhere), never this
    process's own group."""
    groups = []
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_file.read_text().rpartition(")")[2].split()
        except OSError:  # it ended while we looked
            continue
        child = int(stat_file.parent.name)
        if len(fields) > 2 and int(fields[1]) == pid and int(fields[2]) == child != os.getpgrp():
            groups.append(child)
    return groups


def _launch_gateway(master: str, app_name: str, settings: dict[str, str], *, quiet: bool) -> bool:
    """Start the JVM as PySpark would (once per process, with the same settings), mapping the
    class archive of earlier starts (`classcache`); `quiet`: with the quiet log4j configuration
    and its standard error filtered line by line. PySpark then uses it. Whether this call
    launched it (a start that had one already, or that PySpark attaches to a given gateway, did
    not)."""
    global _launched_jvm, _launched_jvm_group, _launch_muted
    from pyspark import SparkConf, SparkContext
    from pyspark.find_spark_home import _find_spark_home
    from pyspark.java_gateway import launch_gateway

    with SparkContext._lock:
        if SparkContext._gateway is not None:
            return False
        spark_home = _find_spark_home()
        # Ours go in `spark.driver.extraJavaOptions`, which replaces the value spark-defaults.conf
        # gives it: the user's options are kept, after ours (a setting of theirs wins).
        java_options = [ClassArchive(spark_home).java_options(),
                        spark_defaults(spark_home).get("spark.driver.extraJavaOptions", "")]
        popen_kwargs: dict[str, Any] = {}
        if quiet:
            if master.startswith("local"):  # the driver binds to loopback anyway; this spares the hostname note
                os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
            java_options.insert(0, f"-Dlog4j2.configurationFile={QUIET_LOG4J.as_uri()}")
            # A session of its own: a Ctrl-C at the terminal reaches this driver only, which cancels
            # the job and stops Spark in order, instead of the JVM and every Python worker printing
            # its own trace. The JVM still ends with the driver (it exits when its stdin closes).
            popen_kwargs["start_new_session"] = True
        conf = SparkConf().setMaster(master).setAppName(app_name).setAll(list(settings.items()))
        if options := " ".join(o for o in java_options if o):
            conf.set("spark.driver.extraJavaOptions", options)
        # Its output comes through this process: a caller reading ours (a pipe, a CI log, `| tee`)
        # sees it end when this process does, not when the JVM has also written its class
        # archive at exit (about 20 s, the first time). The readers run before the JVM starts:
        # it may write more than a pipe holds before PySpark's launch returns.
        ends = [os.pipe(), os.pipe()]
        _launch_muted = threading.Event()  # set when this start is abandoned: its JVM has nothing left to say
        for name, (read_end, _), target, filtered in (("spark-stdout", ends[0], "stdout", False),
                                                      ("spark-stderr", ends[1], "stderr", quiet)):
            threading.Thread(target=_pass_lines, args=(os.fdopen(read_end, "rb"), target, filtered, _launch_muted),
                             daemon=True, name=name).start()
        popen_kwargs.update(stdout=ends[0][1], stderr=ends[1][1])
        _launched_jvm, _launched_jvm_group = None, quiet
        try:
            with _jvm_known_from_its_spawn():
                gateway = launch_gateway(conf, popen_kwargs=popen_kwargs)  # type: ignore[no-untyped-call]
        except BaseException:
            _abandon_start()
            raise
        finally:  # the JVM has its copies: the readers see the end when it exits
            for _, write_end in ends:
                os.close(write_end)
        if _launched_jvm is None:  # a PySpark that no longer spawns through its module's Popen: known from now on
            _launched_jvm = getattr(gateway, "proc", None)
        if quiet and _launched_jvm is not None:  # a crash point kills its group with the driver, as a power cut would
            kill_with_this_process(_launched_jvm.pid)
        SparkContext._gateway = gateway
        SparkContext._jvm = gateway.jvm
        return _launched_jvm is not None


@contextlib.contextmanager
def _jvm_known_from_its_spawn() -> Iterator[None]:
    """While PySpark's `launch_gateway` runs, the process it spawns is this process's
    `_launched_jvm` from the moment it exists, so that any way out of the launch can kill it.

    Why: an interrupt while `launch_gateway` waits for the JVM's connection info (a Ctrl-C, a
    Dagster run terminated during resource setup) makes it remove the directory the JVM was to
    write that info to. The JVM's main thread then dies before it starts watching its stdin for
    the driver's end, and py4j's gateway thread, not a daemon, keeps the JVM alive for good, in
    a session of its own that no terminal signal reaches. `launch_gateway` spawns with its
    module's `Popen` (under SparkContext's lock, as here): it is replaced for the duration."""
    from pyspark import java_gateway

    class RecordedPopen(subprocess.Popen):  # type: ignore[type-arg]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            global _launched_jvm
            with _interrupts_held():  # no interrupt between the fork and the record
                super().__init__(*args, **kwargs)
                _launched_jvm = self

    spawn = java_gateway.Popen  # type: ignore[attr-defined]
    java_gateway.Popen = RecordedPopen  # type: ignore[attr-defined]
    try:
        yield
    finally:
        java_gateway.Popen = spawn  # type: ignore[attr-defined]


def _pass_lines(source: IO[bytes], target: str, filtered: bool, abandoned: threading.Event) -> None:
    """Copy the JVM's `source` line by line to this process's `target` ("stdout" or "stderr", as
    it is at each line); `filtered`: without Spark's chatter, and nothing once Spark is stopping
    or its start was `abandoned` (the JVM's complaint about its vanished connection file).
    A line goes to the stream's file descriptor in one write, as the JVM's own writes did: never
    into the middle of a line of ours, and never holding the stream's lock (a daemon thread
    holding it as the interpreter exits aborts the exit)."""
    for raw in iter(source.readline, b""):
        line = raw.decode("utf-8", "replace")
        if filtered and (_muted.is_set() or abandoned.is_set() or _CHATTER.match(line)):
            continue
        stream = getattr(sys, target, None)
        try:
            os.write(stream.fileno(), raw)  # type: ignore[union-attr]
        except (AttributeError, ValueError, io.UnsupportedOperation):  # no descriptor: a capture, a StringIO
            with contextlib.suppress(Exception):
                stream.write(line)  # type: ignore[union-attr]
                stream.flush()  # type: ignore[union-attr]
        except OSError:  # the terminal went away: keep draining the pipe
            pass


def code_roots(functions: Iterable[Callable[..., Any]]) -> list[tuple[str, Path]]:
    """The top-level modules `functions` come from, with their file (`__init__.py` for a package)."""
    out = []
    for root in sorted({fn.__module__.partition(".")[0] for fn in functions if getattr(fn, "__module__", None)}):
        module = sys.modules.get(root)
        origin = getattr(module, "__file__", None) if module is not None else None
        if origin is not None:
            out.append((root, Path(origin)))
    return out


def ship_modules(spark: SparkSession, functions: Iterable[Callable[..., Any]]) -> list[str]:
    """Make the user's modules that `functions` come from importable on every executor
    (`addPyFile` of the module's file, or of its top-level package zipped): a keyed operator's
    functions travel by reference to their module. Modules installed in site-packages, the
    standard library and sparkpoint's own are left alone. Returns what was shipped."""
    shipped = []
    for root, path in code_roots(functions):
        if root in ("sparkpoint", "__main__") or "site-packages" in str(path) or str(path).startswith(sys.base_prefix):
            continue
        if path.name == "__init__.py":  # a package: ship it whole, zipped
            path = _zip_package(path, root)
        if is_connect(spark):
            spark.addArtifacts(str(path), pyfile=True)  # to the server's Python workers, for this session
        else:
            try:
                spark.sparkContext.addPyFile(str(path))
            except Exception as e:  # py4j's error, whose text is Spark's
                if "does not match contents" in str(e):
                    raise ModuleChangedError(
                        f"the code of {root!r} ({path.name}) changed since this Spark session was given it, and a "
                        "running session keeps the first version (its Python workers have imported it): stop the "
                        "session (spark.stop(), or restart the notebook's kernel) and run again, or run with a "
                        "Spark Connect server, which gives changed code a session of its own"
                    ) from e
                raise
        shipped.append(str(path))
    return shipped


class ModuleChangedError(SparkpointError):
    """An operator's module changed since the running classic Spark session was given it."""
