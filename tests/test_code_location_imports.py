"""What a run process imports before its first step: Dagster's run worker, a sensor tick's code
server and an Airflow DAG parse import the code location (`sparkpoint.definitions`, the factory,
the component, the Airflow provider with a pipeline's declarations) in every process, so nothing
there imports Spark, RocksDB, pandas, pyarrow, numpy, a table format's or an object store's client:
the steps import them when they run (`sparkpoint.lazy`, or an import inside the function). The
second test runs a step after the same import and sees the libraries arrive, so the probe that
finds them absent is one that would find them present."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NOT_AT_IMPORT = ("pyspark", "py4j", "grpc", "rocksdict", "pandas", "pyarrow", "numpy", "deltalake", "pyiceberg",
                 "boto3", "botocore", "s3fs", "aiobotocore")
LOADED = "json.dumps(sorted({m.split('.')[0] for m in sys.modules} & set(NOT_AT_IMPORT)))"
# What each front end's process imports: Dagster's code location (module, factory, `dg` component)
# and an Airflow DAG file (the provider and a pipeline's declarations).
LOCATIONS = ["sparkpoint.definitions", "sparkpoint.factory", "sparkpoint.component",
             "sparkpoint.airflow.dags, sparkpoint.sample"]

A_STEP = """
import pandas as pd
from sparkpoint.state.codecs import StructCodec
from sparkpoint.state.operators import KeyedOperator
from sparkpoint.testing import OperatorHarness

SPENT = StructCodec("<d")

def process(batch, state):
    spent = batch.groupby("buyer")["price"].sum()
    state.value_state("spent", SPENT).update_many(
        spent.index.tolist(), lambda k, old: ((old[0] if old else 0.0) + float(spent[k]),))

def export(state):
    return pd.DataFrame([(k.decode(), v[0]) for k, v in state.value_state("spent", SPENT).items()],
                        columns=["buyer", "spent"])

with OperatorHarness(KeyedOperator("spend", key="buyer", columns=("price",), process=process, export=export),
                     parallelism=2) as h:
    h.process(pd.DataFrame({"buyer": ["ann", "bo", "ann"], "price": [2.5, 1.0, 4.0]}))
    h.snapshot()
    spent = dict(h.export().sort_values("buyer").itertuples(index=False))
"""


def probe(code: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", f"import json, sys\nNOT_AT_IMPORT = {NOT_AT_IMPORT!r}\n{code}"],
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()


@pytest.mark.parametrize("modules", LOCATIONS)
def test_the_code_location_imports_no_step_library(modules: str):
    loaded = json.loads(probe(f"import {modules}\nprint({LOADED})")[-1])
    assert loaded == [], f"importing {modules} loads {loaded} before any step runs"


def test_a_step_after_the_location_import_loads_the_libraries_it_uses():
    """The location imported first (each library absent), then a step on real RocksDB through the
    operator harness: its answer is right and RocksDB, numpy and pyarrow arrived through the
    modules that use them."""
    before, after, spent = probe(f"import sparkpoint.definitions\nprint({LOADED})\n{A_STEP}\n"
                                 f"print({LOADED})\nprint(json.dumps(spent))")[-3:]
    assert json.loads(before) == []
    assert {"rocksdict", "pandas", "pyarrow", "numpy"} <= set(json.loads(after))
    assert json.loads(spent) == {"ann": 6.5, "bo": 1.0}
