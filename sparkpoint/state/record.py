"""`RecordCodec`: named, typed fields (Arrow type names) whose schema is recorded in `_metadata`,
so that a restore reads old entries in a new shape (`sparkpoint.state.schema`).

One stored value, little-endian:

    version(1) | validity bitmap (1 bit per field, 1 = valid) | fixed part | variable part

The fixed part holds every field in order, each at its width (a string or binary field holds its
length as four bytes there); the variable part the bytes of the string and binary fields, in
order. A record of numbers only has one width, so a batch decodes with one `np.frombuffer`, as
`StructCodec` does; strings are gathered into Arrow arrays with index arithmetic, never row by row.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sparkpoint.lazy import lazy_module
from sparkpoint.state.codecs import StateFormatError

if TYPE_CHECKING:
    import numpy as np
    import pandas as pd
    import pyarrow as pa
else:
    np = lazy_module("numpy")
    pd = lazy_module("pandas")
    pa = lazy_module("pyarrow")

VERSION = 1
_FIXED = {  # type name -> (numpy dtype, struct code)
    "int8": ("i1", "b"), "int16": ("i2", "h"), "int32": ("i4", "i"), "int64": ("i8", "q"),
    "uint8": ("u1", "B"), "uint16": ("u2", "H"), "uint32": ("u4", "I"), "uint64": ("u8", "Q"),
    "float32": ("f4", "f"), "float64": ("f8", "d"), "bool": ("u1", "?"),
}
_VARIABLE = ("string", "binary")
_ALIASES = {"float": "float32", "double": "float64", "boolean": "bool", "utf8": "string", "str": "string",
            "bytes": "binary", "halffloat": "float16"}
_TIMESTAMP = re.compile(r"timestamp\[(s|ms|us|ns)(?:,\s*tz=([^\]\s]+))?\]")
_PER_NS = {"s": 1_000_000_000, "ms": 1_000_000, "us": 1_000, "ns": 1}
TYPE_NAMES = (*_FIXED, "timestamp[<unit>]", "timestamp[<unit>, tz=<zone>]", *_VARIABLE)


class RecordSchemaError(ValueError):
    """A RecordCodec's fields or defaults cannot be used (unknown type, bad default)."""


@dataclass(frozen=True)
class RecordField:
    """One field: its name, canonical Arrow type name and whether it may be null."""

    name: str
    type: str
    nullable: bool = True

    @property
    def text(self) -> str:
        """As `_metadata` and messages write it: `int64`, `int64 not null`."""
        return self.type if self.nullable else f"{self.type} not null"

    @property
    def variable(self) -> bool:
        return self.type in _VARIABLE

    @property
    def timestamp(self) -> tuple[str, str | None] | None:
        m = _TIMESTAMP.fullmatch(self.type)
        return (m.group(1), m.group(2)) if m else None

    @property
    def arrow_type(self) -> pa.DataType:
        ts = self.timestamp
        if ts is not None:
            return pa.timestamp(ts[0], tz=ts[1])
        if self.type == "string":
            return pa.string()
        if self.type == "binary":
            return pa.binary()
        if self.type == "bool":
            return pa.bool_()
        return pa.from_numpy_dtype(np.dtype(_FIXED[self.type][0]))

    @property
    def numpy_code(self) -> str:
        """The field's slot in the fixed part, as a numpy dtype."""
        if self.variable:
            return "<u4"
        return "<i8" if self.timestamp else "<" + _FIXED[self.type][0]


def parse_field(name: str, text: str) -> RecordField:
    """`"int64"`, `"float64 not null"`, `"timestamp[us, tz=UTC]"` -> a RecordField (Arrow type names)."""
    if not isinstance(name, str) or not name:
        raise RecordSchemaError(f"a RecordCodec field name is a non-empty string, got {name!r}")
    if not isinstance(text, str):
        raise RecordSchemaError(f"field {name!r}: the type is an Arrow type name (a string), got {text!r}")
    raw = " ".join(text.strip().split())
    nullable = not raw.endswith(" not null")
    raw = raw.removesuffix(" not null").strip()
    raw = _ALIASES.get(raw, raw)
    ts = _TIMESTAMP.fullmatch(raw)
    if ts is not None:
        raw = f"timestamp[{ts.group(1)}]" if ts.group(2) is None else f"timestamp[{ts.group(1)}, tz={ts.group(2)}]"
    elif raw not in _FIXED and raw not in _VARIABLE:
        raise RecordSchemaError(f"field {name!r} has type {text!r}; RecordCodec knows {', '.join(TYPE_NAMES)}")
    return RecordField(name, raw, nullable)


def _fields_of(fields: Any) -> tuple[RecordField, ...]:
    if isinstance(fields, pa.Schema):
        pairs = [(f.name, arrow_type_name(f.type) + ("" if f.nullable else " not null")) for f in fields]
    elif isinstance(fields, Mapping):
        pairs = list(fields.items())
    else:
        pairs = [tuple(p) for p in fields]
    out = tuple(parse_field(*p) for p in pairs)
    names = [f.name for f in out]
    if not out:
        raise RecordSchemaError("a RecordCodec needs at least one field")
    if len(set(names)) != len(names):
        raise RecordSchemaError(f"RecordCodec field names must be unique, got {names}")
    return out


def arrow_type_name(t: pa.DataType) -> str:
    """An Arrow type by the name RecordCodec fields and `KeyedOperator.key_type` use."""
    if pa.types.is_timestamp(t):
        return f"timestamp[{t.unit}]" if t.tz is None else f"timestamp[{t.unit}, tz={t.tz}]"
    if pa.types.is_floating(t):
        return f"float{t.bit_width}"
    if pa.types.is_string(t):
        return "string"
    if pa.types.is_boolean(t):
        return "bool"
    return str(t)


class RecordCodec:
    """Named, typed fields: a value is a dict of field -> value, stored compactly, with its
    schema recorded in `_metadata` so the fields can evolve across a restore.

        from sparkpoint import RecordCodec, KeyedOperator

        totals = RecordCodec({"clicks": "int64", "spend": "float64", "last": "timestamp[us]",
                              "tier": "string"}, defaults={"tier": "free"})
        op = KeyedOperator(..., states={"totals": totals})
        # in process(batch, state):
        s = state.value_state("totals", totals)
        s.put("u1", {"clicks": 3, "spend": 1.5})         # last: None, tier: "free"
        s.get("u1")["clicks"]                             # 3
        old = s.get_many_table(keys)                      # an Arrow table, one row per key
        s.put_many_table(keys, new_table)                 # a table or DataFrame with the fields

    A field not given is its default, else None; `"int64 not null"` refuses None. Types are Arrow
    type names: int8..int64, uint8..uint64, float32, float64, bool, string, binary,
    timestamp[s|ms|us|ns] with an optional `, tz=<zone>`. Across a restore with changed fields,
    adding a field (null, or its default), removing one, widening (int32 -> int64, float32 ->
    float64, int -> float64), reordering and making a field nullable all work: the restore
    rewrites the state's entries in the new shape. Anything else is refused before Spark starts.

    Args:
        fields: field -> Arrow type name (a mapping, (name, type) pairs, or a `pyarrow.Schema`).
        defaults: field -> the value a field not given takes (also what entries written before
            the field was added read as).

    Raises:
        RecordSchemaError: an unknown type, duplicate names, or a default the field cannot hold.
    """

    def __init__(self, fields: Any, defaults: Mapping[str, Any] | None = None):
        self.fields = _fields_of(fields)
        self.names = tuple(f.name for f in self.fields)
        defaults = dict(defaults or {})
        unknown = sorted(set(defaults) - set(self.names))
        if unknown:
            raise RecordSchemaError(f"RecordCodec defaults name fields it does not have: {', '.join(unknown)}")
        self._nbitmap = (len(self.fields) + 7) // 8
        self._fixed = np.dtype([(f"f{i}", f.numpy_code) for i, f in enumerate(self.fields)])
        self._struct = struct.Struct("<" + "".join(_struct_code(f) for f in self.fields))
        self._width = 1 + self._nbitmap + self._fixed.itemsize
        self._variable = [i for i, f in enumerate(self.fields) if f.variable]
        self._row = np.dtype([("version", "u1"), ("valid", "u1", (self._nbitmap,)), ("fixed", self._fixed)])
        self.defaults: dict[str, Any] = {}
        for name, value in defaults.items():
            field = self.fields[self.names.index(name)]
            try:
                self.defaults[name] = _to_python(field, _to_stored(field, value))
            except (TypeError, ValueError, OverflowError, struct.error) as e:
                raise RecordSchemaError(f"default of field {name!r} ({field.text}): {e}") from None

    def __repr__(self) -> str:
        fields = ", ".join(f"{f.name!r}: {f.text!r}" for f in self.fields)
        return f"RecordCodec({{{fields}}}" + (f", defaults={self.defaults!r})" if self.defaults else ")")

    def __reduce__(self) -> tuple[Any, ...]:  # Spark ships operators pickled; a struct.Struct does not pickle
        return (type(self), ([(f.name, f.text) for f in self.fields], self.defaults))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RecordCodec) and self.spec() == other.spec()

    def __hash__(self) -> int:
        return hash((self.fields, tuple(sorted(map(repr, self.defaults.items())))))

    @property
    def schema(self) -> pa.Schema:
        """The fields as an Arrow schema (what `get_many_table` returns)."""
        return pa.schema([pa.field(f.name, f.arrow_type, nullable=f.nullable) for f in self.fields])

    def spec(self) -> dict[str, Any]:
        """What `_metadata` records of this codec."""
        return {"type": "record", "fields": [[f.name, f.text] for f in self.fields],
                "defaults": {k: _json_default(self.fields[self.names.index(k)], v) for k, v in self.defaults.items()}}

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> RecordCodec:
        fields = [parse_field(name, text) for name, text in spec["fields"]]
        defaults = {k: _from_json_default(fields[[f.name for f in fields].index(k)], v)
                    for k, v in (spec.get("defaults") or {}).items() if k in {f.name for f in fields}}
        return cls([(f.name, f.text) for f in fields], defaults)

    # --- one value -----------------------------------------------------------------------------------

    def encode(self, value: Mapping[str, Any]) -> bytes:
        """One value (a dict of field -> value) as stored; a field not given is its default, else None.

        Example:
            ```python
            codec = RecordCodec({"clicks": "int64", "tier": "string"}, defaults={"tier": "free"})
            codec.decode(codec.encode({"clicks": 3}))       # {"clicks": 3, "tier": "free"}
            ```

        Args:
            value: field -> value (a `Mapping`).

        Returns:
            The stored bytes.

        Raises:
            TypeError: the value is not a mapping.
            ValueError: a field the codec lacks, None for a ` not null` field, or a value the field cannot hold.
        """
        if not isinstance(value, Mapping):
            raise TypeError(f"a RecordCodec value is a dict of field -> value, got {type(value).__name__}")
        extra = set(value) - set(self.names)
        if extra:
            raise ValueError(f"record has fields {sorted(extra)} that the RecordCodec lacks ({', '.join(self.names)})")
        bits = 0
        slots: list[Any] = []
        tail: list[bytes] = []
        for i, f in enumerate(self.fields):
            v = value[f.name] if f.name in value else self.defaults.get(f.name)
            if v is None:
                if not f.nullable:
                    raise ValueError(f"field {f.name!r} is {f.text}, got None")
                slots.append(False if f.type == "bool" else 0)
                continue
            bits |= 1 << i
            stored = _to_stored(f, v)
            if f.variable:
                tail.append(stored)
                slots.append(len(stored))
            else:
                slots.append(stored)
        try:
            fixed = self._struct.pack(*slots)
        except struct.error as e:
            raise ValueError(f"record {dict(value)!r} does not fit {self!r}: {e}") from None
        head = bytes([VERSION]) + bits.to_bytes(self._nbitmap, "little") + fixed
        return head + b"".join(tail) if tail else head

    def decode(self, data: bytes) -> dict[str, Any]:
        """One stored value back as a dict of every field.

        Example:
            ```python
            codec.decode(stored)          # {"clicks": 3, "tier": "free"}
            ```

        Args:
            data: the stored bytes.

        Returns:
            Field -> value (None for a null field).

        Raises:
            StateFormatError: a value of another format version, or written with other fields by a state
                that was not declared (declare it to let its fields evolve).
        """
        if not data or data[0] != VERSION:
            raise StateFormatError(f"record value has format version {data[0] if data else None}, this code "
                                   f"reads {VERSION}")
        if len(data) < self._width:
            raise StateFormatError(f"record value of {len(data)} bytes is shorter than its fields' {self._width}: "
                                   "was it written with other fields? Declare the state to let it evolve")
        bits = int.from_bytes(data[1 : 1 + self._nbitmap], "little")
        slots = self._struct.unpack_from(data, 1 + self._nbitmap)
        out: dict[str, Any] = {}
        at = self._width
        for i, (f, s) in enumerate(zip(self.fields, slots, strict=True)):
            if f.variable:
                raw = data[at : at + s]
                at += s
                out[f.name] = _to_python(f, raw) if bits >> i & 1 else None
            else:
                out[f.name] = _to_python(f, s) if bits >> i & 1 else None
        if at != len(data):
            raise StateFormatError(f"record value is {len(data)} bytes, its fields take {at}: was it written with "
                                   "other fields? Declare the state to let it evolve")
        return out

    # --- many values, columnar -------------------------------------------------------------------

    def decode_table(self, values: Sequence[bytes | None]) -> pa.Table:
        """Many stored values at once, as an Arrow table with one row per value (None: every field null).

        What `ValueState.get_many_table` uses; decoded without a Python loop over the rows.

        Example:
            ```python
            codec.decode_table([codec.encode({"clicks": 3}), None]).to_pylist()
            # [{"clicks": 3, "tier": "free"}, {"clicks": None, "tier": None}]
            ```

        Args:
            values: stored values, None where a key has none.

        Returns:
            A `pyarrow.Table` of the codec's fields (every column nullable).

        Raises:
            StateFormatError: a value of another format version or other fields.
        """
        present = [v for v in values if v is not None]
        table = self._decode_present(present)
        if len(present) == len(values):
            return table
        index, at = [], 0
        for v in values:
            index.append(None if v is None else at)
            at += v is not None
        return table.take(pa.array(index, type=pa.int64()))

    def _decode_present(self, values: list[bytes]) -> pa.Table:
        n = len(values)
        lengths = np.fromiter(map(len, values), dtype=np.int64, count=n)
        blob = np.frombuffer(b"".join(values), dtype=np.uint8)
        if self._variable:
            if n and (lengths < self._width).any():
                raise StateFormatError(f"a record value is shorter than its fields' {self._width} bytes")
            starts = np.cumsum(lengths) - lengths
            rows = blob[starts[:, None] + np.arange(self._width)].view(self._row).reshape(n)
        else:
            if n and (lengths != self._width).any():
                bad = int(lengths[lengths != self._width][0])
                raise StateFormatError(f"record values are {self._width} bytes each, one is {bad}: was it written "
                                       "with other fields? Declare the state to let it evolve")
            rows = blob.view(self._row) if n else np.zeros(0, self._row)
        if n and (rows["version"] != VERSION).any():
            raise StateFormatError(f"record value has format version {int(rows['version'][0])}, this code reads "
                                   f"{VERSION}")
        valid = np.unpackbits(rows["valid"], axis=1, count=len(self.fields), bitorder="little").astype(bool)
        columns = []
        var_at = starts + self._width if self._variable else None
        for i, f in enumerate(self.fields):
            slot = rows["fixed"][f"f{i}"]
            mask = pa.py_buffer(np.packbits(valid[:, i], bitorder="little").tobytes())
            if f.variable:
                assert var_at is not None
                sizes = slot.astype(np.int64)
                offsets = np.zeros(n + 1, dtype=np.int64)
                np.cumsum(sizes, out=offsets[1:])
                if offsets[-1] >= 1 << 31:
                    raise StateFormatError(f"field {f.name!r}: more than 2 GB of text in one read; read fewer keys")
                index = np.repeat(var_at - offsets[:-1], sizes) + np.arange(offsets[-1])
                data = pa.py_buffer(blob[index].tobytes())
                columns.append(pa.Array.from_buffers(f.arrow_type, n, [mask, pa.py_buffer(
                    offsets.astype(np.int32).tobytes()), data]))
                var_at = var_at + sizes
            elif f.type == "bool":
                columns.append(pa.Array.from_buffers(pa.bool_(), n, [mask, pa.py_buffer(
                    np.packbits(slot.astype(bool), bitorder="little").tobytes())]))
            else:
                columns.append(pa.Array.from_buffers(f.arrow_type, n, [mask, pa.py_buffer(
                    np.ascontiguousarray(slot).tobytes())]))
        if var_at is not None and n and not np.array_equal(var_at, starts + lengths):
            raise StateFormatError("a record value's length does not match its fields: was it written with other "
                                   "fields? Declare the state to let it evolve")
        # Nullable whatever the fields say: a key without a value reads as a row of nulls.
        return pa.Table.from_arrays(columns, schema=pa.schema([pa.field(f.name, f.arrow_type) for f in self.fields]))

    def encode_table(self, table: Any) -> list[bytes]:
        """A table's rows encoded one value each (what `ValueState.put_many_table` writes).

        Example:
            ```python
            codec.encode_table(pd.DataFrame({"clicks": [3, 4]}))      # two values, tier "free"
            ```

        Args:
            table: an Arrow table, a pandas DataFrame or a dict of columns named as the fields; a missing
                column is its default or null.

        Returns:
            One stored value per row.

        Raises:
            ValueError: a column the codec lacks, or a value a field cannot hold.
        """
        table = _as_table(table)
        n = table.num_rows
        extra = set(table.column_names) - set(self.names)
        if extra:
            raise ValueError(f"table has columns {sorted(extra)} that the RecordCodec lacks ({', '.join(self.names)})")
        rows = np.zeros(n, dtype=self._row)
        rows["version"] = VERSION
        valid = np.zeros((n, len(self.fields)), dtype=bool)
        tails: list[tuple[np.ndarray, np.ndarray]] = []  # (offsets, data) per variable field
        for i, f in enumerate(self.fields):
            column = self._column(table, f, n)
            ok = np.asarray(column.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
            if not f.nullable and not ok.all():
                raise ValueError(f"field {f.name!r} is {f.text}, the table has nulls in it")
            valid[:, i] = ok
            if f.variable:
                filled = column.fill_null(b"" if f.type == "binary" else "")
                buffers = filled.buffers()
                offsets = np.frombuffer(buffers[1], dtype=np.int32)[filled.offset : filled.offset + n + 1]
                offsets = offsets.astype(np.int64)
                data = np.frombuffer(buffers[2], dtype=np.uint8) if buffers[2] is not None else np.zeros(0, np.uint8)
                rows["fixed"][f"f{i}"] = np.diff(offsets)
                tails.append((offsets, data))
            elif f.timestamp:
                rows["fixed"][f"f{i}"] = column.cast(pa.int64()).fill_null(0).to_numpy(zero_copy_only=False)
            elif f.type == "bool":
                rows["fixed"][f"f{i}"] = column.fill_null(False).to_numpy(zero_copy_only=False)
            else:
                rows["fixed"][f"f{i}"] = column.fill_null(0).to_numpy(zero_copy_only=False)
        rows["valid"] = np.packbits(valid, axis=1, bitorder="little").reshape(n, self._nbitmap)
        head = rows.tobytes()
        w = self._width
        if not tails:
            return [head[i : i + w] for i in range(0, len(head), w)]
        sizes = sum(np.diff(o) for o, _ in tails)
        ends = np.cumsum(w + sizes)
        out = np.empty(int(ends[-1]) if n else 0, dtype=np.uint8)
        starts = ends - (w + sizes)
        out[(starts[:, None] + np.arange(w)).ravel()] = np.frombuffer(head, dtype=np.uint8)
        at = starts + w
        for offsets, data in tails:
            lengths = np.diff(offsets)
            total = int(offsets[-1] - offsets[0])
            within = np.arange(total) - np.repeat(offsets[:-1] - offsets[0], lengths)
            out[np.repeat(at, lengths) + within] = data[offsets[0] : offsets[-1]]
            at = at + lengths
        blob = out.tobytes()
        bounds = np.concatenate([[0], ends]).tolist()
        return [blob[bounds[i] : bounds[i + 1]] for i in range(n)]

    def _column(self, table: pa.Table, f: RecordField, n: int) -> pa.Array:
        if f.name not in table.column_names:
            default = self.defaults.get(f.name)
            if default is None and not f.nullable:
                raise ValueError(f"field {f.name!r} is {f.text} and has no default; the table lacks it")
            return pa.array([default] * n, type=f.arrow_type)
        column = table.column(f.name).combine_chunks()
        try:
            return column.cast(f.arrow_type, safe=True)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            raise ValueError(f"column {f.name!r} ({column.type}) does not fit field {f.text}: {e}") from None


def _struct_code(f: RecordField) -> str:
    if f.variable:
        return "I"
    return "q" if f.timestamp else _FIXED[f.type][1]


def _as_table(table: Any) -> pa.Table:
    if isinstance(table, pa.Table):
        return table
    if isinstance(table, pa.RecordBatch):
        return pa.Table.from_batches([table])
    if isinstance(table, pd.DataFrame):
        return pa.Table.from_pandas(table, preserve_index=False)
    if isinstance(table, Mapping):
        return pa.table({k: v if isinstance(v, (pa.Array, pa.ChunkedArray)) else pa.array(v) for k, v in table.items()})
    raise TypeError(f"a table is a pyarrow Table, a pandas DataFrame or a dict of columns, got {type(table).__name__}")


def _to_stored(f: RecordField, v: Any) -> Any:
    """A Python value as the field's slot holds it (bytes for strings and binary)."""
    ts = f.timestamp
    if ts is not None:
        if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
            return int(v)
        stamp = pd.Timestamp(v)
        if stamp.tzinfo is not None:
            stamp = stamp.tz_convert("UTC").tz_localize(None)
        return int(stamp.as_unit("ns").value) // _PER_NS[ts[0]]
    if f.type == "string":
        if not isinstance(v, str):
            raise TypeError(f"field {f.name!r} is a string, got {type(v).__name__} {v!r}")
        return v.encode("utf-8")
    if f.type == "binary":
        if not isinstance(v, (bytes, bytearray, memoryview)):
            raise TypeError(f"field {f.name!r} is binary, got {type(v).__name__}")
        return bytes(v)
    if f.type == "bool":
        return bool(v)
    if f.type.startswith("float"):
        return float(v)
    if isinstance(v, (float, np.floating)) and not float(v).is_integer():
        raise TypeError(f"field {f.name!r} is {f.type}, got {v!r}")
    return int(v)  # out of the type's range: struct.error on packing


def _to_python(f: RecordField, s: Any) -> Any:
    ts = f.timestamp
    if ts is not None:
        stamp = pd.Timestamp(int(s), unit=ts[0])
        return stamp.tz_localize("UTC").tz_convert(ts[1]) if ts[1] else stamp
    if f.type == "string":
        return bytes(s).decode("utf-8")
    if f.type == "binary":
        return bytes(s)
    if f.type == "bool":
        return bool(s)
    return s


def _json_default(f: RecordField, v: Any) -> Any:
    """A default as JSON: timestamps as their integer units, binary as hex."""
    if f.timestamp:
        return _to_stored(f, v)
    if f.type == "binary":
        return bytes(v).hex()
    return v


def _from_json_default(f: RecordField, v: Any) -> Any:
    if v is None:
        return None
    if f.timestamp:
        return _to_python(f, v)
    if f.type == "binary":
        return bytes.fromhex(v)
    return v
