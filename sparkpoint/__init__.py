"""sparkpoint: incremental, externalized checkpoints of keyed RocksDB state for PySpark pipelines.

The public API, imported on first use (so that `import sparkpoint.checkpoint` in a Spark task
loads nothing more):

- your pipeline: `Pipeline` (its output a `ParquetDirectory`, a `DeltaTable` or an
  `IcebergTable`), `KeyedOperator` (its functions take a `RocksDBStateBackend`; its
  `states=` declares them, a codec or a `StateDescriptor` each), the state codecs `RecordCodec`
  (named, typed fields that evolve across restores), `JsonCodec`, `StructCodec`, `BytesCodec`;
  `compare_states` / `StateChange` say what a restore by new code does to each state (state handles:
  `state.value_state(name, codec)`, `state.map_state(name, codec)`,
  `state.list_state(name, codec)`, `state.reducing_state(name, codec, reduce)`, each with
  `ttl=StateTtl(seconds, update=..., clock=...)`);
- the notebook API (pandas DataFrames): `read_state`, `diff_state`, `list_checkpoints`, `registry`;
  `rollback` (a job and its output back to a retained checkpoint) and `erase_keys` (keys erased
  from every retained checkpoint, savepoint and the output, with proof);
- Dagster: `build_pipeline_defs(pipeline)` and the `PipelineComponent` of `dg` projects.

A subpackage is imported on first use as well (`sparkpoint.testing.OperatorHarness` after a bare
`import sparkpoint`), so every name `dir(sparkpoint)` lists resolves, whatever was imported before.
"""

import importlib
import importlib.util
from typing import Any

__version__ = "0.1.0"

_HOMES = {
    "Pipeline": "sparkpoint.pipeline.spec",
    "ParquetDirectory": "sparkpoint.tables.spec",
    "DeltaTable": "sparkpoint.tables.spec",
    "IcebergTable": "sparkpoint.tables.spec",
    "KeyedOperator": "sparkpoint.state.operators",
    "RocksDBStateBackend": "sparkpoint.state.backend",
    "JsonCodec": "sparkpoint.state.codecs",
    "StructCodec": "sparkpoint.state.codecs",
    "BytesCodec": "sparkpoint.state.codecs",
    "RecordCodec": "sparkpoint.state.record",
    "StateDescriptor": "sparkpoint.state.schema",
    "compare_states": "sparkpoint.state.schema",
    "StateChange": "sparkpoint.state.schema",
    "StateSchemaIncompatible": "sparkpoint.state.schema",
    "StateTtl": "sparkpoint.state.ttl",
    "read_state": "sparkpoint.api",
    "diff_state": "sparkpoint.api",
    "list_checkpoints": "sparkpoint.api",
    "registry": "sparkpoint.api",
    "rollback": "sparkpoint.api",
    "erase_keys": "sparkpoint.api",
    "history": "sparkpoint.api",
    "build_pipeline_defs": "sparkpoint.factory",
    "PipelineComponent": "sparkpoint.component",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    if _is_submodule(__name__, name):  # `sparkpoint.testing` works before `import sparkpoint.testing`
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'sparkpoint' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public names and whatever this process imported: every name resolves, in any process."""
    return sorted({*globals(), *__all__})


def _is_submodule(package: str, name: str) -> bool:
    """Whether `name` is a module or package inside `package` (found on disk; nothing is imported).
    A submodule shows in `dir()` once some import loaded it, so it must resolve before one did."""
    if not name.isidentifier() or name.startswith("_"):
        return False
    return importlib.util.find_spec(f"{package}.{name}") is not None
