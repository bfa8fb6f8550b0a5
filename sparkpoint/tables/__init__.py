"""Where a pipeline's output goes and where its input comes from, as tables: a directory of Parquet
files, a Delta Lake table (delta-rs) or an Apache Iceberg table (pyiceberg).

`spec` holds the values a user names (`ParquetDirectory`, `DeltaTable`, `IcebergTable`) and their URL
forms (`delta+file:///...`, `iceberg://<catalog>/<namespace>.<table>`); `sink` the protocol every
exactly-once sink keeps with the checkpoint protocol, and `sinks.open_sink` the sink an output names:
`parquet` (staged files moved to their visible names), `delta` (staged files committed in one Delta
transaction per checkpoint, its plain-data pieces in `delta_parts`), `iceberg`. `files` writes and
reads the Parquet files they all stage. The package knows no Spark and no orchestrator: tables are
committed on the driver, between a checkpoint's `_metadata` and its registry entry.
"""
