"""Whole-batch state access: StructCodec.decode_many/encode_many, ValueState.update_many_encoded,
MapState.put_absent. Each agrees with the one-value-at-a-time API, changelog included."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy as np
import pytest

from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.state.backend import take_checkpoint
from sparkpoint.state.codecs import BytesCodec, StateFormatError, StructCodec
from sparkpoint.state.engine.changelog import ChangelogOptions
from sparkpoint.state.keygroups import key_group_for
from tests.support.backends import make_backend, owned

TOTALS = StructCodec[tuple[int, float, int]]("<qdq")


def test_decode_many_and_encode_many_agree_with_the_scalar_codec():
    values = [(1, 2.5, -7), (2**62, -0.0, 0), (0, float("inf"), 2**63 - 1)]
    encoded = [TOTALS.encode(v) for v in values]
    records, present = TOTALS.decode_many([encoded[0], None, encoded[1], encoded[2]])
    assert present.tolist() == [True, False, True, True]
    assert [tuple(r) for r in records[present].tolist()] == values
    assert tuple(records[1].tolist()) == (0, 0.0, 0)
    assert TOTALS.encode_many(records[present]) == encoded
    assert TOTALS.decode_many([])[0].shape == (0,)
    with pytest.raises(StateFormatError, match="version 2"):
        TOTALS.decode_many([StructCodec[tuple[int, float, int]]("<qdq", version=2).encode(values[0])])
    with pytest.raises(StateFormatError, match="25 bytes each, one is 24"):
        TOTALS.decode_many([encoded[0][:-1]])
    with pytest.raises(StateFormatError, match="one is 24"):  # a short and a long value: the total matches
        TOTALS.decode_many([encoded[0][:-1], encoded[1] + b"\x00"])
    assert StructCodec("=q").dtype == np.dtype([("f0", "=i8")])
    assert StructCodec(">iH").dtype == np.dtype([("f0", ">i4"), ("f1", ">u2")])
    with pytest.raises(ValueError, match="no numpy dtype"):
        _ = StructCodec("<q10s").dtype


backend = partial(make_backend, operator="op", max_parallelism=32, changelog=ChangelogOptions(enabled=True))


def test_update_many_encoded_reads_modifies_and_deletes_in_one_call(local_storage: CheckpointStorage, tmp_path: Path):
    coordinator = CheckpointCoordinator(local_storage, num_retained=2)
    with backend(local_storage, tmp_path / "a") as b:
        b.restore(None)
        state = b.value_state("totals", TOTALS)
        state.put_many([("a", (1, 1.0, 10)), ("b", (2, 2.0, 20))])
        take_checkpoint(coordinator, [b])
        calls = []

        def merge(stored: list[bytes | None]) -> list[bytes | None]:
            calls.append(len(stored))
            old, present = TOTALS.decode_many(stored)
            old["f0"] += 1
            out: list[bytes | None] = list(TOTALS.encode_many(old))
            out[1] = None  # delete "b"
            assert present.tolist() == [True, True, False]
            return out

        assert state.update_many_encoded(["a", "b", "c"], merge) == 3
        assert calls == [3]
        with pytest.raises(ValueError, match="returned 1 values"):
            state.update_many_encoded(["a", "b"], lambda stored: stored[:1])
        done = take_checkpoint(coordinator, [b])  # a changelog checkpoint: the changes must replay
    with backend(local_storage, tmp_path / "fresh") as fresh:
        fresh.restore(done.metadata)
        got = dict((k.decode(), v) for k, v in fresh.value_state("totals", TOTALS).items())
    assert got == {"a": (2, 1.0, 10), "c": (1, 0.0, 0)}


@pytest.mark.parametrize("order", ["sorted", "unsorted"])
def test_update_many_encoded_gives_fn_the_callers_order_and_the_last_of_a_repeated_key_wins(
    local_storage: CheckpointStorage, tmp_path: Path, order: str
):
    # RocksDB is read and written in its own key order (key group first): the function still sees
    # the values in the order the keys were given, and a key given twice ends with its later value,
    # in the database and in the changelog a restore replays.
    keys = [f"user-{i:04d}" for i in range(300)]
    if order == "unsorted":
        keys = keys[::-1][::2] + keys[::-1][1::2]
    coordinator = CheckpointCoordinator(local_storage, num_retained=2)
    with backend(local_storage, tmp_path / "a") as b:
        b.restore(None)
        state = b.value_state("totals", TOTALS)
        state.put_many([(k, (i, 0.0, 0)) for i, k in enumerate(keys) if i % 3])  # every third key absent
        take_checkpoint(coordinator, [b])
        given = [*keys, keys[5], keys[7]]  # keys 5 and 7 again, last

        def stamp(stored: list[bytes | None]) -> list[bytes | None]:
            old, present = TOTALS.decode_many(stored)
            assert present.tolist() == [bool(i % 3) for i in range(len(keys))] + [True, True]
            assert old["f0"][: len(keys)].tolist() == [i if i % 3 else 0 for i in range(len(keys))]
            old["f1"] = np.arange(len(given), dtype=float)  # the position each key was given at
            new: list[bytes | None] = list(TOTALS.encode_many(old))
            new[2] = None  # a delete among the puts
            return new

        assert state.update_many_encoded(given, stamp) == len(given)
        done = take_checkpoint(coordinator, [b])
    expected = {k: (i if i % 3 else 0, float(i), 0) for i, k in enumerate(keys) if i != 2}
    expected[keys[5]], expected[keys[7]] = (5, float(len(keys)), 0), (7, float(len(keys) + 1), 0)
    with backend(local_storage, tmp_path / "fresh") as fresh:  # from the changelog, not the working database
        fresh.restore(done.metadata)
        assert fresh.value_state("totals", TOTALS).get_many(keys) == [expected.get(k) for k in keys]


def test_put_absent_puts_only_new_pairs_once(local_storage: CheckpointStorage, tmp_path: Path):
    with backend(local_storage, tmp_path / "a") as b:
        b.restore(None)
        seen = b.map_state("seen", BytesCodec())
        seen.put("item-1", "u1", b"old")
        added = seen.put_absent([("item-1", "u1", b"x"), ("item-1", "u2", b"y"), ("item-2", "u1", b"z"),
                                 ("item-1", "u2", b"again"), (bytearray(b"item-3"), b"u9", b"w")])
        assert added == [False, True, True, False, True]
        assert sorted(seen.items()) == [
            (b"item-1", b"u1", b"old"), (b"item-1", b"u2", b"y"), (b"item-2", b"u1", b"z"), (b"item-3", b"u9", b"w"),
        ]
        assert seen.put_absent([]) == []


def test_bulk_paths_refuse_keys_of_another_subtask(local_storage: CheckpointStorage, tmp_path: Path):
    with backend(local_storage, tmp_path / "a", subtask=0, parallelism=4) as b:
        b.restore(None)
        mine = owned(b, (f"k{i}" for i in range(200)))[:20]
        foreign = next(f"k{i}" for i in range(1000) if key_group_for(f"k{i}", 32) not in b.key_group_range)
        state = b.value_state("totals", TOTALS)
        with pytest.raises(KeyError, match="wrong subtask"):
            state.update_many_encoded([*mine, foreign], lambda stored: stored)
        with pytest.raises(KeyError, match="wrong subtask"):
            b.map_state("seen", BytesCodec()).put_absent([(foreign, "u", b"")])
        assert list(state.items()) == [], "nothing was written"


def test_reads_of_many_keys_go_to_rocksdb_in_slices_and_come_back_in_order(local_storage: CheckpointStorage,
                                                                           tmp_path: Path):
    # A multi-get pins every block it reads until it returns: reads of more keys than a slice
    # are split, and the answer is still one value (or None) per key, in the caller's order.
    from sparkpoint.state.engine.stores import MULTI_GET_SLICE

    n = 2 * MULTI_GET_SLICE + 123
    assert n == 8315  # the keys named below
    with backend(local_storage, tmp_path / "a") as b:
        b.restore(None)
        state = b.value_state("totals", TOTALS)
        state.put_many([(f"k{i}", (i, i / 2, i % 7)) for i in range(0, n, 2)])  # the odd keys are absent
        b.compact()
        keys = [f"k{i}" for i in reversed(range(n))]
        got = state.get_many(keys)
        assert len(got) == n
        assert got == [(i, i / 2, i % 7) if i % 2 == 0 else None for i in reversed(range(n))]
        seen: list[int] = []

        def bump(stored: list[bytes | None]) -> list[bytes | None]:
            seen.append(len(stored))
            return [s if s is not None else TOTALS.encode((0, 0.0, 0)) for s in stored]

        assert state.update_many_encoded(keys, bump) == n
        assert seen == [n]  # the caller's function still sees the whole batch at once
        assert state.get_many(["k1", "k8313", "k8312"]) == [(0, 0.0, 0), (0, 0.0, 0), (8312, 4156.0, 8312 % 7)]
