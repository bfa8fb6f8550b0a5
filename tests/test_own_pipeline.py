"""A user's own pipeline (a clickstream with `user`, `page`, `clicked_at`; clicks per user in a
ValueState, distinct pages per user in a MapState) through the public API and the CLI: nothing of
the sample is involved."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest

import sparkpoint
from sparkpoint.spark.warm import stop as stop_warm_spark

ROOT = Path(__file__).resolve().parent.parent

MODULE = textwrap.dedent('''
    """clicks_pipeline: a user's module, importable from the directory the command runs in."""
    import numpy as np
    import pandas as pd

    from sparkpoint import BytesCodec, KeyedOperator, Pipeline, StructCodec

    CLICKS = StructCodec("<q")
    SEEN = BytesCodec()


    def count_clicks(batch, state):
        counts = batch.groupby("user").size()
        keys = counts.index.tolist()

        def add(stored):
            old, _ = CLICKS.decode_many(stored)
            old["f0"] += counts.to_numpy()
            return CLICKS.encode_many(old)

        state.value_state("clicks", CLICKS).update_many_encoded(keys, add)


    def export_clicks(state):
        rows = [(k.decode(), v[0]) for k, v in state.value_state("clicks", CLICKS).items()]
        return pd.DataFrame(rows, columns=["user", "clicks"])


    def note_pages(batch, state):
        pairs = batch[["user", "page"]].drop_duplicates()
        state.map_state("pages", SEEN).put_absent(
            (u, p, b"") for u, p in zip(pairs["user"], pairs["page"]))


    def export_pages(state):
        counts = {}
        for user, _page, _ in state.map_state("pages", SEEN).items():
            counts[user.decode()] = counts.get(user.decode(), 0) + 1
        return pd.DataFrame(sorted(counts.items()), columns=["user", "pages"])


    clicks_per_user = KeyedOperator("clicks_per_user", key="user", process=count_clicks, export=export_clicks)
    pages_per_user = KeyedOperator("pages_per_user", key="user", columns=("page",), process=note_pages,
                                   export=export_pages)
    clicks = Pipeline("clicks", [clicks_per_user, pages_per_user], input_url="landing",
                      checkpoints_url="ckpt", local_dir="local", parallelism=2, num_retained=2)
''')


def land(root: Path, batches: int) -> pd.DataFrame:
    (root / "landing").mkdir(exist_ok=True)
    frames = []
    for i in range(batches):
        users = [f"u{(i * 7 + j) % 23}" for j in range(200)]
        frame = pd.DataFrame({"user": users, "page": [f"/p{(i + j) % 11}" for j in range(200)],
                              "clicked_at": pd.Timestamp("2026-11-01", tz="UTC") + pd.to_timedelta(range(200), "s")})
        frame.to_parquet(root / "landing" / f"clicks-{i:04d}.parquet")
        frames.append(frame)
    return pd.concat(frames, ignore_index=True)


def test_the_public_api_is_visible_from_the_package():
    for name in ("Pipeline", "KeyedOperator", "JsonCodec", "StructCodec", "BytesCodec", "read_state",
                 "list_checkpoints", "registry"):
        assert name in dir(sparkpoint) and getattr(sparkpoint, name) is not None


def test_a_pipeline_refuses_what_the_cli_refuses():
    op = sparkpoint.KeyedOperator("x", key="k", process=lambda b, s: None, export=lambda s: pd.DataFrame())
    with pytest.raises(Exception, match="parallelism must be between 1 and"):
        sparkpoint.Pipeline("p", [op], parallelism=0)
    with pytest.raises(Exception, match="max parallelism must be between 1 and 32768"):
        sparkpoint.Pipeline("p", [op]).with_(max_parallelism=40000)
    with pytest.raises(Exception, match="operator names must be unique"):
        sparkpoint.Pipeline("p", [op, op])


@pytest.mark.spark
def test_your_own_pipeline_through_the_cli_and_the_api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "clicks_pipeline.py").write_text(MODULE)
    events = land(tmp_path, 3)
    # A user's environment: the warm local Spark on, as by default, in a directory of the test's own
    # (not the user's cache) and stopped with the test.
    warm = tmp_path / "warm-spark"
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "SPARKPOINT_WARM_SPARK_DIR": str(warm)}
    try:
        run = subprocess.run([sys.executable, "-m", "sparkpoint.cli", "run", "--pipeline", "clicks_pipeline:clicks",
                              "--json"], cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    finally:
        stop_warm_spark(directory=warm)
    assert run.returncode == 0, run.stderr[-3000:]
    reports = [json.loads(line) for line in run.stdout.splitlines()]
    assert [r["checkpoint_id"] for r in reports] == [1, 2, 3]
    assert (tmp_path / "ckpt" / "clicks" / "chk-3" / "_metadata").exists(), "job id defaults to the pipeline's name"

    expected_clicks = events.groupby("user").size().rename("clicks").reset_index()
    expected_pages = events.groupby("user")["page"].nunique().rename("pages").reset_index()
    state = subprocess.run([sys.executable, "-m", "sparkpoint.cli", "state", "--pipeline", "clicks_pipeline:clicks",
                            "--operator", "pages_per_user", "--format", "json"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=300, env=env)
    assert state.returncode == 0, state.stderr[-2000:]
    pages = pd.DataFrame(json.loads(state.stdout)).sort_values("user").reset_index(drop=True)
    assert pages.to_dict("records") == expected_pages.sort_values("user").reset_index(drop=True).to_dict("records")

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    import clicks_pipeline  # type: ignore[import-not-found]

    mine = clicks_pipeline.clicks
    table = mine.read_state("clicks_per_user").sort_values("user").reset_index(drop=True)
    assert table.to_dict("records") == expected_clicks.sort_values("user").reset_index(drop=True).to_dict("records")
    by_operator = sparkpoint.read_state(f"file://{tmp_path}/ckpt", "clicks", clicks_pipeline.clicks_per_user)
    assert by_operator["clicks"].sum() == len(events)
    with pytest.raises(Exception, match="no operator 'user_totals'"):
        mine.read_state("user_totals")


def test_the_guide_pipeline_example_computes_what_it_says(tmp_path: Path):
    from sparkpoint.checkpoint.storage import CheckpointStorage
    from tests.support.backends import make_backend
    from tests.support.docs_text import page, python_blocks

    namespace: dict[str, object] = {}
    exec(compile(python_blocks(page("pipeline.md"))[0], "docs/pipeline.md", "exec"), namespace)
    pipeline = namespace["clicks"]
    assert isinstance(pipeline, sparkpoint.Pipeline) and pipeline.effective_job_id == "clicks"
    events = land(tmp_path, 2)
    storage = CheckpointStorage(f"file://{tmp_path}/ckpt", "clicks")
    tables = {}
    for op in pipeline.operators:
        with make_backend(storage, tmp_path / "local", operator=op.name) as state:
            state.restore(None)
            for half in (events.iloc[:200], events.iloc[200:]):
                op.process(half, state)
            tables[op.name] = op.export(state).set_index("user").iloc[:, 0].to_dict()
    assert tables["clicks_per_user"] == events.groupby("user").size().to_dict()
    assert tables["pages_per_user"] == events.groupby("user")["page"].nunique().to_dict()
