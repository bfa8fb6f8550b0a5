"""Upgrading a pipeline (issue 33): operators keyed by uid, the restore's mapping of a checkpoint's
state onto a changed pipeline (kept, renamed, new, dropped), said before Spark starts, and the
pre-flight `sparkpoint check-upgrade`, which agrees with what `run` then does.

The pipelines are a user's own (`tests.support.shop_pipelines`), in versions."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from sparkpoint import KeyedOperator, Pipeline
from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.errors import MetadataError
from sparkpoint.checkpoint.metadata import content_checksum
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.cli import main
from sparkpoint.pipeline.runtime import PipelineError
from sparkpoint.pipeline.upgrade import plan_restore
from sparkpoint.spark.offsets import SourceOffsets
from sparkpoint.state.keygroups import key_group_for
from tests.support import shop_pipelines as shop
from tests.support.backends import make_backend

MODULE = "tests.support.shop_pipelines"
PURCHASES = [[("ann", 10.0), ("bob", 5.0), ("cy", 7.5), ("ann", 2.0)],
             [("bob", 20.0), ("dee", 1.0), ("ann", 3.0)],
             [("cy", 30.0), ("eve", 4.0), ("bob", 1.0)]]


def purchases(i: int) -> pd.DataFrame:
    return pd.DataFrame(PURCHASES[i], columns=["customer", "amount"])


def land(input_dir: Path, i: int) -> None:
    input_dir.mkdir(parents=True, exist_ok=True)
    purchases(i).to_parquet(input_dir / f"purchases-{i:04d}.parquet", index=False)


def checkpoint_of(url: str, pipeline: Pipeline, rows: pd.DataFrame, local: Path, *, parallelism: int = 2,
                  max_parallelism: int = 128) -> None:
    """A completed checkpoint of `pipeline` holding `rows`, written without Spark (as a run writes it:
    state under each operator's uid, its display name beside it)."""
    storage = CheckpointStorage(url, "shop")
    coordinator = CheckpointCoordinator(storage)
    backends = []
    for op in pipeline.operators:
        for i in range(parallelism):
            b = make_backend(storage, local, i, parallelism, operator=op.uid, max_parallelism=max_parallelism)
            b.restore(None)
            mine = rows[[key_group_for(k, max_parallelism) in b.key_group_range for k in rows["customer"]]]
            if len(mine):
                op.process(mine, b)
            backends.append(b)
    cid = coordinator.trigger(expected={op.uid: parallelism for op in pipeline.operators},
                              names={op.uid: op.name for op in pipeline.operators}).checkpoint_id
    for b in backends:
        coordinator.acknowledge(cid, b.snapshot(cid))
    coordinator.complete(cid, source_offsets={"source": SourceOffsets(()).to_json(), "sink": []})
    for b in backends:
        b.close()


# --- uids ---------------------------------------------------------------------------------------------


def test_an_operators_uid_defaults_to_its_name_and_leaves_code_versions_as_they_were():
    assert shop.spend.uid == "spend" and shop.customer_spend.uid == "spend"
    explicit = KeyedOperator("spend", key="customer", columns=("amount",), process=shop.add_spend,
                             export=shop.export_spend, uid="spend")
    assert Pipeline("shop", [explicit, shop.visits]).code_version() == shop.shop.code_version()
    other = KeyedOperator("spend", key="customer", columns=("amount",), process=shop.add_spend,
                          export=shop.export_spend, uid="spend_v1")
    assert Pipeline("shop", [other, shop.visits]).code_version() != shop.shop.code_version()
    with pytest.raises(PipelineError, match="uids must be unique"):
        Pipeline("shop", [shop.spend, shop.customer_spend])
    with pytest.raises(ValueError, match="operator uid"):
        KeyedOperator("spend", key="customer", process=shop.add_spend, export=shop.export_spend, uid="../spend")


# --- the plan, as a table -----------------------------------------------------------------------------

PLAN_CASES = [  # (pipeline, settings, ok, status by uid, a fix it names)
    ("shop", {}, True, {"spend": "kept", "visits": "kept"}, None),
    ("renamed", {}, True, {"spend": "renamed", "visits": "kept"}, None),
    ("renamed_without_uid", {}, False, {"spend": "dropped", "customer_spend": "new", "visits": "kept"},
     "give it uid='spend'"),
    ("dropped", {}, False, {"spend": "kept", "visits": "dropped"}, "--allow-non-restored-state"),
    ("dropped", {"allow_non_restored_state": True}, True, {"spend": "kept", "visits": "dropped"}, None),
    ("added", {}, False, {"spend": "kept", "visits": "kept", "largest": "new"}, "--allow-new-operators"),
    ("added", {"allow_new_operators": True}, True, {"spend": "kept", "visits": "kept", "largest": "new"}, None),
    ("shop", {"parallelism": 3}, True, {"spend": "kept", "visits": "kept"}, None),
    ("shop", {"max_parallelism": 64}, False, {"spend": "kept", "visits": "kept"}, "--max-parallelism 128"),
]


@pytest.mark.parametrize(("version", "settings", "ok", "statuses", "fix"), PLAN_CASES)
def test_a_restore_plan_maps_state_by_uid(tmp_path: Path, version: str, settings: dict[str, Any], ok: bool,
                                          statuses: dict[str, str], fix: str | None):
    checkpoint_of(f"file://{tmp_path}/ckpt", shop.shop, purchases(0), tmp_path / "w")
    meta = CompletedCheckpointStore(CheckpointStorage(f"file://{tmp_path}/ckpt", "shop")).load(1)
    plan = plan_restore(meta, getattr(shop, version).operators, parallelism=settings.get("parallelism", 2),
                        max_parallelism=settings.get("max_parallelism", 128),
                        allow_non_restored_state=settings.get("allow_non_restored_state", False),
                        allow_new_operators=settings.get("allow_new_operators", False))
    assert plan.ok is ok
    assert {op.uid: op.status for op in plan.operators} == statuses
    if fix:
        assert any(fix in f for f in plan.fixes()), plan.fixes()
    else:
        assert plan.fixes() == []
    as_json = json.loads(json.dumps(plan.to_json()))
    assert as_json["ok"] is ok and all(op["states"] == [] for op in as_json["operators"]), \
        "no per-state verdict until operators declare their states"
    renamed = {op.uid: (op.old_name, op.new_name) for op in plan.operators if op.status == "renamed"}
    assert renamed == ({"spend": ("spend", "customer_spend")} if version == "renamed" else {})
    if settings.get("parallelism") == 3:
        assert {(op.old_parallelism, op.new_parallelism) for op in plan.operators} == {(2, 3)}


# --- _metadata records display names ------------------------------------------------------------------


def test_metadata_records_each_operators_display_name_beside_its_uid(tmp_path: Path):
    checkpoint_of(f"file://{tmp_path}/ckpt", shop.renamed, purchases(0), tmp_path / "w")
    path = tmp_path / "ckpt" / "shop" / "chk-1" / "_metadata"
    raw = json.loads(path.read_bytes())
    assert raw["operators"]["spend"]["name"] == "customer_spend" and raw["operators"]["visits"]["name"] == "visits"
    assert (tmp_path / "ckpt" / "shop" / "shared" / "spend").is_dir(), "state is stored under the uid"
    store = CompletedCheckpointStore(CheckpointStorage(f"file://{tmp_path}/ckpt", "shop"))
    assert store.load(1).operator_name("spend") == "customer_spend"

    del raw["operators"]["spend"]["name"]  # as sparkpoint wrote it before it recorded names
    raw["checksum"] = content_checksum(raw)
    path.write_bytes(json.dumps(raw).encode())
    assert store.load(1).operator_name("spend") == "spend"

    for hostile in ("", "../visits", "a/b", 7, None, ["x"], "x" * 200):
        raw["operators"]["spend"]["name"] = hostile
        raw["checksum"] = content_checksum(raw)
        path.write_bytes(json.dumps(raw).encode())
        with pytest.raises(MetadataError, match=r"field `operators\.spend\.name`"):
            store.load(1)


# --- the commands without Spark -----------------------------------------------------------------------


def job_flags(tmp_path: Path) -> list[str]:
    return ["--checkpoints", f"file://{tmp_path}/ckpt", "--job-id", "shop"]


def check_upgrade(tmp_path: Path, capsys: pytest.CaptureFixture[str], version: str, *extra: str
                  ) -> tuple[int, dict[str, Any]]:
    code = main(["check-upgrade", "--pipeline", f"{MODULE}:{version}", *job_flags(tmp_path), *extra, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_check_upgrade_reports_each_operator_and_exits_1_when_the_restore_would_be_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    checkpoint_of(f"file://{tmp_path}/ckpt", shop.shop, purchases(0), tmp_path / "w")
    before = sorted((p, p.stat().st_mtime_ns) for p in (tmp_path / "ckpt").rglob("*"))

    code, report = check_upgrade(tmp_path, capsys, "renamed")
    assert code == 0 and report["ok"] and report["checkpoint_id"] == 1
    spend = next(op for op in report["operators"] if op["uid"] == "spend")
    assert (spend["status"], spend["old_name"], spend["new_name"]) == ("renamed", "spend", "customer_spend")
    assert spend["parallelism"] == {"old": 2, "new": 2} and spend["max_parallelism"] == {"old": 128, "new": 128}

    code, report = check_upgrade(tmp_path, capsys, "dropped")
    assert code == 1 and not report["ok"] and "allow with --allow-non-restored-state" in report["fixes"]
    assert check_upgrade(tmp_path, capsys, "dropped", "--allow-non-restored-state")[0] == 0
    assert check_upgrade(tmp_path, capsys, "added")[0] == 1
    assert check_upgrade(tmp_path, capsys, "added", "--allow-new-operators")[0] == 0
    code, report = check_upgrade(tmp_path, capsys, "shop", "--max-parallelism", "64")
    assert code == 1 and "run with --max-parallelism 128" in report["fixes"]

    assert main(["check-upgrade", "--pipeline", f"{MODULE}:renamed_without_uid",
                 "--from", f"file://{tmp_path}/ckpt/shop/chk-1"]) == 1
    text = capsys.readouterr().out
    assert "dropped  spend: dropped" in text and "new      customer_spend: new: starts empty" in text
    assert "give it uid='spend'" in text

    assert main(["check-upgrade", "--pipeline", f"{MODULE}:shop", "--checkpoints", f"file://{tmp_path}/none",
                 "--job-id", "shop"]) == 0
    assert "holds no completed checkpoint" in capsys.readouterr().out
    assert sorted((p, p.stat().st_mtime_ns) for p in (tmp_path / "ckpt").rglob("*")) == before, "it only reads"


def test_run_refuses_a_restore_that_would_drop_state_before_spark_starts_and_writes_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch):
    import sparkpoint.spark.session as session

    def no_spark(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("Spark was started")

    monkeypatch.setattr(session, "spark_session", no_spark)
    checkpoint_of(f"file://{tmp_path}/ckpt", shop.shop, purchases(0), tmp_path / "w")
    land(tmp_path / "in", 1)
    before = sorted((p, p.stat().st_mtime_ns) for p in (tmp_path / "ckpt").rglob("*"))
    code = main(["run", "--pipeline", f"{MODULE}:dropped", "--input", str(tmp_path / "in"), *job_flags(tmp_path),
                 "--local-dir", str(tmp_path / "local")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "holds state of visits, which this job does not run" in err and "--allow-non-restored-state" in err
    assert sorted((p, p.stat().st_mtime_ns) for p in (tmp_path / "ckpt").rglob("*")) == before
    assert not (tmp_path / "local").exists()


def test_the_dagster_state_backend_resource_takes_the_two_settings(tmp_path: Path):
    from sparkpoint.resources import PipelineResources, resources_for

    pipeline = shop.added.with_(checkpoints_url=str(tmp_path / "ckpt"), input_url=str(tmp_path / "in"))
    by_role = resources_for(pipeline)
    assert by_role["state_backend"].allow_new_operators is False
    backend = type(by_role["state_backend"])(allow_new_operators=True, allow_non_restored_state=True)
    config = PipelineResources(by_role["storage"], by_role["registry"], backend, by_role["source"]).config(pipeline)
    assert config.allow_new_operators and config.allow_non_restored_state
    defaults = resources_for(pipeline.with_(allow_new_operators=True))["state_backend"]
    assert defaults.allow_new_operators is True, "the pipeline's own setting is the resource's default"


# --- on Spark: what check-upgrade says is what run does -----------------------------------------------


def run_version(tmp_path: Path, version: str, *extra: str) -> int:
    return main(["run", "--pipeline", f"{MODULE}:{version}", "--input", str(tmp_path / "in"), *job_flags(tmp_path),
                 "--local-dir", str(tmp_path / "local"), "--master", "local[2]", *extra])


def recomputed(batches: list[int]) -> pd.DataFrame:
    rows = pd.concat([purchases(i) for i in batches], ignore_index=True)
    g = rows.groupby("customer")["amount"]
    return pd.DataFrame({"spend": g.sum(), "visits": g.size(), "largest": g.max()}).reset_index()


AGREEMENT = [  # (version, flags, states then exported: operator name -> batches it saw)
    ("renamed", [], {"customer_spend": [0, 1], "visits": [0, 1]}),
    ("renamed_without_uid", [], None),
    ("dropped", [], None),
    ("dropped", ["--allow-non-restored-state"], {"spend": [0, 1]}),
    ("added", [], None),
    ("added", ["--allow-new-operators"], {"spend": [0, 1], "visits": [0, 1], "largest": [1]}),
    ("shop", ["--max-parallelism", "64"], None),
]


@pytest.mark.spark
def test_check_upgrade_agrees_with_what_run_then_does(spark, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch):
    import sparkpoint.spark.session as session

    land(tmp_path / "v1" / "in", 0)
    assert run_version(tmp_path / "v1", "shop") == 0
    capsys.readouterr()
    real = session.spark_session
    for version, flags, exported in AGREEMENT:
        case = tmp_path / f"{version}{''.join(flags)}"
        shutil.copytree(tmp_path / "v1" / "ckpt", case / "ckpt")
        land(case / "in", 0)
        land(case / "in", 1)
        checked, report = check_upgrade(case, capsys, version, *flags)
        printed_before_spark: list[str] = []

        def spark_session(*args: Any, printed: list[str] = printed_before_spark, **kwargs: Any) -> Any:
            printed.append(capsys.readouterr().out)
            return real(*args, **kwargs)

        monkeypatch.setattr(session, "spark_session", spark_session)
        ran = run_version(case, version, *flags)
        out = capsys.readouterr()
        assert (checked == 0) == (ran == 0) == (exported is not None), (version, flags, checked, ran, out.err)
        assert ran in (0, 2), out.err
        if exported is None:
            assert printed_before_spark == [], "refused before Spark started"
            assert CompletedCheckpointStore(CheckpointStorage(f"file://{case}/ckpt", "shop")).checkpoint_ids() == [1]
            continue
        counts = ", ".join(f"{n} {s}" for s, n in report["counts"].items() if n)
        assert printed_before_spark[0].startswith(f"sparkpoint run: restoring checkpoint 1 of job shop: {counts}")
        pipeline = getattr(shop, version).with_(checkpoints_url=f"file://{case}/ckpt", job_id="shop")
        for name, batches in exported.items():
            column = pipeline.operator(name).export.__name__.removeprefix("export_")
            got = pipeline.read_state(name)
            want = recomputed(batches)[["customer", column]]
            assert got.sort_values("customer").reset_index(drop=True).astype(want.dtypes.to_dict()).equals(
                want.sort_values("customer").reset_index(drop=True)), (version, name, got, want)
        meta = CompletedCheckpointStore(pipeline.storage()).load(2)
        assert {uid: meta.operator_name(uid) for uid in meta.operators} == \
            {op.uid: op.name for op in pipeline.operators}, "the new checkpoint holds only this job's operators"


# --- Dagster: the blocking pre-flight before the first checkpoint of new code ------------------------


@pytest.mark.spark
def test_the_dagster_preflight_blocks_a_refused_upgrade_before_the_sstable_step(spark, tmp_path: Path):
    import dagster as dg

    from sparkpoint.factory import pipeline_defs

    checkpoint_of(f"file://{tmp_path}/ckpt", shop.shop, purchases(0), tmp_path / "w")
    land(tmp_path / "in", 1)
    where = {"checkpoints_url": f"file://{tmp_path}/ckpt", "input_url": str(tmp_path / "in"), "job_id": "shop",
             "local_dir": str(tmp_path / "local")}
    instance = dg.DagsterInstance.ephemeral()

    def run(pipeline: Pipeline) -> tuple[dg.ExecuteInProcessResult, dg.AssetCheckEvaluation]:
        parts = pipeline_defs(pipeline.with_(**where), landing_sensor=False)
        job = parts.definitions().resolve_job_def("shop_checkpoint")
        result = job.execute_in_process(instance=instance, raise_on_error=False)
        (check,) = [e.asset_check_evaluation_data for e in result.all_events
                    if e.event_type_value == "ASSET_CHECK_EVALUATION"
                    and e.asset_check_evaluation_data.check_name == "upgrade_preflight"]
        return result, check

    refused, check = run(shop.dropped)
    assert not check.passed and "--allow-non-restored-state" in (check.description or "")
    assert not refused.success
    assert "shop_sstables" not in {e.step_key for e in refused.all_events if e.event_type_value == "STEP_START"}
    assert CompletedCheckpointStore(CheckpointStorage(f"file://{tmp_path}/ckpt", "shop")).checkpoint_ids() == [1]

    passed, check = run(shop.renamed)
    assert check.passed and "1 renamed" in (check.description or ""), check.description
    assert passed.success
    assert CompletedCheckpointStore(CheckpointStorage(f"file://{tmp_path}/ckpt", "shop")).checkpoint_ids() == [2, 1]


def test_the_guide_rename_example_keeps_the_uid():
    from tests.support.docs_text import python_blocks, section

    (block,) = python_blocks(section("upgrading.md", "## Operator identity (`uid`)"))
    namespace: dict[str, Any] = {"KeyedOperator": KeyedOperator, "add_spend": shop.add_spend,
                                 "export_spend": shop.export_spend}
    exec(compile(block, "docs/upgrading.md", "exec"), namespace)
    assert (namespace["spend"].name, namespace["spend"].uid) == ("customer_spend", "spend")
