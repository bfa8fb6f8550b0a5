"""sparkpoint: incremental, externalized checkpoints of keyed RocksDB state for PySpark pipelines.

The notebook API (pandas DataFrames) is importable from here: `sparkpoint.list_checkpoints`,
`sparkpoint.read_state`, `sparkpoint.registry` (see `sparkpoint.api`). It is imported on first
use, so that `import sparkpoint.checkpoint` in a Spark task does not load it.
"""

import importlib
from typing import Any

__version__ = "0.1.0"
__all__ = ["list_checkpoints", "read_state", "registry"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("sparkpoint.api"), name)
    raise AttributeError(f"module 'sparkpoint' has no attribute {name!r}")
