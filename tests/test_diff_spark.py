"""`sparkpoint diff` on a pipeline run on Spark: between two checkpoints of random batches, across a
rescale, and between a savepoint and a later checkpoint, it equals a pandas comparison of the two
exports. A user's own pipeline (tests.support.shop_pipelines), not the sample's."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pandas as pd
import pytest

import tests.support.shop_pipelines as shop
from sparkpoint import diff_state, read_state
from sparkpoint.checkpoint.savepoint import take_savepoint
from sparkpoint.cli import main
from sparkpoint.pipeline.driver import StatefulPipeline

pytestmark = pytest.mark.spark


def land(root: Path, index: int, rng: random.Random) -> None:
    (root / "in").mkdir(exist_ok=True)
    customers = [f"c{rng.randrange(300):03d}" for _ in range(rng.randrange(20, 200))]  # churn varies per batch
    pd.DataFrame({"customer": customers, "amount": [rng.randrange(1, 500) / 4 for _ in customers]}).to_parquet(
        root / "in" / f"b{index:03d}.parquet")


def expected(url: str, a, b) -> list[tuple[str, str]]:
    old = read_state(url, "shop", shop.spend, a)
    new = read_state(url, "shop", shop.spend, b)
    merged = old.merge(new, on="customer", how="outer", suffixes=("_old", ""), indicator=True)
    change = merged["_merge"].map({"left_only": "removed", "right_only": "added", "both": "changed"}).astype(str)
    keep = (merged["_merge"] != "both") | (merged["spend"] != merged["spend_old"])
    return sorted(zip(merged["customer"][keep], change[keep]))


def test_diff_on_spark_checkpoints_across_a_rescale_and_against_a_savepoint(spark, tmp_path: Path, capsys):
    rng = random.Random(11)
    url = f"file://{tmp_path}/ckpt"
    spec = shop.shop.with_(input_url=str(tmp_path / "in"), checkpoints_url=url, local_dir=str(tmp_path / "local"),
                           num_retained=20, max_parallelism=32)

    def run(parallelism: int, batches: range) -> None:
        for i in batches:
            land(tmp_path, i, rng)
        config = spec.with_(parallelism=parallelism).config()
        StatefulPipeline(spark, config, spec.operators).run()

    run(2, range(4))
    for a, b in [(1, 2), (2, 4), (1, 4)]:
        diff = diff_state(url, "shop", shop.spend, a, b)
        assert sorted(zip(diff["customer"], diff["change"])) == expected(url, a, b)
        assert diff.attrs["method"] == "changed files", diff.attrs
    saved = take_savepoint(spec.storage())
    run(3, range(4, 7))  # rescaled
    latest = max(spec.storage().completed_checkpoint_ids())
    rescaled = diff_state(url, "shop", shop.spend, 4, latest)
    assert sorted(zip(rescaled["customer"], rescaled["change"])) == expected(url, 4, latest)
    assert main(["diff", "--checkpoints", url, "--job-id", "shop", "--pipeline", "tests.support.shop_pipelines:shop",
                 "--operator", "spend", "--from", saved.url, "--to", str(latest), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["method"] == "full" and report["from"]["kind"] == "savepoint"
    got = sorted((r["customer"], r["change"]) for r in report["rows"])
    assert got == expected(url, saved.metadata.checkpoint_id, latest) and got
