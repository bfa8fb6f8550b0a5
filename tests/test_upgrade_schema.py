"""`check-upgrade` on state schema changes agrees with what a start and a restore then do: each
compatible RecordCodec change is reported with its rule and restores; each incompatible one is
reported with the field and both types and refused, by `run` before Spark and by the restore.
A user's own operator (tests.loyalty_pipeline), not the sample's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import tests.loyalty_pipeline as loy
from sparkpoint import RecordCodec
from sparkpoint.checkpoint.errors import OperatorStateMismatch
from sparkpoint.cli import main
from sparkpoint.pipeline.runtime import PipelineCore
from sparkpoint.testing import OperatorHarness

NARROWED = RecordCodec({"clicks": "int8", "spend": "float32", "visits": "int64 not null", "legacy": "string"})
RETYPED = RecordCodec({"clicks": "string", "spend": "float32", "visits": "int64 not null", "legacy": "string"})
NOT_NULL = RecordCodec({"clicks": "int32 not null", "spend": "float32", "visits": "int64 not null",
                        "legacy": "string"}, defaults={"visits": 0})

CASES = [  # (name, operator, restore works, what the report says of state totals)
    ("unchanged", loy.loyalty_v1, True, "unchanged"),
    ("evolved", loy.loyalty_v2, True, "compatible"),
    ("narrowed", loy.loyalty_operator(NARROWED), False, "clicks changed from int32 to int8"),
    ("retyped", loy.loyalty_operator(RETYPED), False, "clicks changed from int32 to string"),
    ("made not null", loy.loyalty_operator(NOT_NULL), False, "clicks"),
]


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory: pytest.TempPathFactory):
    with OperatorHarness(loy.loyalty_v1, parallelism=2, max_parallelism=32) as h:
        h.process(loy.batch(0))
        yield h.snapshot()


@pytest.mark.parametrize("case, operator, works, said", CASES, ids=[c[0] for c in CASES])
def test_check_upgrade_says_what_the_start_and_the_restore_then_do(snapshot, tmp_path: Path, capsys, case, operator,
                                                                   works, said):
    loy.candidate = loy.loyalty_pipeline(tmp_path, operator)  # type: ignore[attr-defined]
    try:
        code = main(["check-upgrade", "--pipeline", "tests.loyalty_pipeline:candidate", "--checkpoints",
                     snapshot.checkpoints_url, "--job-id", "harness", "--max-parallelism", "32", "--json"])
    finally:
        del loy.candidate  # type: ignore[attr-defined]
    report = json.loads(capsys.readouterr().out)
    (plan,) = report["operators"]
    totals = next(s for s in plan["states"] if s["state"] == "totals")
    assert (code == 0, report["ok"]) == (works, works)
    assert said in (totals["verdict"] + " " + " ".join(totals["problems"]))
    if case == "evolved":
        assert sorted(totals["rules"]) == sorted(loy.V2_RULES)

    (tmp_path / "in").mkdir()
    config = loy.loyalty_pipeline(tmp_path, operator).config(checkpoints_url=snapshot.checkpoints_url,
                                                             job_id="harness")
    try:
        PipelineCore(None, config, (operator,)).check_start()
        started = True
    except OperatorStateMismatch:
        started = False
    try:
        with OperatorHarness.restore(snapshot, parallelism=3, operator=operator) as h:
            restored = len(h.export()) == 24
    except OperatorStateMismatch:
        restored = False
    assert (started, restored) == (works, works), case
