"""Paths inside a job directory: the only paths sparkpoint ever reads, writes or deletes."""

from __future__ import annotations

import posixpath
import re
from typing import TypeGuard

# Matched with `fullmatch`: `$` would also accept a trailing newline ("chk-5\n").
_CHK_DIR = re.compile(r"chk-([1-9][0-9]*)")
# A name sparkpoint puts into a path: operator names, RocksDB's local file names, job ids.
_PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# Plain names joined by single slashes, as sparkpoint writes them: every such path passes the checks
# of `validate_relative`, so it is accepted at once (a registry rebuild validates 100,000 paths).
_PLAIN_RELATIVE = re.compile(r"(?:[A-Za-z0-9_][A-Za-z0-9._-]{0,254}/)*[A-Za-z0-9_][A-Za-z0-9._-]{0,254}")
_DRIVE = re.compile(r"^[A-Za-z]:")
_BACKSLASH_OR_CONTROL = re.compile(r"[\x00-\x1f\\]")
MAX_PATH_CHARS = 1024
MAX_COMPONENT_CHARS = 255


def validate_relative(path: str) -> str:
    """Return `path` if it names a file strictly inside the job directory, else raise ValueError.

    Rejects absolute paths, URLs, `..` and `.` components, backslashes, empty components and
    control characters: anything a hostile `_metadata` could use to reach another directory.
    """
    return path if is_plain_relative(path) else validate_relative_slowly(path)


def validate_relative_slowly(path: str) -> str:
    """`validate_relative` without its fast path for plain names (kept apart so tests can compare them)."""
    if not isinstance(path, str) or not path:
        raise ValueError("empty path")
    if len(path) > MAX_PATH_CHARS:
        raise ValueError(f"path of {len(path)} characters is longer than {MAX_PATH_CHARS}")
    check_encodable(path)
    if "://" in path or path.startswith(("/", "~")) or _DRIVE.match(path):
        raise ValueError(f"{path!r} is absolute or a URL")
    if _BACKSLASH_OR_CONTROL.search(path):
        raise ValueError(f"{path!r} holds a backslash or control character")
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"{path!r} has an empty, '.' or '..' component")
    if any(len(p) > MAX_COMPONENT_CHARS for p in parts):
        raise ValueError(f"{path!r} has a component longer than {MAX_COMPONENT_CHARS} characters")
    if posixpath.normpath(path) != path:
        raise ValueError(f"{path!r} is not normalized")
    return path


def is_plain_relative(path: object) -> TypeGuard[str]:
    """True for the plain paths sparkpoint writes itself: a subset of what `validate_relative` accepts."""
    return isinstance(path, str) and len(path) <= MAX_PATH_CHARS and _PLAIN_RELATIVE.fullmatch(path) is not None


def check_encodable(text: str) -> str:
    """Reject strings that cannot be written as UTF-8 (a lone surrogate such as "\\ud800")."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{text[:80]!r} is not valid Unicode text ({e.reason})") from None
    return text


def validate_name(name: str, what: str) -> str:
    """A plain name that is one path component: 1-128 of letters, digits, '.', '_', '-'."""
    if not is_plain_name(name):
        raise ValueError(
            f"{what} {str(name)[:80]!r} is not valid: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return name


def is_plain_name(name: object) -> TypeGuard[str]:
    return isinstance(name, str) and _PLAIN_NAME.fullmatch(name) is not None


def checkpoint_id_of_dir(name: str) -> int | None:
    """`chk-7` -> 7; anything else -> None."""
    m = _CHK_DIR.fullmatch(name)
    return int(m.group(1)) if m else None


def shared_dir(operator: str, subtask: int) -> str:
    return f"shared/{operator}/{subtask}"


def private_dir(checkpoint_id: int, operator: str, subtask: int) -> str:
    return f"chk-{checkpoint_id}/{operator}/{subtask}"


CHANGELOG_PREFIX = "changelog-"  # the local name of a changelog file: changelog-<checkpoint id, 12 digits>


def is_changelog_name(local_name: str) -> bool:
    """A subtask's file that is a changelog to replay, not a RocksDB file (see core.changelog)."""
    return local_name.startswith(CHANGELOG_PREFIX)
