"""A Spark session set up for sparkpoint: one shuffle partition per (operator, subtask)."""

from __future__ import annotations

import os
import sys
import warnings

from pyspark.sql import SparkSession

from sparkpoint.spark.faults import arm_crash_points


def spark_session(master: str = "local[*]", *, app_name: str = "sparkpoint", ui: bool = False) -> SparkSession:
    # pandas 3 works for what sparkpoint asks of PySpark (Arrow batches in and out); PySpark 4.3
    # warns on every UDF all the same.
    warnings.filterwarnings("ignore", message="PySpark does not yet fully support pandas", category=FutureWarning)
    os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
    # Executors run the same Python as the driver (and so find sparkpoint installed).
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    builder = (
        SparkSession.builder.master(master)
        .appName(app_name)
        .config("spark.ui.enabled", str(ui).lower())
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        # Keep one group per task: coalescing would serialize subtasks in one task.
        .config("spark.sql.adaptive.coalescePartitions.enabled", "false")
    )
    for key, value in arm_crash_points().items():  # tests only: named crash points reach the executors
        builder = builder.config(f"spark.executorEnv.{key}", value)
    if master.startswith("local"):  # nothing outside this machine needs to reach the driver
        builder = builder.config("spark.driver.bindAddress", "127.0.0.1").config("spark.driver.host", "127.0.0.1")
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark
