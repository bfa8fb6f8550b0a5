"""Declared states and how they may change between two versions of an operator.

An operator declares its states (`KeyedOperator(states={...})`): per state its kind, codec and
TTL (Flink's state descriptors). Each checkpoint records the declarations in `_metadata`
(`operators[<id>].states`), as plain JSON:

    {"clicks": {"kind": "value", "key_type": "string" | null, "ttl": {...} | null,
                "codec": {"type": "record", "fields": [["clicks", "int64"], ...], "defaults": {...}}
                       | {"type": "json"} | {"type": "struct", "format": "<q"} | {"type": "bytes"}
                       | {"type": "custom", "class": "module.Name"}}}

`compare_states(old, new)` is a pure function of two such mappings: what a restore of `old`'s
checkpoint by `new`'s code does to each state. The pipeline calls it before Spark starts (and
refuses an incompatible change); `sparkpoint check-upgrade` prints it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from sparkpoint.checkpoint.errors import OperatorStateMismatch
from sparkpoint.checkpoint.metadata import CheckpointMetadata, KeyGroupRange
from sparkpoint.state.codecs import BytesCodec, Codec, JsonCodec, StructCodec
from sparkpoint.state.record import RecordCodec, RecordField, RecordSchemaError, parse_field
from sparkpoint.state.ttl import StateTtl

KINDS = ("value", "map", "list", "reducing")
STRUCT_CANNOT_EVOLVE = (
    "StructCodec cannot evolve: its records are positional bytes; use RecordCodec for fields that change"
)


class StateSchemaIncompatible(OperatorStateMismatch):
    """A checkpoint's state cannot be read by this version of the operator (a narrowed field, a
    changed type, kind or key type); refused before Spark starts."""


@dataclass(frozen=True)
class StateDescriptor:
    """A state an operator declares: its kind, codec and TTL (Flink's state descriptors).

        KeyedOperator(..., states={
            "totals": RecordCodec({"clicks": "int64"}),                # a value state
            "seen": StateDescriptor("map", JsonCodec(), ttl=StateTtl(3600)),
            "spend": StateDescriptor("reducing", RecordCodec({"sum": "float64"}), reduce=add),
        })
        # in process: state.value_state("totals", codec) or state.declared("totals")

    A state the checkpoint kept without a declaration (the operator opened it with
    `state.value_state(name, codec)` and declares it only now) has no recorded codec unless it was
    a `RecordCodec` (its fields are recorded with each snapshot's facts). For any other codec give
    the one it was kept with as `previous`: the restore and `check-upgrade` compare it with `codec`
    as they compare a recorded declaration (a `RecordCodec`'s entries are rewritten in the new
    fields), where without it they refuse the restore rather than read bytes another codec wrote:

        states={"profile": StateDescriptor("value", JsonCodec(), previous=JsonCodec())}

    Args:
        kind: "value" (default), "map", "list" or "reducing".
        codec: how its values are stored; `RecordCodec` fields evolve across restores.
        ttl: entries expire (`StateTtl`), or None.
        reduce: the reduce function of a "reducing" state.
        previous: the codec the state was kept with before it was declared; used only when the
            checkpoint restored recorded no declaration of it (never recorded in `_metadata`).

    Raises:
        ValueError: an unknown kind, or a reducing state without `reduce`.
    """

    kind: str = "value"
    codec: Codec[Any] = JsonCodec()
    ttl: StateTtl | None = None
    reduce: Callable[[Any, Any], Any] | None = None
    previous: Codec[Any] | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"a state's kind is one of {', '.join(KINDS)}, got {self.kind!r}")
        if (self.kind == "reducing") != (self.reduce is not None):
            raise ValueError("a reducing state needs reduce=, and only a reducing state takes it")

    def declaration(self, key_type: str | None = None) -> dict[str, Any]:
        """What `_metadata` records of this state: kind, key type, TTL and codec.

        Example:
            ```python
            StateDescriptor("map", JsonCodec()).declaration("string")
            # {"kind": "map", "key_type": "string", "ttl": None, "codec": {"type": "json"}}
            ```

        Args:
            key_type: the operator's key type (`KeyedOperator(key_type=...)`), or None.

        Returns:
            A JSON-ready dict.
        """
        ttl = None if self.ttl is None else {"seconds": self.ttl.seconds, "update": self.ttl.update,
                                              "clock": self.ttl.clock}
        return {"kind": self.kind, "key_type": key_type, "ttl": ttl, "codec": codec_spec(self.codec)}


class DeclaredStates(Mapping[str, StateDescriptor]):
    """An operator's declared states, name -> `StateDescriptor`, in the order given; read-only
    and hashable (an operator is a frozen value)."""

    def __init__(self, states: Mapping[str, Any] | Iterable[tuple[str, Any]] | None = None):
        items = states.items() if isinstance(states, Mapping) else (states or ())
        out: dict[str, StateDescriptor] = {}
        for name, d in items:
            if not isinstance(name, str) or not name or name == "default":
                raise ValueError(f"invalid state name {name!r}")
            if name in out:
                raise ValueError(f"state {name!r} is declared twice")
            out[name] = d if isinstance(d, StateDescriptor) else StateDescriptor("value", d)
        self._states = out

    def __getitem__(self, name: str) -> StateDescriptor:
        return self._states[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._states)

    def __len__(self) -> int:
        return len(self._states)

    def __hash__(self) -> int:
        return hash(tuple(self._states))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mapping) and dict(self.items()) == dict(other.items())

    def __repr__(self) -> str:
        return f"DeclaredStates({self._states!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (list(self._states.items()),))


def declarations(states: Mapping[str, StateDescriptor], key_type: str | None = None) -> dict[str, dict[str, Any]]:
    return {name: d.declaration(key_type) for name, d in states.items()}


def codec_spec(codec: Any) -> dict[str, Any]:
    """What `_metadata` records of a codec."""
    if isinstance(codec, RecordCodec):
        return codec.spec()
    if isinstance(codec, JsonCodec):
        return {"type": "json"}
    if isinstance(codec, StructCodec):
        return {"type": "struct", "format": codec.fmt}
    if isinstance(codec, BytesCodec):
        return {"type": "bytes"}
    cls = type(codec)
    return {"type": "custom", "class": f"{cls.__module__}.{cls.__qualname__}"}


def codec_of_spec(spec: Mapping[str, Any]) -> Codec[Any] | None:
    """The codec a recorded spec names (None: a custom codec, read as bytes)."""
    kind = spec.get("type")
    if kind == "record":
        return RecordCodec.from_spec(spec)
    if kind == "json":
        return JsonCodec()
    if kind == "struct":
        return StructCodec(spec["format"])
    if kind == "bytes":
        return BytesCodec()
    return None


# --- comparison -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StateChange:
    """What a restore of a checkpoint's state by new code does to one state (`compare_states`).

    Example:
        ```python
        (change,) = compare_states(old_declarations, operator.declarations())
        if change.verdict == "incompatible":
            print(change.problems)        # each names the field and both types
        ```

    Args:
        state: the state's name.
        status: "kept" (in both), "new" (only in the code: starts empty) or "dropped" (only in the checkpoint).
        verdict: "unchanged", "compatible" (the restore rewrites the entries in the new shape), "incompatible",
            or "unchecked" (kept undeclared, and nothing says which codec wrote its entries: refused).
        rules: the compatible changes, e.g. "added field tier (default 'free')", "widened orders int32→int64".
        problems: why it is incompatible, each naming the field and both types.
    """

    state: str
    status: str
    verdict: str
    rules: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """The change as a JSON-ready dict (what `check-upgrade --json` prints per state).

        Example:
            ```python
            change.to_json()     # {"state": "totals", "status": "kept", "verdict": "compatible", "rules": [...], ...}
            ```

        Returns:
            `state`, `status`, `verdict`, `rules` and `problems`.
        """
        return {"state": self.state, "status": self.status, "verdict": self.verdict, "rules": list(self.rules),
                "problems": list(self.problems)}


def compare_states(old: Mapping[str, Mapping[str, Any]], new: Mapping[str, Mapping[str, Any]]) -> list[StateChange]:
    """What a restore by new code does to each state: kept, new or dropped, and whether the code reads
    what the checkpoint stored.

    Pure: it compares recorded declarations (no state file is read), so it runs before Spark starts;
    `sparkpoint check-upgrade` and every restore use it, with `old` as `restored_declarations`
    gives it (a state the checkpoint kept undeclared included, "unchecked" when nothing says which
    codec wrote it).

    Example:
        ```python
        old = snapshot.metadata().operators["spend"].states     # what a checkpoint recorded
        for change in compare_states(old, new_operator.declarations()):
            print(change.state, change.status, change.verdict, change.rules, change.problems)
        ```

    Args:
        old: a checkpoint's declarations, state name -> declaration (`_metadata`'s `operators[uid].states`).
        new: the code's, as `KeyedOperator.declarations()` gives them.

    Returns:
        One `StateChange` per state name of either, sorted by name.
    """
    changes = []
    for name in sorted(set(old) | set(new)):
        if name not in old:
            changes.append(StateChange(name, "new", "compatible", ("new state: starts empty",)))
        elif name not in new:
            changes.append(StateChange(name, "dropped", "compatible",
                                       ("no longer declared: its entries stay in the checkpoint unread",)))
        elif (kept := old[name].get(UNDECLARED)) is not None and kept.get("problem"):
            changes.append(StateChange(name, "kept", UNCHECKED, problems=(kept["problem"],)))
        else:
            rules, problems = _compare_one(old[name], new[name])
            if kept is not None:
                rules.insert(0, f"kept undeclared until now, read {kept['read']}")
            verdict = "incompatible" if problems else "compatible" if rules else "unchanged"
            changes.append(StateChange(name, "kept", verdict, tuple(rules), tuple(problems)))
    return changes


def _compare_one(old: Mapping[str, Any], new: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    rules: list[str] = []
    problems: list[str] = []
    if old.get("kind") != new.get("kind"):
        problems.append(f"kind changed from {old.get('kind')} to {new.get('kind')}")
    ok, nk = old.get("key_type"), new.get("key_type")
    if ok is not None and nk is not None and ok != nk:
        problems.append(f"key type changed from {ok} to {nk}: stored keys would not be found")
    if old.get("ttl") != new.get("ttl"):
        rules.append(f"TTL {_ttl_text(old.get('ttl'))} → {_ttl_text(new.get('ttl'))}")
    oc, nc = old.get("codec") or {}, new.get("codec") or {}
    if oc.get("type") == "json" and nc.get("type") == "json":
        pass  # JSON values keep whatever shape they had: the code reads them as it can
    elif oc.get("type") == "record" and nc.get("type") == "record":
        r, p = compare_records(oc, nc)
        rules += r
        problems += p
    elif oc != nc:
        if oc.get("type") == "struct" and nc.get("type") == "struct":
            problems.append(f"struct format changed from {oc.get('format')} to {nc.get('format')}. "
                            f"{STRUCT_CANNOT_EVOLVE}")
        else:
            problems.append(f"codec changed from {_codec_text(oc)} to {_codec_text(nc)}: entries written by the "
                            "old codec cannot be read by the new one"
                            + (f". {STRUCT_CANNOT_EVOLVE}" if "struct" in (oc.get("type"), nc.get("type")) else ""))
    return rules, problems


def compare_records(old: Mapping[str, Any], new: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """(compatible changes, problems) between two recorded RecordCodec specs."""
    before = {f.name: f for f in _spec_fields(old)}
    after = _spec_fields(new)
    defaults = new.get("defaults") or {}
    rules: list[str] = []
    problems: list[str] = []
    for f in after:
        was = before.get(f.name)
        if was is None:
            if f.name in defaults:
                rules.append(f"added field {f.name} (default {defaults[f.name]!r})")
            elif f.nullable:
                rules.append(f"added field {f.name} (null)")
            else:
                problems.append(f"added field {f.name} as {f.text} without a default: entries written before "
                                "have no value for it (give it a default or make it nullable)")
            continue
        if was.type != f.type:
            if widens(was.type, f.type):
                rules.append(f"widened {f.name} {was.type}→{f.type}")
            else:
                what = "narrowing" if widens(f.type, was.type) else "type change"
                problems.append(f"field {f.name} changed from {was.type} to {f.type}: a {what} sparkpoint does "
                                "not migrate (only widening: int8→int16→int32→int64, float32→float64, int→float)")
        if not was.nullable and f.nullable:
            rules.append(f"made {f.name} nullable")
        elif was.nullable and not f.nullable:
            problems.append(f"field {f.name} changed from {was.text} to {f.text}: entries written before may hold "
                            "null")
    for name in before:
        if name not in {f.name for f in after}:
            rules.append(f"removed field {name}")
    if not problems and [f.name for f in after if f.name in before] != [n for n in before if n in
                                                                        {f.name for f in after}]:
        rules.append("reordered fields")
    return rules, problems


_INT_BITS = {"int8": 8, "int16": 16, "int32": 32, "int64": 64}
_UINT_BITS = {"uint8": 8, "uint16": 16, "uint32": 32, "uint64": 64}


def widens(old: str, new: str) -> bool:
    """Whether every value of type `old` is a value of type `new` (or, int -> float, its nearest)."""
    if old in _INT_BITS and new in _INT_BITS:
        return _INT_BITS[old] < _INT_BITS[new]
    if old in _UINT_BITS and new in _UINT_BITS:
        return _UINT_BITS[old] < _UINT_BITS[new]
    if old in _UINT_BITS and new in _INT_BITS:
        return _UINT_BITS[old] < _INT_BITS[new]
    if old == "float32" and new == "float64":
        return True
    if (old in _INT_BITS or old in _UINT_BITS) and new == "float64":
        return True
    return (old in ("int8", "int16", "uint8", "uint16")) and new == "float32"


def _spec_fields(spec: Mapping[str, Any]) -> list[RecordField]:
    try:
        return [parse_field(name, text) for name, text in spec.get("fields") or []]
    except RecordSchemaError as e:
        raise StateSchemaIncompatible(f"a recorded RecordCodec cannot be read: {e}") from None


def _codec_text(spec: Mapping[str, Any]) -> str:
    kind = spec.get("type")
    if kind == "struct":
        return f"StructCodec({spec.get('format')!r})"
    if kind == "custom":
        return str(spec.get("class"))
    return {"record": "RecordCodec", "json": "JsonCodec", "bytes": "BytesCodec"}.get(str(kind), str(kind))


def _ttl_text(ttl: Mapping[str, Any] | None) -> str:
    return "none" if not ttl else f"{ttl.get('seconds')}s ({ttl.get('clock')}, {ttl.get('update')})"


def refusals(operator: str, changes: list[StateChange]) -> list[str]:
    """One line per problem of the incompatible or unchecked states, naming the operator and the state."""
    return [f"operator {operator}, state {c.state}: {p}" for c in changes for p in c.problems]


def schema_fix(changes: list[StateChange], operator: str | None = None) -> str:
    """What makes a restore the `changes` refuse work, said once per kind of refusal."""
    fixes = []
    whose = f" of {operator}'s state" if operator else ""
    if any(c.verdict == "incompatible" for c in changes):
        fixes.append(f"keep the old schema{whose}, or start the changed state under a new name (RecordCodec fields "
                     "may be added, removed, widened, reordered, made nullable)")
    if any(c.verdict == UNCHECKED for c in changes):
        fixes.append("declare each state kept undeclared with the codec it was kept with as previous= "
                     "(StateDescriptor(kind, codec, previous=OldCodec()))")
    return "; ".join(fixes)


UNDECLARED = "undeclared"  # in a declaration `restored_declarations` made up for a state kept undeclared
UNCHECKED = "unchecked"


def restored_declarations(
    checkpoint: CheckpointMetadata | None, operator: str, declared: Mapping[str, StateDescriptor],
    key_type: str | None = None,
) -> Mapping[str, Any] | None:
    """What the code's declared states are compared with at a restore of `checkpoint`: the
    declarations it recorded, and one for each state the code declares that the checkpoint kept
    undeclared (an operator that opened it with `state.value_state(name, codec)` before).

    Such a state's declaration holds what is known of how it was kept: its kind and TTL from the
    snapshot's facts, and its codec from them when it was a `RecordCodec` (whose fields each
    snapshot records), else the declaration's `previous=` codec, else, when every subtask holds no
    entry of it, the declared codec (nothing to misread). Its `"undeclared"` key says which
    (`read`), or why nothing can check it (`problem`: `compare_states` makes it "unchecked", and a
    restore refuses it rather than read bytes another codec wrote).

    Example:
        ```python
        old = restored_declarations(meta, "spend", spend.states, spend.key_type)
        compare_states(old or {}, spend.declarations())
        ```

    Args:
        checkpoint: the checkpoint restored (None: none).
        operator: the operator's uid.
        declared: the code's declared states (`KeyedOperator.states`).
        key_type: the operator's key type.

    Returns:
        State name -> declaration, as `compare_states` takes `old`; None when the checkpoint holds no
        such operator, or records no declaration and the code declares none.
    """
    if checkpoint is None or operator not in checkpoint.operators:
        return None
    op_state = checkpoint.operators[operator]
    if not declared:
        return op_state.states
    recorded: dict[str, Any] = dict(op_state.states or {})
    for name, descriptor in declared.items():
        if name not in recorded:
            kept = _kept_undeclared(op_state.subtasks, name, descriptor, key_type)
            if kept is not None:
                recorded[name] = kept
    return recorded


def _kept_undeclared(handles: Iterable[Any], name: str, d: StateDescriptor, key_type: str | None
                     ) -> dict[str, Any] | None:
    """The declaration of state `name` as the snapshot's facts know it (None: no subtask holds it)."""
    facts = [h.facts for h in handles]
    kept = [f["states"][name] for f in facts if f is not None and name in (f.get("states") or {})]
    unknown_subtasks = sum(1 for f in facts if f is None)  # written before sparkpoint recorded facts
    if not kept and not unknown_subtasks:
        return None  # a new state: it starts empty
    new = d.declaration(key_type)
    entries = None if unknown_subtasks else sum(int(k.get("entries") or 0) for k in kept)
    kinds = sorted({k["kind"] for k in kept if k.get("kind") not in (None, "unknown")})
    specs = {_spec_key(k["codec"]): k["codec"] for k in kept if k.get("codec")}
    ttls = [k.get("ttl") for k in kept if k.get("kind") not in (None, "unknown")]
    old = {"kind": kinds[0] if len(kinds) == 1 else d.kind, "key_type": None,
           "ttl": ttls[0] if ttls else new["ttl"]}
    said = (f"{unknown_subtasks} of {len(facts)} subtasks checkpointed before sparkpoint recorded their states"
            if unknown_subtasks else f"{entries} entries in {len(kept)} of {len(facts)} subtasks")
    previous = codec_spec(d.previous) if d.previous is not None else None
    problem = read = None
    if len(kinds) > 1:
        problem = f"kept undeclared as a {' and a '.join(kinds)} state by different subtasks: it cannot be restored"
    elif len(specs) > 1:
        problem = ("kept undeclared with other RecordCodec fields by different subtasks ("
                   + "; ".join(str(spec.get("fields")) for spec in specs.values()) + "): it cannot be restored")
    elif specs:
        (old["codec"],) = specs.values()
        # The snapshot's facts name the fields its entries were written with, but no declaration
        # does: the upgrade is checked only once the code confirms them as `previous=`.
        if previous is None:
            fields = {str(f[0]): str(f[1]) for f in old["codec"].get("fields") or ()}
            problem = (f"kept undeclared until now ({said}), so the checkpoint recorded no declaration for it; its "
                       f"entries were written with RecordCodec fields {fields}: confirm them with "
                       f"StateDescriptor({d.kind!r}, ..., previous=RecordCodec({fields}))")
        elif _spec_key(previous) != _spec_key(old["codec"]):
            problem = (f"kept undeclared with RecordCodec fields {old['codec'].get('fields')}, which the "
                       f"checkpoint recorded, and declared with previous={_codec_text(previous)}"
                       f"{_fields_text(previous)}: give previous= the recorded fields")
        else:
            read = "with previous=RecordCodec, the fields its snapshot recorded"
    elif previous is not None:
        old["codec"] = previous
        read = f"with previous={_codec_text(previous)}"
    elif entries == 0:
        old.update(kind=d.kind, ttl=new["ttl"], codec=new["codec"])
        read = "(it holds no entry)"
    else:
        problem = (f"kept undeclared until now ({said}), and the checkpoint recorded no codec for it: sparkpoint "
                   f"cannot check that {_codec_text(new['codec'])} reads its entries (another codec's bytes would "
                   "be misread); declare it with the codec it was kept with: "
                   f"StateDescriptor({d.kind!r}, {_codec_text(new['codec'])}(...), previous=<that codec>)")
    old[UNDECLARED] = {"read": read, "problem": problem, "entries": entries}
    return old


def _spec_key(spec: Mapping[str, Any]) -> str:
    return json.dumps(spec, sort_keys=True, default=str)


def _fields_text(spec: Mapping[str, Any]) -> str:
    return f" fields {spec.get('fields')}" if spec.get("type") == "record" else ""


def check_declarations(
    operator: str, recorded: Mapping[str, Any] | None, declared: Mapping[str, Any],
    checkpoint: CheckpointMetadata | None,
) -> set[str]:
    """The states whose RecordCodec fields a restore must rewrite; StateSchemaIncompatible when
    the code cannot read what the checkpoint recorded (naming operator, state, field, types), or
    when nothing says which codec wrote a state it kept undeclared (`restored_declarations`)."""
    if recorded is None or not declared:
        return set()
    changes = compare_states(recorded, declared)
    problems = refusals(operator, changes)
    if problems:
        where = f"checkpoint {checkpoint.checkpoint_id}" if checkpoint is not None else "the checkpoint"
        raise StateSchemaIncompatible(
            f"{where} cannot be restored by this version of {operator}: " + "; ".join(problems)
            + f". To go ahead: {schema_fix(changes)}"
        )
    return {c.state for c in changes if c.status == "kept" and c.verdict == "compatible"
            and (recorded[c.state].get("codec") or {}).get("type") == "record"
            and recorded[c.state].get("codec") != declared[c.state].get("codec")}


def declared_states(checkpoint: CheckpointMetadata | None, operator: str, kg_range: KeyGroupRange
                    ) -> dict[str, dict[str, Any]]:
    """Each state's kind and TTL (and a RecordCodec's fields) as the snapshots this subtask
    restores recorded them (the old subtasks overlapping its key groups, on a rescale)."""
    if checkpoint is None or operator not in checkpoint.operators:
        return {}
    declared: dict[str, dict[str, Any]] = {}
    for handle in checkpoint.operators[operator].subtasks:
        if handle.key_group_range.intersects(kg_range) and handle.facts is not None:
            for name, fact in handle.facts["states"].items():
                if fact["kind"] != "unknown":
                    declared.setdefault(name, {"kind": fact["kind"], "ttl": fact["ttl"],
                                               **({"codec": fact["codec"]} if "codec" in fact else {})})
    return declared
