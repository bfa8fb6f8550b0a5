"""The sample pipeline: a `Pipeline` like any user's, with the two sample operators
(`sparkpoint.state.sample`: `user_totals`, `item_reach`) over the sample events of
`sparkpoint generate`, at the locations `make run` and the Dagster code location use by default.
"""

from __future__ import annotations

from sparkpoint.checkpoint.errors import OperatorStateMismatch
from sparkpoint.pipeline.spec import Pipeline
from sparkpoint.state.operators import KeyedOperator
from sparkpoint.state.sample import SAMPLE_OPERATORS

pipeline = Pipeline(
    "sparkpoint", SAMPLE_OPERATORS, job_id="demo",
    input_url=".sparkpoint/demo/input", checkpoints_url=".sparkpoint/checkpoints",
    output_url=".sparkpoint/demo/output", local_dir=".sparkpoint/local",
)


def operator(name: str) -> KeyedOperator:
    """The sample operator called `name`: what a command or notebook call that names an operator
    without its pipeline reads through (`sparkpoint state --operator user_totals` without
    `--pipeline`, `sparkpoint.read_state(url, job, "user_totals")`).

    Raises:
        OperatorStateMismatch: no sample operator of that name (the message lists them).
    """
    for op in pipeline.operators:
        if op.name == name:
            return op
    raise OperatorStateMismatch(
        f"unknown operator {name!r}; the sample pipeline has {', '.join(op.name for op in pipeline.operators)}; "
        "for your own operator pass the KeyedOperator (or --pipeline MODULE:ATTR)"
    )
