"""The clickstream example's own `clicks` pipeline (`examples/clickstream`: clicks and latest click
per user, a ValueState) as an Airflow DAG that runs whenever a batch file lands in its input
(`.sparkpoint/clicks/input`): `python -m clickstream.land --batches 3 --into .sparkpoint/clicks/input`."""

import sys
from pathlib import Path

# The example project beside this folder; an installed project needs no such line.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "clickstream"))

from clickstream.pipelines import clicks  # noqa: E402

from sparkpoint.airflow import sparkpoint_dag  # noqa: E402

dag = sparkpoint_dag(clicks, on_landing=True)
