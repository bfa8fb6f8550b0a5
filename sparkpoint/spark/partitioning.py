"""One Spark task for each (operator, subtask): partition keys that Spark's hash partitioning spreads
one to a partition.

`groupBy(op, subtask)` alone does not do it. Spark hashes the grouping keys into
`spark.sql.shuffle.partitions` buckets, so two subtasks can share a task (and run one after the
other) while another task idles; and when the routed rows sit in one partition (one input file),
that single partition already satisfies the grouping and Spark shuffles nothing at all: every
subtask then runs in one task on one core. The pipeline therefore gives group g the key
`partition_keys(groups)[g]`, chosen so that Spark's `pmod(hash(key), groups)` is exactly g, and
repartitions by it into `groups` partitions before grouping by it.
"""

from __future__ import annotations

from functools import cache

_MASK = 0xFFFFFFFF
_SEED = 42  # HashPartitioning's Murmur3Hash seed


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (32 - r))) & _MASK


def _mix_k1(k1: int) -> int:
    return (_rotl((k1 * 0xCC9E2D51) & _MASK, 15) * 0x1B873593) & _MASK


def _mix_h1(h1: int, k1: int) -> int:
    return (_rotl(h1 ^ k1, 13) * 5 + 0xE6546B64) & _MASK


def spark_hash_long(value: int, seed: int = _SEED) -> int:
    """Spark's `hash()` of a LongType value (Murmur3_x86_32.hashLong), as a signed 32-bit int."""
    v = value & 0xFFFFFFFFFFFFFFFF
    h1 = _mix_h1(_mix_h1(seed & _MASK, _mix_k1(v & _MASK)), _mix_k1(v >> 32))
    h1 ^= 8
    h1 ^= h1 >> 16
    h1 = (h1 * 0x85EBCA6B) & _MASK
    h1 ^= h1 >> 13
    h1 = (h1 * 0xC2B2AE35) & _MASK
    h1 ^= h1 >> 16
    return h1 - (1 << 32) if h1 & 0x80000000 else h1


def spark_partition_of(value: int, partitions: int) -> int:
    """The partition `repartition(partitions, col)` sends a LongType `value` to."""
    return spark_hash_long(value) % partitions  # Python's % is already Spark's pmod for a positive divisor


@cache
def partition_keys(groups: int) -> tuple[int, ...]:
    """For each group g in 0..groups-1 the smallest key >= 0 that Spark sends to partition g."""
    if groups < 1:
        raise ValueError(f"groups must be >= 1, got {groups}")
    keys: dict[int, int] = {}
    candidate = 0
    while len(keys) < groups:  # a balls-into-bins search: about groups * ln(groups) candidates
        keys.setdefault(spark_partition_of(candidate, groups), candidate)
        candidate += 1
    return tuple(keys[g] for g in range(groups))
