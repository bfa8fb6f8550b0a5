"""A model checker for the protocol's actors: real code, every interleaving of their storage steps.

Three review rounds found races between the actors of one job (completer, recoverer, a zombie of a
failed run, a retried step, the orphan sweep, retention), each by forcing one order by hand. This
runs two or three *real* actors (`finish_step`, `recover`, `start_step`, `prune`, ...) in threads
over one `memory://` job directory and lets exactly one of them move at a time: every storage
operation of the protocol passes `sparkpoint.checkpoint.interleave.storage_step`, where the
scheduler parks the actor and picks who goes next. `explore` enumerates the schedules
systematically (depth-first over the choices, every schedule with at most `bound` preemptions:
switching away from an actor that could have gone on) or samples them at random, and checks the
invariants after each one:

- every retained checkpoint's files exist with their recorded size and CRC32;
- at most one of abort and commit wins an attempt;
- nothing outside the job's directory and output is touched (a neighbour job's files stay);
- after the product's own way out (a recovery, then the remaining input processed), the visible
  output holds every batch's rows exactly once and the restored state equals a recomputation in
  pandas — a committed checkpoint's sink output that was discarded, or a good checkpoint subsumed
  by one with missing files, fails here.

No Spark: the Spark half runs the real subtasks in the calling thread (`InProcessPipeline`), on
real RocksDB, so the steps of one actor happen in its own thread, in order.
"""

from __future__ import annotations

import fnmatch
import itertools
import random
import re
import shutil
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import pandas as pd

from sparkpoint.checkpoint.files import stored_size_problems
from sparkpoint.checkpoint.interleave import set_step_hook
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.pipeline.attempt import (
    COMPLETE,
    PendingAttempt,
    claim,
    claim_path,
    complete_attempt,
    finish_step,
    load_attempt,
    save_attempt,
    spark_half_with_fallback,
    start_step,
)
from sparkpoint.pipeline.driver import StatefulPipeline
from sparkpoint.pipeline.maintenance import clear_failed_attempts, prune, recover, settle_attempts
from sparkpoint.pipeline.runtime import PipelineConfig
from sparkpoint.spark.tasks import run_slots
from sparkpoint.state.codecs import StructCodec
from sparkpoint.state.extract import state_table
from sparkpoint.state.operators import KeyedOperator
from sparkpoint.state.verify import verify_checkpoint

# --- a user's operator (not the sample's): running balances per account -------------------------

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


BALANCES = KeyedOperator("balances", key="acct", columns=("amount",), process=apply_amounts,
                         export=export_balances, emits=True)


class InProcessPipeline(StatefulPipeline):
    """The pipeline's driver with its Spark job run in the calling thread: the same subtasks
    (`run_slots`: restore, process, stage, snapshot, upload) without a JVM, on the read-all route
    whatever route the batch was given (the routes differ in how rows reach a subtask, not in
    what the subtask does with storage)."""

    def _run_spark(self, spec: Any, urls: list[str], *route: Any) -> list[dict[str, Any]]:
        ids = iter([pd.DataFrame({"id": list(range(spec.parallelism))})])
        return [row for frame in run_slots(spec, urls, ids) for row in frame.to_dict("records")]


# --- the scheduler ------------------------------------------------------------------------------


class Hang(RuntimeError):
    """An actor neither reached a storage step nor ended in time (it waits on something else)."""


@dataclass
class _Actor:
    name: str
    fn: Callable[[], Any]
    thread: threading.Thread | None = None
    parked: tuple[str, str] | None = None  # the step it waits at
    done: bool = False
    result: Any = None
    error: BaseException | None = None


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
    step to the next. `choose(enabled, previous, index)` picks who goes."""

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
        if self.visible is None or self.visible(actor.name, op, path):
            self._park(actor, (op, path))

    def _park(self, actor: _Actor, step: tuple[str, str]) -> None:
        with self.cond:
            actor.parked = step
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

    def run(self) -> list[Choice]:
        previous = set_step_hook(self._hook)
        parallel = CheckpointStorage.parallel
        # Every step of an actor in its own thread, in order: no worker threads.
        CheckpointStorage.parallel = _inline  # type: ignore[method-assign]
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
                    enabled = tuple(a.name for a in self.actors.values() if not a.done)
                    if not enabled:
                        break
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
            CheckpointStorage.parallel = parallel  # type: ignore[method-assign]
        return self.trace


def _inline(self: CheckpointStorage, fn: Any, items: Any, *, workers: int | None = None) -> list[Any]:
    return [fn(item) for item in items]


def preemptions(choices: list[tuple[tuple[str, ...], str | None, str]]) -> int:
    """Switches away from an actor that could have gone on: (enabled, previous, chosen) each."""
    return sum(1 for enabled, previous, chosen in choices if previous in enabled and chosen != previous)


def default_choice(enabled: tuple[str, ...], previous: str | None) -> str:
    """No preemption: the last actor goes on while it can, else the first waiting one."""
    return previous if previous in enabled else enabled[0]


def in_order(order: tuple[str, ...]) -> Chooser:
    """Each actor runs to its end before the next one starts."""
    def choose(enabled: tuple[str, ...], previous: str | None, index: int, steps: Any) -> str:
        return next(a for a in order if a in enabled)
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
        steps = [f"{c.step[0]} {c.step[1].rsplit('/', 2)[-2:] and '/'.join(c.step[1].rsplit('/', 2)[-2:])}".strip()
                 for c in group]
        parts.append(f"{actor}: " + ", ".join(steps))
    text = " | ".join(parts)
    return text if len(text) <= limit else text[:limit] + " ..."


# --- which steps can matter to another actor ---------------------------------------------------

WRITES = frozenset({"create", "write", "delete", "move", "upload", "rmdir"})
_RUN_PREFIX = re.compile(r"^/?ilv-\d+/(?:template|r\d+)/")
_UNIQUE = re.compile(r"[0-9a-f]{8,}")


def normalized(op: str, path: str) -> tuple[str, tuple[str, ...]]:
    """A step as it recurs from run to run: the run's prefix and unique (hex) names stripped; a
    move touches its source and its target."""
    paths = path.split(" -> ") if op == "move" else [path]
    return op, tuple(_UNIQUE.sub("*", _RUN_PREFIX.sub("", p.lstrip("/") if p.startswith("/ilv-") else p))
                     for p in paths)


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


# --- scenarios ----------------------------------------------------------------------------------


@dataclass
class Run:
    """One interleaving's world: the job, its input, one pipeline object per actor (as separate
    processes would have), and what the actors returned."""

    root: Path  # local: the actors' working directories
    url: str  # memory:// prefix of this run's checkpoints and output
    input_dir: Path | None = None  # the batches (read only: shared by every run of a checker)

    @property
    def input(self) -> Path:
        return self.input_dir or self.root / "in"

    @property
    def checkpoints(self) -> str:
        return f"{self.url}/ckpt"

    @property
    def output(self) -> str:
        return f"{self.url}/out"

    def pipeline(self, actor: str, *, num_retained: int = 1, max_batches: int | None = None) -> InProcessPipeline:
        config = PipelineConfig(
            input_url=str(self.input), checkpoints_url=self.checkpoints, job_id="job",
            output_url=self.output, num_retained=num_retained, parallelism=1, max_parallelism=8,
            local_dir=str(self.root / "local" / actor), max_batches=max_batches,
        )
        return InProcessPipeline(None, config, (BALANCES,))

    def storage(self) -> CheckpointStorage:
        return CheckpointStorage(self.checkpoints, "job")


def land(run: Run, batches: int, seed: int = 7) -> None:
    run.input.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for i in range(batches):
        frame = pd.DataFrame({"acct": [f"a{rng.randrange(12)}" for _ in range(20)],
                              "amount": [rng.randrange(-50, 100) for _ in range(20)]})
        frame.to_parquet(run.input / f"b{i:03d}.parquet")


def canary(run: Run) -> dict[str, bytes]:
    """A neighbour job's checkpoint file and output: no actor may touch them."""
    fs = fsspec.filesystem("memory")
    files = {f"{run.checkpoints}/other-job/chk-1/_metadata": b"neighbour", f"{run.output}/part-other~00000001~x~00000"
             ".parquet": b"neighbour output"}
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


@dataclass(frozen=True)
class Scenario:
    """A job in some state (`setup`) and the actors that then run at once."""

    name: str
    setup: Callable[[Run], None]
    actors: Callable[[Run], dict[str, Callable[[], Any]]]
    batches: int = 4


def _first_checkpoint(run: Run, n: int = 1, *, num_retained: int = 1) -> None:
    run.pipeline("setup", num_retained=num_retained, max_batches=n).run()


def _persisted(run: Run, attempt_id: str, actor: str = "setup") -> None:
    assert start_step(run.pipeline(actor), attempt_id) is not None


def completer_vs_recoverer() -> Scenario:
    """Run A persisted its attempt at chk-2 and its checkpoint step is completing it; run
    monitoring marked A failed meanwhile and the recovery sensor started the recover job."""
    def setup(run: Run) -> None:
        _first_checkpoint(run)
        _persisted(run, "run-a")

    def actors(run: Run) -> dict[str, Callable[[], Any]]:
        return {"completer": lambda: finish_step(run.pipeline("completer"), ["run-a"]),
                "recoverer": lambda: recover(run.pipeline("recoverer"), failed_before=time.time() + 3600,
                                             failed_attempts=("run-a",))}
    return Scenario("completer-vs-recoverer", setup, actors)


def zombie_vs_recover_with_sweep() -> Scenario:
    """Run Z was marked failed while its process lives: it runs its Spark half, persists its
    attempt and completes it, while the recover job aborts, sweeps (grace 0 up to Z's end) and
    re-processes. With num_retained=1 a commit over swept files would subsume the only good one."""
    def setup(run: Run) -> None:
        _first_checkpoint(run)

    def zombie(run: Run) -> Any:
        p = run.pipeline("zombie")
        if start_step(p, "run-z") is None:
            return None
        return finish_step(p, ["run-z"])

    def actors(run: Run) -> dict[str, Callable[[], Any]]:
        return {"zombie": lambda: zombie(run),
                "recoverer": lambda: recover(run.pipeline("recoverer"), failed_before=time.time() + 3600,
                                             failed_attempts=("run-z",))}
    return Scenario("zombie-vs-recover-with-sweep", setup, actors)


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
                "prune": lambda: prune(run.storage(), num_retained=1, orphan_grace_seconds=0.0, sink_url=run.output),
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
                "recoverer": lambda: recover(run.pipeline("recoverer"), failed_before=time.time() + 3600,
                                             failed_attempts=("run-a",))}
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


SCENARIOS = {s.name: s for s in (
    claimed_completer_vs_recovery_abort(), uploaded_zombie_vs_recovery_sweep(), completer_vs_recoverer(),
    zombie_vs_recover_with_sweep(), two_completers(), completer_vs_prune_vs_sweep(), retried_step_vs_recoverer(),
)}


# --- invariants -----------------------------------------------------------------------------------


def expected(run: Run) -> tuple[list[tuple[str, int]], dict[str, int]]:
    """Every batch's emitted rows (account, balance after the batch) and the final balances."""
    totals: dict[str, int] = {}
    emitted = []
    for path in sorted(run.input.glob("b*.parquet")):
        sums = pd.read_parquet(path).groupby("acct")["amount"].sum()
        for acct, amount in sums.items():
            totals[acct] = totals.get(acct, 0) + int(amount)
            emitted.append((str(acct), totals[acct]))
    return sorted(emitted), totals


def visible_output(run: Run) -> list[tuple[str, int]]:
    fs = fsspec.filesystem("memory")
    rows: list[tuple[str, int]] = []
    for path in sorted(fs.ls(run.output, detail=False)):
        if path.rsplit("/", 1)[-1].startswith("part-job~"):
            with fs.open(path, "rb") as f:
                frame = pd.read_parquet(f)
            rows += [(str(a), int(b)) for a, b in zip(frame["acct"], frame["balance"])]
    return sorted(rows)


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
    listing = CompletedCheckpointStore(storage).load_all()
    for meta in listing.checkpoints:
        problems = stored_size_problems(storage, list(meta.files())) + verify_checkpoint(storage, meta)
        if problems:
            found.append(f"retained chk-{meta.checkpoint_id} lost files: {problems[0]}")
    return found + both_won(run, actors)


def replay_violations(run: Run) -> list[str]:
    """The product's own way out (a recovery), then everything left: output and state must be
    exact. Costs a recovery and a batch or two on RocksDB."""
    found = []
    try:
        recover(run.pipeline("after"))
        run.pipeline("after").run()
    except Exception as e:
        return [f"the job cannot go on: {type(e).__name__}: {e}"]
    want_rows, want_totals = expected(run)
    got = visible_output(run)
    if got != want_rows:
        missing = len(set(want_rows) - set(got))
        dupes = len(got) - len(set(got))
        found.append(f"output is not exactly once: {len(got)} rows, want {len(want_rows)} "
                     f"({missing} missing, {dupes} repeated)")
    _, state = state_table(run.storage(), BALANCES)
    if dict(zip(state["acct"], state["balance"].astype(int))) != want_totals:
        found.append("restored state differs from the recomputation")
    return found


_VOLATILE = re.compile(r'\\?"(?:created_at|started_at|seconds|crc32|size|at|by|pid|pid_start|host|state_size|'
                       r'checkpointed_size|checksum)\\?":\s*(?:\\?"[^"\\]*\\?"|[-0-9.e]+|null)')


def end_state(run: Run) -> tuple[tuple[str, str], ...]:
    """The world as a replay depends on it, up to renaming: every file's path with unique names
    blanked, and the control files' contents without times, sizes and checksums. Two interleavings
    that leave the same end state need one replay."""
    fs = fsspec.filesystem("memory")
    prefix = fs._strip_protocol(run.url).rstrip("/") + "/"
    state = []
    for path in fs.find(run.url):
        rel = path[len(prefix):]
        content = ""
        if rel.endswith(("_metadata", ".json", ".claim")):
            content = _UNIQUE.sub("*", _VOLATILE.sub("", fs.cat_file(path).decode("utf-8", "replace")))
        state.append((_UNIQUE.sub("*", rel), content))
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


@dataclass
class Report:
    scenario: str
    explored: int = 0
    violations: list[Outcome] = field(default_factory=list)
    steps: dict[str, int] = field(default_factory=dict)  # per actor, in the schedule without preemption

    def line(self) -> str:
        steps = ", ".join(f"{a} {n}" for a, n in self.steps.items())
        return (f"{self.scenario}: actors {list(self.steps)} ({steps} steps alone), {self.explored} interleavings, "
                f"violations: {len(self.violations)}")


class Checker:
    """Runs one scenario under a schedule: a fresh world each time, from a template made once."""

    def __init__(self, scenario: Scenario, workdir: Path):
        self.scenario = scenario
        self.workdir = workdir
        self.count = itertools.count()
        self.replayed: dict[tuple[tuple[str, str], ...], list[str]] = {}  # end state -> its replay's findings
        self.template = self._template()
        self.visible: Callable[[str, str, str], bool] | None = None
        self.visible = self._visibility()

    def _visibility(self) -> Callable[[str, str, str], bool]:
        """Run the actors one after the other in every order, without preemption, and keep what
        each touched (see `visibility`)."""
        seen: dict[str, set[tuple[str, tuple[str, ...]]]] = {}
        with self.world() as run:
            names = list(self.scenario.actors(run))
        for order in itertools.permutations(names):
            with self.world() as run:
                scheduler = Scheduler(self.scenario.actors(run), in_order(order))
                scheduler.run()
            for actor, steps in scheduler.steps.items():
                seen.setdefault(actor, set()).update(normalized(op, path) for op, path in steps)
        return visibility(seen)

    def _template(self) -> Run:
        run = Run(self.workdir / "template", f"memory://ilv-{id(self)}/template")
        land(run, self.scenario.batches)
        self.scenario.setup(run)
        return run

    @contextmanager
    def world(self) -> Iterator[Run]:
        n = next(self.count)
        run = Run(self.workdir / f"r{n}", f"memory://ilv-{id(self)}/r{n}", self.template.input)
        fs = fsspec.filesystem("memory")
        for path in fs.find(self.template.url):
            fs.pipe_file(path.replace("/template/", f"/r{n}/", 1), fs.cat_file(path))
        try:
            yield run
        finally:
            shutil.rmtree(run.root, ignore_errors=True)
            for path in fs.find(run.url):
                fs.rm_file(path)

    def run(self, choose: Chooser) -> Outcome:
        with self.world() as run:
            neighbours = canary(run)
            scheduler = Scheduler(self.scenario.actors(run), choose, visible=self.visible)
            schedule = scheduler.run()
            errors = {a.name: f"{type(a.error).__name__}: {a.error}" for a in scheduler.actors.values()
                      if a.error is not None}
            try:
                found = violations(run, scheduler.actors, neighbours)
                key = end_state(run)
                if key not in self.replayed:
                    self.replayed[key] = replay_violations(run)
                found += self.replayed[key]
            except Exception as e:
                found = [f"checking the end state failed: {type(e).__name__}: {e}\n{traceback.format_exc()}"]
            return Outcome(schedule, found, errors)

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
        stack: list[list[str]] = [[]]
        while stack and report.explored < limit and not (until_found and report.violations):
            prefix = stack.pop()
            outcome = self.replay(prefix)
            self._note(report, outcome)
            schedule = outcome.schedule
            if not prefix:
                report.steps = {a: sum(1 for c in schedule if c.chosen == a) for a in dict.fromkeys(
                    c.chosen for c in schedule)}
            made = [(c.enabled, c.previous, c.chosen) for c in schedule]
            for i in range(len(schedule) - 1, len(prefix) - 1, -1):
                c = schedule[i]
                for alternative in c.enabled:
                    if alternative == c.chosen:
                        continue
                    if preemptions([*made[:i], (c.enabled, c.previous, alternative)]) <= bound:
                        stack.append([x.chosen for x in schedule[:i]] + [alternative])
        return report

    def sample(self, runs: int, *, seed: int, switch: float = 0.1, report: Report | None = None) -> Report:
        """`runs` random schedules: at each step the last actor goes on, or with probability
        `switch` another waiting one does."""
        report = report or Report(self.scenario.name)
        rng = random.Random(seed)
        for _ in range(runs):
            def choose(enabled: tuple[str, ...], previous: str | None, index: int, steps: Any) -> str:
                if previous in enabled and rng.random() > switch:
                    return previous
                return rng.choice(enabled)
            self._note(report, self.run(choose))
        return report

    @staticmethod
    def _note(report: Report, outcome: Outcome) -> None:
        report.explored += 1
        if outcome.violations:
            report.violations.append(outcome)
