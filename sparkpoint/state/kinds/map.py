"""Per key a map of user key -> value (`MapState`): `kg(2) | len(key)(4) | key | user key -> codec(value)`."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TypeVar

from sparkpoint.state.keygroups import key_bytes, raw_keys
from sparkpoint.state.kinds.base import LEN, KeyedState, next_prefix

V = TypeVar("V")


class MapState(KeyedState[V]):
    """Per key a map of user key -> value (Flink's MapState): what `state.map_state(name, codec)` returns.

    Each (key, user key) entry is one RocksDB entry, so a read or a write touches one entry, however
    large the key's map is. With a TTL each entry expires on its own.

    Example:
        ```python
        pages = state.map_state("pages", JsonCodec())
        pages.put("ann", "/cart", 2)
        pages.get("ann", "/cart")          # 2
        dict(pages.entries("ann"))         # {b"/cart": 2}
        ```
    """

    KIND = "map"

    def _map_prefix(self, key: bytes | str) -> bytes:
        prefixed = self._prefixed(key)
        return prefixed[:2] + LEN.pack(len(prefixed) - 2) + prefixed[2:]

    def _entry_key(self, key: bytes | str, user_key: bytes | str) -> bytes:
        return self._map_prefix(key) + key_bytes(user_key)

    def _entry_keys(self, pairs: Iterable[tuple[bytes | str, bytes | str]]) -> list[bytes]:
        """`_entry_key` of many pairs: each distinct key's prefix computed once, all in one batch."""
        pairs = list(pairs)
        keys = raw_keys(k for k, _ in pairs)  # bytes: hashable (a bytearray key is not)
        distinct = list(dict.fromkeys(keys))
        prefixes = {
            raw: p[:2] + LEN.pack(len(raw)) + raw for raw, p in zip(distinct, self._prefixed_many(distinct))
        }
        return [prefixes[k] + u for k, u in zip(keys, raw_keys(u for _, u in pairs))]

    def get(self, key: bytes | str, user_key: bytes | str) -> V | None:
        """The value of one entry of `key`'s map, or None when the map lacks `user_key`.

        Example:
            ```python
            visits = pages.get("ann", "/cart")
            ```

        Args:
            key: the key, `str` or `bytes`.
            user_key: the entry's key in the map, `str` or `bytes`.

        Returns:
            The decoded value, or None.
        """
        (data,) = self._read([self._entry_key(key, user_key)])
        return None if data is None else self.codec.decode(data)

    def contains(self, key: bytes | str, user_key: bytes | str) -> bool:
        """Whether `key`'s map has `user_key` (an expired entry counts as absent).

        Example:
            ```python
            if not pages.contains("ann", "/cart"):
                ...
            ```

        Args:
            key: the key, `str` or `bytes`.
            user_key: the entry's key in the map.

        Returns:
            True when the entry is there.
        """
        return self._live([self._store.get(self._entry_key(key, user_key))])[0] is not None

    def put(self, key: bytes | str, user_key: bytes | str, value: V) -> None:
        """Set one entry of `key`'s map.

        Example:
            ```python
            pages.put("ann", "/cart", 3)
            ```

        Args:
            key: the key, `str` or `bytes`.
            user_key: the entry's key in the map.
            value: what the codec encodes.
        """
        self._put_values([self._entry_key(key, user_key)], [value])

    def delete(self, key: bytes | str, user_key: bytes | str) -> None:
        """Delete one entry of `key`'s map (the rest of the map stays).

        Example:
            ```python
            pages.delete("ann", "/cart")
            ```

        Args:
            key: the key, `str` or `bytes`.
            user_key: the entry's key in the map.
        """
        self._delete(self._entry_key(key, user_key))

    def get_many(self, pairs: Sequence[tuple[bytes | str, bytes | str]]) -> list[V | None]:
        """The values of many entries at once, in the order given (one multi-get).

        Example:
            ```python
            pages.get_many([("ann", "/"), ("bob", "/cart")])      # [1, None]
            ```

        Args:
            pairs: (key, user key) pairs.

        Returns:
            One value per pair, None where the map lacks the entry.
        """
        if not pairs:
            return []
        found = self._read(self._entry_keys(pairs))
        decode = self.codec.decode
        return [None if d is None else decode(d) for d in found]

    def put_many(self, entries: Iterable[tuple[bytes | str, bytes | str, V]]) -> int:
        """Set many entries in one write.

        Example:
            ```python
            pages.put_many([("ann", "/", 1), ("ann", "/cart", 2)])
            ```

        Args:
            entries: (key, user key, value) triples.

        Returns:
            The entries written.
        """
        triples = list(entries)
        return self._put_values(self._entry_keys((k, u) for k, u, _ in triples), [v for _, _, v in triples])

    def put_absent(self, entries: Iterable[tuple[bytes | str, bytes | str, V]]) -> list[bool]:
        """Put each (key, user key, value) whose user key the key's map lacks; one multi-get and one write.

        A "seen before?" set in one pass: a pair given twice is put once, the first time.

        Example:
            ```python
            SEEN = BytesCodec()
            pairs = batch[["user", "page"]].drop_duplicates()
            new = state.map_state("pages", SEEN).put_absent((u, p, b"") for u, p in zip(pairs["user"], pairs["page"]))
            first_visits = pairs[new]
            ```

        Args:
            entries: (key, user key, value) triples.

        Returns:
            One bool per triple: True where it was put (the entry was new).
        """
        triples = list(entries)
        entry_keys = self._entry_keys((k, u) for k, u, _ in triples)
        added, keys, values, seen = [], [], [], set()
        for entry_key, found, (_, _, value) in zip(entry_keys, self._live(self._multi_get(entry_keys)), triples):
            new = found is None and entry_key not in seen
            if new:
                seen.add(entry_key)
                keys.append(entry_key)
                values.append(value)
            added.append(new)
        self._put_values(keys, values)
        return added

    def entries(self, key: bytes | str) -> Iterator[tuple[bytes, V]]:
        """The (user key, value) pairs of one key's map, in user-key order.

        Example:
            ```python
            visited = {page.decode(): n for page, n in pages.entries("ann")}
            ```

        Args:
            key: the key, `str` or `bytes`.

        Yields:
            (user key as `bytes`, value) pairs; none for a key without a map.
        """
        prefix = self._map_prefix(key)
        decode = self.codec.decode
        for k, v in self._live_entries(self._scan(prefix, next_prefix(prefix))):
            yield k[len(prefix) :], decode(v)

    def remove_key(self, key: bytes | str) -> None:
        """Delete the whole map of one key (one range delete, however many entries it has).

        Example:
            ```python
            pages.remove_key("ann")
            ```

        Args:
            key: the key, `str` or `bytes`.
        """
        prefix = self._map_prefix(key)
        self._delete_range(prefix, next_prefix(prefix))

    def items(self) -> Iterator[tuple[bytes, bytes, V]]:
        """Every (key, user key, value) of this subtask, in key-group order.

        Example:
            ```python
            rows = [(k.decode(), u.decode(), v) for k, u, v in pages.items()]
            ```

        Yields:
            (key, user key, value) triples, keys as `bytes`.
        """
        decode = self.codec.decode
        for k, v in self._all():
            (n,) = LEN.unpack_from(k, 2)
            yield k[6 : 6 + n], k[6 + n :], decode(v)
