"""How the commands print: JSON for scripts, rich tables, and progress bars on a terminal only."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from sparkpoint.checkpoint.catalog import readable_size
from sparkpoint.checkpoint.progress import ProgressFn


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=1, default=str))


def printed_json(args: argparse.Namespace, data: Any) -> bool:
    """With --json, print `data` as JSON (and the caller prints nothing else)."""
    if args.json:
        print_json(data)
    return bool(args.json)


def write_text(path: str | None, text: str) -> None:
    """`text` into the file `path`, or to standard output without one."""
    if path:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)


def size(n: int | None) -> str:
    """A byte count as people read it ("" when not known)."""
    return "" if n is None else readable_size(n)


def key_range(key_groups: dict[str, int]) -> str:
    return f"{key_groups['start']}..{key_groups['end']}"


def _console(*, stderr: bool = False) -> Any:
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    # In a pipe rich would assume 80 columns and squeeze the tables; a file gets whole lines.
    return Console(file=stream, width=None if stream.isatty() else 200, highlight=False)


def table(title: str | None, columns: Sequence[str], rows: Sequence[Sequence[Any]], *, right: int = 0) -> None:
    """Print a table; the last `right` columns (numbers) are right-aligned."""
    from rich.table import Table
    from rich.text import Text

    drawn = Table(header_style="bold")
    for i, name in enumerate(columns):
        drawn.add_column(name, justify="right" if i >= len(columns) - right else "left", overflow="fold")
    for row in rows:  # as Text: a value with `[` (a file name, a reason) is printed literally, never as markup
        drawn.add_row(*(Text("" if v is None else str(v)) for v in row))
    console = _console()
    if title:  # above the table, not as its title: a title wider than the table would wrap
        console.print(title, markup=False)
    console.print(drawn)


@contextmanager
def progress_bar(args: argparse.Namespace, what: str) -> Iterator[ProgressFn | None]:
    """A rich progress bar of bytes on standard error when it is a terminal and `--json` is off; else
    None. The function it yields takes (bytes done, bytes in total), total 0 when it is not known."""
    if getattr(args, "json", False) or not sys.stderr.isatty():
        yield None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), console=_console(stderr=True)) as bar:
        task = bar.add_task(what, total=None)

        def update(done: int, total: int) -> None:  # total 0: not known in advance
            bar.update(task, completed=done, total=total or None)

        yield update
