"""The orchestrator-neutral seam: a pipeline's driver (`runtime`, `driver`), the two-step attempt
that Dagster and Airflow drive (`attempt`: run the Spark half of a batch, complete a pending
attempt), the maintenance actions (`maintenance`: recover, prune, verify, checkpoint facts) and
the settings with Flink's aliases (`settings`).

Imports `sparkpoint.checkpoint`, `sparkpoint.state` and `sparkpoint.spark`, never an orchestrator.
"""
