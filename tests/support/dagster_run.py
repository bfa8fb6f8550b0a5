"""A Dagster run of the sample pipeline in a process of its own, as a run worker executes one:
`python -m tests.support.dagster_run DIR` materializes the sample's assets over DIR/in (resources as
`tests.support.dagster_setup` points them, in DIR). Dagster's run termination interrupts such a process
with SIGINT (SIGTERM is mapped to the same handler); during resource setup the interrupt is
raised in whatever the Spark resource is doing."""

from __future__ import annotations

import sys
from pathlib import Path

import dagster as dg

from tests.support.dagster_setup import materialize

if __name__ == "__main__":
    result = materialize(Path(sys.argv[1]), dg.DagsterInstance.ephemeral(), raise_on_error=False)
    print("success" if result.success else "failure", flush=True)
