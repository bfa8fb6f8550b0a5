"""`Sink.erase_rows` in a process of its own that a test kills (SIGKILL, no cleanup) right before
its n-th storage step (`sparkpoint.checkpoint.interleave`), or lets finish and prints the steps
it made (their ops, in order).

`changing_steps` picks the steps worth a kill: those that change storage (a kill before a read
leaves what a kill before the change after it leaves), the ends of a run of alike ones.

    python -m tests.support.erase_driver OUTPUT JOB COLUMN VALUE [DIE_AT]

An Iceberg OUTPUT's catalog properties come as JSON in `ERASE_CATALOG`.
"""

from __future__ import annotations

import json
import os
import signal
import sys

from sparkpoint.checkpoint.interleave import set_step_hook
from sparkpoint.tables.sinks import open_sink


def main(output: str, job: str, column: str, value: str, die_at: int = 0) -> None:
    steps: list[str] = []

    def hook(op: str, path: str) -> None:
        steps.append(op)
        if len(steps) == die_at:
            os.kill(os.getpid(), signal.SIGKILL)

    sink = open_sink(output, job, catalog=json.loads(os.environ.get("ERASE_CATALOG", "null")))
    set_step_hook(hook)
    erased = sink.erase_rows(column, [value])
    set_step_hook(None)
    print(json.dumps({"steps": steps, "erased": erased.to_json()}))


CHANGES = frozenset({"write", "move", "delete", "create", "upload", "rmdir"})


def changing_steps(ops: list[str]) -> list[int]:
    """The 1-based numbers of the steps that change storage, of a run of the same op its first
    and last only (a kill between two copies of a run leaves what a kill at its ends leaves: some
    files done, some not), and the last step."""
    changing = [i for i, op in enumerate(ops, 1) if op in CHANGES]
    ends = {i for n, i in enumerate(changing)
            if n in (0, len(changing) - 1) or ops[changing[n - 1] - 1] != ops[i - 1]
            or ops[changing[n + 1] - 1] != ops[i - 1]}
    return sorted({*ends, len(ops)})


if __name__ == "__main__":
    main(*sys.argv[1:5], *(int(a) for a in sys.argv[5:6]))
