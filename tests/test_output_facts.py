"""The output asset's facts come from the checkpoint's own part files (its `_metadata`'s sink
entries), in a directory whose name needs no escaping to be taken literally; a part file that
cannot be read is named, never raised (the checkpoint is already committed when they are read)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from sparkpoint.tables.parquet import ExactlyOnceParquetSink, part_name
from sparkpoint.tables.sinks import output_facts


def test_facts_read_the_checkpoints_own_files_and_name_a_damaged_one(tmp_path: Path):
    out = tmp_path / "out [1] #2"  # glob and URL characters in the user's path, taken literally
    sink = ExactlyOnceParquetSink.at(str(out), "job")
    rows = pd.DataFrame({"user": ["a", "b", "c"], "clicks": [1, 2, 3]})
    staged = [*sink.stage(4, "clicks", 0, rows.iloc[:2]), *sink.stage(4, "clicks", 1, rows.iloc[2:])]
    assert all(staged)
    sink.commit(4, [s for s in staged if s])
    [other] = sink.stage(5, "clicks", 0, rows)  # another checkpoint's file: not counted
    assert other is not None
    sink.commit(5, [other])

    facts = output_facts(sink, 4, [s for s in staged if s])
    assert (facts["files"], facts["rows"], facts["unreadable"]) == (2, 3, [])
    assert list(facts["columns"]) == ["user", "clicks", "checkpoint_id"]

    (out / part_name("job", 4, "clicks", 1)).write_bytes(b"not parquet")  # one flipped file
    damaged = output_facts(sink, 4, [s for s in staged if s])
    assert (damaged["files"], damaged["rows"]) == (1, 2)
    assert len(damaged["unreadable"]) == 1 and part_name("job", 4, "clicks", 1) in damaged["unreadable"][0]
