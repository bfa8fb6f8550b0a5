"""The `sparkpoint` command: generate, run, skip, state, diff, verify, gc, list, inspect, registry, metrics,
restore, savepoint, rollback, bootstrap.

Also `check-upgrade`: what restoring a checkpoint into a changed pipeline would do, before running it.
Exit status: 0 fine, 1 `verify` found bad files or `check-upgrade` a restore that would be refused,
2 bad input (the message says what to fix), 3 the work failed while running (e.g. a Spark task
raised; the message names the cause).

The parser is in `parser` (one function per command), the commands by family in `run` (run,
follow, skip, generate), `state` (state, diff, restore, check-upgrade, bootstrap), `catalog`
(list, inspect, registry, metrics) and `maintenance` (verify, gc, savepoint, rollback); `common` reads the arguments
every command shares and `output` prints.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Sequence

from sparkpoint.checkpoint.errors import SparkpointError
from sparkpoint.cli.common import (
    EXIT_BAD_FILES,
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_REFUSED,
    EXIT_TERMINATED,
    UsageError,
)
from sparkpoint.cli.parser import build_parser

__all__ = ["EXIT_BAD_FILES", "EXIT_BAD_INPUT", "EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_REFUSED", "EXIT_TERMINATED",
           "UsageError", "build_parser", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command `argv` (default: this process's arguments) and return its exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    logging.getLogger("sparkpoint.spark.warm").setLevel(logging.INFO)  # which warm Spark a run attached to
    if args.verbose:
        os.environ["SPARKPOINT_VERBOSE"] = "1"  # also for the processes it starts
    try:
        return int(args.fn(args))
    except KeyboardInterrupt:  # before `run` had anything to report, or in any other command
        # One Ctrl-C is the whole answer: a second one while the process exits (Spark's threads,
        # Python's shutdown) would print a traceback after the one line. Only when this process is
        # the command (`argv` None): a caller's process, and what it starts later, keeps its Ctrl-C.
        if argv is None:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        print(f"sparkpoint {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `sparkpoint list | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (UsageError, SparkpointError, ValueError, FileNotFoundError) as e:
        print(f"sparkpoint {args.command}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as e:  # e.g. a Spark task's error, which arrives as a long Java/Python trace
        logging.getLogger("sparkpoint").debug("failure", exc_info=True)
        print(f"sparkpoint {args.command}: failed: {_cause(e)}", file=sys.stderr)
        return EXIT_FAILED


def _cause(error: BaseException) -> str:
    """The most telling line of an error: the last 'SomethingError: …' line of its text."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    causes = [line for line in lines if "Error: " in line or "Exception: " in line or "Corrupted: " in line]
    return (causes[-1] if causes else lines[-1] if lines else type(error).__name__)[:2000]
