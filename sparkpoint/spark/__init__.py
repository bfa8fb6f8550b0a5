"""The PySpark side: keyed-state operators on Spark partitions, source offsets, exactly-once sink.

Spark partitions are the subtasks: rows are routed by key group, each Spark task opens or
restores its subtask's RocksDB state through `sparkpoint.core`, applies the batch and snapshots.
"""
