"""A Delta table as a pipeline's input, on Spark (issue 45, items 5 and 6), with a user's own
operators (`tests.support.shop_tables`: spend and regions per customer; the region is a partition
column, absent from the data files): appends over several runs equal a recomputation, through
both routes and with an event time; `_metadata` records the table version reached, which does not
grow with the table's history; a compaction is passed over by itself; a delete is refused naming
its version, passed over with `table_changes="skip"`, and applied as a change feed with `"feed"`; a
table vacuumed past the consumed version stops the run naming the versions it has and the command
that goes on from one, which then does."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from deltalake import DeltaTable as DeltaRs
from deltalake import write_deltalake

from sparkpoint.pipeline.driver import StatefulPipeline
from sparkpoint.tables.source import TableChangeRefused, TableVersionsGone
from sparkpoint.tables.spec import DeltaTable
from tests.support.shop_tables import balance, orders, regions, shop, source_offsets, spend, state_of

pytestmark = pytest.mark.spark


def append(url: str, batch: int, **kwargs: object) -> pd.DataFrame:
    rows = orders(batch)
    write_deltalake(url, rows, partition_by=["region"], mode="append", **kwargs)  # type: ignore[arg-type]
    return rows.to_pandas()


def spend_state(pipeline) -> dict[str, tuple[float, int]]:  # type: ignore[no-untyped-def]
    table = state_of(pipeline)
    return {str(c): (float(s), int(n)) for c, s, n in zip(table["customer"], table["spent"], table["orders"])}


def metadata_sizes(tmp_path: Path) -> list[int]:
    return [len(json.dumps(json.loads(p.read_text())["source_offsets"]["source"]))
            for p in sorted((tmp_path / "ckpt" / "shop").glob("chk-*/_metadata"))]


def test_appends_over_several_runs_equal_a_recomputation_and_the_offset_is_the_version(tmp_path: Path, spark):
    url = str(tmp_path / "orders")
    frames = [append(url, 0), append(url, 1)]  # versions 0 and 1, two files each (one per region)
    pipeline = shop(tmp_path, DeltaTable(url), files_per_checkpoint=3, event_time="ordered_at", allowed_lateness=3600)
    first = StatefulPipeline(spark, pipeline.config(), pipeline.operators).run()
    assert [len(r.files) for r in first] == [3, 1], "version 1's files went into two checkpoints"
    assert source_offsets(pipeline)["table"] == {"format": "delta", "table": DeltaTable(url).uri, "version": 1}
    highest = pd.concat(frames)["ordered_at"].max().value // 1000
    assert first[-1].watermark == highest - 3600 * 1_000_000, "from the files' event times"
    assert [r.late_rows for r in first] == [0, 0]
    assert spend_state(pipeline) == spend(frames)

    DeltaRs(url).optimize.compact()  # version 2: a rewrite, no new rows
    frames += [append(url, 2), append(url, 3)]  # versions 3 and 4
    shuffled = pipeline.with_(routing="shuffle", files_per_checkpoint=4)
    second = StatefulPipeline(spark, shuffled.config(), pipeline.operators).run()
    assert [(r.read["routing"], len(r.files)) for r in second] == [("shuffle", 4)]
    assert source_offsets(pipeline)["table"]["version"] == 4
    assert spend_state(pipeline) == spend(frames), "the compaction was not read again"
    seen = state_of(pipeline, "regions_per_customer")
    assert set(zip(seen["customer"], seen["region"])) == regions(frames), "partition values reached the operator"
    sizes = metadata_sizes(tmp_path)
    assert max(sizes) - min(sizes) <= 16, f"the source offset does not grow with the history: {sizes}"
    assert StatefulPipeline(spark, pipeline.config(), pipeline.operators).run() == [], "nothing pending"


def test_a_delete_is_refused_skipped_or_applied_as_a_change_feed(tmp_path: Path, spark):
    url = str(tmp_path / "orders")
    frames = [append(url, 0, configuration={"delta.enableChangeDataFeed": "true"}), append(url, 1)]
    DeltaRs(url).delete("customer = 'c1'")  # version 2
    frames.append(append(url, 2))  # version 3
    pipeline = shop(tmp_path, DeltaTable(url), files_per_checkpoint=2)
    driver = StatefulPipeline(spark, pipeline.config(), pipeline.operators)
    with pytest.raises(TableChangeRefused, match=r"version 2 \(DELETE\) removes or rewrites rows"):
        driver.run()
    assert source_offsets(pipeline)["table"]["version"] == 1, "the appends before it were processed"
    assert spend_state(pipeline) == spend(frames[:2])

    skipping = pipeline.with_settings({"source.table.changes": "skip"})
    assert [r.checkpoint_id for r in StatefulPipeline(spark, skipping.config(), skipping.operators).run()] == [3]
    assert source_offsets(pipeline)["table"]["version"] == 3
    assert spend_state(pipeline) == spend(frames), "the delete passed over, the state keeps c1"

    feed = shop(tmp_path, DeltaTable(url), balance, table_changes="feed", files_per_checkpoint=4,
                job_id="balances")
    StatefulPipeline(spark, feed.config(), feed.operators).run()
    live = DeltaRs(url).to_pandas()
    want = live.groupby("customer")["amount"].sum()
    got = feed.read_state("balance").set_index("customer")["balance"]
    assert got.loc[got.abs() > 1e-9].sort_index().to_dict() == pytest.approx(want.sort_index().to_dict())
    assert got["c1"] == pytest.approx(frames[2].loc[frames[2]["customer"] == "c1", "amount"].sum()), \
        "c1's orders before the delete were taken away again"


def test_a_vacuumed_table_stops_the_run_with_the_versions_it_has_and_the_command(tmp_path: Path, spark):
    url = str(tmp_path / "orders")
    frames = [append(url, 0)]
    pipeline = shop(tmp_path, DeltaTable(url), files_per_checkpoint=2)
    StatefulPipeline(spark, pipeline.config(), pipeline.operators).run()  # version 0
    frames += [append(url, 1), append(url, 2), append(url, 3)]
    DeltaRs(url).create_checkpoint()  # at version 3: a log clean-up drops the commits before it
    for v in (0, 1, 2):
        (Path(url) / "_delta_log" / f"{v:020d}.json").unlink()
    with pytest.raises(TableVersionsGone) as gone:
        StatefulPipeline(spark, pipeline.config(), pipeline.operators).run()
    for said in ("no longer has version 1, the one after version 0 it consumed", "it has versions 3.",
                 "nothing was read",
                 "`sparkpoint run --pipeline MODULE:ATTR --conf source.table.resume-from=<version>`"):
        assert said in str(gone.value), str(gone.value)

    resumed = pipeline.with_settings({"source.table.resume-from": "3"})
    assert len(StatefulPipeline(spark, resumed.config(), resumed.operators).run()) == 1
    assert spend_state(pipeline) == spend([frames[0], frames[3]]), "versions 1 and 2 were never read"
    assert source_offsets(pipeline)["table"]["version"] == 3
