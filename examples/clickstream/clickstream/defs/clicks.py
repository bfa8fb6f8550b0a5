"""The `clicks` pipeline as Dagster definitions, built in Python."""

from clickstream.pipelines import clicks
from sparkpoint import build_pipeline_defs

defs = build_pipeline_defs(clicks, owners=["team:web-analytics"], tags={"domain": "clickstream"})
