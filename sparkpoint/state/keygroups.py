"""Keys -> key groups -> subtasks: the stable mapping that makes rescaling possible.

A key's group is a stable hash of its bytes (CRC32 with a MurmurHash3 finalizer), never Python's
randomized `hash()`. Subtask i of P owns a contiguous range of groups (Flink's formula).
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from sparkpoint.checkpoint.metadata import KeyGroupRange
from sparkpoint.lazy import lazy_module

if TYPE_CHECKING:
    import numpy as np
    import pandas as pd
    import pyarrow as pa
else:
    np = lazy_module("numpy")
    pd = lazy_module("pandas")
    pa = lazy_module("pyarrow")

MAX_KEY_GROUPS = 1 << 15  # two bytes of prefix, Flink's upper bound


def _fmix32(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    h ^= h >> 16
    return h


def key_bytes(key: bytes | str) -> bytes:
    if isinstance(key, str):
        return key.encode("utf-8")
    if isinstance(key, bytes | bytearray | memoryview):
        return bytes(key)
    raise TypeError(f"state keys are str or bytes, got {type(key).__name__} {key!r}: convert them first")


def key_group_for(key: bytes | str, max_parallelism: int) -> int:
    return key_group_of_raw(key_bytes(key), max_parallelism)


def key_group_of_raw(raw: bytes, max_parallelism: int) -> int:
    """`key_group_for` of a key already in bytes."""
    return _fmix32(zlib.crc32(raw)) % max_parallelism


def raw_keys(keys: Iterable[bytes | str]) -> list[bytes]:
    """The bytes of every key (`key_bytes`, with str and bytes taken on the fast path)."""
    return [k.encode("utf-8") if type(k) is str else k if type(k) is bytes else key_bytes(k) for k in keys]


def key_groups_of(keys: Sequence[bytes | str], max_parallelism: int) -> np.ndarray:
    """`key_group_for` of every key, as an int64 array."""
    return key_groups_of_raw(raw_keys(keys), max_parallelism)


def key_groups_of_raw(raws: Sequence[bytes], max_parallelism: int) -> np.ndarray:
    """`key_group_for` of keys already in bytes: one CRC32 per key, the finalizer vectorized."""
    return _finalize(np.fromiter(map(zlib.crc32, raws), dtype=np.uint64, count=len(raws)), max_parallelism)


def _finalize(crc: np.ndarray, max_parallelism: int) -> np.ndarray:
    """The MurmurHash3 finalizer of `_fmix32`, vectorized, then the key group."""
    h: np.ndarray = crc.astype(np.uint64)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    h ^= h >> 16
    return (h % max_parallelism).astype(np.int64)


@functools.cache
def _crc32_table() -> np.ndarray:
    """zlib's CRC32 table, made on the first vectorized key-group computation."""
    table = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        table = np.where(table & 1, (table >> 1) ^ np.uint32(0xEDB88320), table >> 1).astype(np.uint32)
    return table


_VECTOR_MAX_LEN = 64  # longer keys: one zlib.crc32 each (a byte-at-a-time numpy loop would be slow)


def key_groups_of_strings(values: pa.Array | pa.ChunkedArray, max_parallelism: int) -> np.ndarray:
    """`key_group_for` of every value of an Arrow string or binary array, without a Python object
    per key: the CRC32 (zlib's) runs over the array's buffers, a table step per byte position for
    all keys of one length at a time. Null values are refused."""
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks() if values.num_chunks != 1 else values.chunk(0)
    if values.null_count:
        raise ValueError("keys must not be null")
    if pa.types.is_string(values.type) or pa.types.is_large_string(values.type):
        values = values.cast(pa.large_binary() if pa.types.is_large_string(values.type) else pa.binary())
    if not (pa.types.is_binary(values.type) or pa.types.is_large_binary(values.type)):
        raise TypeError(f"keys must be strings or bytes, got Arrow type {values.type}")
    n = len(values)
    _, offsets_buf, data_buf = values.buffers()
    offset_type = np.int64 if pa.types.is_large_binary(values.type) else np.int32
    offsets = np.frombuffer(offsets_buf, dtype=offset_type)[values.offset : values.offset + n + 1].astype(np.int64)
    data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
    lengths = np.diff(offsets)
    crc, table = np.full(n, 0xFFFFFFFF, dtype=np.uint32), _crc32_table()
    for length in np.unique(lengths).tolist():
        rows = np.nonzero(lengths == length)[0]
        if length > _VECTOR_MAX_LEN:
            crc[rows] = [zlib.crc32(data[s : s + length].tobytes()) ^ 0xFFFFFFFF for s in offsets[rows].tolist()]
            continue
        starts, c = offsets[rows], crc[rows]
        for j in range(length):
            c = table[(c ^ data[starts + j]) & 0xFF] ^ (c >> 8)
        crc[rows] = c
    return _finalize(crc ^ np.uint32(0xFFFFFFFF), max_parallelism)


def subtasks_of(keys: Sequence[bytes | str] | pa.Array | pa.ChunkedArray, max_parallelism: int,
                parallelism: int) -> np.ndarray:
    """`subtask_for_key` of every key (a sequence, or an Arrow string or binary array), as an int64 array."""
    check_parallelism(parallelism, max_parallelism)
    if isinstance(keys, pa.Array | pa.ChunkedArray):
        groups = key_groups_of_strings(keys, max_parallelism)
    else:
        groups = key_groups_of(keys, max_parallelism)
    return groups * parallelism // max_parallelism


def check_parallelism(parallelism: int, max_parallelism: int) -> None:
    if not 1 <= max_parallelism <= MAX_KEY_GROUPS:
        raise ValueError(f"max parallelism must be 1..{MAX_KEY_GROUPS}, got {max_parallelism}")
    if not 1 <= parallelism <= max_parallelism:
        raise ValueError(f"parallelism must be 1..max parallelism ({max_parallelism}), got {parallelism}")


def key_group_range(max_parallelism: int, parallelism: int, subtask: int) -> KeyGroupRange:
    check_parallelism(parallelism, max_parallelism)
    if not 0 <= subtask < parallelism:
        raise ValueError(f"subtask must be 0..{parallelism - 1}, got {subtask}")
    start = (subtask * max_parallelism + parallelism - 1) // parallelism
    end = ((subtask + 1) * max_parallelism - 1) // parallelism
    return KeyGroupRange(start, end)


def subtask_for_key_group(max_parallelism: int, parallelism: int, key_group: int) -> int:
    return key_group * parallelism // max_parallelism


def subtask_for_key(key: bytes | str, max_parallelism: int, parallelism: int) -> int:
    return subtask_for_key_group(max_parallelism, parallelism, key_group_for(key, max_parallelism))


def arrow_keys(keys: pd.Series) -> pa.Array:
    """A key column as the Arrow strings or bytes the state will key by: str and bytes keys as they
    are (state keys bytes as bytes, not as their repr), anything else as its string form."""
    try:
        values = pa.array(keys, from_pandas=True)
    except (pa.ArrowInvalid, pa.ArrowTypeError):  # mixed types in an object column
        values = None
    if values is None or not (pa.types.is_string(values.type) or pa.types.is_large_string(values.type)
                              or pa.types.is_binary(values.type) or pa.types.is_large_binary(values.type)):
        values = pa.array(keys.astype("string"), from_pandas=True)
    return values
