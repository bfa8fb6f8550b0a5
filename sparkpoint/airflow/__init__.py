"""sparkpoint's Airflow provider: the same checkpoints, recovery and retention as the Dagster
integration, over the same orchestrator-neutral seam (`sparkpoint.pipeline`), for Airflow 3.

    from sparkpoint.airflow import sparkpoint_dag
    from my_project.pipelines import clicks

    dag = sparkpoint_dag(clicks, schedule="*/10 * * * *")

Operators: `SparkpointBatchOperator` (the Spark half), `SparkpointCheckpointOperator` (completes
it), `SparkpointUpgradeCheckOperator` (the upgrade pre-flight), `SparkpointRecoverOperator`,
`SparkpointPruneOperator`, `SparkpointVerifyOperator`, `SparkpointSavepointOperator`, and
`SparkpointLandingSensor`. Nothing else in sparkpoint imports
this package; installing `sparkpoint[airflow]` registers it (`airflow providers list`).
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "SparkpointBatchOperator": "sparkpoint.airflow.operators",
    "SparkpointCheckpointOperator": "sparkpoint.airflow.operators",
    "SparkpointRecoverOperator": "sparkpoint.airflow.operators",
    "SparkpointUpgradeCheckOperator": "sparkpoint.airflow.operators",
    "SparkpointPruneOperator": "sparkpoint.airflow.operators",
    "SparkpointVerifyOperator": "sparkpoint.airflow.operators",
    "SparkpointSavepointOperator": "sparkpoint.airflow.operators",
    "SparkpointLandingSensor": "sparkpoint.airflow.operators",
    "sparkpoint_dag": "sparkpoint.airflow.dags",
    "checkpoint_asset": "sparkpoint.airflow.dags",
    "checkpoint_alias": "sparkpoint.airflow.dags",
    "output_asset": "sparkpoint.airflow.dags",
}
__all__ = sorted([*_HOMES, "get_provider_info"])


def get_provider_info() -> dict[str, Any]:
    """What `airflow providers list` shows (the `apache_airflow_provider` entry point).

    Example:
        ```python
        get_provider_info()["package-name"]        # "sparkpoint"
        ```

    Returns:
        Airflow's provider-info dict: package name, versions, operator and sensor modules, asset URI scheme.
    """
    from sparkpoint import __version__

    return {
        "package-name": "sparkpoint",
        "name": "sparkpoint",
        "description": "Incremental, externalized checkpoints of keyed RocksDB state for PySpark pipelines: "
                       "batch, checkpoint, recovery, retention, verification and savepoints as Airflow tasks.",
        "versions": [__version__],
        "integrations": [{"integration-name": "sparkpoint", "external-doc-url": "https://pypi.org/project/sparkpoint/",
                          "tags": ["software"]}],
        "operators": [{"integration-name": "sparkpoint", "python-modules": ["sparkpoint.airflow.operators"]}],
        "sensors": [{"integration-name": "sparkpoint", "python-modules": ["sparkpoint.airflow.operators"]}],
        "asset-uris": [{"schemes": ["sparkpoint"]}],
    }


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    if name in ("dags", "operators"):  # listed by dir() once imported: they resolve before that too
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'sparkpoint.airflow' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
