"""sparkpoint: incremental, externalized checkpoints of keyed RocksDB state for PySpark pipelines."""

__version__ = "0.1.0"
