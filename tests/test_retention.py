"""Retention and shutdown policies as tables of cases."""

from __future__ import annotations

import pytest

from sparkpoint.checkpoint.retention import checkpoints_to_subsume, discard_on_shutdown

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
