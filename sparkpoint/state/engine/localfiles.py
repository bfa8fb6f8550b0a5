"""Writing files in a task's local directory without following links planted there.

The local directory is shared by every task of a machine and may hold anything a previous process
left (DESIGN rule 11): a symbolic link named like a file we write would make an ordinary `open`
truncate or overwrite what it points to, outside the directory. Every write here opens with
`O_NOFOLLOW`, and a new file with `O_EXCL` as well, so a link is an error, never a target.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from sparkpoint.checkpoint.errors import StateBackendError

_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def open_no_follow(path: Path | str, flags: int, mode: int = 0o644) -> int:
    """`os.open` that refuses a symbolic link at `path` with a clear error."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), mode)
    except OSError as e:
        if os.path.islink(path):
            raise StateBackendError(
                f"refusing to write through {path}: it is a symbolic link (to {os.readlink(path)!r}). "
                "Remove it; sparkpoint's local directory holds only files it writes itself"
            ) from e
        raise


def write_new(path: Path | str, data: bytes) -> None:
    """Create `path` with `data`; an existing file or link there is an error (FileExistsError)."""
    fd = os.open(path, _NEW, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def write_replacing(path: Path, data: bytes) -> None:
    """Replace `path` with `data` atomically: a fresh temporary name, then a rename over it (a
    rename replaces a link at `path` itself, never what it points to)."""
    tmp = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    write_new(tmp, data)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
