"""Paths inside a job directory: the only paths sparkpoint ever reads, writes or deletes."""

from __future__ import annotations

import posixpath
import re

_CHK_DIR = re.compile(r"^chk-([1-9][0-9]*)$")


def validate_relative(path: str) -> str:
    """Return `path` if it names a file strictly inside the job directory, else raise ValueError.

    Rejects absolute paths, URLs, `..` and `.` components, backslashes, empty components and
    control characters: anything a hostile `_metadata` could use to reach another directory.
    """
    if not isinstance(path, str) or not path:
        raise ValueError("empty path")
    if "://" in path or path.startswith(("/", "~")) or re.match(r"^[A-Za-z]:", path):
        raise ValueError(f"{path!r} is absolute or a URL")
    if "\\" in path or any(ord(c) < 32 for c in path):
        raise ValueError(f"{path!r} holds a backslash or control character")
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"{path!r} has an empty, '.' or '..' component")
    if posixpath.normpath(path) != path:
        raise ValueError(f"{path!r} is not normalized")
    return path


def checkpoint_id_of_dir(name: str) -> int | None:
    """`chk-7` -> 7; anything else -> None."""
    m = _CHK_DIR.match(name)
    return int(m.group(1)) if m else None


def shared_dir(operator: str, subtask: int) -> str:
    return f"shared/{operator}/{subtask}"


def private_dir(checkpoint_id: int, operator: str, subtask: int) -> str:
    return f"chk-{checkpoint_id}/{operator}/{subtask}"
