"""Libraries imported on first use, so that importing a pipeline's declarations costs no step's
libraries.

Dagster's run worker, a sensor tick's code server and an Airflow DAG parse import the code location
(the pipeline, its operators and codecs, the factory) but may run no step; numpy, pandas, pyarrow
and rocksdict cost about a second of CPU to import. A module that uses one binds the stand-in
`lazy_module` returns: the library is imported when a name is first read from it (in a step), and
from then on the stand-in holds the library's names, so a read costs what a module's does. Type
checkers and import-linter see the real import under `TYPE_CHECKING`:

    if TYPE_CHECKING:
        import pandas as pd
    else:
        pd = lazy_module("pandas")
"""

from __future__ import annotations

import importlib
import types
from typing import Any


class _StandIn(types.ModuleType):
    """A module object that pickles as its library's name (so a function pickled by value, as
    Spark ships a closure to its workers, finds the real library there, loaded or not here)."""

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return importlib.import_module, (self.__name__,)


def lazy_module(name: str) -> types.ModuleType:
    """A module object standing in for `name`: not imported (nor in `sys.modules`) until an
    attribute is read, then filled with the module's names; names the module gains later (a
    submodule imported afterwards) are read through from it."""
    stand_in = _StandIn(name, f"{name}, imported on first use")

    def load(attr: str) -> Any:
        module = importlib.import_module(name)
        stand_in.__dict__.update(module.__dict__)
        stand_in.__dict__["__getattr__"] = lambda later: getattr(module, later)
        return getattr(module, attr)

    stand_in.__dict__["__getattr__"] = load
    return stand_in
