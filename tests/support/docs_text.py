"""The documentation pages as the tests read them: a page's section under a heading, and the fenced
Python blocks in it. Guides whose examples run are executed from here, so they cannot rot."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
_HEADING = re.compile(r"^(#+) ", re.M)


def page(name: str) -> str:
    """The Markdown of `docs/<name>` (or of README.md)."""
    path = ROOT / name if name == "README.md" else DOCS / name
    return path.read_text(encoding="utf-8")


def section(name: str, heading: str) -> str:
    """The text under `heading` (the whole line, e.g. "## Testing an operator") of page `name`, up to
    the next heading of the same level or above; outside code blocks."""
    text = page(name)
    start = text.index(f"\n{heading}\n") + 1
    level = len(heading) - len(heading.lstrip("#"))
    body = text[start + len(heading) + 1 :]
    fenced = False
    out = []
    for line in body.splitlines(keepends=True):
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else _HEADING.match(line)
        if m and len(m.group(1)) <= level:
            break
        out.append(line)
    return "".join(out)


def python_blocks(text: str) -> list[str]:
    """The fenced ```python blocks of `text`, in order."""
    return re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)
