"""`Sink.erase_rows` in a process of its own that a test kills (SIGKILL, no cleanup) right before
its n-th storage step (`sparkpoint.checkpoint.interleave`), or lets finish and prints the steps
it made.

    python -m tests.support.erase_driver OUTPUT JOB COLUMN VALUE [DIE_AT]
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

    sink = open_sink(output, job)
    set_step_hook(hook)
    erased = sink.erase_rows(column, [value])
    set_step_hook(None)
    print(json.dumps({"steps": len(steps), "erased": erased.to_json()}))


if __name__ == "__main__":
    main(*sys.argv[1:5], *(int(a) for a in sys.argv[5:6]))
