"""An fsspec filesystem wrapper that fails a random fraction of operations, reproducibly.

    fs = FaultyFileSystem("memory://", rate=0.05, seed=7)            # or any filesystem object, e.g. s3fs
    storage = CheckpointStorage("memory://ckpt", "job", filesystem=fs)
    storage, fs = faulty_storage("s3://bucket/ckpt", "job", {...s3 options...}, rate=0.05, seed=7)
    fs.injected                                                      # Counter: fault kind -> times
    fs.paused(): ...                                                 # a block without faults

Fault kinds (choose with `kinds=`, default all):

- `error`: the operation raises OSError before doing anything (a 503, a reset connection);
- `timeout`: it raises TimeoutError before doing anything;
- `short_write`: a whole-file write (`put_file`, `open(..., "wb")`) leaves a truncated file, then
  raises OSError. Exclusive creates (`"xb"`) are never truncated: S3's conditional PUT and a
  local link are all or nothing;
- `lost_response`: a write or delete happens, then TimeoutError is raised (the caller cannot
  tell that it happened);
- `list_error`: a listing (`ls`, `find`) raises OSError;
- `read_error`: a read (`cat_file`, `get_file`, `info`, `open(..., "rb")`) raises OSError.

Every operation the wrapper does not name is passed through untouched. Decisions come from one
`random.Random(seed)` under a lock, so a single-threaded run is reproducible; with worker threads
the order of draws (not the rate) varies.
"""

from __future__ import annotations

import io
import random
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import fsspec

FAULT_KINDS = ("error", "timeout", "short_write", "lost_response", "list_error", "read_error")
"""The fault kinds a `FaultyFileSystem` injects (`kinds=` chooses among them), e.g. `kinds=("error", "timeout")`."""
_BEFORE = ("error", "timeout")  # fail without doing anything


class InjectedFault(OSError):
    """An OSError raised by FaultyFileSystem (TimeoutError faults raise InjectedTimeout)."""


class InjectedTimeout(TimeoutError):
    pass


def _failing(op: str, kinds: tuple[str, ...]) -> Any:
    """A method that may fail before it calls the target's `op` (reads, listings, makedirs)."""

    def method(self: FaultyFileSystem, path: str, *args: Any, **kwargs: Any) -> Any:
        self._before(op, path, kinds)
        return getattr(self.target, op)(path, *args, **kwargs)

    method.__name__ = op
    return method


class FaultyFileSystem:
    """Wraps an fsspec filesystem (or the one a URL names) and fails a random fraction of its operations.

    The fault kinds are in `FAULT_KINDS` (see the module's docstring); every operation the wrapper
    does not name is the target's own. Decisions come from one `random.Random(seed)`, so a
    single-threaded run is reproducible.

    Example:
        ```python
        fs = FaultyFileSystem("memory://", rate=0.05, seed=7)
        storage = CheckpointStorage("memory://ckpt", "job", filesystem=fs)
        ...
        fs.injected                 # Counter: fault kind -> times
        ```

    Args:
        target: an fsspec filesystem object, or a URL whose filesystem to wrap.
        rate: the fraction of operations that fail, 0 to 1.
        seed: the seed of the random draws.
        kinds: the fault kinds to inject (default: all of `FAULT_KINDS`).
        target_options: fsspec options when `target` is a URL.

    Raises:
        ValueError: an unknown fault kind, or a rate outside [0, 1].
    """

    def __init__(
        self,
        target: Any,
        *,
        rate: float = 0.05,
        seed: int = 0,
        kinds: Iterable[str] = FAULT_KINDS,
        target_options: dict[str, Any] | None = None,
    ):
        if isinstance(target, str):
            target = fsspec.core.url_to_fs(target, **(target_options or {}))[0]
        self.kinds = tuple(kinds)
        unknown = set(self.kinds) - set(FAULT_KINDS)
        if unknown or not 0 <= rate <= 1:
            raise ValueError(f"unknown fault kinds {sorted(unknown)} or rate {rate} outside [0, 1]")
        self.target = target
        self.rate = rate
        self.injected: Counter[str] = Counter()  # kind -> faults injected
        self.calls: Counter[str] = Counter()  # operation -> calls seen
        self.deleted: list[str] = []  # every path a delete reached (done, or done and then "lost")
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self._paused = 0

    def __getattr__(self, name: str) -> Any:  # everything not wrapped: the target's own
        return getattr(self.target, name)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """A block without faults (set-up and final checks).

        Example:
            ```python
            with fs.paused():
                assert store.checkpoint_ids() == [7, 6]
            ```

        Yields:
            Nothing; faults resume when the block ends.
        """
        with self._lock:
            self._paused += 1
        try:
            yield
        finally:
            with self._lock:
                self._paused -= 1

    @property
    def total_injected(self) -> int:
        """Faults injected so far, all kinds together."""
        return sum(self.injected.values())

    def _draw(self, op: str, kinds: tuple[str, ...]) -> str | None:
        """The fault to inject into this call of `op`, or None."""
        with self._lock:
            self.calls[op] += 1
            possible = [k for k in kinds if k in self.kinds]
            if self._paused or not possible or self._random.random() >= self.rate:
                return None
            kind = self._random.choice(possible)
            self.injected[kind] += 1
            return kind

    @staticmethod
    def _raise(kind: str, op: str, path: str) -> None:
        if kind in ("timeout", "lost_response"):
            raise InjectedTimeout(f"injected {kind} in {op}({path!r})")
        raise InjectedFault(f"injected {kind} in {op}({path!r})")

    def _before(self, op: str, path: str, kinds: tuple[str, ...]) -> str | None:
        kind = self._draw(op, kinds)
        if kind in _BEFORE or kind in ("list_error", "read_error"):
            self._raise(kind, op, path)
        return kind

    # --- reads and listings --------------------------------------------------------------------

    cat_file = _failing("cat_file", (*_BEFORE, "read_error"))
    get_file = _failing("get_file", (*_BEFORE, "read_error"))
    info = _failing("info", (*_BEFORE, "read_error"))
    exists = _failing("exists", (*_BEFORE, "read_error"))
    ls = _failing("ls", (*_BEFORE, "list_error"))
    find = _failing("find", (*_BEFORE, "list_error"))

    # --- writes and deletes --------------------------------------------------------------------

    makedirs = _failing("makedirs", _BEFORE)

    def put_file(self, lpath: str, rpath: str, *args: Any, **kwargs: Any) -> Any:
        def half() -> bytes:
            with open(lpath, "rb") as f:
                data = f.read()
            return data[: len(data) // 2]

        return self._whole_write("put_file", rpath, half, lambda: self.target.put_file(lpath, rpath, *args, **kwargs))

    def pipe_file(self, path: str, value: bytes, *args: Any, **kwargs: Any) -> Any:
        write = lambda: self.target.pipe_file(path, value, *args, **kwargs)  # noqa: E731
        return self._whole_write("pipe_file", path, lambda: value[: len(value) // 2], write)

    def _whole_write(self, op: str, path: str, half: Callable[[], bytes], write: Callable[[], Any]) -> Any:
        kind = self._before(op, path, (*_BEFORE, "short_write", "lost_response"))
        if kind == "short_write":
            self.target.pipe_file(path, half())
            self._raise(kind, op, path)
        return self._after(kind, op, path, write())

    def _after(self, kind: str | None, op: str, path: str, result: Any) -> Any:
        """The operation happened: its response may still be lost."""
        if kind == "lost_response":
            self._raise(kind, op, path)
        return result

    def open(self, path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
        if "r" in mode:
            self._before("open", path, (*_BEFORE, "read_error"))
            return self.target.open(path, mode, *args, **kwargs)
        kinds = (*_BEFORE, "lost_response") if "x" in mode else (*_BEFORE, "short_write", "lost_response")
        kind = self._before("open", path, kinds)
        try:
            inner = self.target.open(path, mode, *args, **kwargs)
        except FileExistsError:  # an exclusive create refused at once: the drawn fault never happened
            if kind is not None:
                with self._lock:
                    self.injected[kind] -= 1
            raise
        return _FaultyWriter(self, path, mode, kind, inner)

    def rm_file(self, path: str, *args: Any, **kwargs: Any) -> Any:
        return self._delete("rm_file", [path], lambda: self.target.rm_file(path, *args, **kwargs))

    def rm(self, path: Any, *args: Any, **kwargs: Any) -> Any:
        paths = [path] if isinstance(path, str) else list(path)
        return self._delete("rm", paths, lambda: self.target.rm(path, *args, **kwargs))

    def _delete(self, op: str, paths: list[str], delete: Callable[[], Any]) -> Any:
        kind = self._before(op, str(paths[:1]), (*_BEFORE, "lost_response"))
        result = delete()
        with self._lock:
            self.deleted.extend(paths)
        return self._after(kind, op, str(paths[:1]), result)


class _FaultyWriter(io.RawIOBase):
    """A file opened for writing whose close may truncate it or lose the response."""

    def __init__(self, fs: FaultyFileSystem, path: str, mode: str, kind: str | None, inner: Any):
        super().__init__()
        self._fs, self._path, self._mode, self._kind, self._inner = fs, path, mode, kind, inner
        self._buffer = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self._buffer += bytes(data)
        return len(data)

    def close(self) -> None:
        if self.closed:
            return
        super().close()
        data = bytes(self._buffer)
        if self._kind == "short_write":
            self._inner.write(data[: len(data) // 2])
            self._inner.close()
            self._fs._raise("short_write", "open", self._path)
        self._inner.write(data)
        self._inner.close()  # an exclusive create that lost the race raises FileExistsError here
        self._fs._after(self._kind, "open", self._path, None)


def faulty_storage(
    checkpoints_dir: str,
    job_id: str,
    storage_options: dict[str, Any] | None = None,
    *,
    rate: float = 0.05,
    seed: int = 0,
    kinds: Iterable[str] = FAULT_KINDS,
    **storage_kwargs: Any,
) -> tuple[Any, FaultyFileSystem]:
    """A CheckpointStorage whose every operation goes through a FaultyFileSystem, and that wrapper.

    Example:
        ```python
        storage, fs = faulty_storage("memory://ckpt", "job", rate=0.06, seed=3)
        ```

    Args:
        checkpoints_dir: the checkpoints directory (any fsspec URL).
        job_id: the job's directory under it.
        storage_options: fsspec options of `checkpoints_dir`.
        rate: the fraction of operations that fail.
        seed: the seed of the random draws.
        kinds: the fault kinds to inject (default: all).
        **storage_kwargs: passed on to `CheckpointStorage`.

    Returns:
        (storage, the wrapper).
    """
    from sparkpoint.checkpoint.storage import CheckpointStorage

    target = fsspec.core.url_to_fs(checkpoints_dir, **(storage_options or {}))[0]
    fs = FaultyFileSystem(target, rate=rate, seed=seed, kinds=kinds)
    storage = CheckpointStorage(checkpoints_dir, job_id, storage_options, filesystem=fs, **storage_kwargs)
    return storage, fs
