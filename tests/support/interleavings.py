"""A model checker for the protocol's actors: real code, the interleavings of their storage steps.

Review rounds found races between the writers of one job directory, each by forcing one order by
hand. This runs two or three *real* actors in threads over one `memory://` job directory and
lets exactly one of them move at a time: every storage operation of the protocol (and every
operation on a task's local directory: the subtask's lock, its task-local copies) passes
`sparkpoint.checkpoint.interleave.storage_step`, where the scheduler parks the actor and picks
who goes next. The actors, each what a front end calls:

- a run (`sparkpoint run`, its batch loop), the two steps of an orchestrator (`start_step`,
  `finish_step`: a completer, a zombie of a failed run, a retried step), a run that falls back
  from a damaged checkpoint;
- recovery (the Dagster recover job: `recover` with the failed run's attempts fenced; the Airflow
  `recover` task: `recover` with an orphan grace period and no fence), `prune`, `gc`;
- `take_savepoint` into the job directory and out of it, `sparkpoint skip` (`skip_file`), the
  `--follow` loop (`follow`), `sparkpoint bootstrap` (`plan_bootstrap(...).run`), `sparkpoint
  rollback` (`rollback_job`), `sparkpoint erase` (`erase_job`);
- two actors sharing one host's `local_dir` (the same subtask directories and task-local copies);
- corruption: a byte of a stored file flips, as one step of its own.

`Checker.explore` enumerates the schedules systematically (depth first over the choices, every
schedule with at most `bound` preemptions: switching away from an actor that could have gone on);
`Checker.sample` draws schedules with at most `bound` preemptions at random (a fixed seed), for
scenarios of whole actors where the exhaustive set is too large. After each schedule:

- every retained checkpoint's files exist with their recorded size and CRC32 (a file a
  corruption step flipped excepted), and every savepoint an actor took verifies where it is;
- at most one of abort and commit wins an attempt;
- nothing outside the job's directory, its output and the savepoint targets is touched;
- after the product's own way out (a recovery on a host that lost its local disk, then the
  remaining input processed), the visible output holds every batch's rows exactly once and the
  restored state equals a recomputation: in pandas for the balances, and for the operator with
  event-time timers and TTL a run of the same input alone. A committed checkpoint's output that
  was discarded, a good checkpoint subsumed for a broken one, a rollback: each fails here. Only a
  flipped byte in a file every retained checkpoint needed when it flipped may stop the job.

The world: two subtasks of two operators (balances per account; an idle alert per account by an
event-time timer, over a value state with an event-time TTL), four batches of input.

No Spark: the Spark half runs the real subtasks in the calling thread (`InProcessPipeline`), on
real RocksDB, so the steps of one actor happen in its own thread, in order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import itertools
import json
import os
import random
import re
import shutil
import tempfile
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import pandas as pd
import pyarrow as pa

from sparkpoint.checkpoint.files import stored_size_problems
from sparkpoint.checkpoint.history import HISTORY_DIR, read_history
from sparkpoint.checkpoint.interleave import set_step_hook, storage_step
from sparkpoint.checkpoint.savepoint import SavepointResult
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.pipeline.attempt import (
    PendingAttempt,
    complete_attempt,
    finish_step,
    load_attempt,
    save_attempt,
    spark_half_with_fallback,
    start_step,
)
from sparkpoint.pipeline.claims import COMPLETE, claim, claim_path
from sparkpoint.pipeline.driver import StatefulPipeline
from sparkpoint.pipeline.maintenance import clear_failed_attempts, prune, recover, settle_attempts
from sparkpoint.pipeline.runtime import PipelineConfig
from sparkpoint.spark.tasks import run_slots
from sparkpoint.state.codecs import StructCodec
from sparkpoint.state.engine.verify import verify_checkpoint
from sparkpoint.state.extract import state_table
from sparkpoint.state.operators import KeyedOperator
from sparkpoint.state.ttl import StateTtl

# --- a user's operators (not the sample's) --------------------------------------------------------

BALANCE: StructCodec[Any] = StructCodec("<q")


def apply_amounts(batch: pd.DataFrame, state: Any) -> pd.DataFrame:
    sums = batch.groupby("acct")["amount"].sum()
    balances = state.value_state("balance", BALANCE)
    keys = sums.index.tolist()
    old = balances.get_many(keys)
    new = [(0 if o is None else o[0]) + int(s) for o, s in zip(old, sums.tolist())]
    balances.put_many((k, (v,)) for k, v in zip(keys, new))
    return pd.DataFrame({"acct": keys, "balance": new})


def export_balances(state: Any) -> pd.DataFrame:
    rows = [(k.decode(), v[0]) for k, v in state.value_state("balance", BALANCE).items()]
    return pd.DataFrame(rows, columns=["acct", "balance"]).astype({"balance": "int64"})


def opening_balances(table: pd.DataFrame, state: Any) -> None:
    """`bootstrap`: the opening amounts of a table, as a first batch would add them."""
    if len(table):
        apply_amounts(table, state)


BALANCES = KeyedOperator("balances", key="acct", columns=("amount",), process=apply_amounts,
                         export=export_balances, emits=True)
BOOTSTRAPPED_BALANCES = KeyedOperator("balances", key="acct", columns=("amount",), process=apply_amounts,
                                      export=export_balances, emits=True, bootstrap=opening_balances)

T0 = pd.Timestamp("2026-03-01 08:00:00", tz="UTC")
SILENCE_US = 150 * 1_000_000  # event time without a row of an account before its idle alert fires
LAST_SEEN: StructCodec[Any] = StructCodec("<q")  # the account's newest event time, µs
SEEN_TTL = StateTtl(250, clock="event")  # an account unseen for this long (of watermark) is forgotten


def track_idle(batch: pd.DataFrame, state: Any) -> None:
    """Per account its newest event time (event-time TTL), and a timer SILENCE after it."""
    newest = batch.groupby("acct")["ts"].max()
    keys = [str(k) for k in newest.index]
    seen = state.value_state("last_seen", LAST_SEEN, ttl=SEEN_TTL)
    moved = []
    for key, ts, old in zip(keys, newest.tolist(), seen.get_many(keys)):
        us = int(pd.Timestamp(ts).value // 1000)
        if old is not None and old[0] >= us:
            continue
        if old is not None:
            state.timers.delete(key, old[0] + SILENCE_US)
        moved.append((key, us))
    seen.put_many((k, (us,)) for k, us in moved)
    state.timers.register_many((k, us + SILENCE_US) for k, us in moved)


def idle_alerts(fired: pd.DataFrame, state: Any) -> pd.DataFrame:
    return pd.DataFrame({"acct": fired["key"].astype(str), "idle_at": fired["timestamp"].astype(str)})


def export_last_seen(state: Any) -> pd.DataFrame:
    rows = [(k.decode(), v[0]) for k, v in state.value_state("last_seen", LAST_SEEN, ttl=SEEN_TTL).items()]
    return pd.DataFrame(rows, columns=["acct", "last_seen"]).astype({"last_seen": "int64"})


IDLE = KeyedOperator("idle", key="acct", columns=("ts",), process=track_idle, export=export_last_seen,
                     on_timer=idle_alerts, emits=True)
OPERATORS = (BALANCES, IDLE)


class InProcessPipeline(StatefulPipeline):
    """The pipeline's driver with its Spark job run in the calling thread: the same subtasks
    (`run_slots`: restore, process, stage, snapshot, upload) without a JVM, on the read-all route
    whatever route the batch was given (the routes differ in how rows reach a subtask, not in
    what the subtask does with storage)."""

    def run_spark(self, spec: Any, urls: list[str], *route: Any) -> list[dict[str, Any]]:
        ids = iter([pd.DataFrame({"id": list(range(spec.parallelism))})])
        return [row for frame in run_slots(spec, urls, ids) for row in frame.to_dict("records")]


# --- the scheduler ------------------------------------------------------------------------------


class Hang(RuntimeError):
    """An actor neither reached a storage step nor ended in time (it waits on something else),
    or every actor left waits for a lock another one holds."""


BLOCKED = "blocked"  # the step of an actor that waits for a lock (the subtask's) another actor holds


@dataclass
class _Actor:
    name: str
    fn: Callable[[], Any]
    thread: threading.Thread | None = None
    parked: tuple[str, str] | None = None  # the step it waits at
    done: bool = False
    result: Any = None
    error: BaseException | None = None
    blocked_at: int | None = None  # parked at a BLOCKED step when this many choices were made


Chooser = Callable[[tuple[str, ...], "str | None", int, "dict[str, tuple[str, str]]"], str]
"""(actors waiting at a step, the actor that moved last, the choice's index, each waiting actor's
step) -> the actor that moves next."""


@dataclass(frozen=True)
class Choice:
    enabled: tuple[str, ...]  # actors waiting at a step, in a fixed order
    chosen: str
    previous: str | None  # the actor that made the last step
    step: tuple[str, str]  # what the chosen actor does now


class Scheduler:
    """Runs actors in threads, one at a time: an actor moves only when chosen, from one storage
    step to the next. `choose(enabled, previous, index)` picks who goes. An actor waiting for a
    lock another actor holds is not enabled until another actor has moved."""

    def __init__(self, actors: dict[str, Callable[[], Any]], choose: Chooser,
                 *, visible: Callable[[str, str, str], bool] | None = None, step_timeout: float = 60.0):
        self.actors = {name: _Actor(name, fn) for name, fn in actors.items()}
        self.choose = choose
        self.visible = visible  # (actor, op, path) -> whether another actor may be scheduled before it
        self.steps: dict[str, list[tuple[str, str]]] = {name: [] for name in actors}  # every step, visible or not
        self.step_timeout = step_timeout
        self.cond = threading.Condition()
        self.turn: _Actor | None = None
        self.local = threading.local()  # which actor a thread is (thread ids are reused)
        self.trace: list[Choice] = []

    def _hook(self, op: str, path: str) -> None:
        actor = getattr(self.local, "actor", None)
        if actor is None:  # setup, checks, or a thread no actor started: not scheduled
            return
        self.steps[actor.name].append((op, path))
        if op == BLOCKED or self.visible is None or self.visible(actor.name, op, path):
            self._park(actor, (op, path))

    def _park(self, actor: _Actor, step: tuple[str, str]) -> None:
        with self.cond:
            actor.parked = step
            actor.blocked_at = len(self.trace) if step[0] == BLOCKED else None
            self.turn = None
            self.cond.notify_all()
            while self.turn is not actor:
                self.cond.wait()

    def _body(self, actor: _Actor) -> None:
        self.local.actor = actor
        try:
            self._park(actor, ("start", ""))
            actor.result = actor.fn()
        except BaseException as e:  # an actor may fail cleanly: what counts is the end state
            actor.error = e
        finally:
            with self.cond:
                actor.done, actor.parked = True, None
                self.turn = None
                self.cond.notify_all()

    def _may_go(self, actor: _Actor) -> bool:
        """Not done, and not waiting for a lock that no other actor could have released since."""
        if actor.done:
            return False
        return actor.blocked_at is None or any(c.chosen != actor.name for c in self.trace[actor.blocked_at:])

    def run(self) -> list[Choice]:
        previous = set_step_hook(self._hook)
        try:
            for actor in self.actors.values():
                actor.thread = threading.Thread(target=self._body, args=(actor,), daemon=True,
                                                name=f"actor-{actor.name}")
                actor.thread.start()
            last: str | None = None
            while True:
                with self.cond:
                    deadline = time.monotonic() + self.step_timeout
                    while not all(a.done or (a.parked is not None and self.turn is None)
                                  for a in self.actors.values()):
                        if not self.cond.wait(max(0.0, deadline - time.monotonic())):
                            moving = [a.name for a in self.actors.values() if not a.done and a.parked is None]
                            raise Hang(f"actor(s) {moving} neither reached a storage step nor ended in "
                                       f"{self.step_timeout:.0f} s; steps so far: {describe(self.trace)}")
                    if all(a.done for a in self.actors.values()):
                        break
                    enabled = tuple(a.name for a in self.actors.values() if self._may_go(a))
                    if not enabled:
                        raise Hang(f"deadlock: every actor left waits for a lock; steps so far: {describe(self.trace)}")
                    waiting = {a.name: a.parked for a in self.actors.values() if a.parked is not None}
                    chosen = self.choose(enabled, last, len(self.trace), waiting)
                    actor = self.actors[chosen]
                    assert actor.parked is not None
                    self.trace.append(Choice(enabled, chosen, last, actor.parked))
                    actor.parked = None
                    self.turn = actor
                    self.cond.notify_all()
                last = chosen
            for actor in self.actors.values():
                assert actor.thread is not None
                actor.thread.join()
        finally:
            set_step_hook(previous)
        return self.trace


@contextmanager
def inline_parallel() -> Iterator[None]:
    """Every storage operation of an actor in its own thread, in order: no worker threads (a
    worker's step would be no actor's). Also spares the replays the pools' start-up."""
    parallel = CheckpointStorage.parallel
    CheckpointStorage.parallel = _inline  # type: ignore[method-assign]
    try:
        yield
    finally:
        CheckpointStorage.parallel = parallel  # type: ignore[method-assign]


def _inline(self: CheckpointStorage, fn: Any, items: Any, *, workers: int | None = None) -> list[Any]:
    return [fn(item) for item in items]


def preemptions(choices: list[tuple[tuple[str, ...], str | None, str]]) -> int:
    """Switches away from an actor that could have gone on: (enabled, previous, chosen) each."""
    return sum(1 for enabled, previous, chosen in choices if previous in enabled and chosen != previous)


def default_choice(enabled: tuple[str, ...], previous: str | None) -> str:
    """No preemption: the last actor goes on while it can, else the first waiting one."""
    return previous if previous in enabled else enabled[0]


def in_order(order: tuple[str, ...]) -> Chooser:
    """Each actor runs to its end before the next one starts (one blocked on a lock: the next)."""
    def choose(enabled: tuple[str, ...], previous: str | None, index: int, steps: Any) -> str:
        return next(a for a in order if a in enabled)
    return choose


def round_robin() -> Chooser:
    """The actors take turns at every step."""
    def choose(enabled: tuple[str, ...], previous: str | None, index: int, steps: Any) -> str:
        later = [a for a in enabled if previous is not None and a > previous]
        return later[0] if later else enabled[0]
    return choose


def legs(*plan: tuple[Any, ...]) -> Chooser:
    """A schedule told as a story: each leg `(actor, until[, n])` runs `actor` until its next
    step's text (`op path`) contains `until` for the n-th time in the leg (that step not made
    yet); `until` None runs it to its end. After the last leg, actors go on without preemption."""
    state = {"leg": 0, "seen": 0}

    def choose(enabled: tuple[str, ...], previous: str | None, index: int, steps: dict[str, tuple[str, str]]) -> str:
        while state["leg"] < len(plan):
            actor, until, *times = plan[state["leg"]]
            step = steps.get(actor)
            if actor in enabled and step is not None:
                hit = until is not None and until in " ".join(step)
                if not hit or state["seen"] + 1 < (times[0] if times else 1):
                    state["seen"] += hit
                    return str(actor)
            state["leg"], state["seen"] = state["leg"] + 1, 0
        return default_choice(enabled, previous)
    return choose


def describe(trace: list[Choice], limit: int = 400) -> str:
    """A schedule as a reader follows it: runs of steps by the same actor."""
    parts = []
    for actor, group in itertools.groupby(trace, key=lambda c: c.chosen):
        steps = [f"{c.step[0]} {'/'.join(c.step[1].rsplit('/', 2)[-2:])}".strip() for c in group]
        parts.append(f"{actor}: " + ", ".join(steps))
    text = " | ".join(parts)
    return text if len(text) <= limit else text[:limit] + " ..."


# --- which steps can matter to another actor ---------------------------------------------------

WRITES = frozenset({"create", "write", "delete", "move", "upload", "rmdir", "lock"})
_RUN_PREFIX = re.compile(r"^.*?/world-(?:template|\d+)/")  # a world's memory:// or local directory
_UNIQUE = re.compile(r"[0-9a-f]{8,}")


def normalized(op: str, path: str) -> tuple[str, tuple[str, ...]]:
    """A step as it recurs from run to run: the world's prefix and unique (hex) names stripped; a
    move touches its source and its target."""
    paths = path.split(" -> ") if op == "move" else [path]
    return op, tuple(_UNIQUE.sub("*", _RUN_PREFIX.sub("", p)) for p in paths)


def _touches(a: str, b: str) -> bool:
    """The same file, or one is a directory (walked, removed) that holds the other."""
    return a == b or b.startswith(a.rstrip("/") + "/") or a.startswith(b.rstrip("/") + "/")


def _listed(listing: str, path: str) -> bool:
    """Whether writing `path` can change a one-directory listing `dir/pattern`: it makes or
    removes an entry of `dir` whose name matches the pattern."""
    directory, pattern = listing.rsplit("/", 1)
    if not path.startswith(directory + "/"):
        return False
    return fnmatch.fnmatchcase(path[len(directory) + 1:].split("/", 1)[0], pattern)


def conflict(s: tuple[str, tuple[str, ...]], t: tuple[str, tuple[str, ...]]) -> bool:
    """Two steps whose order can change what either does: they touch the same file or directory
    and at least one of them writes."""
    if s[0] not in WRITES and t[0] not in WRITES:
        return False
    for a in s[1]:
        for b in t[1]:
            if s[0] == "list" or t[0] == "list":
                listing, other = (a, b) if s[0] == "list" else (b, a)
                if _listed(listing, other):
                    return True
            elif _touches(a, b):
                return True
    return False


def visibility(seen: dict[str, set[tuple[str, tuple[str, ...]]]]) -> Callable[[str, str, str], bool]:
    """From the steps each actor made in the runs without preemption (every actor order): a step
    is a scheduling point when it conflicts with a step of another actor; a step never seen there
    always is. Between two scheduling points an actor's steps touch nothing another actor touches,
    so running them without a switch loses no outcome those runs could show."""
    points: set[tuple[str, tuple[str, tuple[str, ...]]]] = set()
    for actor, steps in seen.items():
        others = [t for other, ts in seen.items() if other != actor for t in ts]
        points |= {(actor, s) for s in steps if any(conflict(s, t) for t in others)}

    def visible(actor: str, op: str, path: str) -> bool:
        step = normalized(op, path)
        return step not in seen.get(actor, set()) or (actor, step) in points

    return visible


# --- the world ----------------------------------------------------------------------------------


@dataclass
class Run:
    """One interleaving's world: the job, its input, one pipeline object per actor (as separate
    processes would have), and what a corruption step did."""

    root: Path  # local: the hosts' local directories (one per actor unless actors share one)
    url: str  # memory:// prefix of this world's checkpoints, output and savepoint targets
    input_dir: Path | None = None  # the batches (read only: shared by every world of a checker)
    rotted: list[tuple[str, bool]] = field(default_factory=list)  # (flipped file, every retained chk needed it)
    # When the failed run a recovery heals ended: before the actors start (files they write are
    # newer, the sweep keeps them), unless the actor that fails is among them (`_recover(harsh=True)`).
    failed_before: float = field(default_factory=time.time)
    table: str | None = None  # the output is a "delta" or "iceberg" table under `root` (neither writes memory://)

    @property
    def input(self) -> Path:
        return self.input_dir or self.root / "in"

    @property
    def archive(self) -> Path:
        """Where an input cleanup archives the consumed batches (`input_cleanup=archive:...`)."""
        return self.root / "archive"

    @property
    def checkpoints(self) -> str:
        return f"{self.url}/ckpt"

    @property
    def output(self) -> str:
        if self.table == "iceberg":
            return "iceberg://lake/shop.out"
        return f"delta+file://{self.root}/table" if self.table else f"{self.url}/out"

    @property
    def catalog(self) -> dict[str, str]:
        """An Iceberg output's catalog: SQLite and a warehouse under `root`."""
        return {"uri": f"sqlite:///{self.root}/catalog.db", "warehouse": f"file://{self.root}/warehouse"}

    @property
    def table_root(self) -> Path:
        """Where the job's files in the output table are found (the paths `_table_files` gives are under it)."""
        return self.root / "warehouse" / "shop" / "out" / "data" if self.table == "iceberg" else self.root / "table"

    def target(self, name: str) -> str:
        """A savepoint target (a new directory) beside the job's."""
        return f"{self.url}/savepoints/{name}"

    def config(self, actor: str, *, num_retained: int = 1, max_batches: int | None = None, host: str | None = None,
               **settings: Any) -> PipelineConfig:
        """`host`: whose local directory the actor uses (default: a host of its own). A table
        output takes the idle alerts' column beside the balances' (schema evolution)."""
        if self.table:
            settings.setdefault("output_schema_evolution", True)
        if self.table == "iceberg":
            settings.setdefault("output_catalog", self.catalog)
        return PipelineConfig(
            input_url=str(self.input), checkpoints_url=self.checkpoints, job_id="job", output_url=self.output,
            num_retained=num_retained, parallelism=2, max_parallelism=8, local_dir=str(self.root / "local" / (
                host or actor)), max_batches=max_batches, event_time="ts", **settings)

    def pipeline(self, actor: str, *, num_retained: int = 1, max_batches: int | None = None, host: str | None = None,
                 **settings: Any) -> InProcessPipeline:
        config = self.config(actor, num_retained=num_retained, max_batches=max_batches, host=host, **settings)
        return InProcessPipeline(None, config, OPERATORS)

    def storage(self) -> CheckpointStorage:
        return CheckpointStorage(self.checkpoints, "job")


def land(run: Run, batches: int, seed: int = 7) -> None:
    """`batches` files of 20 rows over 12 accounts; batch i's event times lie in [100 i, 100 i + 60)
    seconds after T0, so no row is late and accounts fall idle (timers) and are forgotten (TTL)."""
    run.input.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for i in range(batches):
        frame = pd.DataFrame({"acct": [f"a{rng.randrange(12)}" for _ in range(20)],
                              "amount": [rng.randrange(-50, 100) for _ in range(20)],
                              "ts": [T0 + pd.Timedelta(seconds=100 * i + rng.randrange(60)) for _ in range(20)]})
        frame.to_parquet(run.input / f"b{i:03d}.parquet")


def canary(run: Run) -> dict[str, bytes]:
    """A neighbour job's checkpoint file and output: no actor may touch them."""
    fs = fsspec.filesystem("memory")
    files = {f"{run.checkpoints}/other-job/chk-1/_metadata": b"neighbour"}
    if not run.table:
        files[f"{run.output}/part-other~00000001~x~00000.parquet"] = b"neighbour output"
    for url, data in files.items():
        fs.pipe_file(url, data)
    return files


def dead_holder_claim(storage: CheckpointStorage, checkpoint_id: int, attempt_id: str) -> None:
    """The claim a completer killed between its claim and `_metadata` leaves (kill -9, OOM): its
    holder is a process of this host, boot and PID namespace that no longer exists."""
    import dataclasses
    import subprocess

    from sparkpoint.pipeline.claims import Claim, _process_start

    gone = subprocess.Popen(["sleep", "30"])
    started = _process_start(gone.pid)
    gone.kill()
    gone.wait()
    record = dataclasses.replace(Claim.mine(COMPLETE), pid=gone.pid, pid_start=started, by="dead0000")
    storage.commit_exclusive(claim_path(checkpoint_id, attempt_id), record.dumps())


# --- corruption: a byte flips in a stored file --------------------------------------------------

ROT_TARGET = "rot-target"  # beside the job: the file (relative to the job directory) a rot step flips


def choose_rot_target(run: Run) -> str:
    """The largest shared file the latest checkpoint uploaded that an older retained one lacks: a
    restore can fall back from its damage."""
    listing = CompletedCheckpointStore(run.storage()).load_all().checkpoints
    latest, older = listing[0], listing[1:]
    new = [f for f in latest.restored_files() if f.created_by == latest.checkpoint_id and f.path.startswith("shared/")
           and any(f.path not in m.paths() for m in older)]
    path = max(new, key=lambda f: (f.size, f.path)).path
    fsspec.filesystem("memory").pipe_file(f"{run.url}/{ROT_TARGET}", path.encode())
    return path


def rot_target(run: Run) -> str:
    return str(fsspec.filesystem("memory").cat_file(f"{run.url}/{ROT_TARGET}").decode())


def flip_a_byte(run: Run, path: str) -> None:
    """The corruption step: the stored file keeps its size, one byte of its middle changes. Which
    retained checkpoints needed it when it flipped is noted (no step: the flip is one move)."""
    storage = run.storage()
    data = bytearray(storage.read_bytes(path))
    data[len(data) // 2] ^= 0x40
    storage_step("write", storage.abspath(path))  # the write's turn: what is retained now is what it hits
    run.rotted.append((path, every_retained_needs(run, path)))
    storage.fs.pipe_file(storage.abspath(path), bytes(data))


def every_retained_needs(run: Run, path: str) -> bool:
    """Whether every completed checkpoint references `path` (read past the seam: no step)."""
    from sparkpoint.checkpoint.metadata import CheckpointMetadata

    fs = fsspec.filesystem("memory")
    job = f"{run.checkpoints}/job"
    needs = []
    for entry in fs.ls(job, detail=False):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        if name.startswith("chk-") and fs.exists(f"{entry}/_metadata"):
            try:
                needs.append(path in CheckpointMetadata.loads(fs.cat_file(f"{entry}/_metadata")).paths())
            except Exception:
                needs.append(True)
    return all(needs)


# --- scenarios ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    """A job in some state (`setup`) and the actors that then run at once. `patch`: what the
    actors run under, the same in every world (e.g. a Spark job run in process)."""

    name: str
    setup: Callable[[Run], None]
    actors: Callable[[Run], dict[str, Callable[[], Any]]]
    batches: int = 4
    patch: Callable[[], contextlib.AbstractContextManager[Any]] | None = None
    table: str | None = None  # the job writes a "delta" or "iceberg" table (its commit: steps on the table)
    own_input: bool = False  # an actor deletes or archives input (`input_cleanup`): each world a copy of its own
    erased: tuple[str, ...] = ()  # accounts an actor erases (`sparkpoint erase`): left out of the recomputation


def into_a_table(scenario: Scenario, kind: str = "delta") -> Scenario:
    """`scenario` with the job's output a Delta (or Iceberg) table: the completer's, the recoverer's
    and a zombie's table commits (a read of the table, a create of its next log entry / snapshot)
    are steps."""
    return dataclasses.replace(scenario, name=f"{scenario.name}-{kind}", table=kind)


def _first_checkpoint(run: Run, n: int = 1, *, num_retained: int = 1, host: str = "setup") -> None:
    run.pipeline("setup", num_retained=num_retained, max_batches=n, host=host).run()


def _persisted(run: Run, attempt_id: str, actor: str = "setup") -> None:
    assert start_step(run.pipeline(actor), attempt_id) is not None


def _recover(run: Run, actor: str, *attempts: str, harsh: bool = True, **settings: Any) -> Any:
    """The Dagster recover job: the failed run's attempts fenced, the orphans it left swept. With
    `harsh` the failed run is an actor of the scenario (a zombie): everything unreferenced is
    swept, whenever it was written; else only what was written before the actors started."""
    failed_before = time.time() + 3600 if harsh else run.failed_before
    return recover(run.pipeline(actor, **settings), failed_before=failed_before, failed_attempts=attempts)


def _zombie(run: Run, attempt_id: str, actor: str = "zombie", **settings: Any) -> Any:
    """A run of an orchestrator's two steps whose process lives on after it was marked failed."""
    p = run.pipeline(actor, **settings)
    if start_step(p, attempt_id) is None:
        return None
    return finish_step(p, [attempt_id])


def completer_vs_recoverer() -> Scenario:
    """Run A persisted its attempt at chk-2 and its checkpoint step is completing it; run
    monitoring marked A failed meanwhile and the recovery sensor started the recover job."""
    def setup(run: Run) -> None:
        _first_checkpoint(run)
        _persisted(run, "run-a")

    def actors(run: Run) -> dict[str, Callable[[], Any]]:
        return {"completer": lambda: finish_step(run.pipeline("completer"), ["run-a"]),
                "recoverer": lambda: _recover(run, "recoverer", "run-a")}
    return Scenario("completer-vs-recoverer", setup, actors)


def zombie_vs_recover_with_sweep(name: str = "zombie-vs-recover-with-sweep", host: str | None = None) -> Scenario:
    """Run Z was marked failed while its process lives: it runs its Spark half, persists its
    attempt and completes it, while the recover job aborts, sweeps (grace 0 up to Z's end) and
    re-processes. With num_retained=1 a commit over swept files would subsume the only good one.
    With `host`, both run on that host (and the first checkpoint was made there): they share its
    subtask directories, locks and task-local copies."""
    def setup(run: Run) -> None:
        _first_checkpoint(run, host=host or "setup")

    def actors(run: Run) -> dict[str, Callable[[], Any]]:
        return {"zombie": lambda: _zombie(run, "run-z", host=host),
                "recoverer": lambda: _recover(run, "recoverer", "run-z", host=host)}
    return Scenario(name, setup, actors)


def two_completers() -> Scenario:
    """Two runs overlapped (a sensor's run beside a UI click, no pool limit): both persisted an
    attempt at chk-2 from chk-1, and both checkpoint steps complete at once."""
    def setup(run: Run) -> None:
        _first_checkpoint(run)
        _persisted(run, "run-a", "a")
        _persisted(run, "run-b", "b")

    def actors(run: Run) -> dict[str, Callable[[], Any]]:
        return {"a": lambda: finish_step(run.pipeline("a"), ["run-a"]),
                "b": lambda: finish_step(run.pipeline("b"), ["run-b"])}
    return Scenario("two-completers", setup, actors)


def completer_vs_prune_vs_sweep() -> Scenario:
    """A checkpoint step completes chk-3 while a prune (num_retained lowered from 2 to 1) subsumes
    and `sparkpoint gc --grace 0` sweeps."""
    def setup(run: Run) -> None:
        _first_checkpoint(run, 2, num_retained=2)
        _persisted(run, "run-a")

    def actors(run: Run) -> dict[str, Callable[[], Any]]:
        from sparkpoint.checkpoint.sweep import sweep_orphans
        from sparkpoint.pipeline.attempt import pending_paths

        def gc() -> Any:
            storage = run.storage()
            return sweep_orphans(storage, grace_seconds=0.0, pending_paths=pending_paths(storage))

        return {"completer": lambda: finish_step(run.pipeline("completer", num_retained=2), ["run-a"]),
                "prune": lambda: prune(run.storage(), num_retained=1, orphan_grace_seconds=0.0,
                                        sink=run.pipeline("prune").sink),
                "gc": gc}
    return Scenario("completer-vs-prune-vs-sweep", setup, actors)


def retried_step_vs_recoverer() -> Scenario:
    """Run A's checkpoint step was killed between its claim and `_metadata`; its retry (Airflow's
    task retry, Dagster's re-execution) and the recover job run at once."""
    def setup(run: Run) -> None:
        _first_checkpoint(run)
        _persisted(run, "run-a")
        dead_holder_claim(run.storage(), 2, "run-a")

    def actors(run: Run) -> dict[str, Callable[[], Any]]:
        return {"retry": lambda: finish_step(run.pipeline("retry"), ["run-a"]),
                "recoverer": lambda: _recover(run, "recoverer", "run-a")}
    return Scenario("retried-step-vs-recoverer", setup, actors)


def claimed_completer_vs_recovery_abort() -> Scenario:
    """Run A's checkpoint step holds the claim of its attempt at chk-2 and is about to commit
    (the rest of `complete_attempt` is the actor); recovery's first step settles the job's
    attempts at the same time."""
    def setup(run: Run) -> None:
        _first_checkpoint(run)
        _persisted(run, "run-a")
        storage = run.storage()
        assert claim(storage, 2, "run-a", COMPLETE)

    def actors(run: Run) -> dict[str, Callable[[], Any]]:
        completer = run.pipeline("completer")
        attempt = load_attempt(completer.storage, "run-a")
        recoverer = run.pipeline("recoverer")
        return {"completer": lambda: complete_attempt(completer, attempt),
                "recoverer": lambda: settle_attempts(recoverer.storage, recoverer.sink)}
    return Scenario("claimed-completer-vs-recovery-abort", setup, actors)


def uploaded_zombie_vs_recovery_sweep() -> Scenario:
    """Run Z's Spark half uploaded its files and has not persisted its attempt yet when run
    monitoring marks Z failed; the zombie then persists and completes it while recovery's storage
    half (settle, sweep up to Z's end) runs."""
    def setup(run: Run) -> None:
        _first_checkpoint(run)
        attempt, _ = spark_half_with_fallback(run.pipeline("zombie"), attempt_id="run-z")
        assert attempt is not None
        fsspec.filesystem("memory").pipe_file(f"{run.url}/zombie-attempt.json", attempt.dumps())

    def zombie(run: Run) -> Any:
        p = run.pipeline("zombie")
        attempt = PendingAttempt.loads(fsspec.filesystem("memory").cat_file(f"{run.url}/zombie-attempt.json"))
        save_attempt(p.storage, attempt)
        return finish_step(p, ["run-z"])

    def actors(run: Run) -> dict[str, Callable[[], Any]]:
        recoverer = run.pipeline("recoverer")
        return {"zombie": lambda: zombie(run),
                "recoverer": lambda: clear_failed_attempts(recoverer.storage, recoverer.sink,
                                                           failed_before=time.time() + 3600,
                                                           failed_attempts=("run-z",))}
    return Scenario("uploaded-zombie-vs-recovery-sweep", setup, actors)


# --- the writers the fifth review added -------------------------------------------------------------


@contextmanager
def _savepoints_do_not_wait() -> Iterator[None]:
    """A savepoint's look at a checkpoint whose completion has not settled: a step each, no sleep."""
    from sparkpoint.checkpoint import savepoint

    before = savepoint.SETTLE_SECONDS, savepoint.SETTLE_POLLS
    savepoint.SETTLE_SECONDS, savepoint.SETTLE_POLLS = 0.0, 3
    try:
        yield
    finally:
        savepoint.SETTLE_SECONDS, savepoint.SETTLE_POLLS = before


def _savepoint(run: Run, target: str | None = None) -> SavepointResult:
    from sparkpoint.checkpoint.savepoint import take_savepoint

    return take_savepoint(run.storage(), target=run.target(target) if target else None)


def run_vs_savepoint() -> Scenario:
    """`sparkpoint run` commits chk-2 while `sparkpoint savepoint` (no --to: into the job
    directory, as the Airflow operator and the Dagster job do by default) copies chk-1 (the
    review's item 4: the copy committed above chk-2 became the latest and batch 2 was replayed)."""
    def actors(run: Run) -> dict[str, Callable[[], Any]]:
        return {"run": lambda: run.pipeline("run", max_batches=1).run(), "savepoint": lambda: _savepoint(run)}
    return Scenario("run-vs-savepoint", _first_checkpoint, actors, patch=_savepoints_do_not_wait)


def fenced_completer_vs_recoverer_vs_savepoint() -> Scenario:
    """A completer of run A's attempt (which run monitoring marked failed), the recover job that
    fences A, and a savepoint into the job directory: A's chk-2 may be withdrawn by its completer
    right after its commit; a savepoint of it would outlive it. The savepoint started after A's
    failure: its copies are newer than what the recovery's sweep takes (one that started before
    is protected by nothing but time, as a CLI run's uploads are)."""
    def setup(run: Run) -> None:
        _first_checkpoint(run)
        _persisted(run, "run-a")

    def actors(run: Run) -> dict[str, Callable[[], Any]]:
        return {"completer": lambda: finish_step(run.pipeline("completer"), ["run-a"]),
                "recoverer": lambda: _recover(run, "recoverer", "run-a", harsh=False),
                "savepoint": lambda: _savepoint(run)}
    return Scenario("fenced-completer-vs-recoverer-vs-savepoint", setup, actors, patch=_savepoints_do_not_wait)


def savepoints_to_one_target_vs_run() -> Scenario:
    """Two `savepoint --to` the same new directory while the job commits and subsumes (one
    retained): one savepoint at most, whole; a loser removes only its own files."""
    def actors(run: Run) -> dict[str, Callable[[], Any]]:
        return {"sp-a": lambda: _savepoint(run, "sp"), "sp-b": lambda: _savepoint(run, "sp"),
                "run": lambda: run.pipeline("run", max_batches=1).run()}
    return Scenario("savepoints-to-one-target-vs-run", _first_checkpoint, actors)


OPENING = "opening.parquet"  # the bootstrap's initial table, beside the input


def _bootstrap(run: Run, actor: str, target: str) -> Any:
    from sparkpoint.pipeline.bootstrap import plan_bootstrap
    from sparkpoint.pipeline.spec import Pipeline

    pipeline = Pipeline("job", (BOOTSTRAPPED_BALANCES, IDLE), input_url=str(run.input), checkpoints_url=run.checkpoints,
                        output_url=run.output, local_dir=str(run.root / "local" / actor), parallelism=2,
                        max_parallelism=8, event_time="ts")
    return plan_bootstrap(pipeline, "balances", str(run.input.parent / OPENING), run.target(target)).run(None)


@contextmanager
def _bootstrap_in_process() -> Iterator[None]:
    """The bootstrap's Spark job in the calling thread: the same subtasks, no JVM."""
    from sparkpoint.pipeline import bootstrap
    from sparkpoint.spark.bootstrap import bootstrap_slots

    def run_spark(spark: Any, spec: Any) -> list[dict[str, Any]]:
        ids = iter([pd.DataFrame({"id": list(range(spec.parallelism))})])
        return [row for frame in bootstrap_slots(spec, ids) for row in frame.to_dict("records")]

    before = bootstrap._run_spark
    bootstrap._run_spark = run_spark
    try:
        yield
    finally:
        bootstrap._run_spark = before


def bootstrap_vs_savepoint_one_target() -> Scenario:
    """`sparkpoint bootstrap --to T` and `sparkpoint savepoint --to T` at once: at most one of
    them ends with a savepoint in T, whole; the other leaves nothing of its own and takes
    nothing of the winner's."""
    def setup(run: Run) -> None:
        _first_checkpoint(run)
        pd.DataFrame({"acct": ["a1", "a2", "a3"], "amount": [5, 7, 9]}).to_parquet(run.input.parent / OPENING)

    def actors(run: Run) -> dict[str, Callable[[], Any]]:
        return {"bootstrap": lambda: _bootstrap(run, "bootstrap", "t"), "savepoint": lambda: _savepoint(run, "t")}
    return Scenario("bootstrap-vs-savepoint-one-target", setup, actors, patch=_bootstrap_in_process)


def skip_vs_run() -> Scenario:
    """`sparkpoint skip b001` (the way out of on_bad_file=fail) while a run takes b001 as its
    batch: both commit chk-2 from chk-1."""
    from sparkpoint.pipeline.skipping import skip_file

    def actors(run: Run) -> dict[str, Callable[[], Any]]:
        return {"skip": lambda: skip_file(run.pipeline("skip"), "b001.parquet", "garbled export"),
                "run": lambda: run.pipeline("run", max_batches=1).run()}
    return Scenario("skip-vs-run", _first_checkpoint, actors)


def follow_vs_recoverer() -> Scenario:
    """The Dagster `<name>_follow` job's loop (`follow`, each batch's attempt persisted under its
    run id) goes on after run monitoring marked its run failed; the recover job fences that run."""
    from sparkpoint.pipeline.follow import FollowOptions, follow

    def loop(run: Run) -> Any:
        options = FollowOptions(poll_seconds=0.01, idle_seconds=0.0, settle_seconds=0.0)
        return list(follow(run.pipeline("follow", max_batches=2), options, attempt_id="run-f", sleep=lambda s: None))

    def actors(run: Run) -> dict[str, Callable[[], Any]]:
        return {"follow": lambda: loop(run), "recoverer": lambda: _recover(run, "recoverer", "run-f")}
    return Scenario("follow-vs-recoverer", _first_checkpoint, actors)


def airflow_zombie_vs_recover_task() -> Scenario:
    """Airflow's batch and checkpoint tasks of a run whose worker lives on after the scheduler
    failed them (a zombie), and that run's `recover` task: `recover` with the operator's orphan
    grace period and no fence (what `SparkpointRecoverOperator` calls)."""
    def actors(run: Run) -> dict[str, Callable[[], Any]]:
        return {"zombie": lambda: _zombie(run, "run-z"),
                "recover": lambda: recover(run.pipeline("recover"), orphan_grace_seconds=3600.0)}
    return Scenario("airflow-zombie-vs-recover-task", _first_checkpoint, actors)


def _two_on_one_host(run: Run) -> None:
    """chk-1 and chk-2 made on host `host` (two retained): its task-local copy of chk-2 is there."""
    _first_checkpoint(run, 2, num_retained=2, host="host")
    choose_rot_target(run)


def rot_vs_run_from_task_local_copy() -> Scenario:
    """A byte of a file chk-2 uploaded flips while the next run, on the host that made chk-2,
    restores from its task-local copy (it never reads the stored file), reuses that file in
    chk-3 and applies retention (two kept): the review's item 7."""
    def actors(run: Run) -> dict[str, Callable[[], Any]]:
        return {"rot": lambda: flip_a_byte(run, rot_target(run)),
                "run": lambda: run.pipeline("run", num_retained=2, max_batches=1, host="host").run()}
    return Scenario("rot-vs-run-from-task-local-copy", _two_on_one_host, actors)


def _rotted(run: Run) -> None:
    _two_on_one_host(run)
    flip_a_byte(run, rot_target(run))


def fallback_run_vs_savepoint() -> Scenario:
    """chk-2 is damaged (a flipped byte); a run on another host restores it from stable storage,
    finds the damage and falls back to chk-1 (discarding chk-2, rolling its output back), while a
    savepoint into the job directory copies the latest checkpoint."""
    def actors(run: Run) -> dict[str, Callable[[], Any]]:
        return {"run": lambda: run.pipeline("run", num_retained=2, max_batches=1).run(),
                "savepoint": lambda: _savepoint(run)}
    return Scenario("fallback-run-vs-savepoint", _rotted, actors, patch=_savepoints_do_not_wait)


def local_copy_run_vs_fallback_recovery() -> Scenario:
    """chk-2 is damaged; the next run, on the host with chk-2's task-local copy, never sees it
    and commits chk-3 reusing the damaged file, while a recovery on another host verifies the
    latest checkpoint, finds the damage and falls back (DESIGN rule 10: only corruption)."""
    def actors(run: Run) -> dict[str, Callable[[], Any]]:
        return {"run": lambda: run.pipeline("run", num_retained=2, max_batches=1, host="host").run(),
                "recoverer": lambda: _recover(run, "recoverer", harsh=False, num_retained=2)}
    return Scenario("local-copy-run-vs-fallback-recovery", _rotted, actors)


def _rollback(run: Run, actor: str, to: int) -> Any:
    """`sparkpoint rollback --to N` of the job and its output (the actor's own sink object)."""
    from sparkpoint.pipeline.rollback import rollback_job

    p = run.pipeline(actor)
    return rollback_job(p.storage, p.sink, to)


def rollback_vs_run() -> Scenario:
    """`sparkpoint rollback --to 1` while `sparkpoint run` (one process: no attempt persisted,
    nothing to refuse it by) commits chk-3 on top of chk-2, which the rollback retires."""
    def actors(run: Run) -> dict[str, Callable[[], Any]]:
        return {"rollback": lambda: _rollback(run, "rollback", 1),
                "run": lambda: run.pipeline("run", num_retained=3, max_batches=1).run()}
    return Scenario("rollback-vs-run", lambda run: _first_checkpoint(run, 2, num_retained=3), actors)


def rollback_vs_run_vs_input_cleanup() -> Scenario:
    """`sparkpoint rollback --to 1` and `sparkpoint run` (as in rollback-vs-run) while a prune with
    `input_cleanup=archive:<url>` archives what every retained checkpoint consumed: whatever the
    order, no batch the rollback replays may leave the input (the replay and the recomputation
    read the input and the archive)."""
    def prune_and_clean(run: Run) -> Any:
        from sparkpoint.pipeline.cleanup import InputCleanup

        cleanup = InputCleanup(f"archive:file://{run.archive}", f"file://{run.input}")
        return prune(run.storage(), num_retained=3, orphan_grace_seconds=3600.0, input_cleanup=cleanup)

    def actors(run: Run) -> dict[str, Callable[[], Any]]:
        return {"rollback": lambda: _rollback(run, "rollback", 1),
                "run": lambda: run.pipeline("run", num_retained=3, max_batches=1).run(),
                "prune": lambda: prune_and_clean(run)}
    return Scenario("rollback-vs-run-vs-input-cleanup", lambda run: _first_checkpoint(run, 2, num_retained=3), actors,
                    own_input=True)


def rollback_vs_recoverer() -> Scenario:
    """Run A persisted its attempt at chk-3 and died; the recover job aborts it and processes its
    batch again while `sparkpoint rollback --to 1` (refused while the attempt is pending) runs."""
    def setup(run: Run) -> None:
        _first_checkpoint(run, 2, num_retained=3)
        _persisted(run, "run-a")

    def actors(run: Run) -> dict[str, Callable[[], Any]]:
        return {"rollback": lambda: _rollback(run, "rollback", 1),
                "recoverer": lambda: _recover(run, "recoverer", "run-a", num_retained=3)}
    return Scenario("rollback-vs-recoverer", setup, actors)


ERASED = ("a3",)


def _erase(run: Run, actor: str) -> Any:
    """`sparkpoint erase --key a3` from both operators of the job and its output (the actor's own sink)."""
    from sparkpoint.pipeline.erase import EraseScope, erase_job, state_key

    p = run.pipeline(actor, num_retained=2)
    scope = EraseScope(tuple(state_key(k) for k in ERASED), tuple(op.uid for op in OPERATORS), {"acct": ERASED})
    return erase_job(p.storage, scope, sink=p.sink, local_dir=p.config.local_dir)


def erase_vs_run_vs_retention() -> Scenario:
    """`sparkpoint erase` of account a3 while `sparkpoint run` (one process, started before the
    erase: nothing refuses it) commits chk-3 and a prune applies retention: whatever the order, no
    batch of another account may be lost or repeated (a copy's id below the run's checkpoint would
    roll the job back), and every retained checkpoint keeps its files."""
    def actors(run: Run) -> dict[str, Callable[[], Any]]:
        return {"erase": lambda: _erase(run, "erase"),
                "run": lambda: run.pipeline("run", num_retained=2, max_batches=1).run(),
                "prune": lambda: prune(run.storage(), num_retained=2, orphan_grace_seconds=3600.0)}
    return Scenario("erase-vs-run-vs-retention", lambda run: _first_checkpoint(run, 2, num_retained=2), actors,
                    erased=ERASED)


SCENARIOS = {s.name: s for s in (
    claimed_completer_vs_recovery_abort(), uploaded_zombie_vs_recovery_sweep(), completer_vs_recoverer(),
    zombie_vs_recover_with_sweep(), two_completers(), completer_vs_prune_vs_sweep(), retried_step_vs_recoverer(),
    run_vs_savepoint(), fenced_completer_vs_recoverer_vs_savepoint(), savepoints_to_one_target_vs_run(),
    bootstrap_vs_savepoint_one_target(), skip_vs_run(), follow_vs_recoverer(), airflow_zombie_vs_recover_task(),
    zombie_vs_recover_with_sweep("zombie-vs-recoverer-on-one-host", host="host"), rot_vs_run_from_task_local_copy(),
    fallback_run_vs_savepoint(), local_copy_run_vs_fallback_recovery(),
    into_a_table(completer_vs_recoverer()), into_a_table(two_completers()),
    into_a_table(zombie_vs_recover_with_sweep()), into_a_table(retried_step_vs_recoverer()),
    into_a_table(completer_vs_recoverer(), "iceberg"), into_a_table(zombie_vs_recover_with_sweep(), "iceberg"),
    rollback_vs_run(), rollback_vs_recoverer(), rollback_vs_run_vs_input_cleanup(), erase_vs_run_vs_retention(),
)}


# --- invariants -----------------------------------------------------------------------------------


def expected(run: Run, skipped: frozenset[str] = frozenset()) -> tuple[list[tuple[str, int]], dict[str, int]]:
    """Every batch's emitted balances (account, balance after the batch) and the final balances,
    recomputed in pandas; files consumed as skipped (`sparkpoint skip`) left out."""
    totals: dict[str, int] = {}
    emitted = []
    landed = {p.name: p for p in [*run.archive.glob("b*.parquet"), *run.input.glob("b*.parquet")]}
    for path in (landed[name] for name in sorted(landed)):
        if path.name in skipped:
            continue
        sums = pd.read_parquet(path).groupby("acct")["amount"].sum()
        for acct, amount in sums.items():
            totals[acct] = totals.get(acct, 0) + int(amount)
            emitted.append((str(acct), totals[acct]))
    return sorted(emitted), totals


def visible_output(run: Run, operator: str = "balances") -> list[tuple[Any, ...]]:
    """The job's visible output rows of `operator`: (account, balance) or (account, idle_at)."""
    rows: list[tuple[Any, ...]] = []
    for frame in (_table_frames(run, operator) if run.table else _part_frames(run, operator)):
        if operator == "balances":
            rows += [(str(a), int(b)) for a, b in zip(frame["acct"], frame["balance"])]
        else:
            rows += [(str(a), str(b)) for a, b in zip(frame["acct"], frame["idle_at"])]
    return sorted(rows)


def _part_frames(run: Run, operator: str) -> Iterator[pd.DataFrame]:
    fs = fsspec.filesystem("memory")
    for path in sorted(fs.ls(run.output, detail=False)):
        name = path.rsplit("/", 1)[-1]
        if name.startswith("part-job~") and f"~{operator}~" in name:
            with fs.open(path, "rb") as f:
                yield pd.read_parquet(f)


def _table_files(run: Run) -> list[str]:
    """The files the output table holds now (none before it exists), under `run.table_root`."""
    if run.table == "iceberg":
        return _iceberg_files(run)
    from deltalake import DeltaTable
    from deltalake.exceptions import TableNotFoundError

    try:
        table = DeltaTable(str(run.root / "table"))
    except TableNotFoundError:
        return []
    return sorted(pa.table(table.get_add_actions(flatten=True)).column("path").to_pylist())


def _iceberg_files(run: Run) -> list[str]:
    from pyiceberg.catalog import load_catalog
    from pyiceberg.exceptions import NoSuchTableError

    try:
        table = load_catalog("lake", **run.catalog).load_table("shop.out")
    except NoSuchTableError:
        return []
    root = f"file://{run.table_root}/"
    return sorted(task.file.file_path.removeprefix(root) for task in table.scan().plan_files())


def _table_frames(run: Run, operator: str) -> Iterator[pd.DataFrame]:
    """The rows `operator` wrote into the table, file by file (a file holds one operator's rows)."""
    for path in _table_files(run):
        if path.startswith("sparkpoint-job/") and path.rsplit("/", 1)[-1].startswith(f"{operator}-"):
            yield pd.read_parquet(run.table_root / path)


def skipped_in(run: Run) -> frozenset[str]:
    """The input files the latest checkpoint records as consumed unprocessed."""
    latest = CompletedCheckpointStore(run.storage()).latest()
    return frozenset(s.file for s in latest.skipped_files) if latest is not None else frozenset()


def _result_storage(url: str) -> CheckpointStorage:
    """The job directory of a savepoint's `.../<job>/chk-<N>` URL."""
    job_url = url.rsplit("/chk-", 1)[0]
    base, _, job = job_url.rpartition("/")
    return CheckpointStorage(base, job)


def savepoint_problems(run: Run, actors: dict[str, _Actor]) -> list[str]:
    """Every savepoint an actor took verifies where it is (one in the job directory only while
    its `_metadata` is there: a fallback discards savepoints above the checkpoint it restores);
    a target holds no file that no `_metadata` in it lists (a loser's leftovers, or a winner's
    files deleted by a loser)."""
    from sparkpoint.pipeline.bootstrap import CLAIM_FILE, BootstrapResult

    found = []
    for actor in actors.values():
        result = actor.result
        if not isinstance(result, (SavepointResult, BootstrapResult)):
            continue
        storage = _result_storage(result.url)
        meta = result.metadata
        if storage.job_url == run.storage().job_url and not storage.exists(meta.metadata_path):
            continue
        problems = verify_checkpoint(storage, meta)
        if problems:
            found.append(f"{actor.name}'s savepoint {result.url} does not verify: {problems[0]}")
    fs = fsspec.filesystem("memory")
    top = f"{run.url}/savepoints"
    for target in fs.ls(top, detail=False) if fs.exists(top) else []:
        target = target.rstrip("/")
        storage = CheckpointStorage(top, target.rsplit("/", 1)[-1])
        listed = {CLAIM_FILE}
        for m in CompletedCheckpointStore(storage).load_all().checkpoints:
            listed |= m.paths() | {m.metadata_path}
        stray = sorted(rel for path in fs.find(target) if (rel := path[len(target) + 1:]) not in listed)
        if stray:
            found.append(f"savepoint target {storage.job_url} holds files no savepoint lists: {stray[:3]}")
    return found


def violations(run: Run, actors: dict[str, _Actor], neighbours: dict[str, bytes]) -> list[str]:
    """What is wrong with the world the actors left, checked at once (cheap)."""
    found = []
    storage = run.storage()
    fs = fsspec.filesystem("memory")
    for url, data in neighbours.items():
        if not fs.exists(url) or fs.cat_file(url) != data:
            found.append(f"touched {url}, outside the job")
    for actor in actors.values():
        if isinstance(actor.error, Hang):
            found.append(f"{actor.name} hung: {actor.error}")
    rotted = {path for path, _ in run.rotted}
    listing = CompletedCheckpointStore(storage).load_all()
    for meta in listing.checkpoints:
        problems = [p for p in stored_size_problems(storage, list(meta.files())) + verify_checkpoint(storage, meta)
                    if p.path not in rotted]
        if problems:
            found.append(f"retained chk-{meta.checkpoint_id} lost files: {problems[0]}")
    return found + both_won(run, actors) + savepoint_problems(run, actors) + history_problems(run)


def history_problems(run: Run) -> list[str]:
    """The history (written by completers after their commit, DESIGN rule 14) holds only records of
    checkpoints that stood: a record of chk-N whose `_metadata` is still there names the attempt
    that committed it (a loser of the race for N, or a completer whose commit was withdrawn, wrote
    none), and every record reads."""
    storage = run.storage()
    history = read_history(storage)
    found = [f"unreadable history: {why}" for why in history.unreadable]
    for cid, record in history.records.items():
        try:
            meta = CompletedCheckpointStore(storage).load(cid)
        except Exception:  # noqa: BLE001  subsumed, retired or withdrawn since: the record stays as history
            continue
        committed = meta.source_offsets.get("attempt") if isinstance(meta.source_offsets, dict) else None
        if committed is not None and record.get("attempt_id") != committed:
            found.append(f"history record of chk-{cid} names attempt {record.get('attempt_id')}, chk-{cid} was "
                         f"committed by {committed}")
    return found


Reference = tuple[list[tuple[Any, ...]], dict[str, int]]
"""The idle operator's output rows and state after a run of the input alone."""


def replay_violations(run: Run, reference: Callable[[frozenset[str]], Reference],
                      erased: tuple[str, ...] = ()) -> list[str]:
    """The product's own way out (an erase that failed run again, a recovery on a host that lost
    its local disk), then everything left: output and state must be exact, but for the `erased`
    accounts (an erase removed them, a later batch may bring them back). Costs a recovery and a
    batch or two on RocksDB. Only a flipped byte in a file every retained checkpoint needed when
    it flipped may stop the job."""
    found = []
    try:
        if erased and run.storage().exists("_erase/lock.json"):
            _erase(run, "after")
        recover(run.pipeline("after"))
        run.pipeline("after").run()
    except Exception as e:
        if run.rotted and all(excused for _, excused in run.rotted):
            return []
        return [f"the job cannot go on: {type(e).__name__}: {e}"]
    skipped = skipped_in(run)
    want_rows, want_totals = expected(run, skipped)
    got = visible_output(run)
    if erased:
        want_rows, got = [r for r in want_rows if r[0] not in erased], [r for r in got if r[0] not in erased]
        want_totals = {a: t for a, t in want_totals.items() if a not in erased}
    if got != want_rows:
        missing = len(set(want_rows) - set(got))
        dupes = len(got) - len(set(got))
        found.append(f"output is not exactly once: {len(got)} rows, want {len(want_rows)} "
                     f"({missing} missing, {dupes} repeated)")
    _, state = state_table(run.storage(), BALANCES)
    totals = dict(zip(state["acct"], state["balance"].astype(int)))
    if {a: t for a, t in totals.items() if a not in erased} != want_totals:
        found.append("restored state differs from the recomputation")
    idle_rows, idle_state = reference(skipped)
    alerts = visible_output(run, "idle")
    if erased:
        idle_rows, alerts = [r for r in idle_rows if r[0] not in erased], [r for r in alerts if r[0] not in erased]
        idle_state = {a: t for a, t in idle_state.items() if a not in erased}
    if alerts != idle_rows:
        found.append(f"the timers' output is not exactly once: {len(alerts)} alerts, want {len(idle_rows)} "
                     f"({len(set(idle_rows) - set(alerts))} missing, {len(alerts) - len(set(alerts))} repeated)")
    _, seen = state_table(run.storage(), IDLE)
    if {a: t for a, t in zip(seen["acct"], seen["last_seen"].astype(int)) if a not in erased} != idle_state:
        found.append("the TTL state differs from a run of the input alone")
    return found


_VOLATILE = re.compile(r'\\?"(?:created_at|started_at|seconds|crc32|size|at|by|pid|pid_start|host|state_size|'
                       r'checkpointed_size|checksum)\\?":\s*(?:\\?"[^"\\]*\\?"|[-0-9.e]+|null)')


# What a run observed of itself (timings, request and byte counts) in `_metadata` and the attempt
# records: never the same twice, and nothing a replay depends on.
_OBSERVED = frozenset({"phases", "restore_phases", "phase_seconds", "duration_seconds", "requests", "bytes_up",
                       "bytes_down", "input", "estimated_cost_usd"})


def _without_observations(raw: bytes) -> str:
    """A control file's text with what its run observed of itself left out (JSON nested in JSON
    strings too), or as it is when it is not JSON."""
    text = raw.decode("utf-8", "replace")
    try:
        return json.dumps(_strip_observed(json.loads(text)), sort_keys=True)
    except ValueError:
        return text


def _strip_observed(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_observed(v) for k, v in value.items()
                if k not in _OBSERVED and not (k == "restore" and isinstance(v, dict))}
    if isinstance(value, list):
        return [_strip_observed(v) for v in value]
    if isinstance(value, str) and value[:1] in "{[":
        try:
            return json.dumps(_strip_observed(json.loads(value)), sort_keys=True)
        except ValueError:
            return value
    return value


def end_state(run: Run) -> tuple[tuple[str, str], ...]:
    """The world as a replay depends on it, up to renaming: every file's path with unique names
    blanked, and the control files' contents without times, sizes and checksums; and which
    flipped bytes were excused. Two interleavings that leave the same end state need one replay."""
    fs = fsspec.filesystem("memory")
    prefix = fs._strip_protocol(run.url).rstrip("/") + "/"
    state = [("rotted", repr(sorted(run.rotted)))]
    for path in fs.find(run.url):
        rel = path[len(prefix):]
        content = ""
        if rel.endswith(("_metadata", ".json", ".claim")) and f"/{HISTORY_DIR}/" not in f"/{rel}":
            content = _UNIQUE.sub("*", _VOLATILE.sub("", _without_observations(fs.cat_file(path))))
        state.append((_UNIQUE.sub("*", rel), content))
    if run.table:  # what the table holds, and every file in its location
        state.append(("table", repr([_UNIQUE.sub("*", p) for p in _table_files(run)])))
        state += [(_UNIQUE.sub("*", p.relative_to(run.root).as_posix()), "")
                  for p in run.table_root.rglob("*.parquet")]
    return tuple(sorted(state))


def both_won(run: Run, actors: dict[str, _Actor]) -> list[str]:
    """An attempt both committed by a completer and aborted by a recovery that deleted its files."""
    from sparkpoint.pipeline.maintenance import AttemptSettlement, RecoveryReport

    committed = {r[1].checkpoint_id for a in actors.values() if isinstance(r := a.result, tuple) and len(r) == 2
                 and hasattr(r[1], "checkpoint_id")}
    reports = [r for a in actors.values() for r in (a.result if isinstance(a.result, tuple) else (a.result,))]
    aborted = {cid for r in reports if isinstance(r, (RecoveryReport, AttemptSettlement)) for cid in r.aborted}
    return [f"chk-{cid} was both committed by its completer and aborted by recovery"
            for cid in sorted(committed & aborted)]


# --- exploring ------------------------------------------------------------------------------------


@dataclass
class Outcome:
    schedule: list[Choice]
    violations: list[str]
    errors: dict[str, str]  # actor -> how it ended, when it raised
    results: dict[str, Any] = field(default_factory=dict)  # actor -> what it returned


@dataclass
class Report:
    scenario: str
    explored: int = 0  # distinct schedules run
    violations: list[Outcome] = field(default_factory=list)
    steps: dict[str, int] = field(default_factory=dict)  # per actor, in the schedule without preemption
    how: str = ""  # "all with <= k preemptions" / "n sampled with <= k preemptions"

    def line(self) -> str:
        steps = ", ".join(f"{a} {n}" for a, n in self.steps.items())
        return (f"{self.scenario}: actors {list(self.steps)} ({steps} steps alone), {self.explored} schedules"
                f"{' (' + self.how + ')' if self.how else ''}, violations: {len(self.violations)}")


def _fast_dir() -> str | None:
    """A memory-backed directory for the actors' local directories (RocksDB's files), when there is one."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None


_CHECKERS = itertools.count()


def _forget(root: str, url: str) -> None:
    shutil.rmtree(root, ignore_errors=True)
    fs = fsspec.filesystem("memory")
    for path in fs.find(url):
        fs.rm_file(path)


class Checker:
    """Runs one scenario under a schedule: a fresh world each time, from a template made once."""

    def __init__(self, scenario: Scenario, workdir: Path):
        self.scenario = scenario
        self.workdir = workdir
        self.root = Path(tempfile.mkdtemp(prefix="ilv-", dir=_fast_dir()))
        self.url = f"memory://ilv-{next(_CHECKERS)}-{os.getpid()}"
        self._cleanup = weakref.finalize(self, _forget, str(self.root), self.url)
        self.count = itertools.count()
        self.replayed: dict[tuple[tuple[str, str], ...], list[str]] = {}  # end state -> its replay's findings
        self.references: dict[frozenset[str], Reference] = {}
        self.template = self._template()
        self.visible: Callable[[str, str, str], bool] | None = None
        self.visible = self._visibility()

    def _visibility(self) -> Callable[[str, str, str], bool]:
        """Run the actors one after the other in every order, without preemption, and keep what
        each touched (see `visibility`)."""
        seen: dict[str, set[tuple[str, tuple[str, ...]]]] = {}
        with self.world() as run:
            names = list(self.scenario.actors(run))
        # One after the other in every order; and once taking turns at every step, since an actor
        # may stop at once when another ran first (a target that exists): its steps are seen too.
        for choose in [*(in_order(order) for order in itertools.permutations(names)), round_robin()]:
            with self.world() as run, self._patched():
                scheduler = Scheduler(self.scenario.actors(run), choose)
                try:
                    scheduler.run()
                except Hang:
                    pass
            for actor, steps in scheduler.steps.items():
                seen.setdefault(actor, set()).update(normalized(op, path) for op, path in steps)
        return visibility(seen)

    def _template(self) -> Run:
        run = Run(self.root / "world-template", f"{self.url}/world-template", table=self.scenario.table)
        land(run, self.scenario.batches)
        with inline_parallel():
            self.scenario.setup(run)
        return run

    @contextmanager
    def _patched(self) -> Iterator[None]:
        with inline_parallel(), (self.scenario.patch() if self.scenario.patch else contextlib.nullcontext()):
            yield

    @contextmanager
    def world(self) -> Iterator[Run]:
        """A copy of the template: its storage, and its hosts' local directories."""
        n = next(self.count)
        root = self.root / f"world-{n}"
        run = Run(root, f"{self.url}/world-{n}", None if self.scenario.own_input else self.template.input,
                  rotted=list(self.template.rotted), table=self.scenario.table)
        if self.scenario.own_input:
            shutil.copytree(self.template.input, run.input)
        fs = fsspec.filesystem("memory")
        for path in fs.find(self.template.url):
            fs.pipe_file(path.replace("/world-template/", f"/world-{n}/", 1), fs.cat_file(path))
        if (self.template.root / "table").is_dir():  # the output table as the setup left it
            shutil.copytree(self.template.root / "table", root / "table")
        if self.scenario.table == "iceberg":  # its catalog names absolute paths: the world's own setup
            for path in fs.find(run.url):
                fs.rm_file(path)
            root.mkdir(parents=True, exist_ok=True)
            with inline_parallel():
                self.scenario.setup(run)
            run.failed_before = time.time()
        if (self.template.root / "local" / "host").is_dir():  # the task-local copies a shared host keeps
            shutil.copytree(self.template.root / "local" / "host", root / "local" / "host", symlinks=True)
        try:
            yield run
        finally:
            shutil.rmtree(run.root, ignore_errors=True)
            for path in fs.find(run.url):
                fs.rm_file(path)

    def reference(self, skipped: frozenset[str]) -> Reference:
        """The idle operator's output and state after a run of the input (less `skipped`) alone."""
        if skipped not in self.references:
            k = len(self.references)
            ref = Run(self.root / f"reference-{k}", f"{self.url}/reference-{k}")
            ref.input.mkdir(parents=True)
            for path in sorted(self.template.input.glob("b*.parquet")):
                if path.name not in skipped:
                    shutil.copy(path, ref.input / path.name)
            with inline_parallel():
                ref.pipeline("reference").run()
            _, seen = state_table(ref.storage(), IDLE)
            self.references[skipped] = (visible_output(ref, "idle"),
                                        dict(zip(seen["acct"], seen["last_seen"].astype(int))))
            shutil.rmtree(ref.root, ignore_errors=True)
            fs = fsspec.filesystem("memory")
            for path in fs.find(ref.url):
                fs.rm_file(path)
        return self.references[skipped]

    def run(self, choose: Chooser) -> Outcome:
        with self.world() as run, self._patched():
            neighbours = canary(run)
            run.failed_before = time.time()
            scheduler = Scheduler(self.scenario.actors(run), choose, visible=self.visible)
            try:
                schedule = scheduler.run()
            except Hang as e:
                return Outcome(scheduler.trace, [f"hung: {e}"], {})
            errors = {a.name: f"{type(a.error).__name__}: {a.error}" for a in scheduler.actors.values()
                      if a.error is not None}
            try:
                found = violations(run, scheduler.actors, neighbours)
                key = end_state(run)
                if key not in self.replayed:
                    self.replayed[key] = replay_violations(run, self.reference, self.scenario.erased)
                found += self.replayed[key]
            except Exception as e:
                found = [f"checking the end state failed: {type(e).__name__}: {e}\n{traceback.format_exc()}"]
            return Outcome(schedule, found, errors, {a.name: a.result for a in scheduler.actors.values()})

    def replay(self, prefix: list[str]) -> Outcome:
        """The schedule that makes `prefix`'s choices, then goes on without preemption."""
        def choose(enabled: tuple[str, ...], previous: str | None, index: int, steps: Any) -> str:
            if index < len(prefix) and prefix[index] in enabled:
                return prefix[index]
            return default_choice(enabled, previous)
        return self.run(choose)

    def explore(
        self, *, bound: int = 2, limit: int = 10_000, report: Report | None = None, until_found: bool = False
    ) -> Report:
        """Every schedule with at most `bound` preemptions (up to `limit` of them), depth first;
        with `until_found`, only until the first violation."""
        report = report or Report(self.scenario.name)
        report.how = f"all with <= {bound} preemptions" + (f", at most {limit}" if limit < 10_000 else "")
        stack: list[list[str]] = [[]]
        while stack and report.explored < limit and not (until_found and report.violations):
            prefix = stack.pop()
            outcome = self.replay(prefix)
            self._note(report, outcome)
            schedule = outcome.schedule
            if not prefix:
                report.steps = _steps_alone(schedule)
            made = [(c.enabled, c.previous, c.chosen) for c in schedule]
            for i in range(len(schedule) - 1, len(prefix) - 1, -1):
                c = schedule[i]
                for alternative in c.enabled:
                    if alternative == c.chosen:
                        continue
                    if preemptions([*made[:i], (c.enabled, c.previous, alternative)]) <= bound:
                        stack.append([x.chosen for x in schedule[:i]] + [alternative])
        return report

    def sample(self, runs: int, *, seed: int, bound: int = 2, report: Report | None = None,
               until_found: bool = False) -> Report:
        """`runs` distinct schedules drawn at random (`seed`), each with at most `bound`
        preemptions: the first switch at a step of the schedule without preemption, each later one
        a random number of steps after the one before. Draws that make a schedule already run
        are drawn again (up to four times `runs` draws in all)."""
        report = report or Report(self.scenario.name)
        report.how = f"up to {runs} drawn with <= {bound} preemptions, seed {seed}"
        rng = random.Random(seed)
        base = self.replay([])
        if not report.explored:  # else an exploration before ran it
            self._note(report, base)
        report.steps = _steps_alone(base.schedule)
        switchable = [i for i, c in enumerate(base.schedule) if len(c.enabled) > 1]
        made = {tuple(c.chosen for c in base.schedule)}
        draws = 0
        while report.explored < runs and draws < 4 * runs and switchable and not (until_found and report.violations):
            draws += 1
            points = [rng.choice(switchable)]
            for _ in range(rng.randint(1, bound) - 1):
                points.append(points[-1] + 1 + int(rng.expovariate(1 / 8)))
            picks = {p: rng.random() for p in points}

            def choose(enabled: tuple[str, ...], previous: str | None, index: int, steps: Any,
                       picks: dict[int, float] = picks) -> str:
                if index in picks and previous in enabled and len(enabled) > 1:
                    others = [a for a in enabled if a != previous]
                    return others[int(picks[index] * len(others))]
                return default_choice(enabled, previous)

            outcome = self.run(choose)
            signature = tuple(c.chosen for c in outcome.schedule)
            if signature in made:
                continue
            made.add(signature)
            self._note(report, outcome)
        return report

    @staticmethod
    def _note(report: Report, outcome: Outcome) -> None:
        report.explored += 1
        if outcome.violations:
            report.violations.append(outcome)


def _steps_alone(schedule: list[Choice]) -> dict[str, int]:
    return {a: sum(1 for c in schedule if c.chosen == a) for a in dict.fromkeys(c.chosen for c in schedule)}
