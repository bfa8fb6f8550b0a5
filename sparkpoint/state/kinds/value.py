"""One value per key (`ValueState`): `kg(2) | key -> codec(value)`."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

from sparkpoint.lazy import lazy_module
from sparkpoint.state.kinds.base import KeyedState

if TYPE_CHECKING:
    import numpy as np
else:
    np = lazy_module("numpy")

V = TypeVar("V")


class ValueState(KeyedState[V]):
    """One value per key (Flink's ValueState): what `state.value_state(name, codec)` returns.

    Keys are `str` or `bytes` (a `str` is stored as its UTF-8 bytes); reads give keys back as `bytes`.
    A value is whatever the codec encodes. With a TTL (`ttl=StateTtl(...)`), a value expires that
    long after its last write (or read) and is never returned again.

    Example:
        ```python
        totals = state.value_state("totals", StructCodec("<q"))
        totals.put("ann", (3,))
        totals.get("ann")           # (3,)
        totals.get("bob")           # None: no value
        ```
    """

    KIND = "value"

    def get(self, key: bytes | str) -> V | None:
        """The value of `key`, or None when it has none (or it expired).

        Example:
            ```python
            clicks = totals.get("ann")          # (3,) or None
            ```

        Args:
            key: the key, `str` or `bytes`.

        Returns:
            The decoded value, or None.
        """
        (data,) = self._read([self._prefixed(key)])
        return None if data is None else self.codec.decode(data)

    def put(self, key: bytes | str, value: V) -> None:
        """Set the value of `key` (replacing any value it had).

        Example:
            ```python
            totals.put("ann", (4,))
            ```

        Args:
            key: the key, `str` or `bytes`.
            value: what the codec encodes.
        """
        self._put_values([self._prefixed(key)], [value])

    def delete(self, key: bytes | str) -> None:
        """Delete the value of `key` (nothing happens when it has none).

        Example:
            ```python
            totals.delete("ann")
            ```

        Args:
            key: the key, `str` or `bytes`.
        """
        self._delete(self._prefixed(key))

    def get_many(self, keys: Sequence[bytes | str]) -> list[V | None]:
        """The values of many keys at once, in the order given (one RocksDB multi-get).

        Example:
            ```python
            old = totals.get_many(["ann", "bob"])     # [(3,), None]
            ```

        Args:
            keys: the keys, `str` or `bytes`.

        Returns:
            One value per key, None where a key has none.
        """
        if not keys:
            return []
        found = self._read(self._prefixed_many(keys))
        decode = self.codec.decode
        return [None if d is None else decode(d) for d in found]

    def put_many(self, items: Iterable[tuple[bytes | str, V]]) -> int:
        """Set the values of many keys in one write.

        Example:
            ```python
            totals.put_many([("ann", (4,)), ("bob", (1,))])
            totals.put_many(zip(batch["user"], batch["page"]))      # any iterable of pairs
            ```

        Args:
            items: (key, value) pairs; a key given twice keeps its last value.

        Returns:
            The entries written.
        """
        pairs = list(items)
        return self._put_values(self._prefixed_many(k for k, _ in pairs), [v for _, v in pairs])

    def get_many_table(self, keys: Any) -> Any:
        """The values of many keys as one Arrow table, a row per key in order (a key without a
        value: a row of nulls), for a codec with a columnar form (`RecordCodec`). One multi-get;
        decoded without a Python loop over the rows.

        Example:
            ```python
            old = totals.get_many_table(batch["user"])           # pyarrow.Table
            clicks = pc.add(pc.fill_null(old["clicks"], 0), batch_clicks)
            ```

        Args:
            keys: str or bytes keys (a list, a NumPy array, a pandas Series or an Arrow array).

        Returns:
            A `pyarrow.Table` with the codec's fields (`.to_pandas()` for a DataFrame).

        Raises:
            TypeError: the state's codec has no columnar form (it is not a `RecordCodec`).
        """
        decode_table = _columnar(self.codec, "decode_table")
        keys = _key_list(keys)
        return decode_table(self._read(self._prefixed_many(keys)) if keys else [])

    def put_many_table(self, keys: Any, table: Any) -> int:
        """Write row i of `table` as the value of `keys[i]`, all in one WriteBatch (a columnar
        codec: `RecordCodec`). A field the table lacks is its default, else null.

        Example:
            ```python
            totals.put_many_table(["ann", "bob"], {"clicks": [4, 1], "spend": [2.5, 0.0]})
            ```

        Args:
            keys: str or bytes keys, one per row.
            table: a `pyarrow.Table`, a pandas DataFrame or a dict of columns.

        Returns:
            The entries written.

        Raises:
            TypeError: the state's codec has no columnar form (it is not a `RecordCodec`).
            ValueError: the table has another number of rows than there are keys.
        """
        encode_table = _columnar(self.codec, "encode_table")
        keys = _key_list(keys)
        encoded = encode_table(table)
        if len(encoded) != len(keys):
            raise ValueError(f"put_many_table: {len(keys)} keys, but the table has {len(encoded)} rows")
        return self._write(zip(self._prefixed_many(keys), self._stamp(encoded)))

    def update_many_encoded(
        self, keys: Sequence[bytes | str], fn: Callable[[list[bytes | None]], Sequence[bytes | None]]
    ) -> int:
        """Read-modify-write of many keys in one call of `fn`, over the values as stored (encoded).

        `fn` gets the old values as stored (None: absent or expired), in key order, and returns the new
        ones (None: delete the key). For operators that decode and encode whole batches at once, such as
        with `StructCodec.decode_many` / `encode_many` (NumPy records): one multi-get, one write, no
        Python call per key.

        Example:
            ```python
            COUNT = StructCodec("<q")
            counts = batch.groupby("user").size()

            def add(stored):                          # the stored values, None where a key has none
                old, present = COUNT.decode_many(stored)
                old["f0"] += counts.to_numpy()        # absent keys decode as zeros
                return COUNT.encode_many(old)

            state.value_state("count", COUNT).update_many_encoded(counts.index.tolist(), add)
            ```

        Args:
            keys: the keys, `str` or `bytes`.
            fn: takes the list of stored values and returns a sequence of new ones, as long.

        Returns:
            The entries written or deleted.

        Raises:
            ValueError: `fn` returned another number of values than there are keys.
        """
        prefixed, order = self._prefixed_in_order(keys)  # read and written in RocksDB's order
        found = np.empty(len(order), dtype=object)
        found[order] = np.fromiter(self._live(self._multi_get(prefixed)), dtype=object, count=len(order))
        new = fn(found.tolist())  # in the caller's order
        if len(new) != len(prefixed):
            raise ValueError(f"update_many_encoded: {len(prefixed)} keys, but fn returned {len(new)} values")
        values = [new[i] for i in order]
        try:
            encoded = [v if type(v) is bytes else bytes(cast(Any, v)) for v in values]
        except TypeError:  # deletes (None) among them
            pass
        else:
            return self._write(zip(prefixed, self._stamp(encoded)))
        kept = [(pk, bytes(v)) for pk, v in zip(prefixed, values) if v is not None]
        puts = list(zip([pk for pk, _ in kept], self._stamp([v for _, v in kept])))
        return self._write(puts, [pk for pk, v in zip(prefixed, values) if v is None])

    def update_many(self, keys: Sequence[bytes | str], fn: Callable[[bytes | str, V | None], V | None]) -> int:
        """Read-modify-write of many keys: one multi-get, one WriteBatch, `fn` called once per key.

        Example:
            ```python
            counts = batch.groupby("user").size()
            totals.update_many(counts.index.tolist(),
                               lambda key, old: ((old[0] if old else 0) + int(counts[key]),))
            ```

        Args:
            keys: the keys, `str` or `bytes` (as given, they are what `fn` receives).
            fn: `fn(key, old)` returns the new value, or None to delete the key; `old` is None for a key
                without a value.

        Returns:
            The entries written or deleted.
        """
        prefixed = self._prefixed_many(keys)
        old = self._live(self._multi_get(prefixed))
        decode, encode = self.codec.decode, self.codec.encode
        puts: list[tuple[bytes, bytes]] = []
        deletes: list[bytes] = []
        for key, pk, data in zip(keys, prefixed, old):
            new = fn(key, None if data is None else decode(data))
            if new is None:
                deletes.append(pk)
            else:
                puts.append((pk, encode(new)))
        return self._write(zip([k for k, _ in puts], self._stamp([v for _, v in puts])), deletes)

    def items(self) -> Iterator[tuple[bytes, V]]:
        """Every (key, value) of this subtask, in key-group order (expired values left out).

        Example:
            ```python
            def export(state):
                return pd.DataFrame([(k.decode(), v[0]) for k, v in state.value_state("totals", TOTALS).items()],
                                    columns=["user", "clicks"])
            ```

        Yields:
            (key as `bytes`, value) pairs.
        """
        decode = self.codec.decode
        for k, v in self._all():
            yield k[2:], decode(v)


def _columnar(codec: Any, method: str) -> Callable[..., Any]:
    fn = getattr(codec, method, None)
    if fn is None:
        raise TypeError(f"{type(codec).__name__} has no columnar form: tables need a RecordCodec")
    return cast(Callable[..., Any], fn)


def _key_list(keys: Any) -> list[Any]:
    """Keys from a list, a NumPy array, a pandas Series or an Arrow array, as a list."""
    if hasattr(keys, "to_pylist"):
        return list(keys.to_pylist())
    if hasattr(keys, "tolist"):
        return list(keys.tolist())
    return list(keys)
