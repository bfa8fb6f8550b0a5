"""The project's pipelines. Locations left unset live under `.sparkpoint/<name>/` (input,
checkpoints, local state) in the directory Dagster runs in; set them to any fsspec URL."""

from __future__ import annotations

from clickstream.operators import clicks_per_user
from sparkpoint import Pipeline

# Built in Python and turned into Dagster definitions in defs/clicks.py. The `pages` pipeline
# is declared in defs/pages/defs.yaml through sparkpoint.PipelineComponent.
clicks = Pipeline("clicks", [clicks_per_user], output_url=".sparkpoint/clicks/output", num_retained=2)
