"""A run that names no parallelism keeps the latest checkpoint's (issue 34, item 3): `sparkpoint run
--parallelism 3`, then a run without the flag stays at 3 and reuses the checkpoint's files (no
rescale, no full re-upload); an explicit other parallelism rescales, said in one line. The same
"unset" default reaches every front end: `Pipeline`, the Dagster resources, the Airflow provider."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from sparkpoint import Pipeline
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.cli import main
from sparkpoint.pipeline.runtime import restore_plan
from tests.support.helpers import empty_checkpoint

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples" / "clickstream"))

from clickstream.land import land  # noqa: E402
from clickstream.operators import clicks_per_user, pages_per_user  # noqa: E402


def run(tmp_path: Path, capsys: pytest.CaptureFixture[str], *flags: str) -> tuple[list[dict], str]:
    """`sparkpoint run --json` of the clickstream example's `clicks` pipeline, one batch; its JSON
    lines, and everything else it printed."""
    assert main(["run", "--pipeline", "clickstream.pipelines:clicks", "--input", str(tmp_path / "in"),
                 "--checkpoints", f"file://{tmp_path}/ckpt", "--job-id", "clicks", "--local-dir",
                 str(tmp_path / "local"), "--output", str(tmp_path / "out"), "--master", "local[2]",
                 "--max-batches", "1", "--json", *flags]) == 0
    printed = capsys.readouterr()
    return [json.loads(line) for line in printed.out.splitlines()], printed.err


@pytest.mark.spark
def test_a_run_without_parallelism_keeps_the_checkpoints_and_a_change_is_said_once(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    land(tmp_path / "in", 3)
    storage = CheckpointStorage(f"file://{tmp_path}/ckpt", "clicks")
    store = CompletedCheckpointStore(storage)

    first, said = run(tmp_path, capsys, "--parallelism", "3")
    assert [r["checkpoint_id"] for r in first] == [1] and "rescaling" not in said
    assert {op.parallelism for op in store.load(1).operators.values()} == {3}

    second, said = run(tmp_path, capsys)  # no --parallelism: the checkpoint's 3, not a default 2
    assert "rescaling" not in said, said
    assert {op.parallelism for op in store.load(2).operators.values()} == {3}
    assert set(second[0]["restored"]) == {"working"}, "each subtask went on from its working database"
    assert second[0]["files_reused"] > 0, "the second checkpoint reuses the first's files"
    assert second[0]["checkpointed_size"] < second[0]["state_size"], "no full re-upload"

    third, said = run(tmp_path, capsys, "--parallelism", "2")
    assert [line for line in said.splitlines() if "rescaling" in line] == ["rescaling 3 -> 2 subtasks from chk-2"]
    assert set(third[0]["restored"]) == {"rescale"}
    assert {op.parallelism for op in store.load(3).operators.values()} == {2}


def test_every_front_end_leaves_parallelism_unset_unless_the_user_sets_it(tmp_path: Path):
    from sparkpoint.airflow.operators import PipelineRef
    from sparkpoint.resources import PipelineResources, resources_for

    empty_checkpoint(CheckpointStorage(f"file://{tmp_path}/ckpt", "clicks"), (clicks_per_user, pages_per_user), 3,
                     tmp_path / "w")
    pipeline = Pipeline("clicks", [clicks_per_user, pages_per_user], checkpoints_url=f"file://{tmp_path}/ckpt",
                        input_url=str(tmp_path / "in"))
    assert pipeline.parallelism is None and pipeline.config().parallelism is None

    kept = restore_plan(pipeline.config(), pipeline.operators)
    assert kept is not None and kept.ok and kept.rescaling() is None
    assert {op.new_parallelism for op in kept.operators} == {3}, "unset: the checkpoint's"
    changed = restore_plan(pipeline.with_(parallelism=2).config(), pipeline.operators)
    assert changed is not None and changed.rescaling() == "rescaling 3 -> 2 subtasks from chk-1"
    by_setting = pipeline.with_settings({"parallelism.default": "4"}).config()
    assert by_setting.parallelism == 4

    resources = resources_for(pipeline)
    dagster = PipelineResources(resources["storage"], resources["registry"], resources["state_backend"],  # type: ignore[arg-type]
                                resources["source"]).config(pipeline)  # type: ignore[arg-type]
    assert dagster.parallelism is None, "the Dagster resource's default: the checkpoint's"
    assert PipelineRef(pipeline, None, None).resolved().config().parallelism is None, "Airflow likewise"
    assert PipelineRef(pipeline, {"parallelism": 5}, None).resolved().config().parallelism == 5


@pytest.mark.spark
def test_dagster_runs_keep_the_parallelism_their_run_config_once_set(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch):
    """Materializing the checkpoint job of `orders` (a test pipeline of its own) with the state
    backend's `parallelism: 3` in its run config, then without: still 3, no rescale; then 2 in
    the run config: the SSTable step logs the one rescale line."""
    import dagster as dg

    from sparkpoint.factory import pipeline_defs
    from sparkpoint.resources import SparkResource
    from tests.support.orders_pipeline import land, orders_pipeline

    monkeypatch.setattr(SparkResource, "teardown_after_execution", lambda self, context: None)  # one JVM
    pipeline = orders_pipeline(tmp_path).with_(parallelism=None)
    built = pipeline_defs(pipeline, resources={"spark": SparkResource(app_name="orders")})
    job = built.definitions().resolve_job_def(built.scope.name("checkpoint"))
    storage = pipeline.storage()
    instance = dg.DagsterInstance.ephemeral()

    def materialize(parallelism: int | None) -> list[str]:
        config = {} if parallelism is None else {
            "resources": built.scope.keyed({"state_backend": {"config": {"parallelism": parallelism}}})}
        result = job.execute_in_process(run_config=config, instance=instance)
        assert result.success
        return [e.user_message for e in instance.all_logs(result.run_id) if "rescaling" in e.user_message]

    for number, parallelism in enumerate((3, None, 2)):
        land(tmp_path, f"batch-{number}.parquet")
        said = materialize(parallelism)
        meta = CompletedCheckpointStore(storage).load(number + 1)
        assert {op.parallelism for op in meta.operators.values()} == {parallelism or 3}
        assert said == ([] if parallelism != 2 else ["rescaling 3 -> 2 subtasks from chk-2"]), said
