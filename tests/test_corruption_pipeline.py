"""Corruption end to end (issue 11, item 3): the sample pipeline on local Spark, a bad SST that
every retained checkpoint needs. Without a good copy the run stops with that message and discards
nothing; `sparkpoint verify --repair` rewrites it from the task-local copy and the run goes on."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.cli import main
from sparkpoint.pipeline.driver import StatefulPipeline
from sparkpoint.pipeline.runtime import PipelineConfig, PipelineError
from sparkpoint.spark.generate import generate
from sparkpoint.state.sample import SAMPLE_OPERATORS

pytestmark = pytest.mark.spark


def test_a_bad_sst_every_checkpoint_needs_stops_the_run_and_verify_repair_lets_it_resume(spark, tmp_path: Path):
    generate(str(tmp_path / "in"), batches=2, events_per_batch=300, users=100, items=20, seed=9)
    url = f"file://{tmp_path}/ckpt"
    config = PipelineConfig(input_url=str(tmp_path / "in"), checkpoints_url=url, job_id="job", parallelism=2,
                            local_dir=str(tmp_path / "local"), output_url=f"file://{tmp_path}/out", num_retained=3)
    assert [r.checkpoint_id for r in StatefulPipeline(spark, config, SAMPLE_OPERATORS).run()] == [1, 2]
    storage = CheckpointStorage(url, "job")
    store = CompletedCheckpointStore(storage)
    retained = store.load_all().checkpoints
    victim = next(f for f in retained[-1].files() if f.local_name.endswith(".sst")
                  and all(f.path in m.paths() for m in retained))
    path = tmp_path / "ckpt" / "job" / victim.path
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    shutil.move(tmp_path / "local", tmp_path / "saved-local")  # the working state is gone: restore reads storage

    generate(str(tmp_path / "in"), batches=1, events_per_batch=300, users=100, items=20, seed=9, first=2)
    with pytest.raises(PipelineError) as err:
        StatefulPipeline(spark, config, SAMPLE_OPERATORS).run()
    message = str(err.value)
    assert victim.path in message and "every retained checkpoint (chk-2, chk-1) needs it" in message
    assert "no good copy exists" in message
    assert store.checkpoint_ids() == [2, 1], "nothing was discarded by a fallback that could not help"

    args = ["verify", "--checkpoints", url, "--job-id", "job"]
    assert main([*args, "--repair", "--local-dir", str(tmp_path / "saved-local")]) == 0
    assert [r.checkpoint_id for r in StatefulPipeline(spark, config, SAMPLE_OPERATORS).run()] == [3]
    assert main(args) == 0
