"""The "Faster: whole batches at once" examples of docs/writing-operators.md run, and both ways of
counting agree."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from sparkpoint.checkpoint.storage import CheckpointStorage
from tests.support.backends import make_backend
from tests.support.docs_text import python_blocks, section


def operator_examples() -> dict[str, object]:
    namespace: dict[str, object] = {}
    for block in python_blocks(section("writing-operators.md", "## Faster: whole batches at once")):
        exec(compile(block, "docs/writing-operators.md", "exec"), namespace)
    return namespace


def test_the_readme_operators_count_the_same(local_storage: CheckpointStorage, tmp_path: Path):
    ns = operator_examples()
    rng = np.random.default_rng(3)
    batches = [pd.DataFrame({"user_id": [f"u{i}" for i in rng.integers(0, 300, 2000)]}) for _ in range(3)]
    counts = {}
    for name in ("process", "process_fast"):
        state = make_backend(local_storage, tmp_path / name, operator=name.replace("_", "-"))
        with state:
            state.restore(None)
            for batch in batches:
                ns[name](batch, state)  # type: ignore[operator]
            counts[name] = ns["export"](state).set_index("user_id")["count"].to_dict()  # type: ignore[operator]
    expected = pd.concat(batches)["user_id"].value_counts().to_dict()
    assert counts["process"] == counts["process_fast"] == expected
    assert ns["clicks"].name == "clicks"  # type: ignore[attr-defined]
