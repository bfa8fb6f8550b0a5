"""sparkpoint: incremental, externalized checkpoints of keyed RocksDB state for PySpark pipelines.

The public API, imported on first use (so that `import sparkpoint.checkpoint` in a Spark task
loads nothing more):

- your pipeline: `Pipeline`, `KeyedOperator` (its functions take a `RocksDBStateBackend`; its
  `states=` declares them, a codec or a `StateDescriptor` each), the state codecs `RecordCodec`
  (named, typed fields that evolve across restores), `JsonCodec`, `StructCodec`, `BytesCodec`;
  `compare_states` / `StateChange` say what a restore by new code does to each state (state handles:
  `state.value_state(name, codec)`, `state.map_state(name, codec)`,
  `state.list_state(name, codec)`, `state.reducing_state(name, codec, reduce)`, each with
  `ttl=StateTtl(seconds, update=..., clock=...)`);
- the notebook API (pandas DataFrames): `read_state`, `diff_state`, `list_checkpoints`, `registry`;
- Dagster: `build_pipeline_defs(pipeline)` and the `PipelineComponent` of `dg` projects.
"""

import importlib
from typing import Any

__version__ = "0.1.0"

_HOMES = {
    "Pipeline": "sparkpoint.pipeline.spec",
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
    "build_pipeline_defs": "sparkpoint.factory",
    "PipelineComponent": "sparkpoint.component",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'sparkpoint' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
