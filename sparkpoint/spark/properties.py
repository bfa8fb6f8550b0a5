"""The user's own Spark settings that the driver JVM's launch must keep: what
`spark-defaults.conf` (or the file `--properties-file` names) gives, read as Spark's launcher
reads it, a Java properties file."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

from sparkpoint.spark.classcache import spark_conf_dir

_LINES = re.compile(r"\r\n|\r|\n")  # Java's line ends; not str.splitlines's (form feeds, U+2028)
_KEY_VALUE = re.compile(r"((?:[^\s=:\\]|\\.)+)\s*[=:]?\s*(.*)", re.DOTALL)
_ESCAPE = re.compile(r"\\(u[0-9a-fA-F]{4}|.)", re.DOTALL)
_CONTROL = {"t": "\t", "n": "\n", "r": "\r", "f": "\f"}


def read_properties(text: str) -> dict[str, str]:
    """A Java properties file's settings: `#`/`!` comment lines, a key ended by whitespace, `=` or
    `:`, a line ending in an odd number of backslashes continued on the next (its leading
    whitespace dropped), `\\t`, `\\u` with four hex digits and other escapes; values trimmed, as Spark trims them."""
    settings: dict[str, str] = {}
    logical: list[str] = []
    pending: str | None = None
    for raw in _LINES.split(text):
        line = raw.lstrip(" \t\f")
        if pending is None and (not line or line[0] in "#!"):
            continue
        line = line if pending is None else pending + line
        if (len(line) - len(line.rstrip("\\"))) % 2:
            pending = line[:-1]
            continue
        logical.append(line)
        pending = None
    if pending is not None:  # the file ends in a backslash: the line ends there
        logical.append(pending)
    for line in logical:
        match = _KEY_VALUE.match(line)
        if match:
            settings[_unescape(match.group(1))] = _unescape(match.group(2)).strip()
    return settings


def _unescape(text: str) -> str:
    def one(match: re.Match[str]) -> str:
        code = match.group(1)
        return chr(int(code[1:], 16)) if len(code) == 5 else _CONTROL.get(code, code)

    return _ESCAPE.sub(one, text)


def properties_file(spark_home: str | Path) -> Path:
    """The file spark-submit reads the settings from: `--properties-file` in
    PYSPARK_SUBMIT_ARGS, else `spark-defaults.conf` in Spark's conf directory."""
    try:
        args = shlex.split(os.environ.get("PYSPARK_SUBMIT_ARGS", ""))
    except ValueError:  # unbalanced quotes: spark-submit would refuse them itself
        args = []
    for i, arg in enumerate(args):
        if arg == "--properties-file" and i + 1 < len(args):
            return Path(args[i + 1])
        if arg.startswith("--properties-file="):
            return Path(arg.partition("=")[2])
    return spark_conf_dir(spark_home) / "spark-defaults.conf"


def spark_defaults(spark_home: str | Path) -> dict[str, str]:
    """The user's file settings for a JVM launched from `spark_home` (empty without a file).
    Read as UTF-8 with replacement, as Spark's launcher reads it: one odd byte in a comment does
    not lose the rest."""
    try:
        text = properties_file(spark_home).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return {}
    return read_properties(text)
