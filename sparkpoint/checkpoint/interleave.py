"""The one seam every storage operation of the protocol passes: where a test scheduler may pause
the actor that makes it.

Checkpoint storage (`CheckpointStorage`: exclusive create, read, write, list, delete, upload,
download) and the exactly-once sinks (stage, move, list, delete; a table's log read and its commit)
call `storage_step(op, path)` before each operation on one file or one listing (a table's commit
is one `create` of its next log entry). Nothing happens unless a test installed a hook
with `set_step_hook`: then the hook runs in the thread that makes the operation and may block it
until a scheduler lets that actor go on. `tests/support/interleavings.py` drives the protocol's actors
(completer, recoverer, zombie, retried step, sweep, retention, savepoint, skip, rollback, erase, ...) through the
interleavings of these steps that its bound allows and checks the protocol's invariants after
each one.
"""

from __future__ import annotations

from collections.abc import Callable

StepHook = Callable[[str, str], None]

_hook: StepHook | None = None


def storage_step(op: str, path: str) -> None:
    """Called before one storage operation on `path`; a no-op unless a hook is installed.

    `op` is one of create (exclusive), write, read, info, delete, upload, download, rmdir, move
    (`path` is then "source -> target"), walk (every file below `path`) and list (the entries of
    one directory: `path` ends with the pattern of the names the caller looks at, e.g. `chk-*`).
    A task's local directory passes the seam too (its `path` is a local one): the subtask's lock
    (lock; blocked while another holder keeps it, see `stepping`), the task-local copies written
    (write), read (read) and dropped (delete)."""
    hook = _hook
    if hook is not None:
        hook(op, path)


def stepping() -> bool:
    """Whether a scheduler drives the steps: then an actor that would block on a lock another
    actor holds makes `blocked` steps instead (the scheduler lets the holder go on), since a
    thread blocked outside the seam would stop every actor."""
    return _hook is not None


def set_step_hook(hook: StepHook | None) -> StepHook | None:
    """Install `hook` (None removes it); returns the one it replaces."""
    global _hook
    previous, _hook = _hook, hook
    return previous
