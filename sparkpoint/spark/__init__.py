"""The PySpark side: keyed-state operators on Spark partitions, source offsets, exactly-once sink.

Spark tasks are the subtasks: each task keeps the batch's rows of its key groups, opens or restores
its subtask's RocksDB state through `sparkpoint.core`, applies the rows and snapshots.
"""
