"""The sample pipeline: a `Pipeline` like any user's, with the two sample operators
(`sparkpoint.state.sample`: `user_totals`, `item_reach`) over the sample events of
`sparkpoint generate`, at the locations `make run` and the Dagster code location use by default.
"""

from __future__ import annotations

from sparkpoint.pipeline.spec import Pipeline
from sparkpoint.state.sample import SAMPLE_OPERATORS

pipeline = Pipeline(
    "sparkpoint", SAMPLE_OPERATORS, job_id="demo",
    input_url=".sparkpoint/demo/input", checkpoints_url=".sparkpoint/checkpoints",
    output_url=".sparkpoint/demo/output", local_dir=".sparkpoint/local",
)
