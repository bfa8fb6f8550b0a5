"""What runs on Spark: the session, the Spark tasks that run every operator's subtasks on
partitions (local, standalone master), the directory source and its offsets, injected failures and
the sample data generator. The exactly-once sinks the tasks stage into are `sparkpoint.tables`'.

Spark tasks are the subtasks: each task keeps the batch's rows of its key groups, opens or restores
its subtask's RocksDB state through `sparkpoint.state`, applies the rows and snapshots.
"""
