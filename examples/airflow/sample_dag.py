"""The sample pipeline as an Airflow DAG, on its embedded defaults (input `.sparkpoint/demo/input`,
checkpoints `.sparkpoint/checkpoints`, relative to where Airflow runs the tasks). Land batches with
`sparkpoint generate --out .sparkpoint/demo/input --batches 3 --events-per-batch 20000 --users 5000 --items 500`; trigger `sparkpoint_sparkpoint`."""

from sparkpoint.airflow import sparkpoint_dag
from sparkpoint.sample import pipeline

dag = sparkpoint_dag(pipeline, schedule=None)
