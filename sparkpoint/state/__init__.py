"""The RocksDB keyed-state backend over the checkpoint protocol (rocksdict), in two rooms.

The state model, what an operator writes against: the kinds of state (`kinds`), codecs and the
record schema (`codecs`, `record`, `schema`), TTL (`ttl`), timers (`timers`), event time
(`eventtime`), key groups (`keygroups`), and the rewriting of records whose fields changed
(`migration`). It imports no storage engine and no rocksdict: the kinds reach storage through
`kinds.StateStore`.

The storage engine (`engine`): RocksDB, the local state of a subtask, incremental snapshots, the
changelog, verified restore, task-local recovery, repair and verification.

Over both: `backend.RocksDBStateBackend` (the `state` an operator receives: it holds the engine's
parts and opens the model's kinds), keyed operators (`operators`, `sample`), and what reads a
checkpoint's state (`extract`, `diff`).

Imports `sparkpoint.checkpoint`, never Spark or an orchestrator.
"""
