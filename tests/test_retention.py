"""Retention and shutdown policies as tables of cases."""

from __future__ import annotations

from pathlib import Path

import pytest

from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.retention import checkpoints_to_subsume, discard_on_shutdown
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.state.engine.verify import verify_checkpoint
from tests.support.helpers import FakeSubtask

R, D, N = "RETAIN_ON_CANCELLATION", "DELETE_ON_CANCELLATION", "NO_EXTERNALIZED_CHECKPOINTS"


@pytest.mark.parametrize(
    ("retention", "status", "discard"),
    [
        (R, "FINISHED", False), (R, "CANCELED", False), (R, "FAILED", False), (R, "SUSPENDED", False),
        (D, "FINISHED", True), (D, "CANCELED", True), (D, "FAILED", False), (D, "SUSPENDED", False),
        (N, "FINISHED", True), (N, "CANCELED", True), (N, "FAILED", True), (N, "SUSPENDED", True),
    ],
)
def test_flink_externalized_retention_table(retention: str, status: str, discard: bool):
    assert discard_on_shutdown(retention, status) is discard


C, S = "checkpoint", "savepoint"


@pytest.mark.parametrize(
    ("retained", "num_retained", "subsumed"),
    [
        ([], 1, []),
        ([(1, C)], 1, []),
        ([(1, C), (2, C)], 1, [1]),
        ([(1, C), (2, C), (3, C)], 2, [1]),
        ([(3, C), (1, C), (2, C)], 1, [1, 2]),
        ([(1, S), (2, C), (3, C)], 1, [2]),
        ([(1, C), (2, S), (3, S)], 1, []),  # the latest checkpoint survives whatever savepoints follow
        ([(1, C), (2, C)], 0, [1]),  # never subsume the latest, even at num_retained 0
        ([(1, C), (2, C), (3, C)], 5, []),
    ],
)
def test_subsumption(retained, num_retained, subsumed):
    assert checkpoints_to_subsume(retained, num_retained) == subsumed


def test_retention_never_subsumes_for_a_checkpoint_whose_new_upload_is_gone(tmp_path: Path):
    """N2's second half: a commit over files a sweep took must not drop the last good checkpoint."""
    storage = CheckpointStorage(f"file://{tmp_path}/ckpt", "job")
    coordinator = CheckpointCoordinator(storage, num_retained=1)
    sub = FakeSubtask(storage, tmp_path / "db")
    sub.write("a")
    first = coordinator.trigger(expected={"op": 1}).checkpoint_id
    coordinator.acknowledge(first, sub.snapshot(first, ["a"]))
    coordinator.complete(first)
    sub.confirm(first)
    sub.write("b")
    second = coordinator.trigger(expected={"op": 1}).checkpoint_id
    handle = sub.snapshot(second, ["a", "b"])
    coordinator.acknowledge(second, handle)
    storage.delete([handle.new_files()[0].path])  # an orphan sweep took it while the checkpoint committed
    done = coordinator.complete(second)
    assert done.subsumed == () and done.deletion_blocked and "missing" in done.deletion_blocked
    assert CompletedCheckpointStore(storage).checkpoint_ids() == [2, 1], "chk-1 still restores"
    assert verify_checkpoint(storage, CompletedCheckpointStore(storage).load(1)) == []
