"""Explicit, versioned value encodings for state (never pickle).

Every encoded value starts with one version byte, so a codec can change its layout later and
still read what older checkpoints hold.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

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
    """Fixed-width records (struct format such as '<qddd'), decoded as tuples."""

    fmt: str
    version: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "_struct", struct.Struct(self.fmt))

    def encode(self, value: Any) -> bytes:
        return bytes([self.version]) + self._struct.pack(*value)  # type: ignore[attr-defined, no-any-return]

    def decode(self, data: bytes) -> Any:
        _check_version(data, self.version, f"struct {self.fmt}")
        return self._struct.unpack_from(data, 1)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class JsonCodec:
    """Any JSON value; flexible, slower than StructCodec."""

    version: int = 1

    def encode(self, value: Any) -> bytes:
        return bytes([self.version]) + json.dumps(value, separators=(",", ":"), allow_nan=False).encode()

    def decode(self, data: bytes) -> Any:
        _check_version(data, self.version, "json")
        return json.loads(data[1:])


@dataclass(frozen=True)
class BytesCodec:
    """Raw bytes (no version byte: the caller owns the layout)."""

    def encode(self, value: bytes) -> bytes:
        return bytes(value)

    def decode(self, data: bytes) -> bytes:
        return bytes(data)


EMPTY = BytesCodec()
