"""Explicit, versioned value encodings for state (never pickle).

Every encoded value starts with one version byte, so a codec can change its layout later and
still read what older checkpoints hold.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from sparkpoint.lazy import lazy_module

if TYPE_CHECKING:
    import numpy as np
else:
    np = lazy_module("numpy")

T = TypeVar("T")


class Codec(Protocol[T]):
    def encode(self, value: T) -> bytes: ...
    def decode(self, data: bytes) -> T: ...


class StateFormatError(ValueError):
    """A stored value was written by a codec version this code cannot read."""


def _check_version(data: bytes, version: int, name: str) -> None:
    if not data or data[0] != version:
        found = data[0] if data else None
        raise StateFormatError(f"{name} value has format version {found}, this code reads {version}")


@dataclass(frozen=True)
class StructCodec(Generic[T]):
    """Fixed-width records (a `struct` format such as `"<qddd"`), decoded as tuples: the fastest codec.

    A value is a tuple of numbers as the format says; `decode_many` / `encode_many` turn whole
    batches into NumPy records and back (fields `f0`, `f1`, ...), for vectorized operators
    (`ValueState.update_many_encoded`).

    StructCodec cannot evolve: its records are positional bytes; use RecordCodec for fields that change

    Example:
        ```python
        TOTALS = StructCodec("<qd")                  # count (int64), sum (float64)
        totals = state.value_state("totals", TOTALS)
        totals.put("ann", (3, 12.5))
        ```

    Args:
        fmt: a `struct` format with a byte order first (`<`, `>`, `=` or `!`).
        version: the format version byte stored before each value.
    """

    fmt: str
    version: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "_struct", struct.Struct(self.fmt))

    def __reduce__(self) -> tuple[Any, ...]:  # a struct.Struct does not pickle: Spark ships operators pickled
        return (type(self), (self.fmt, self.version))

    def encode(self, value: Any) -> bytes:
        """One value (a tuple of the format's fields) as stored: the version byte, then the record.

        Example:
            ```python
            StructCodec("<q").encode((3,))          # b"\x01\x03\x00\x00\x00\x00\x00\x00\x00"
            ```

        Args:
            value: a tuple (or sequence) of the format's fields.

        Returns:
            The stored bytes.
        """
        return bytes([self.version]) + self._struct.pack(*value)  # type: ignore[attr-defined, no-any-return]

    def decode(self, data: bytes) -> Any:
        """One stored value back as a tuple.

        Example:
            ```python
            COUNT.decode(COUNT.encode((3,)))         # (3,)
            ```

        Args:
            data: the stored bytes.

        Returns:
            The tuple of the format's fields.

        Raises:
            StateFormatError: the value was written by another format version.
        """
        _check_version(data, self.version, f"struct {self.fmt}")
        return self._struct.unpack_from(data, 1)  # type: ignore[attr-defined]

    @property
    def dtype(self) -> np.dtype:
        """The records as a packed NumPy structured dtype, fields `f0`, `f1`, ... (the version byte left out).

        Example:
            ```python
            StructCodec("<qd").dtype       # dtype([('f0', '<i8'), ('f1', '<f8')])
            ```
        """
        order, codes = self.fmt[:1], self.fmt[1:]
        if order not in ("<", ">", "=", "!") or not codes or any(c not in _NUMPY_CODES for c in codes):
            raise ValueError(f"struct format {self.fmt!r} has no numpy dtype: give a byte order and any of "
                             f"{''.join(_NUMPY_CODES)}")
        endian = {"<": "<", ">": ">", "!": ">", "=": "="}[order]
        return np.dtype([(f"f{i}", endian + _NUMPY_CODES[c]) for i, c in enumerate(codes)])

    def decode_many(self, values: Sequence[bytes | None]) -> tuple[np.ndarray, np.ndarray]:
        """Many stored values at once, as NumPy records.

        Absent values (None) are zero records with `present` False. Every value must be one record of
        this codec's version.

        Example:
            ```python
            old, present = COUNT.decode_many(stored)      # stored: what update_many_encoded passes
            old["f0"] += counts.to_numpy()
            ```

        Args:
            values: stored values, None where a key has none.

        Returns:
            (records, present): a structured array of `dtype`, and a bool array.

        Raises:
            StateFormatError: a value of another width or format version.
        """
        dtype = self.dtype
        present = np.fromiter((v is not None for v in values), dtype=bool, count=len(values))
        records = np.zeros(len(values), dtype=dtype)
        stored = [v for v in values if v is not None]
        if stored:
            width = 1 + dtype.itemsize
            # Each value on its own: a short one next to a long one must not shift every record after it.
            if any(len(v) != width for v in stored):
                bad = next(len(v) for v in stored if len(v) != width)
                raise StateFormatError(f"struct {self.fmt} values must be {width} bytes each, one is {bad}")
            raw = np.frombuffer(b"".join(stored), dtype=np.dtype([("version", "u1"), ("record", dtype)]))
            if (raw["version"] != self.version).any():
                bad = int(raw["version"][raw["version"] != self.version][0])
                raise StateFormatError(f"struct {self.fmt} value has format version {bad}, this code reads "
                                       f"{self.version}")
            records[present] = raw["record"]
        return records, present

    def encode_many(self, records: np.ndarray) -> list[bytes]:
        """Records of `dtype` (or anything NumPy casts to it), encoded one value each.

        Example:
            ```python
            new_values = COUNT.encode_many(old)        # what update_many_encoded's fn returns
            ```

        Args:
            records: a structured array (or array-like) of the codec's fields.

        Returns:
            One stored value per record.
        """
        out = np.empty(len(records), dtype=np.dtype([("version", "u1"), ("record", self.dtype)]))
        out["version"] = self.version
        out["record"] = records
        blob, width = out.tobytes(), out.dtype.itemsize
        return [blob[i : i + width] for i in range(0, len(blob), width)]


_NUMPY_CODES = {"b": "i1", "B": "u1", "?": "b1", "h": "i2", "H": "u2", "i": "i4", "I": "u4", "l": "i4", "L": "u4",
                "q": "i8", "Q": "u8", "e": "f2", "f": "f4", "d": "f8"}


@dataclass(frozen=True)
class JsonCodec:
    """Any JSON value (numbers, strings, lists, dicts, None); flexible, slower than StructCodec.

    Its values keep working across any change of shape: old and new shapes live side by side, and
    the code reads them as it can.

    Example:
        ```python
        last = state.value_state("last_click", JsonCodec())
        last.put("ann", {"page": "/cart", "at": "2026-01-01T10:00:00Z"})
        ```

    Args:
        version: the format version byte stored before each value.
    """

    version: int = 1

    def encode(self, value: Any) -> bytes:
        """One JSON value as stored: the version byte, then compact JSON (UTF-8; NaN refused).

        Example:
            ```python
            JsonCodec().encode({"page": "/"})          # b'\x01{"page":"/"}'
            ```

        Args:
            value: any JSON value.

        Returns:
            The stored bytes.
        """
        return bytes([self.version]) + json.dumps(value, separators=(",", ":"), allow_nan=False).encode()

    def decode(self, data: bytes) -> Any:
        """One stored value back as its JSON value.

        Example:
            ```python
            JsonCodec().decode(b'\x01{"page":"/"}')     # {"page": "/"}
            ```

        Args:
            data: the stored bytes.

        Returns:
            The JSON value (dicts, lists, str, int, float, bool, None).

        Raises:
            StateFormatError: the value was written by another format version.
        """
        _check_version(data, self.version, "json")
        return json.loads(data[1:])


@dataclass(frozen=True)
class BytesCodec:
    """Raw bytes, stored as they are (no version byte: the caller owns the layout).

    The cheapest value for sets ("seen before?"), where only the key matters.

    Example:
        ```python
        seen = state.map_state("pages", BytesCodec())
        seen.put_absent([("ann", "/cart", b"")])
        ```
    """

    def encode(self, value: bytes) -> bytes:
        """The value as stored: the same bytes.

        Example:
            ```python
            BytesCodec().encode(b"x")       # b"x"
            ```

        Args:
            value: bytes (or a bytes-like object).

        Returns:
            The stored bytes.
        """
        return bytes(value)

    def decode(self, data: bytes) -> bytes:
        """The stored bytes, as they are.

        Example:
            ```python
            BytesCodec().decode(b"x")       # b"x"
            ```

        Args:
            data: the stored bytes.

        Returns:
            The same bytes.
        """
        return bytes(data)


EMPTY = BytesCodec()
