"""Per key one value that every `add` folds into (`ReducingState`): `kg(2) | key -> codec(the reduced value)`."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

from sparkpoint.state.kinds.base import KeyedState

V = TypeVar("V")


class ReducingState(KeyedState[V]):
    """Per key one value that every `add` folds into (Flink's ReducingState).

    What `state.reducing_state(name, codec, reduce)` returns. A batch's values of one key are
    reduced in memory first (`reduce(old, new)`), then read, merged and written with one multi-get
    and one write.

    Example:
        ```python
        latest = state.reducing_state("latest", JsonCodec(), max)
        latest.add("ann", "2026-01-01T10:00")
        latest.add("ann", "2026-01-01T09:00")
        latest.get("ann")             # "2026-01-01T10:00"
        ```
    """

    KIND = "reducing"

    def __init__(self, *args: Any, reduce: Callable[[V, V], V], **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.reduce = reduce

    def add(self, key: bytes | str, value: V) -> None:
        """Fold `value` into the key's value (it becomes the value when the key has none).

        Example:
            ```python
            latest.add("ann", "2026-01-01T10:00")
            ```

        Args:
            key: the key, `str` or `bytes`.
            value: what the codec encodes.
        """
        self.add_many([(key, value)])

    def add_many(self, pairs: Iterable[tuple[bytes | str, V]]) -> int:
        """Fold every (key, value) into the keys' values, in the order given; one multi-get, one write.

        Example:
            ```python
            spend = state.reducing_state("spend", StructCodec("<d"), lambda a, b: (a[0] + b[0],))
            spend.add_many((u, (a,)) for u, a in zip(batch["user"], batch["amount"]))
            ```

        Args:
            pairs: (key, value) pairs.

        Returns:
            The entries written (one per distinct key).
        """
        folded: dict[bytes, V] = {}
        pairs = list(pairs)
        for pk, (_, value) in zip(self._prefixed_many(k for k, _ in pairs), pairs):
            folded[pk] = self.reduce(folded[pk], value) if pk in folded else value
        keys = list(folded)
        decode = self.codec.decode
        merged = [folded[pk] if old is None else self.reduce(decode(old), folded[pk])
                  for pk, old in zip(keys, self._live(self._multi_get(keys)))]
        return self._put_values(keys, merged)

    def get(self, key: bytes | str) -> V | None:
        """The key's reduced value, or None when it has none (or it expired).

        Example:
            ```python
            latest.get("ann")
            ```

        Args:
            key: the key, `str` or `bytes`.

        Returns:
            The decoded value, or None.
        """
        (data,) = self._read([self._prefixed(key)])
        return None if data is None else self.codec.decode(data)

    def get_many(self, keys: Sequence[bytes | str]) -> list[V | None]:
        """The reduced values of many keys, in the order given (one multi-get).

        Example:
            ```python
            latest.get_many(["ann", "bob"])
            ```

        Args:
            keys: the keys, `str` or `bytes`.

        Returns:
            One value per key, None where a key has none.
        """
        if not keys:
            return []
        decode = self.codec.decode
        return [None if d is None else decode(d) for d in self._read(self._prefixed_many(keys))]

    def delete(self, key: bytes | str) -> None:
        """Delete the key's value.

        Example:
            ```python
            latest.delete("ann")
            ```

        Args:
            key: the key, `str` or `bytes`.
        """
        self._delete(self._prefixed(key))

    def items(self) -> Iterator[tuple[bytes, V]]:
        """Every (key, value) of this subtask, in key-group order.

        Example:
            ```python
            dict(latest.items())
            ```

        Yields:
            (key as `bytes`, value) pairs.
        """
        decode = self.codec.decode
        for k, v in self._all():
            yield k[2:], decode(v)
