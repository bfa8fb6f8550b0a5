"""The product's batch loop into a Delta table, without Spark, for crash-point tests: the ledger
pipeline (`tests.support.ledger_pipeline`) driven by `StatefulPipeline.run` (begin, the sink's
settling, each batch's checkpoint and table commit), its subtasks run in process as the
interleaving checker runs them, so a test can kill and resume it many times in the time one JVM
takes to start.

    python -m tests.support.delta_crash_driver ROOT

reads `ROOT/in`, checkpoints to `ROOT/ckpt` (job `ledger`), writes the table `ROOT/table`.
"""

from __future__ import annotations

import sys

from tests.support.interleavings import InProcessPipeline
from tests.support.ledger_pipeline import ledger


def main(root: str) -> None:
    config = ledger.config(input_url=f"{root}/in", checkpoints_url=f"file://{root}/ckpt",
                           output_url=f"delta+file://{root}/table", local_dir=f"{root}/local", num_retained=2)
    for report in InProcessPipeline(None, config, ledger.operators).run():
        print(report.line(), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
