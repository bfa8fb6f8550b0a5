"""Keys -> key groups -> subtasks: the stable mapping that makes rescaling possible.

A key's group is a stable hash of its bytes (CRC32 with a MurmurHash3 finalizer), never Python's
randomized `hash()`. Subtask i of P owns a contiguous range of groups (Flink's formula).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence

import numpy as np

from sparkpoint.core.metadata import KeyGroupRange

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
    crc = np.fromiter(map(zlib.crc32, raws), dtype=np.uint64, count=len(raws))
    h = crc ^ (crc >> 16)
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    h ^= h >> 16
    return (h % max_parallelism).astype(np.int64)


def subtasks_of(keys: Sequence[bytes | str], max_parallelism: int, parallelism: int) -> np.ndarray:
    """`subtask_for_key` of every key, as an int64 array."""
    check_parallelism(parallelism, max_parallelism)
    return key_groups_of(keys, max_parallelism) * parallelism // max_parallelism


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
