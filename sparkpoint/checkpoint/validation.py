"""Strict reading of JSON, field by field: the `Validator` every reader of `_metadata` (and of a
pending attempt) uses, whose errors name the field and the file, and the sections of a document
that stay plain JSON once read: source offsets, an operator's declared states and their codecs, a
subtask's facts. The sections read into the document model are `metadata`'s.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from sparkpoint.checkpoint.errors import MetadataError
from sparkpoint.checkpoint.paths import check_encodable

MAX_OFFSETS_DEPTH = 32  # source offsets deeper than this are refused, not recursed into
STATE_KINDS = ("value", "map", "list", "reducing")
CODEC_TYPES = ("record", "json", "struct", "bytes", "custom")
TTL_UPDATES = ("on_write", "on_read_and_write")
TTL_CLOCKS = ("processing", "event")
_MAX_FIELDS = 1000
_TYPE_NAME = re.compile(r"[a-z][a-z0-9_]{0,30}(\[[A-Za-z0-9_+:/, =-]{1,80}\])?( not null)?")
_MAX_STATES = 1000


class Validator:
    """Checks raw JSON field by field; every error names the field and the file."""

    def __init__(self, where: str):
        self.where = where

    def fail(self, field_name: str, problem: str) -> MetadataError:
        return MetadataError(f"{self.where}: field `{field_name}` {problem}")

    def obj(self, value: Any, name: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(name, f"must be an object, got {type(value).__name__}")
        return value

    def get(self, obj: dict[str, Any], key: str, name: str) -> Any:
        if key not in obj:
            raise self.fail(f"{name}.{key}" if name else key, "is missing")
        return obj[key]

    def string(self, obj: dict[str, Any], key: str, name: str, *, choices: tuple[str, ...] = ()) -> str:
        value = self.get(obj, key, name)
        full = f"{name}.{key}" if name else key
        if not isinstance(value, str) or not value:
            raise self.fail(full, f"must be a non-empty string, got {str(value)[:200]!r}")
        try:
            check_encodable(value)
        except ValueError as e:
            raise self.fail(full, str(e)) from None
        if choices and value not in choices:
            raise self.fail(full, f"must be one of {', '.join(choices)}, got {value!r}")
        return value

    def integer(self, obj: dict[str, Any], key: str, name: str, *, minimum: int = 0, maximum: int | None = None) -> int:
        value = self.get(obj, key, name)
        full = f"{name}.{key}" if name else key
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(full, f"must be an integer, got {str(value)[:200]!r}")
        if value < minimum or (maximum is not None and value > maximum):
            bound = f"between {minimum} and {maximum}" if maximum is not None else f">= {minimum}"
            raise self.fail(full, f"must be {bound}, got {value}")
        return value

    def array(self, obj: dict[str, Any], key: str, name: str) -> list[Any]:
        value = self.get(obj, key, name)
        if not isinstance(value, list):
            raise self.fail(f"{name}.{key}", f"must be an array, got {type(value).__name__}")
        return value


def json_only(v: Validator, value: Any, name: str) -> Any:
    """Source offsets are opaque, but must be plain JSON: no NaN, text that is valid Unicode, and
    at most MAX_OFFSETS_DEPTH levels deep (walked without recursion, so depth cannot crash us)."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_OFFSETS_DEPTH:
            raise v.fail(name, f"is nested deeper than {MAX_OFFSETS_DEPTH} levels")
        if isinstance(item, float) and not math.isfinite(item):
            raise v.fail(name, "holds a non-finite number")
        if isinstance(item, list):
            stack.extend((x, depth + 1) for x in item)
        elif isinstance(item, dict):
            stack.extend((x, depth + 1) for x in [*item.keys(), *item.values()])
        elif isinstance(item, str):
            try:
                check_encodable(item)
            except ValueError as e:
                raise v.fail(name, str(e)) from None
        elif not (item is None or isinstance(item, (bool, int, float))):
            raise v.fail(name, f"holds a non-JSON value {str(item)[:200]!r}")
    return value


def facts_from_json(v: Validator, raw: Any, name: str) -> dict[str, Any]:
    """A subtask's facts, shape-checked (no restore reads them; `inspect` prints them)."""
    obj = v.obj(raw, name)
    states = v.obj(v.get(obj, "states", name), f"{name}.states")
    if len(states) > _MAX_STATES:
        raise v.fail(f"{name}.states", f"lists {len(states)} states, more than {_MAX_STATES}")
    out_states: dict[str, Any] = {}
    for state, fact in states.items():
        where = f"{name}.states[{state[:40]!r}]"
        if not isinstance(state, str) or not 0 < len(state) <= 200:
            raise v.fail(where, "a state name is a string of 1 to 200 characters")
        f = v.obj(fact, where)
        ttl = f.get("ttl")
        if ttl is not None:  # a restore sweeps by it
            ttl = _ttl_from_json(v, ttl, where, repr)
        out_states[state] = {"kind": v.string(f, "kind", where)[:40], "ttl": ttl,
                             "entries": v.integer(f, "entries", where)}
        if f.get("codec") is not None:  # a restore evolves an undeclared RecordCodec state by it
            codec = codec_from_json(v, f["codec"], f"{where}.codec")
            if codec["type"] != "record":
                raise v.fail(f"{where}.codec", f"only a record codec is recorded here, got {codec['type']!r}")
            out_states[state]["codec"] = codec
    timers = v.obj(v.get(obj, "timers", name), f"{name}.timers")
    earliest = timers.get("earliest")
    if earliest is not None and (isinstance(earliest, bool) or not isinstance(earliest, int)):
        raise v.fail(f"{name}.timers.earliest", f"must be an integer or null, got {earliest!r}")
    return {
        "states": out_states,
        "timers": {"pending": v.integer(timers, "pending", f"{name}.timers"), "earliest": earliest,
                   "fired": v.integer(timers, "fired", f"{name}.timers")},
        "expired_removed": v.integer(obj, "expired_removed", name),
    }


def declarations_from_json(v: Validator, raw: Any, name: str) -> dict[str, Any]:
    """An operator's declared states, checked field by field (a restore builds codecs from them)."""
    obj = v.obj(raw, name)
    if len(obj) > _MAX_STATES:
        raise v.fail(name, f"lists {len(obj)} states, more than {_MAX_STATES}")
    out: dict[str, Any] = {}
    for state, decl in obj.items():
        where = f"{name}[{state[:40]!r}]"
        if not 0 < len(state) <= 200 or state == "default":
            raise v.fail(where, "a state name is a string of 1 to 200 characters, not 'default'")
        try:
            check_encodable(state)
        except ValueError as e:
            raise v.fail(where, str(e)) from None
        d = v.obj(decl, where)
        key_type = d.get("key_type")
        if key_type is not None:
            key_type = v.string(d, "key_type", where)
            if not _TYPE_NAME.fullmatch(key_type):
                raise v.fail(f"{where}.key_type", f"is not an Arrow type name: {key_type[:80]!r}")
        ttl = d.get("ttl")
        if ttl is not None:
            ttl = _ttl_from_json(v, ttl, where, lambda seconds: repr(str(seconds)[:80]))
        out[state] = {"kind": v.string(d, "kind", where, choices=STATE_KINDS), "key_type": key_type, "ttl": ttl,
                      "codec": codec_from_json(v, v.get(d, "codec", where), f"{where}.codec")}
    return out


def _ttl_from_json(v: Validator, raw: Any, where: str, shown: Callable[[Any], str]) -> dict[str, Any]:
    """A state's TTL: only what `StateTtl` takes. `shown` quotes a bad `seconds` in the error."""
    t = v.obj(raw, f"{where}.ttl")
    seconds = t.get("seconds")
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < float("inf"):
        raise v.fail(f"{where}.ttl.seconds", f"must be a positive number, got {shown(seconds)}")
    return {"seconds": seconds, "update": v.string(t, "update", f"{where}.ttl", choices=TTL_UPDATES),
            "clock": v.string(t, "clock", f"{where}.ttl", choices=TTL_CLOCKS)}


def codec_from_json(v: Validator, raw: Any, name: str) -> dict[str, Any]:
    c = v.obj(raw, name)
    kind = v.string(c, "type", name, choices=CODEC_TYPES)
    if kind == "struct":
        fmt = v.string(c, "format", name)
        if len(fmt) > 200:
            raise v.fail(f"{name}.format", "is longer than 200 characters")
        return {"type": kind, "format": fmt}
    if kind == "custom":
        cls = v.string(c, "class", name)
        if len(cls) > 300:
            raise v.fail(f"{name}.class", "is longer than 300 characters")
        return {"type": kind, "class": cls}
    if kind != "record":
        return {"type": kind}
    fields = v.array(c, "fields", name)
    if not 0 < len(fields) <= _MAX_FIELDS:
        raise v.fail(f"{name}.fields", f"must list 1 to {_MAX_FIELDS} fields, got {len(fields)}")
    pairs = []
    for i, pair in enumerate(fields):
        where = f"{name}.fields[{i}]"
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(x, str) and 0 < len(x) <= 200
                                                                  for x in pair)):
            raise v.fail(where, "must be a [name, Arrow type] pair of strings")
        if not _TYPE_NAME.fullmatch(pair[1]):
            raise v.fail(where, f"has type {pair[1][:80]!r}, which is not an Arrow type name")
        try:
            check_encodable(pair[0])
        except ValueError as e:
            raise v.fail(where, str(e)) from None
        pairs.append([pair[0], pair[1]])
    names = [p[0] for p in pairs]
    if len(set(names)) != len(names):
        raise v.fail(f"{name}.fields", "names a field twice")
    defaults = v.obj(c.get("defaults") or {}, f"{name}.defaults")
    for field_name, value in defaults.items():
        if field_name not in names:
            raise v.fail(f"{name}.defaults", f"gives a default for {field_name[:80]!r}, which is not a field")
        if not (value is None or isinstance(value, (str, bool, int))
                or (isinstance(value, float) and math.isfinite(value))):
            raise v.fail(f"{name}.defaults.{field_name[:80]}", f"must be a JSON scalar, got {str(value)[:80]!r}")
        if isinstance(value, str):
            try:
                check_encodable(value)
            except ValueError as e:
                raise v.fail(f"{name}.defaults.{field_name[:80]}", str(e)) from None
    return {"type": kind, "fields": pairs, "defaults": dict(defaults)}
