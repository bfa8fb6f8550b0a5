"""Erasing a key on Spark reads and rewrites its key group's files, not its subtask's: a user's
operator (`subscriptions`: a profile, a map of newsletters, a reminder timer) at parallelism 2 of
128 key groups, its state compacted by a long-running job's compaction; the erase downloads
(counted at the storage) a few of the subtask's files, the key is gone, the rest identical,
`sparkpoint verify` passes, and the job runs on from the erased checkpoint."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

import sparkpoint
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.cli import main
from sparkpoint.pipeline.driver import StatefulPipeline
from sparkpoint.state.keygroups import key_group_for
from tests.support import subscriptions_pipeline as sp

ACCOUNTS = [f"acct-{i:05d}" for i in range(12000)]
GONE = "acct-00042"


@pytest.mark.spark
def test_an_erase_at_a_parallelism_below_the_key_groups_reads_the_key_groups_files(
        spark, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    pipeline = sp.subscriptions_pipeline(tmp_path)
    sp.land(tmp_path / "in", 1, ACCOUNTS)
    sp.land(tmp_path / "in", 2, ACCOUNTS, compact=True)
    sp.land(tmp_path / "in", 3, ACCOUNTS[-10:])  # chk-3 materializes the changelog's chain: the compacted state
    assert [r.checkpoint_id for r in StatefulPipeline(spark, pipeline.config(), pipeline.operators).run()] == [1, 2, 3]
    before = pipeline.read_state("subscriptions").set_index("account")
    assert before.loc[GONE, "reminders"] == 2 and before.loc[GONE, "reads"]
    storage = CheckpointStorage(str(tmp_path / "ckpt"), "subscriptions")
    meta = CompletedCheckpointStore(storage).load(3)
    group = key_group_for(GONE, 128)
    holder = next(h for h in meta.operators["subscriptions"].subtasks if group in h.key_group_range)
    ssts = {f.path: f.size for f in holder.files() if f.local_name.endswith(".sst")}
    assert len(ssts) > 20, "the compacted state is cut into files of about a key group"

    read: dict[str, int] = {}
    real = CheckpointStorage.download

    def counting(self: CheckpointStorage, pairs):  # type: ignore[no-untyped-def]
        out = real(self, pairs)
        for (rel, _), (size, _) in zip(pairs, out):
            read[rel] = read.get(rel, 0) + size
        return out

    monkeypatch.setattr(CheckpointStorage, "download", counting)
    report = sparkpoint.erase_keys(pipeline, [GONE])
    monkeypatch.undo()

    assert report.verified, report.message
    chk3 = next(c for c in report.checkpoints if c.original_id == 3)
    (sub,) = chk3.subtasks
    assert sub.subtask == holder.subtask and sub.route == "key_group_files", sub.fallback
    # Of the holding subtask's files, the erase of chk-3 and its proof read the key group's few.
    of_chk3 = {p: n for p, n in read.items() if p in ssts}
    assert 0 < len(of_chk3) < len(ssts) // 4, (len(of_chk3), len(ssts))
    assert sum(of_chk3.values()) < 0.5 * sum(ssts.values()), "erase, proof and final check: less than half, together"
    assert 0 < sub.bytes_read < 0.2 * sum(ssts.values()) and 0 < sub.bytes_written < 0.2 * sum(ssts.values())
    assert sub.proof is not None and sub.proof.files_kept > 20
    after = pipeline.read_state("subscriptions").set_index("account")
    assert GONE not in after.index
    pd.testing.assert_frame_equal(after, before.drop(index=GONE))
    assert main(["verify", "--checkpoints", str(tmp_path / "ckpt"), "--job-id", "subscriptions"]) == 0

    # The job runs on from the erased copy of chk-3 (its files partly the original's, partly rewritten).
    sp.land(tmp_path / "in", 4, [a for a in ACCOUNTS[:100] if a != GONE])
    assert [r.checkpoint_id for r in StatefulPipeline(spark, pipeline.config(), pipeline.operators).run()] == [7]
    final = pipeline.read_state("subscriptions").set_index("account")
    assert GONE not in final.index and final.loc["acct-00001", "reminders"] == 3
    assert final.loc["acct-11000", "reminders"] == 2
