"""The two routes a batch can take to its subtasks (sparkpoint.spark.routing): read-all and the
shuffle give the same state, output and `_metadata`, on random workloads of a user's own
order-sensitive operators, across a rescale between checkpoints taken on different routes; the
shuffle reads each batch once."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sparkpoint import JsonCodec, KeyedOperator, StateTtl, StructCodec
from sparkpoint.api import read_state
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.cli import main
from sparkpoint.pipeline.driver import StatefulPipeline
from sparkpoint.pipeline.runtime import PipelineConfig, PipelineError, validate_config
from sparkpoint.spark import routing
from sparkpoint.spark.routing import FileLayout, ReadUnit, choose_route, partition_routes, read_units, spark_hash_int

LAST = StructCodec[tuple[float]]("<d")
COUNT = StructCodec[tuple[int]]("<q")
T0 = pd.Timestamp("2026-05-01T00:00:00Z")


def ledger_process(batch: pd.DataFrame, state) -> pd.DataFrame:  # type: ignore[no-untyped-def]
    # Order-sensitive on purpose: the list keeps arrival order, "last" keeps the last amount seen.
    state.list_state("amounts", JsonCodec()).add_many(zip(batch["acct"], batch["amount"].astype(float)))
    last = state.reducing_state("last", LAST, lambda a, b: b)
    last.add_many((k, (float(v),)) for k, v in zip(batch["acct"], batch["amount"]))
    out = batch.groupby("acct", sort=True)["amount"].agg(["count", "sum"]).reset_index()
    return out.rename(columns={"count": "n", "sum": "total"})


def ledger_export(state) -> pd.DataFrame:  # type: ignore[no-untyped-def]
    amounts = dict(state.list_state("amounts", JsonCodec()).items())
    rows = [(k.decode(), v[0], amounts.get(k, [])) for k, v in state.reducing_state("last", LAST, max).items()]
    return pd.DataFrame(rows, columns=["acct", "last", "amounts"])


def shop_process(batch: pd.DataFrame, state) -> None:  # type: ignore[no-untyped-def]
    sizes = batch.groupby("shop").size()
    counts = state.value_state("visits", COUNT, ttl=StateTtl(3600 * 24 * 365, clock="event"))
    old = counts.get_many(sizes.index.tolist())
    counts.put_many((s, (int(n) + (o[0] if o else 0),)) for s, n, o in zip(sizes.index, sizes, old))
    # The last quantity as pandas typed it: 3 from an int64 column, 3.0 from a float64 one (an int
    # column with a null anywhere in its file is float64 when the whole file is read).
    last = batch.groupby("shop")["qty"].last().fillna(-1)
    state.value_state("last_qty", JsonCodec()).put_many(zip(last.index, last.tolist()))


def shop_export(state) -> pd.DataFrame:  # type: ignore[no-untyped-def]
    qty = {k: json.dumps(v) for k, v in state.value_state("last_qty", JsonCodec()).items()}
    rows = [(k.decode(), v[0], qty.get(k)) for k, v in state.value_state("visits", COUNT).items()]
    return pd.DataFrame(rows, columns=["shop", "visits", "last_qty"])


OPERATORS = (
    KeyedOperator("ledger", key="acct", columns=("amount",), process=ledger_process, export=ledger_export,
                  emits=True),
    KeyedOperator("shops", key="shop", columns=("qty",), process=shop_process, export=shop_export),
)


def write_batches(root: Path, seed: int, batches: int = 4) -> None:
    """Random batches of several row groups each; event times run forward with jitter, so some
    rows of a later batch fall below the watermark (late)."""
    rng = random.Random(seed)
    root.mkdir(parents=True)
    clock = 0.0
    for b in range(batches):
        n = rng.randint(9, 16) * 100  # whole row groups of 100 in the files that end with nulls
        times = [clock + rng.uniform(-40, 60) for _ in range(n)]
        clock = max(times)
        frame = pd.DataFrame({
            "acct": [f"a{rng.randint(0, 150)}" for _ in range(n)],
            "shop": [f"s{rng.randint(0, 12)}" for _ in range(n)],
            "amount": np.round([rng.uniform(-50, 200) for _ in range(n)], 2),
            "at": [T0 + pd.Timedelta(seconds=t) for t in times],
            "qty": pd.array([rng.randint(1, 9) for _ in range(n)], dtype="Int64"),
        })
        if b % 2:  # the file ends with row groups of one shop whose quantities are missing (nulls nowhere else)
            frame.loc[n - 200:, ["shop", "qty"]] = ["s0", None]
        table = pa.Table.from_pandas(frame, preserve_index=False).replace_schema_metadata(None)  # not pandas'
        pq.write_table(table, root / f"part-{b:03d}.parquet", row_group_size=100 if b % 2 else rng.choice([150, 400]))


def run(spark, tmp_path: Path, name: str, plan: list[tuple[str, int]]) -> list[dict]:  # type: ignore[no-untyped-def]
    """Batch after batch, each with (routing, parallelism) from `plan`: one start per batch."""
    reports = []
    for routing_, parallelism in plan:
        config = PipelineConfig(
            input_url=str(tmp_path / "in"), checkpoints_url=f"file://{tmp_path}/{name}/ckpt", job_id="job",
            local_dir=str(tmp_path / name / "local"), output_url=f"file://{tmp_path}/{name}/out",
            parallelism=parallelism, max_parallelism=16, num_retained=10, event_time="at", allowed_lateness=20.0,
            routing=routing_, max_batches=1,
        )
        reports += [r.to_json() for r in StatefulPipeline(spark, config, OPERATORS).run()]
    return reports


def export(tmp_path: Path, name: str, operator: str, checkpoint: int) -> pd.DataFrame:
    op = next(o for o in OPERATORS if o.name == operator)
    frame = read_state(f"file://{tmp_path}/{name}/ckpt", "job", op, checkpoint)
    frame = frame.drop(columns=[c for c in frame.columns if c.startswith("_") or c == "subtask"])
    return frame.sort_values(list(frame.columns[:1])).reset_index(drop=True)


def metadata_view(tmp_path: Path, name: str, checkpoint: int) -> dict:
    """What `_metadata` says of a checkpoint apart from when, by whom and how it was read."""
    meta = CompletedCheckpointStore(CheckpointStorage(f"file://{tmp_path}/{name}/ckpt", "job")).load(checkpoint)
    offsets = {k: v for k, v in meta.source_offsets.items() if k not in ("attempt", "read", "sink")}
    return {
        "checkpoint_id": meta.checkpoint_id, "kind": meta.kind, "offsets": offsets,
        "sink_files": len(meta.source_offsets["sink"]), "skipped": meta.skipped_files,
        "operators": {uid: (op.name, [(h.subtask, h.key_group_range) for h in op.subtasks])
                      for uid, op in meta.operators.items()},
    }


def output(tmp_path: Path, name: str) -> pd.DataFrame:
    frame = pd.read_parquet(tmp_path / name / "out")
    return frame.sort_values(list(frame.columns)).reset_index(drop=True)


@pytest.mark.spark
@pytest.mark.parametrize("seed", [5, pytest.param(23, marks=pytest.mark.soak)])  # another seed: make soak
def test_both_routes_give_the_same_state_output_and_metadata_across_a_rescale(
        spark, tmp_path: Path, monkeypatch, seed: int):
    monkeypatch.setattr(routing, "UNIT_BYTES", 2048)  # the shuffle cuts each file between its row groups
    write_batches(tmp_path / "in", seed)
    # Same batches, same parallelism per batch (3, 3, then a rescale to 2, then 4): only the routes differ.
    a = run(spark, tmp_path, "a", [("read-all", 3), ("read-all", 3), ("shuffle", 2), ("read-all", 4)])
    b = run(spark, tmp_path, "b", [("shuffle", 3), ("shuffle", 3), ("read-all", 2), ("shuffle", 4)])
    assert [r["routing"] for r in a] == ["read-all", "read-all", "shuffle", "read-all"]
    assert [r["routing"] for r in b] == ["shuffle", "shuffle", "read-all", "shuffle"]
    for ra, rb in zip(a, b):
        assert ra["rows"] == rb["rows"] > 0 and ra["late_rows"] == rb["late_rows"]
        assert ra["watermark"] == rb["watermark"]
    assert sum(r["late_rows"] for r in a) > 0, "the workload has late rows"
    for checkpoint in range(1, 5):
        assert metadata_view(tmp_path, "a", checkpoint) == metadata_view(tmp_path, "b", checkpoint)
        for operator in ("ledger", "shops"):
            pd.testing.assert_frame_equal(export(tmp_path, "a", operator, checkpoint),
                                          export(tmp_path, "b", operator, checkpoint))
    pd.testing.assert_frame_equal(output(tmp_path, "a"), output(tmp_path, "b"))
    # The order of arrival survived the shuffle: each list is the account's amounts in batch order.
    events = pd.concat([pd.read_parquet(p) for p in sorted((tmp_path / "in").glob("*.parquet"))])
    lists = export(tmp_path, "b", "ledger", 4)
    some = lists[lists["amounts"].map(len) > 3].iloc[0]
    assert list(some["amounts"])[:3] == [float(x) for x in events[events["acct"] == some["acct"]]["amount"][:3]]


@pytest.mark.spark
def test_the_shuffle_reads_a_batch_once_at_any_parallelism(spark, tmp_path: Path, capsys):
    write_batches(tmp_path / "in", 7, batches=1)
    big = tmp_path / "in" / "part-000.parquet"
    frame = pd.read_parquet(big)
    pq.write_table(pa.Table.from_pandas(pd.concat([frame] * 200, ignore_index=True), preserve_index=False), big,
                   row_group_size=20_000)  # ~6 MB in many row groups: read piecewise, not whole
    amplification = {}
    for routing_, parallelism in [("read-all", 4), ("shuffle", 4), ("shuffle", 8)]:
        name = f"{routing_}-{parallelism}"
        config = PipelineConfig(
            input_url=str(tmp_path / "in"), checkpoints_url=f"file://{tmp_path}/{name}/ckpt", job_id="job",
            local_dir=str(tmp_path / name / "local"), parallelism=parallelism, max_parallelism=16,
            event_time="at", routing=routing_,
        )
        (report,) = StatefulPipeline(spark, config, OPERATORS).run()
        assert report.read is not None and report.read["routing"] == routing_
        assert report.read["batch_bytes"] == big.stat().st_size
        amplification[name] = report.read_amplification
        meta = CompletedCheckpointStore(CheckpointStorage(config.checkpoints_url, "job")).load(1)
        assert meta.source_offsets["read"] == report.read  # in `_metadata`, beside the offsets
        capsys.readouterr()
        assert main(["inspect", f"{config.checkpoints_url}/job/chk-1"]) == 0
        shown = capsys.readouterr().out
        assert f"batch routed by {routing_}: read " in shown and "estimated cost $" in shown
        # the ledger's input reads come back from the reading tasks on either route
        assert report.requests is not None and report.requests.input_bytes >= report.read["bytes_read"] > 0
    assert amplification["shuffle-4"] <= 1.2 and amplification["shuffle-8"] <= 1.2, amplification
    assert amplification["read-all-4"] > 3 * amplification["shuffle-4"], amplification


def test_spark_hash_of_each_route_puts_subtask_s_in_partition_s(spark):
    from pyspark.sql import functions as F

    values = list(range(-300, 3000, 7))
    frame = spark.createDataFrame([(v,) for v in values], "v int").select("v", F.hash("v").alias("h")).collect()
    assert [spark_hash_int(r["v"]) for r in frame] == [r["h"] for r in frame]
    for parallelism in (1, 2, 5, 16, 33):
        routes = partition_routes(parallelism)
        got = (spark.createDataFrame([(s, r) for s, r in enumerate(routes)], "subtask int, route int")
               .repartition(parallelism, "route").select("subtask", F.spark_partition_id().alias("p")).collect())
        assert sorted((r["subtask"], r["p"]) for r in got) == [(s, s) for s in range(parallelism)]


def test_read_units_cut_a_file_between_row_groups_in_order():
    files = [FileLayout("f1", 100, (40, 40, 20), True), FileLayout("f2", 500, (100, 300, 50, 60), True),
             FileLayout("f3", 9)]
    assert read_units(files, unit_bytes=200) == [
        ReadUnit("f1"), ReadUnit("f2", (0,)), ReadUnit("f2", (1,)), ReadUnit("f2", (2, 3)), ReadUnit("f3"),
    ]
    assert read_units(files, unit_bytes=10**9) == [ReadUnit("f1"), ReadUnit("f2"), ReadUnit("f3")]
    # a file whose row groups read apart would come out with other types is read whole
    assert read_units([FileLayout("f2", 500, (100, 300, 50, 60))], unit_bytes=200) == [ReadUnit("f2")]


def test_auto_takes_the_shuffle_once_read_all_would_read_much_more_than_the_batch():
    above = routing.SHUFFLE_ABOVE_BYTES
    batch = [FileLayout("x", above // 4), FileLayout("y", above // 4)]  # half the crossover
    assert choose_route("auto", 2, batch) == "read-all"  # half the crossover more: the stage costs more
    assert choose_route("auto", 3, batch) == "shuffle"  # the crossover more
    assert choose_route("auto", 1, batch * 8) == "read-all"  # one subtask reads the batch once either way
    small = [FileLayout("x", above // 100)]
    assert choose_route("auto", 101, small) == "read-all" and choose_route("auto", 102, small) == "shuffle"
    assert choose_route("shuffle", 1, small) == "shuffle" and choose_route("read-all", 64, batch) == "read-all"
    assert choose_route("shuffle", 8, []) == "read-all"  # nothing to read: one stage, every subtask runs
    with pytest.raises(PipelineError, match="routing must be one of auto, read-all, shuffle, got 'both'"):
        validate_config(PipelineConfig(input_url="in", checkpoints_url="file:///c", job_id="j", routing="both"))


def test_routing_is_a_setting_of_every_front_end_and_a_bad_value_is_refused_naming_the_choices(tmp_path: Path):
    from sparkpoint import Pipeline
    from sparkpoint.pipeline.settings import resolve_settings
    from sparkpoint.resources import StateBackendResource

    assert resolve_settings({"routing": " Shuffle "}) == {"routing": "shuffle"}
    clicks = Pipeline("clicks", OPERATORS, input_url=str(tmp_path / "in"), routing="read-all")
    assert clicks.config().routing == "read-all" and clicks.with_(routing="shuffle").config().routing == "shuffle"
    with pytest.raises(PipelineError, match="routing must be one of auto, read-all, shuffle, got 'fast'"):
        clicks.with_(routing="fast")
    import dagster as dg

    from sparkpoint.resources import ResourceConfigError

    with pytest.raises(ResourceConfigError, match="state backend: routing must be one of"):
        StateBackendResource(routing="fast").setup_for_execution(dg.build_init_resource_context())
