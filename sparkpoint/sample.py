"""The sample pipeline: a `Pipeline` like any user's, with the two sample operators
(`sparkpoint.state.sample`: `user_totals`, `item_reach`) over the sample events of
`sparkpoint generate`, at the locations `make run` and the Dagster code location use by default
(its output a Delta table, `.sparkpoint/demo/output`);
and its stream, which `land_sample_batch` continues one batch at a time (the code location's
checkpoint step calls it when it finds no unconsumed batch, so a fresh checkout makes progress).
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Sequence

from sparkpoint.checkpoint.errors import OperatorStateMismatch
from sparkpoint.pipeline.spec import Pipeline
from sparkpoint.state.operators import KeyedOperator
from sparkpoint.state.sample import SAMPLE_OPERATORS
from sparkpoint.tables.spec import DeltaTable

pipeline = Pipeline(
    "sparkpoint", SAMPLE_OPERATORS, job_id="demo",
    input_url=".sparkpoint/demo/input", checkpoints_url=".sparkpoint/checkpoints",
    output=DeltaTable(".sparkpoint/demo/output"), local_dir=".sparkpoint/local",
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


_BATCH_NAME = re.compile(r"batch-(\d{6})\.parquet")


def land_sample_batch(input_url: str, consumed: Sequence[str] = ()) -> str:
    """Write the next batch of the sample stream under `input_url` and return its URL, numbered
    after every batch present or `consumed`: a consumed file that was removed must not be written
    again under its name (the source would skip it for ever)."""
    import fsspec

    from sparkpoint.spark.generate import generate

    fs, root = fsspec.core.url_to_fs(input_url)
    present = [posixpath.basename(p.rstrip("/")) for p in fs.ls(root, detail=False)] if fs.isdir(root) else []
    numbers = [int(m.group(1)) for n in [*present, *consumed] if (m := _BATCH_NAME.fullmatch(n))]
    return generate(input_url, batches=1, first=max(numbers, default=-1) + 1, events_per_batch=20_000, users=5_000,
                    items=500, seed=42)[0]
