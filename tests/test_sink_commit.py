"""The exactly-once sink's commit and rollback: a commit that finds its output gone is an error,
a rollback or a staging touches only its own job's files, whatever characters the output
directory's name holds."""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd
import pytest

from sparkpoint.tables.parquet import ExactlyOnceParquetSink, SinkOutputLost


def test_a_sink_commit_that_finds_neither_its_staged_nor_its_part_file_is_an_error(tmp_path: Path):
    sink = ExactlyOnceParquetSink.at(str(tmp_path / "out"), "job")
    [staged] = sink.stage(3, "balances", 0, pd.DataFrame({"acct": ["a"], "balance": [1]}))
    assert staged is not None
    assert sink.commit(3, [staged]) == 1
    assert sink.commit(3, [staged]) == 0, "a repeat (or another process settling the same checkpoint) is fine"
    for path in sink.committed()[3]:
        os.unlink(path)
    with pytest.raises(SinkOutputLost, match="checkpoint 3 is committed with output .* rows it wrote are lost"):
        sink.commit(3, [staged])


def test_a_later_start_leaves_a_finished_commits_output_alone_but_a_commit_never_guesses(tmp_path: Path):
    from sparkpoint.testing import FaultyFileSystem

    sink = ExactlyOnceParquetSink.at(str(tmp_path / "out"), "job")
    [staged] = sink.stage(4, "balances", 0, pd.DataFrame({"acct": ["a"], "balance": [1]}))
    assert staged is not None
    sink.commit(4, [staged])
    for path in sink.committed()[4]:
        os.unlink(path)  # a downstream job moved the part file away after reading it
    assert sink.commit(4, [staged], resuming=True) == 0, "a later start: the commit had finished"
    with pytest.raises(SinkOutputLost):
        sink.commit(4, [staged])
    from sparkpoint.tables.files import present as _present
    from sparkpoint.tables.sink import SinkError

    flaky = FaultyFileSystem(str(tmp_path), rate=1.0, kinds=("read_error",))
    with pytest.raises(SinkError, match="cannot tell whether"):
        _present(flaky, str(tmp_path / "out"))


def _stage_and_commit(sink, checkpoint_id: int, rows: int = 3) -> None:
    import pandas as pd

    frame = pd.DataFrame({"user_id": [f"u{i}" for i in range(rows)], "count": list(range(rows))})
    [staged] = sink.stage(checkpoint_id, "user_totals", 0, frame)
    sink.commit(checkpoint_id, [staged])


def test_one_jobs_rollback_never_deletes_another_jobs_output(tmp_path: Path):
    from sparkpoint.tables.parquet import ExactlyOnceParquetSink

    out = f"file://{tmp_path}/out[x]"  # and a glob character in the output directory
    etl = ExactlyOnceParquetSink.at(out, "etl")
    dated = ExactlyOnceParquetSink.at(out, "etl-20240101")
    _stage_and_commit(dated, 3)
    _stage_and_commit(etl, 1)
    _stage_and_commit(etl, 123_456_789)  # ids of nine digits and more parse too
    assert sorted(etl.committed()) == [1, 123_456_789]
    assert sorted(dated.committed()) == [3]
    assert etl.rollback(after=0) == [1, 123_456_789]
    assert sorted(dated.committed()) == [3], "job etl took none of job etl-20240101's files"
    assert etl.committed() == {}


def test_staging_of_an_output_directory_with_brackets_touches_no_sibling(tmp_path: Path):
    from sparkpoint.tables.parquet import ExactlyOnceParquetSink

    sibling = tmp_path / "outx" / "_staging" / "etl" / "chk-1"
    sibling.mkdir(parents=True)
    (sibling / "keep.parquet").write_bytes(b"not ours")
    sink = ExactlyOnceParquetSink.at(f"file://{tmp_path}/out[x]", "etl")
    _stage_and_commit(sink, 1)
    sink.discard_staging(up_to=5)
    assert (sibling / "keep.parquet").read_bytes() == b"not ours"
    assert sorted(sink.committed()) == [1]


def test_discarding_staged_files_refuses_names_that_leave_the_staging_directory(tmp_path: Path):
    from sparkpoint.tables.parquet import ExactlyOnceParquetSink
    from sparkpoint.tables.sink import SinkError

    precious = tmp_path / "precious.parquet"
    precious.write_bytes(b"keep")
    sink = ExactlyOnceParquetSink.at(f"file://{tmp_path}/out", "etl")
    hostile = ["chk-3/user_totals-00000-0123456789ab.parquet", "../../../precious.parquet"]
    with pytest.raises(SinkError, match="precious"):
        sink.discard_staged(3, hostile)  # e.g. from a tampered _pending/*.json
    assert precious.read_bytes() == b"keep"
