"""`check-upgrade` on state schema changes agrees with what a start and a restore then do: each
compatible RecordCodec change is reported with its rule and restores; each incompatible one is
reported with the field and both types and refused, by `run` before Spark and by the restore.
A user's own operator (tests.support.loyalty_pipeline), not the sample's."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

import tests.support.loyalty_pipeline as loy
from sparkpoint import JsonCodec, KeyedOperator, Pipeline, RecordCodec, StateDescriptor
from sparkpoint.checkpoint.errors import OperatorStateMismatch
from sparkpoint.cli import main
from sparkpoint.pipeline.driver import StatefulPipeline
from sparkpoint.state.schema import StateSchemaIncompatible
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
        code = main(["check-upgrade", "--pipeline", "tests.support.loyalty_pipeline:candidate", "--checkpoints",
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
        StatefulPipeline(None, config, (operator,)).check_start()
        started = True
    except OperatorStateMismatch:
        started = False
    try:
        with OperatorHarness.restore(snapshot, parallelism=3, operator=operator) as h:
            restored = len(h.export()) == 24
    except OperatorStateMismatch:
        restored = False
    assert (started, restored) == (works, works), case


@pytest.mark.parametrize("case, operator, works, said", CASES, ids=[c[0] for c in CASES])
def test_check_upgrade_text_names_each_states_verdict(snapshot, tmp_path: Path, capsys, case, operator, works,
                                                      said):
    loy.candidate = loy.loyalty_pipeline(tmp_path, operator)  # type: ignore[attr-defined]
    try:
        code = main(["check-upgrade", "--pipeline", "tests.support.loyalty_pipeline:candidate", "--checkpoints",
                     snapshot.checkpoints_url, "--job-id", "harness", "--max-parallelism", "32"])
    finally:
        del loy.candidate  # type: ignore[attr-defined]
    text = capsys.readouterr().out
    assert code == (0 if works else 1)
    lines = {line.split(":")[0].strip(): line.strip() for line in text.splitlines()
             if line.strip().startswith("state ")}
    assert set(lines) == {"state totals", "state profile", "state days"}, text
    assert lines["state days"] == "state days: unchanged"
    totals = lines["state totals"]
    if case == "unchanged":
        assert totals == "state totals: unchanged"
    elif case == "evolved":  # each rule: the field added with its default, each widening with both types
        assert totals.startswith("state totals: compatible: ")
        assert all(rule in totals for rule in loy.V2_RULES), totals
    else:  # refused, naming the field and both types
        assert totals.startswith("state totals: REFUSED: ") and said in totals


# --- a state the checkpoint kept undeclared, declared by the new version ------------------------------

KEPT_AS = RecordCodec({"points": "int64", "games": "int64"})


def progress_operator(codec: Any, *, declared: bool = True, previous: Any = None) -> KeyedOperator:
    """A user's operator: per player the points scored and the games played, in state `progress`;
    version 1 opens it without declaring it, version 2 declares it (with `previous=` or not)."""
    def store(state: Any) -> Any:
        return state.declared("progress") if declared else state.value_state("progress", codec)

    def process(batch: pd.DataFrame, state: Any) -> None:
        agg = batch.groupby("player", sort=True)["points"].agg(["sum", "size"])
        progress = store(state)
        old = progress.get_many(agg.index.tolist())
        progress.put_many((p, {"points": (o or {}).get("points", 0) + int(total),
                               "games": (o or {}).get("games", 0) + int(n)})
                          for p, total, n, o in zip(agg.index, agg["sum"], agg["size"], old))

    def export(state: Any) -> pd.DataFrame:
        rows = [{"player": k.decode(), **v} for k, v in store(state).items()]
        return pd.DataFrame(rows).sort_values("player").reset_index(drop=True)

    return KeyedOperator("progress", key="player", columns=("points",), process=process, export=export,
                         key_type="string",
                         states={"progress": StateDescriptor("value", codec, previous=previous)} if declared else {})


def games(seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame({"player": [f"p{i:02d}" for i in rng.integers(0, 30, 200)],
                         "points": rng.integers(1, 1000, 200)})


def played(*batches: pd.DataFrame) -> pd.DataFrame:
    g = pd.concat(batches).groupby("player", sort=True)["points"]
    return pd.DataFrame({"player": g.sum().index, "points": g.sum().values, "games": g.size().values})


def kept_undeclared(codec: Any) -> Any:
    with OperatorHarness(progress_operator(codec, declared=False), parallelism=2, max_parallelism=32) as h:
        h.process(games(1))
        h.process(games(2))
        return h.snapshot()


def check_upgrade_text(snap: Any, tmp_path: Path, capsys: Any, operator: KeyedOperator, monkeypatch: Any
                       ) -> tuple[int, str]:
    monkeypatch.setattr(sys.modules[__name__], "candidate",
                        Pipeline("progress", [operator], input_url=str(tmp_path / "in"),
                                 checkpoints_url=str(tmp_path / "ckpt"), max_parallelism=32), raising=False)
    code = main(["check-upgrade", "--pipeline", f"{__name__}:candidate", "--checkpoints", snap.checkpoints_url,
                 "--job-id", "harness", "--max-parallelism", "32"])
    return code, capsys.readouterr().out


def starts(snap: Any, tmp_path: Path, operator: KeyedOperator) -> None:
    (tmp_path / "in").mkdir(exist_ok=True)
    config = Pipeline("progress", [operator], input_url=str(tmp_path / "in"), checkpoints_url=snap.checkpoints_url,
                      job_id="harness", max_parallelism=32).config()
    StatefulPipeline(None, config, (operator,)).check_start()


@pytest.mark.parametrize("declared_as, rule, points", [
    # The run failed ("record value is 18 bytes, its fields take 26 ... Declare the state") after a green check.
    (RecordCodec({"points": "int64", "games": "int64", "level": "string"}, defaults={"level": "rookie"}),
     "added field level (default 'rookie')", int),
    # One width: the old int64 bytes read as float64 numbers, silently.
    (RecordCodec({"points": "float64", "games": "int64"}), "widened points int64→float64", float),
], ids=["field added", "same width widened"])
def test_a_record_state_kept_undeclared_and_declared_now_is_checked_and_migrated_from_its_recorded_fields(
        tmp_path: Path, capsys, monkeypatch, declared_as: RecordCodec, rule: str, points: type):
    snap = kept_undeclared(KEPT_AS)
    # Without previous=, nothing declared the state: the pre-flight cannot check it (exit 1),
    # and names the fields the snapshot recorded so the user can confirm them.
    unconfirmed = progress_operator(declared_as)
    code, text = check_upgrade_text(snap, tmp_path, capsys, unconfirmed, monkeypatch)
    assert code == 1 and "state progress: CANNOT CHECK, refused: kept undeclared until now" in text, text
    assert "recorded no declaration" in text and "previous=RecordCodec(" in text and "'points': 'int64'" in text, text
    with pytest.raises(StateSchemaIncompatible, match="previous="):
        starts(snap, tmp_path, unconfirmed)
    new = progress_operator(declared_as, previous=KEPT_AS)
    code, text = check_upgrade_text(snap, tmp_path, capsys, new, monkeypatch)
    assert code == 0, text
    assert ("state progress: compatible: kept undeclared until now, read with previous=RecordCodec, the fields its "
            f"snapshot recorded; {rule}") in text
    starts(snap, tmp_path, new)
    with OperatorHarness.restore(snap, parallelism=3, operator=new) as h:
        h.process(games(3))
        got = h.export()
    want = played(games(1), games(2), games(3))
    assert got.player.tolist() == want.player.tolist() and got.games.tolist() == want.games.tolist()
    assert got.points.tolist() == [points(p) for p in want.points]
    if "level" in declared_as.names:
        assert set(got.level) == {"rookie"}
    # previous= that contradicts the fields the checkpoint recorded is refused, both ways.
    wrong = progress_operator(declared_as, previous=RecordCodec({"points": "int32"}))
    code, text = check_upgrade_text(snap, tmp_path, capsys, wrong, monkeypatch)
    assert code == 1 and "state progress: CANNOT CHECK, refused: " in text, text
    assert "give previous= the recorded" in text, text


def test_a_state_kept_undeclared_without_a_recorded_codec_is_refused_unless_its_previous_codec_is_given(
        tmp_path: Path, capsys, monkeypatch):
    snap = kept_undeclared(JsonCodec())  # JsonCodec's entries: nothing records which codec wrote them
    declared = progress_operator(JsonCodec())
    code, text = check_upgrade_text(snap, tmp_path, capsys, declared, monkeypatch)
    assert code == 1, text
    assert "state progress: CANNOT CHECK, refused: kept undeclared until now" in text and "previous=" in text
    assert "the restore would be refused" in text
    with pytest.raises(StateSchemaIncompatible, match="recorded no codec for it.*previous="):
        starts(snap, tmp_path, declared)
    with pytest.raises(StateSchemaIncompatible, match="recorded no codec for it.*previous="):
        OperatorHarness.restore(snap, operator=declared)
    # Another codec's bytes are refused at the restore, not misread.
    as_record = progress_operator(RecordCodec({"points": "int64", "games": "int64"}))
    with pytest.raises(StateSchemaIncompatible, match="recorded no codec for it"):
        OperatorHarness.restore(snap, operator=as_record)
    code, text = check_upgrade_text(snap, tmp_path, capsys, progress_operator(
        RecordCodec({"points": "int64", "games": "int64"}), previous=JsonCodec()), monkeypatch)
    assert code == 1 and "state progress: REFUSED: codec changed from JsonCodec to RecordCodec" in text

    with_previous = progress_operator(JsonCodec(), previous=JsonCodec())
    code, text = check_upgrade_text(snap, tmp_path, capsys, with_previous, monkeypatch)
    assert code == 0, text
    assert "state progress: compatible: kept undeclared until now, read with previous=JsonCodec" in text
    starts(snap, tmp_path, with_previous)
    with OperatorHarness.restore(snap, parallelism=1, operator=with_previous) as h:
        h.process(games(3))
        got = h.export()
    pd.testing.assert_frame_equal(got, played(games(1), games(2), games(3)), check_dtype=False)
