"""The RocksDB keyed-state backend over the checkpoint protocol (rocksdict): state handles and
codecs, key groups, incremental snapshots, the state changelog, verified restore, task-local
recovery, repair, verification and extraction of a checkpoint's state, keyed operators.

Imports `sparkpoint.checkpoint`, never Spark or an orchestrator.
"""
