"""Per key a list of values (`ListState`): `kg(2) | len(key)(4) | key | seq(8) -> codec(element)`.

An element is one entry under a sequence number that only grows for its key, so an append is one
seek (the key's last sequence number) and one put, however long the list is; no merge operator
is needed (rocksdict has none)."""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator, Sequence
from typing import TypeVar

from sparkpoint.state.kinds.base import LEN, KeyedState, next_prefix

V = TypeVar("V")


_SEQ = struct.Struct(">Q")


class ListState(KeyedState[V]):
    """Per key a list of values (Flink's ListState): what `state.list_state(name, codec)` returns.

    An append is one write, whatever the list's length (each element is its own RocksDB entry under a
    sequence number); with a TTL each element expires on its own.

    Example:
        ```python
        clicks = state.list_state("clicks", JsonCodec())
        clicks.add("ann", ["2026-01-01T10:00", "/"])
        clicks.add_many([("ann", ["2026-01-01T10:05", "/cart"]), ("bob", ["2026-01-01T10:06", "/"])])
        clicks.get("ann")          # both of ann's clicks, oldest first
        ```
    """

    KIND = "list"

    def _list_prefix(self, prefixed: bytes) -> bytes:
        return prefixed[:2] + LEN.pack(len(prefixed) - 2) + prefixed[2:]

    def _last_seq(self, prefix: bytes) -> int:
        """The key's highest sequence number, -1 for an empty list: one seek, whatever its length."""
        key = self._store.floor_key(prefix + b"\xff" * _SEQ.size)
        if key is not None and key.startswith(prefix) and len(key) == len(prefix) + _SEQ.size:
            return int(_SEQ.unpack_from(key, len(prefix))[0])
        return -1

    def _appends(self, pairs: list[tuple[bytes | str, V]]) -> list[tuple[bytes, bytes]]:
        """The entries that append `pairs` in order: each distinct key's last number read once."""
        prefixes = [self._list_prefix(p) for p in self._prefixed_many(k for k, _ in pairs)]
        following: dict[bytes, int] = {}
        keys = []
        for prefix in prefixes:
            seq = following.get(prefix)
            if seq is None:
                seq = self._last_seq(prefix) + 1
            following[prefix] = seq + 1
            keys.append(prefix + _SEQ.pack(seq))
        encode = self.codec.encode
        return list(zip(keys, self._stamp([encode(v) for _, v in pairs])))

    def add(self, key: bytes | str, value: V) -> None:
        """Append `value` to the key's list (one write).

        Example:
            ```python
            clicks.add("ann", ["2026-01-01T10:00", "/"])
            ```

        Args:
            key: the key, `str` or `bytes`.
            value: what the codec encodes.
        """
        self._write(self._appends([(key, value)]))

    def add_many(self, pairs: Iterable[tuple[bytes | str, V]]) -> int:
        """Append every (key, value), in the order given; one write.

        Example:
            ```python
            clicks.add_many(zip(batch["user"], batch[["clicked_at", "page"]].astype(str).values.tolist()))
            ```

        Args:
            pairs: (key, value) pairs; a key's values are appended in their order here.

        Returns:
            The elements written.
        """
        return self._write(self._appends(list(pairs)))

    def get(self, key: bytes | str) -> list[V]:
        """The key's list, oldest first ([] when it has none).

        Example:
            ```python
            history = clicks.get("ann")
            ```

        Args:
            key: the key, `str` or `bytes`.

        Returns:
            The decoded elements (expired ones left out).
        """
        prefix = self._list_prefix(self._prefixed(key))
        entries = list(self._live_entries(self._scan(prefix, next_prefix(prefix))))
        self._touch([k for k, _ in entries], [v for _, v in entries])
        decode = self.codec.decode
        return [decode(v) for _, v in entries]

    def get_many(self, keys: Sequence[bytes | str]) -> list[list[V]]:
        """The lists of many keys, in the order given.

        Example:
            ```python
            a, b = clicks.get_many(["ann", "bob"])
            ```

        Args:
            keys: the keys, `str` or `bytes`.

        Returns:
            One list per key ([] for a key without one).
        """
        return [self.get(k) for k in keys]

    def put(self, key: bytes | str, values: Iterable[V]) -> None:
        """Replace the key's list with `values` (an empty `values` leaves no list).

        Example:
            ```python
            clicks.put("ann", [c for c in clicks.get("ann") if c[1] != "/"])
            ```

        Args:
            key: the key, `str` or `bytes`.
            values: the new elements, in order.
        """
        prefix = self._list_prefix(self._prefixed(key))
        self._delete_range(prefix, next_prefix(prefix))
        values = list(values)
        self._put_values([prefix + _SEQ.pack(i) for i in range(len(values))], values)

    def delete(self, key: bytes | str) -> None:
        """Delete the key's whole list (one range delete).

        Example:
            ```python
            clicks.delete("ann")
            ```

        Args:
            key: the key, `str` or `bytes`.
        """
        prefix = self._list_prefix(self._prefixed(key))
        self._delete_range(prefix, next_prefix(prefix))

    def items(self) -> Iterator[tuple[bytes, list[V]]]:
        """Every (key, list) of this subtask, in key-group order.

        Example:
            ```python
            lengths = {k.decode(): len(v) for k, v in clicks.items()}
            ```

        Yields:
            (key as `bytes`, list of elements) pairs.
        """
        decode = self.codec.decode
        current: bytes | None = None
        values: list[V] = []
        for k, v in self._all():
            (n,) = LEN.unpack_from(k, 2)
            key = k[6 : 6 + n]
            if key != current:
                if current is not None:
                    yield current, values
                current, values = key, []
            values.append(decode(v))
        if current is not None:
            yield current, values
