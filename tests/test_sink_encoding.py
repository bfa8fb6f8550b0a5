"""A staged output file holds exactly the changed rows and their checkpoint id, dtypes included;
only its encoding is chosen per column (dictionary for few-valued columns, plain for columns of
mostly distinct values, which changed rows usually are)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

from sparkpoint.spark.sink import ExactlyOnceParquetSink


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
    staged = sink.stage(3, "totals", 1, rows)
    assert staged is not None
    path = tmp_path / "out" / "_staging" / "job" / staged

    back = pd.read_parquet(path)
    expected = rows.reset_index(drop=True).assign(checkpoint_id=pd.Series([3] * n, dtype="int64"))
    pd.testing.assert_frame_equal(back, expected)

    group = pq.ParquetFile(path).metadata.row_group(0)
    dictionary = {group.column(i).path_in_schema for i in range(group.num_columns)
                  if group.column(i).dictionary_page_offset is not None}
    assert dictionary == {"country", "count", "checkpoint_id"}
