"""Mapping a checkpoint's state onto a job's operators: what a restore would keep, rename, start
empty or drop, and whether it is allowed. One pure function of plain data (`plan_restore`), used by
every start (`sparkpoint.pipeline.runtime.check_operators`, which refuses a plan that is not `ok`) and by the
pre-flight `sparkpoint check-upgrade`, the Dagster blocking check and the Airflow first task, so
what a pre-flight says is what the restore then does.

State is matched by operator uid (Flink's operator uid), never by display name: an operator
renamed with its uid kept keeps its state. A uid the checkpoint lacks starts empty only with
`allow_new_operators`; a uid the job lacks is dropped only with `allow_non_restored_state`
(Flink's `--allowNonRestoredState`). A changed max parallelism is always refused: key groups
would not line up. A changed parallelism is a rescale, which every restore can do.

Each operator's `states` lists a verdict per declared state (`sparkpoint.state.schema.
compare_states`: kept, new or dropped; schema unchanged, compatible by which rule, incompatible
and why, naming the field and both types, or unchecked: a state the checkpoint kept undeclared
whose codec nothing records, see `restored_declarations`), when the code declares states; an
incompatible or unchecked state refuses the restore. The text report (`RestorePlan.lines`) says
each state's verdict under its operator, as `--json` does.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from sparkpoint.checkpoint.metadata import CheckpointMetadata
from sparkpoint.state.operators import KeyedOperator
from sparkpoint.state.schema import compare_states, refusals, restored_declarations, schema_fix

KEPT, RENAMED, NEW, DROPPED = "kept", "renamed", "new", "dropped"
ALLOW_NEW = "--allow-new-operators"
ALLOW_DROP = "--allow-non-restored-state"


@dataclass(frozen=True)
class OperatorPlan:
    """What a restore does with one operator uid.

    `old_*` are the checkpoint's (None for a new operator), `new_*` the job's (None for a dropped
    one). `problem` says why this operator stops the restore, `fix` what makes it work."""

    uid: str
    status: str  # kept | renamed | new | dropped
    old_name: str | None
    new_name: str | None
    old_parallelism: int | None
    new_parallelism: int | None
    old_max_parallelism: int | None
    new_max_parallelism: int | None
    problem: str | None = None
    fix: str | None = None
    states: tuple[dict[str, Any], ...] = ()  # per declared state: its schema verdict (StateChange.to_json)

    @property
    def ok(self) -> bool:
        return self.problem is None

    def line(self) -> str:
        shown = self.new_name or self.old_name or self.uid
        what = {
            KEPT: "state kept",
            RENAMED: f"renamed from {self.old_name}, state kept",
            NEW: "new: starts empty",
            DROPPED: "dropped: its state is not restored",
        }[self.status]
        uid = f" (uid {self.uid})" if shown != self.uid else ""
        shape = ""
        if self.old_parallelism is not None and self.new_parallelism is not None:
            shape = f"; parallelism {_change(self.old_parallelism, self.new_parallelism)}, max parallelism " \
                    f"{_change(self.old_max_parallelism, self.new_max_parallelism)}"
        verdict = f" -- REFUSED: {self.fix}" if self.fix else ""
        return f"{self.status:<8} {shown}{uid}: {what}{shape}{verdict}"

    def state_lines(self) -> list[str]:
        """For people: one line per declared state, its verdict and why (each rule of a compatible
        change, each problem of a refused one, naming the field and both types)."""
        out = []
        for s in self.states:
            reasons = "; ".join(s["problems"] or s["rules"])
            label = {"unchanged": "unchanged", "compatible": "compatible", "incompatible": "REFUSED",
                     "unchecked": "CANNOT CHECK, refused"}.get(s["verdict"], s["verdict"])
            if s["status"] in (NEW, DROPPED):
                label = s["status"]
            out.append(f"state {s['state']}: {label}" + (f": {reasons}" if reasons else ""))
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "uid": self.uid, "status": self.status, "old_name": self.old_name, "new_name": self.new_name,
            "parallelism": {"old": self.old_parallelism, "new": self.new_parallelism},
            "max_parallelism": {"old": self.old_max_parallelism, "new": self.new_max_parallelism},
            "ok": self.ok, "problem": self.problem, "fix": self.fix, "states": list(self.states),
        }


@dataclass(frozen=True)
class RestorePlan:
    """A checkpoint mapped onto a job's operators (`plan_restore`)."""

    checkpoint_id: int
    kind: str  # checkpoint | savepoint
    job_id: str  # the job that wrote the checkpoint
    operators: tuple[OperatorPlan, ...]
    allow_non_restored_state: bool = False
    allow_new_operators: bool = False
    hints: tuple[str, ...] = field(default=())

    @property
    def ok(self) -> bool:
        """Whether the restore would go ahead."""
        return all(op.ok for op in self.operators)

    def problems(self) -> list[str]:
        return [op.problem for op in self.operators if op.problem]

    def fixes(self) -> list[str]:
        """What would make a refused plan work: a flag or a change, each said once."""
        return list(dict.fromkeys([*(op.fix for op in self.operators if op.fix), *self.hints]))

    def counts(self) -> dict[str, int]:
        return {s: sum(1 for op in self.operators if op.status == s) for s in (KEPT, RENAMED, NEW, DROPPED)}

    def decision(self) -> str:
        """One line: what the restore does, or why it is refused."""
        counts = ", ".join(f"{n} {s}" for s, n in self.counts().items() if n)
        where = f"{self.kind} {self.checkpoint_id} of job {self.job_id}"
        if self.ok:
            return f"restoring {where}: {counts}"
        return (f"refusing to restore {where} ({counts}): " + "; ".join(self.problems())
                + ". To go ahead: " + "; ".join(self.fixes()))

    def rescaling(self) -> str | None:
        """`rescaling 3 -> 2 subtasks from chk-12` when the restore changes the parallelism of the
        operators it keeps; None when it does not (what `sparkpoint run` prints, once)."""
        changed = [(op.old_parallelism, op.new_parallelism) for op in self.operators
                   if op.old_parallelism is not None and op.new_parallelism is not None
                   and op.old_parallelism != op.new_parallelism]
        if not changed:
            return None
        old = ",".join(str(p) for p in sorted({o for o, _ in changed}))
        new = ",".join(str(p) for p in sorted({n for _, n in changed}))
        return f"rescaling {old} -> {new} subtasks from chk-{self.checkpoint_id}"

    def lines(self) -> list[str]:
        """For people: one line per operator, then the verdict."""
        verdict = "the restore would work" if self.ok else "the restore would be refused; to make it work: " \
            + "; ".join(self.fixes())
        lines = [f"{self.kind} {self.checkpoint_id} of job {self.job_id} onto this job's operators:"]
        for op in self.operators:
            lines += [f"  {op.line()}", *(f"      {line}" for line in op.state_lines())]
        return [*lines, verdict]

    def to_json(self) -> dict[str, Any]:
        return {
            "checkpoint_id": self.checkpoint_id, "kind": self.kind, "job_id": self.job_id, "ok": self.ok,
            "allow_non_restored_state": self.allow_non_restored_state,
            "allow_new_operators": self.allow_new_operators,
            "counts": self.counts(), "operators": [op.to_json() for op in self.operators],
            "problems": self.problems(), "fixes": self.fixes(),
        }

    def refusal(self, operators: Iterable[str]) -> str:
        """The error a refused start raises (`OperatorStateMismatch`)."""
        return (f"checkpoint {self.checkpoint_id} does not fit this job's operators ({', '.join(sorted(operators))}; "
                "refused before Spark starts): "
                + "; ".join(f"{op.problem}: {op.fix}" for op in self.operators if op.problem)
                + "".join(f"; {hint}" for hint in self.hints))


def plan_restore(
    meta: CheckpointMetadata,
    operators: Iterable[KeyedOperator],
    *,
    parallelism: int,
    max_parallelism: int,
    allow_non_restored_state: bool = False,
    allow_new_operators: bool = False,
) -> RestorePlan:
    """What restoring `meta` into a job of `operators` (at `parallelism`, `max_parallelism`) does,
    per operator uid, and whether it is allowed. Reads nothing but `meta`."""
    ops = {op.uid: op for op in operators}
    plans = []
    for uid in sorted(set(ops) | set(meta.operators)):
        op, old = ops.get(uid), meta.operators.get(uid)
        if old is None:
            assert op is not None
            refused = not allow_new_operators
            plans.append(OperatorPlan(
                uid, NEW, None, op.name, None, parallelism, None, max_parallelism,
                problem=f"the checkpoint has no state for {op.name} (it would start empty)" if refused else None,
                fix=f"allow with {ALLOW_NEW}" if refused else None,
            ))
            continue
        old_name = meta.operator_name(uid)
        if op is None:
            refused = not allow_non_restored_state
            plans.append(OperatorPlan(
                uid, DROPPED, old_name, None, old.parallelism, None, old.max_parallelism, None,
                problem=f"the checkpoint holds state of {old_name}, which this job does not run (it would be "
                        "dropped)" if refused else None,
                fix=f"allow with {ALLOW_DROP}" if refused else None,
            ))
            continue
        mismatch = old.max_parallelism != max_parallelism
        problem = fix = None
        if mismatch:
            problem = (f"{op.name} has max parallelism {old.max_parallelism} in the checkpoint, {max_parallelism} "
                       "in this job (key groups would not line up)")
            fix = f"run with --max-parallelism {old.max_parallelism}"
        recorded = restored_declarations(meta, uid, op.states, op.key_type)
        changes = compare_states(recorded, op.declarations()) if recorded is not None and len(op.states) else []
        incompatible = refusals(op.name, changes)
        if incompatible and problem is None:
            problem = "; ".join(incompatible)
            fix = schema_fix(changes, op.name)
        plans.append(OperatorPlan(
            uid, KEPT if old_name == op.name else RENAMED, old_name, op.name, old.parallelism, parallelism,
            old.max_parallelism, max_parallelism, problem=problem, fix=fix,
            states=tuple(c.to_json() for c in changes),
        ))
    hints: tuple[str, ...] = ()
    new = [p for p in plans if p.status == NEW and not p.ok]
    dropped = [p for p in plans if p.status == DROPPED and not p.ok]
    if new and dropped:  # likely a rename that changed the uid with the name
        hints = (f"or, if {new[0].new_name} is {dropped[0].old_name} renamed, give it uid={dropped[0].uid!r}",)
    return RestorePlan(meta.checkpoint_id, meta.kind, meta.job_id, tuple(plans), allow_non_restored_state,
                       allow_new_operators, hints)


def checkpoint_parallelism(meta: CheckpointMetadata) -> int | None:
    """The parallelism `meta` was taken at (its operators'; the highest should they differ),
    None for a checkpoint of no operator."""
    return max((op.parallelism for op in meta.operators.values()), default=None)


def _change(old: int | None, new: int | None) -> str:
    return f"{old}" if old == new else f"{old} -> {new}"
