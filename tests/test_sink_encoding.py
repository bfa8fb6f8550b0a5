"""A staged output file holds exactly the changed rows and their checkpoint id, dtypes included;
only its encoding is chosen per column (dictionary for few-valued columns, plain for columns of
mostly distinct values, which changed rows usually are)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from sparkpoint.tables.files import dictionary_columns
from sparkpoint.tables.parquet import ExactlyOnceParquetSink


def test_staged_rows_read_back_exactly_and_only_few_valued_columns_are_dictionary_encoded(tmp_path: Path):
    n = 3000
    rows = pd.DataFrame({
        "user_id": pd.Series([f"u{i:07d}" for i in range(n)], dtype="string"),
        "country": pd.Series(["fr", "de", "jp"] * (n // 3), dtype="string"),
        "amount": np.linspace(0.5, 999.5, n),
        "count": np.arange(n, dtype="int64") % 7,
        "last_ts": pd.Series(pd.to_datetime(np.arange(n) * 1_000_000, unit="us", utc=True)).astype(
            "datetime64[us, UTC]"),
    }, index=pd.RangeIndex(10, 10 + n))  # a subtask's rows need not start at row 0
    sink = ExactlyOnceParquetSink.at(str(tmp_path / "out"), "job")
    [staged] = sink.stage(3, "totals", 1, rows)
    assert staged is not None
    path = tmp_path / "out" / "_staging" / "job" / staged

    back = pd.read_parquet(path)
    expected = rows.reset_index(drop=True).assign(checkpoint_id=pd.Series([3] * n, dtype="int64"))
    pd.testing.assert_frame_equal(back, expected)

    group = pq.ParquetFile(path).metadata.row_group(0)
    dictionary = {group.column(i).path_in_schema for i in range(group.num_columns)
                  if group.column(i).dictionary_page_offset is not None}
    assert dictionary == {"country", "count", "checkpoint_id"}


def test_a_users_list_struct_and_map_columns_are_staged_and_read_back(tmp_path: Path):
    # A user's operator may emit nested columns (a list state's items, a struct, a map), which
    # Arrow cannot count distinct values of: they are written with pyarrow's default encoding.
    n = 50
    rows = pd.DataFrame({
        "session": [f"s{i}" for i in range(n)],
        "pages": [[f"/p{j}" for j in range(i % 4)] for i in range(n)],
        "first": [{"page": f"/p{i}", "at": i} for i in range(n)],
    })
    sink = ExactlyOnceParquetSink.at(str(tmp_path / "out"), "job")
    [staged] = sink.stage(7, "sessions", 0, rows)
    assert staged is not None
    back = pq.read_table(tmp_path / "out" / "_staging" / "job" / staged).to_pylist()
    assert [r["pages"] for r in back] == rows["pages"].tolist()
    assert [r["first"] for r in back] == rows["first"].tolist()
    assert {r["checkpoint_id"] for r in back} == {7}
    tags = pa.table({"k": ["a", "b"], "tags": pa.array([[("x", 1)], []], type=pa.map_(pa.string(), pa.int64()))})
    assert dictionary_columns(tags) is True
