"""Schema evolution on Spark (issue 33): a user's operator (`tests.support.loyalty_pipeline`) runs with its
first RecordCodec at parallelism 2, a savepoint is taken, and the changed code (every compatible
rule) starts from it at parallelism 3: its state equals the pandas recomputation, as exported by
the operator and raw from `_metadata` alone. Real local Spark, RocksDB and files."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from sparkpoint.api import read_state
from sparkpoint.checkpoint.savepoint import take_savepoint
from sparkpoint.pipeline.driver import StatefulPipeline
from tests.support import loyalty_pipeline as loy


@pytest.mark.spark
def test_a_changed_record_codec_reads_a_savepoint_taken_at_another_parallelism(spark, tmp_path: Path):
    (tmp_path / "in").mkdir()
    v1_batches, v2_batches = [loy.batch(b) for b in range(2)], [loy.batch(b) for b in range(2, 4)]
    for i, b in enumerate(v1_batches):
        b.to_parquet(tmp_path / "in" / f"b{i}.parquet", index=False)
    first = loy.loyalty_pipeline(tmp_path)
    assert len(StatefulPipeline(spark, first.config(), first.operators).run()) == 2
    saved = take_savepoint(first.storage(), target=f"file://{tmp_path}/savepoints/v1")
    assert saved.metadata.operators["loyalty"].states["totals"]["codec"] == loy.V1.spec()

    for i, b in enumerate(v2_batches, start=2):
        b.to_parquet(tmp_path / "in" / f"b{i}.parquet", index=False)
    second = loy.loyalty_pipeline(tmp_path, loy.loyalty_v2, job_id="loyalty-v2", parallelism=3,
                                  from_checkpoint=saved.url)
    reports = StatefulPipeline(spark, second.config(), second.operators).run()
    assert len(reports) == 2  # the savepoint consumed b0, b1: these are b2, b3
    want = loy.recompute(v1_batches, v2_batches, loy.V2.names)
    got = second.read_state("loyalty").sort_values("customer").reset_index(drop=True)
    pd.testing.assert_frame_equal(got, want, check_dtype=False)
    meta = second.storage()
    raw = read_state(meta.url, "loyalty-v2", "loyalty", raw=True)
    totals = raw[raw.state == "totals"]
    exported = pd.DataFrame([{"customer": k, **v} for k, v in zip(totals.key, totals.value)])
    pd.testing.assert_frame_equal(exported.sort_values("customer").reset_index(drop=True), want, check_dtype=False)
