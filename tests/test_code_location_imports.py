"""What a run process imports before its first step: Dagster's run worker imports the code
location (`sparkpoint.definitions`, the factory, assets, ops, sensors, resources) in every run, so
nothing there imports Spark or a table format's or object store's client; the steps import them
where they use them. (pandas, pyarrow and RocksDB stay: the state model that a pipeline's spec
declares is built on them, and the SSTable step's Spark Connect client imports pandas and
pyarrow whatever the location does.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NOT_AT_IMPORT = ("pyspark", "py4j", "grpc", "deltalake", "pyiceberg", "boto3", "botocore", "s3fs", "aiobotocore")


@pytest.mark.parametrize("module", ["sparkpoint.definitions", "sparkpoint.factory"])
def test_the_code_location_imports_no_spark_table_or_object_store_client(module: str):
    probe = (f"import json, sys, {module}; "
             f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & set({list(NOT_AT_IMPORT)!r}))))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == [], f"{module} imports them before any step runs"
