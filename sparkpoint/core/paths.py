"""Paths inside a job directory: the only paths sparkpoint ever reads, writes or deletes."""

from __future__ import annotations

import posixpath
import re

_CHK_DIR = re.compile(r"^chk-([1-9][0-9]*)$")
# A name sparkpoint puts into a path: operator names, RocksDB's local file names, job ids.
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MAX_PATH_CHARS = 1024
MAX_COMPONENT_CHARS = 255


def validate_relative(path: str) -> str:
    """Return `path` if it names a file strictly inside the job directory, else raise ValueError.

    Rejects absolute paths, URLs, `..` and `.` components, backslashes, empty components and
    control characters: anything a hostile `_metadata` could use to reach another directory.
    """
    if not isinstance(path, str) or not path:
        raise ValueError("empty path")
    if len(path) > MAX_PATH_CHARS:
        raise ValueError(f"path of {len(path)} characters is longer than {MAX_PATH_CHARS}")
    check_encodable(path)
    if "://" in path or path.startswith(("/", "~")) or re.match(r"^[A-Za-z]:", path):
        raise ValueError(f"{path!r} is absolute or a URL")
    if "\\" in path or any(ord(c) < 32 for c in path):
        raise ValueError(f"{path!r} holds a backslash or control character")
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"{path!r} has an empty, '.' or '..' component")
    if any(len(p) > MAX_COMPONENT_CHARS for p in parts):
        raise ValueError(f"{path!r} has a component longer than {MAX_COMPONENT_CHARS} characters")
    if posixpath.normpath(path) != path:
        raise ValueError(f"{path!r} is not normalized")
    return path


def check_encodable(text: str) -> str:
    """Reject strings that cannot be written as UTF-8 (a lone surrogate such as "\\ud800")."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{text[:80]!r} is not valid Unicode text ({e.reason})") from None
    return text


def validate_name(name: str, what: str) -> str:
    """A plain name that is one path component: 1-128 of letters, digits, '.', '_', '-'."""
    if not isinstance(name, str) or not _PLAIN_NAME.match(name) or name in (".", ".."):
        raise ValueError(
            f"{what} {str(name)[:80]!r} is not valid: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return name


def checkpoint_id_of_dir(name: str) -> int | None:
    """`chk-7` -> 7; anything else -> None."""
    m = _CHK_DIR.match(name)
    return int(m.group(1)) if m else None


def shared_dir(operator: str, subtask: int) -> str:
    return f"shared/{operator}/{subtask}"


def private_dir(checkpoint_id: int, operator: str, subtask: int) -> str:
    return f"chk-{checkpoint_id}/{operator}/{subtask}"


CHANGELOG_PREFIX = "changelog-"  # the local name of a changelog file: changelog-<checkpoint id, 12 digits>


def is_changelog_name(local_name: str) -> bool:
    """A subtask's file that is a changelog to replay, not a RocksDB file (see core.changelog)."""
    return local_name.startswith(CHANGELOG_PREFIX)
