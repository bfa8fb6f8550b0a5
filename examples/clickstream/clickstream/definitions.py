"""The project's code location: everything under `clickstream/defs/` (a Python-built pipeline and
a `defs.yaml` one), as `dg dev` and `dg check defs` load it."""

from pathlib import Path

import dagster as dg


@dg.definitions
def defs() -> dg.Definitions:
    return dg.load_from_defs_folder(path_within_project=Path(__file__).parent)
