"""Declared states, RecordCodec and schema evolution, state without the code (issue 33, items 3,
4 and 7), without Spark: a user's operator (`tests.support.loyalty_pipeline`) on real RocksDB through
`OperatorHarness`, snapshots restored at other parallelisms by a changed version of the code."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from sparkpoint import JsonCodec, KeyedOperator, RecordCodec, StateDescriptor, StateTtl, StructCodec, compare_states
from sparkpoint.api import read_state
from sparkpoint.checkpoint.errors import MetadataError, StateBackendError
from sparkpoint.checkpoint.metadata import CheckpointMetadata, content_checksum
from sparkpoint.cli import EXIT_BAD_INPUT, main
from sparkpoint.state.record import RecordSchemaError
from sparkpoint.state.schema import STRUCT_CANNOT_EVOLVE, StateSchemaIncompatible
from sparkpoint.testing import OperatorHarness
from tests.support import loyalty_pipeline as loy


def test_record_codec_round_trips_dicts_and_tables_with_nulls_defaults_and_timestamps():
    codec = RecordCodec({"clicks": "int64", "spend": "float64", "last": "timestamp[us]", "tier": "string",
                         "at": "timestamp[ms, tz=UTC]", "ok": "bool", "raw": "binary", "n": "int32 not null"},
                        defaults={"tier": "free", "n": 7})
    value = {"clicks": 3, "spend": 1.25, "last": pd.Timestamp("2026-01-02 03:04:05.123456"),
             "at": pd.Timestamp("2026-05-01 10:00:00.5", tz="UTC"), "ok": True, "raw": b"\x00\xff", "n": -2,
             "tier": "gold ✓"}
    assert codec.decode(codec.encode(value)) == value
    # A field not given is its default, else None; None given stays None.
    assert codec.decode(codec.encode({"clicks": None})) == {
        "clicks": None, "spend": None, "last": None, "tier": "free", "at": None, "ok": None, "raw": None, "n": 7}
    with pytest.raises(ValueError, match="field 'n' is int32 not null"):
        codec.encode({"n": None})
    with pytest.raises(ValueError, match="lacks"):
        codec.encode({"nope": 1})
    values = [codec.encode(value), None, codec.encode({"tier": ""}), codec.encode({"clicks": 1, "tier": "x" * 300})]
    table = codec.decode_table(values)
    assert table.column_names == list(codec.names) and table.num_rows == 4
    rows = table.to_pylist()
    assert rows[1] == dict.fromkeys(codec.names)  # an absent value: a row of nulls
    assert rows[0]["tier"] == "gold ✓" and rows[0]["raw"] == b"\x00\xff" and rows[2]["tier"] == ""
    assert rows[3]["tier"] == "x" * 300 and rows[3]["n"] == 7
    assert pd.Timestamp(rows[0]["at"]) == value["at"]
    # The columnar encoding is byte for byte the one-value encoding.
    present = table.filter(pa.array([True, False, True, True]))
    assert codec.encode_table(present) == [values[0], values[2], values[3]]
    assert codec.encode_table(present.to_pandas()) == [values[0], values[2], values[3]]
    assert codec.encode_table({"clicks": [5]}) == [codec.encode({"clicks": 5})]
    assert RecordCodec.from_spec(codec.spec()) == codec
    with pytest.raises(RecordSchemaError, match="decimal"):
        RecordCodec({"x": "decimal"})


def test_declared_record_state_is_read_and_written_as_dicts_and_tables_and_recorded_in_metadata():
    with OperatorHarness(loy.loyalty_v1, parallelism=2) as h:
        h.process(loy.batch(0))
        h.process(loy.batch(1))
        pd.testing.assert_frame_equal(h.export().sort_values("customer").reset_index(drop=True),
                                      loy.recompute([loy.batch(0), loy.batch(1)], [], loy.V1.names),
                                      check_dtype=False)
        snap = h.snapshot()
    states = snap.metadata().operators["loyalty"].states
    assert states == {
        "totals": {"kind": "value", "key_type": "string", "ttl": {"seconds": loy.TTL.seconds, "update": "on_write",
                                                                   "clock": "processing"},
                   "codec": {"type": "record", "fields": [["clicks", "int32"], ["spend", "float32"],
                                                          ["visits", "int64 not null"], ["legacy", "string"]],
                             "defaults": {"visits": 0}}},
        "profile": {"kind": "value", "key_type": "string", "ttl": None, "codec": {"type": "json"}},
        "days": {"kind": "map", "key_type": "string", "ttl": None, "codec": {"type": "json"}},
    }


@pytest.mark.parametrize("parallelisms", [(2, 3, 1), (3, 1, 2)])
def test_every_compatible_change_reads_old_entries_in_the_new_shape_across_rescaled_restores(parallelisms):
    p1, p2, p3 = parallelisms
    v1_batches, v2_batches = [loy.batch(b) for b in range(3)], [loy.batch(b) for b in range(3, 6)]
    with OperatorHarness(loy.loyalty_v1, parallelism=p1) as h:
        for b in v1_batches:
            h.process(b)
        snap = h.snapshot()
    changes = compare_states(snap.metadata().operators["loyalty"].states, loy.loyalty_v2.declarations())
    assert [(c.state, c.status, c.verdict) for c in changes] == [
        ("days", "kept", "unchanged"), ("profile", "kept", "unchanged"), ("totals", "kept", "compatible")]
    assert sorted(changes[2].rules) == sorted(loy.V2_RULES)
    with OperatorHarness.restore(snap, parallelism=p2, operator=loy.loyalty_v2) as h2:
        # Old entries read in the new shape before version 2 wrote anything.
        got = h2.export().sort_values("customer").reset_index(drop=True)
        pd.testing.assert_frame_equal(got, loy.recompute(v1_batches, [], loy.V2.names), check_dtype=False)
        for b in v2_batches[:2]:
            h2.process(b)
        snap2 = h2.snapshot()  # the changelog carries the rewritten entries
        h2.process(v2_batches[2])
        snap3 = h2.snapshot()
    assert snap2.metadata().operators["loyalty"].states["totals"]["codec"] == loy.V2.spec()
    with OperatorHarness.restore(snap3, parallelism=p3, operator=loy.loyalty_v2) as h3:
        got = h3.export().sort_values("customer").reset_index(drop=True)
    pd.testing.assert_frame_equal(got, loy.recompute(v1_batches, v2_batches, loy.V2.names), check_dtype=False)
    # The TTL stamps went through the rewrite: every entry still carries one.
    raw = read_state(snap3.checkpoints_url, "harness", "loyalty", raw=True)
    assert len(raw[raw.state == "totals"]) == len(got)


def test_an_incompatible_change_is_refused_naming_operator_state_field_and_both_types():
    with OperatorHarness(loy.loyalty_v1, parallelism=2) as h:
        h.process(loy.batch(0))
        snap = h.snapshot()
    cases = [
        (RecordCodec({"clicks": "int16", "spend": "float32", "visits": "int64", "legacy": "string"}),
         "state totals: field clicks changed from int32 to int16: a narrowing"),
        (RecordCodec({"clicks": "int32", "spend": "int64", "visits": "int64", "legacy": "string"}),
         "state totals: field spend changed from float32 to int64: a type change"),
        (RecordCodec({"clicks": "int32", "spend": "float32", "visits": "int64", "legacy": "int64"}),
         "state totals: field legacy changed from string to int64"),
        (RecordCodec({"clicks": "int32 not null", "spend": "float32", "visits": "int64", "legacy": "string"}),
         "state totals: field clicks changed from int32 to int32 not null"),
        (RecordCodec({"clicks": "int32", "spend": "float32", "visits": "int64", "x": "int8 not null"}),
         "state totals: added field x as int8 not null without a default"),
    ]
    for codec, message in cases:
        with pytest.raises(StateSchemaIncompatible, match=f"operator loyalty, {message}"):
            OperatorHarness.restore(snap, parallelism=3, operator=loy.loyalty_operator(codec))
    rekeyed = KeyedOperator("loyalty", key="customer", process=lambda b, s: None, export=lambda s: pd.DataFrame(),
                            key_type="int64", states={"totals": StateDescriptor("value", loy.V1, ttl=loy.TTL)})
    with pytest.raises(StateSchemaIncompatible, match="state totals: key type changed from string to int64"):
        OperatorHarness.restore(snap, operator=rekeyed)
    kind = KeyedOperator("loyalty", key="customer", process=lambda b, s: None, export=lambda s: pd.DataFrame(),
                         states={"days": StateDescriptor("list", JsonCodec())})
    with pytest.raises(StateSchemaIncompatible, match="state days: kind changed from map to list"):
        OperatorHarness.restore(snap, operator=kind)


def test_the_pipeline_refuses_an_incompatible_schema_before_spark_starts(tmp_path: Path, capsys):
    pipeline = loy.loyalty_pipeline(tmp_path)
    with OperatorHarness(loy.loyalty_v1, parallelism=2, max_parallelism=32) as h:
        h.process(loy.batch(0))
        snap = h.snapshot()
    narrowed = loy.loyalty_operator(RecordCodec({"clicks": "int8", "spend": "float32", "visits": "int64"}))
    (tmp_path / "in").mkdir()
    loy.batch(1).to_parquet(tmp_path / "in" / "b1.parquet")
    args = ["run", "--pipeline", "tests.support.loyalty_pipeline:loyalty_narrowed", "--input", str(tmp_path / "in"),
            "--checkpoints", snap.checkpoints_url, "--job-id", "harness", "--local-dir", str(tmp_path / "local"),
            "--max-parallelism", "32"]
    loy.loyalty_narrowed = pipeline.with_(operators=[narrowed])  # type: ignore[attr-defined]
    try:
        assert main(args) == EXIT_BAD_INPUT  # no Spark session was asked for: the run ends before one
    finally:
        del loy.loyalty_narrowed  # type: ignore[attr-defined]
    err = capsys.readouterr().err
    assert "operator loyalty, state totals: field clicks changed from int32 to int8" in err, err
    assert "refused before Spark starts" in err
    from sparkpoint.pipeline.driver import StatefulPipeline

    config = pipeline.config(checkpoints_url=snap.checkpoints_url, job_id="harness")
    with pytest.raises(StateSchemaIncompatible) as e:
        StatefulPipeline(None, config, (narrowed,)).check_start()
    assert "refused before Spark starts" in str(e.value)
    assert "operator loyalty, state totals: field clicks changed from int32 to int8" in str(e.value)
    assert StatefulPipeline(None, config, (loy.loyalty_v2,)).check_start() is not None  # compatible: goes on


@pytest.mark.parametrize(("old", "new", "verdict", "says"), [
    ({"type": "json"}, {"type": "json"}, "unchanged", ""),
    ({"type": "struct", "format": "<q"}, {"type": "struct", "format": "<q"}, "unchanged", ""),
    ({"type": "struct", "format": "<q"}, {"type": "struct", "format": "<qd"}, "incompatible", STRUCT_CANNOT_EVOLVE),
    ({"type": "struct", "format": "<q"}, RecordCodec({"n": "int64"}).spec(), "incompatible", STRUCT_CANNOT_EVOLVE),
    ({"type": "json"}, {"type": "bytes"}, "incompatible", "codec changed from JsonCodec to BytesCodec"),
    (RecordCodec({"a": "int8"}).spec(), RecordCodec({"a": "float32"}).spec(), "compatible", "widened a int8→float32"),
    (RecordCodec({"a": "int64"}).spec(), RecordCodec({"a": "float64"}).spec(), "compatible", "widened a int64→float64"),
    (RecordCodec({"a": "int64"}).spec(), RecordCodec({"a": "float32"}).spec(), "incompatible",
     "field a changed from int64 to float32"),
    (RecordCodec({"a": "uint8"}).spec(), RecordCodec({"a": "int16"}).spec(), "compatible", "widened a uint8→int16"),
    (RecordCodec({"a": "timestamp[us]"}).spec(), RecordCodec({"a": "timestamp[ns]"}).spec(), "incompatible",
     "field a changed from timestamp[us] to timestamp[ns]"),
    (RecordCodec({"a": "int8", "b": "string"}).spec(), RecordCodec({"b": "string", "a": "int8"}).spec(),
     "compatible", "reordered fields"),
])
def test_compare_states_says_what_a_restore_does_to_each_codec(old, new, verdict, says):
    decl = {"kind": "value", "key_type": None, "ttl": None}
    (change,) = compare_states({"s": {**decl, "codec": old}}, {"s": {**decl, "codec": new}})
    assert change.verdict == verdict
    assert says in " ".join(change.rules + change.problems)


def test_compare_states_names_new_and_dropped_states_and_ttl_changes():
    decl = {"kind": "value", "key_type": "string", "ttl": None, "codec": {"type": "json"}}
    ttl = {**decl, "ttl": {"seconds": 60, "update": "on_write", "clock": "event"}}
    changes = {c.state: c for c in compare_states({"a": decl, "b": decl}, {"b": ttl, "c": decl})}
    assert (changes["a"].status, changes["b"].status, changes["c"].status) == ("dropped", "kept", "new")
    assert changes["b"].verdict == "compatible" and changes["b"].rules == ("TTL none → 60s (event, on_write)",)
    assert changes["a"].to_json()["verdict"] == "compatible"


def test_struct_codec_says_in_one_line_that_it_cannot_evolve():
    assert STRUCT_CANNOT_EVOLVE in (StructCodec.__doc__ or "")
    assert "\n" not in STRUCT_CANNOT_EVOLVE and "RecordCodec" in STRUCT_CANNOT_EVOLVE


def test_json_codec_values_keep_working_across_a_change_of_their_shape():
    with OperatorHarness(loy.loyalty_v1, parallelism=1) as h:
        h.process(loy.batch(0))
        snap = h.snapshot()
    with OperatorHarness.restore(snap, parallelism=2, operator=loy.loyalty_v2) as h2:
        h2.process(loy.batch(1))
        snap2 = h2.snapshot()
    raw = read_state(snap2.checkpoints_url, "harness", "loyalty", raw=True)
    profiles = raw[raw.state == "profile"].set_index("key")["value"].to_dict()
    seen_later = set(loy.batch(1)["customer"])
    assert all(("tiers" in v) == (k in seen_later) for k, v in profiles.items())  # both shapes, side by side
    assert set(profiles) == set(loy.batch(0)["customer"]) | seen_later


def test_a_declared_state_asked_for_with_another_codec_is_refused():
    op = KeyedOperator("o", key="k", process=lambda b, s: s.value_state("t", JsonCodec()),
                       export=lambda s: pd.DataFrame(), states={"t": RecordCodec({"n": "int64"})})
    with OperatorHarness(op) as h, pytest.raises(StateBackendError, match="state 't' of o is declared as a value"):
        h.process(pd.DataFrame({"k": ["a"]}))


def test_the_state_of_a_removed_operator_is_exported_raw_from_metadata_alone(tmp_path: Path, capsys):
    batches = [loy.batch(b) for b in range(3)]
    with OperatorHarness(loy.loyalty_v1, parallelism=3) as h:
        for b in batches:
            h.process(b)
        snap = h.snapshot()
    # No code of `loyalty` is given: only its id in `_metadata`.
    raw = read_state(snap.checkpoints_url, "harness", "loyalty", raw=True)
    assert list(raw.columns) == ["state", "kind", "key", "user_key", "index", "value"]
    totals = raw[raw.state == "totals"]
    got = pd.DataFrame([{"customer": k, **v} for k, v in zip(totals.key, totals.value)])
    pd.testing.assert_frame_equal(got.sort_values("customer").reset_index(drop=True),
                                  loy.recompute(batches, [], loy.V1.names), check_dtype=False)
    days = raw[raw.state == "days"]
    every = pd.concat(batches).groupby(["customer", "day"]).size()
    assert {(k, u): v for k, u, v in zip(days.key, days.user_key, days.value)} == every.to_dict()
    assert set(raw.kind) == {"value", "map"}
    code = main(["state", "--checkpoints", snap.checkpoints_url, "--job-id", "harness", "--operator", "loyalty",
                 "--raw", "--format", "json"])
    assert code == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == len(raw) and {r["state"] for r in rows} == {"totals", "profile", "days"}
    assert main(["state", "--checkpoints", snap.checkpoints_url, "--job-id", "harness", "--operator", "loyalty",
                 "--raw", "--out", str(tmp_path / "raw.csv")]) == 0
    assert len(pd.read_csv(tmp_path / "raw.csv")) == len(raw)


def _with_states(meta: CheckpointMetadata, states: object) -> bytes:
    body = json.loads(meta.dumps())
    body["operators"]["loyalty"]["states"] = states
    body.pop("checksum")
    body["checksum"] = content_checksum(body)
    return json.dumps(body).encode()


GOOD = {"kind": "value", "key_type": "string", "ttl": None,
        "codec": {"type": "record", "fields": [["a", "int64"]], "defaults": {}}}


@pytest.mark.parametrize(("states", "field"), [
    ([], "operators.loyalty.states"),
    ({"t": {**GOOD, "kind": "queue"}}, "operators.loyalty.states['t'].kind"),
    ({"t": {**GOOD, "codec": {"type": "pickle"}}}, "operators.loyalty.states['t'].codec.type"),
    ({"t": {**GOOD, "codec": {"type": "record", "fields": [["a"]]}}}, "operators.loyalty.states['t'].codec.fields[0]"),
    ({"t": {**GOOD, "codec": {"type": "record", "fields": [["a", "int64); DROP"]]}}},
     "operators.loyalty.states['t'].codec.fields[0]"),
    ({"t": {**GOOD, "codec": {"type": "record", "fields": [["a", "int64"], ["a", "int8"]]}}},
     "operators.loyalty.states['t'].codec.fields"),
    ({"t": {**GOOD, "codec": {"type": "record", "fields": [["a", "int64"]], "defaults": {"a": [1]}}}},
     "operators.loyalty.states['t'].codec.defaults.a"),
    ({"t": {**GOOD, "codec": {"type": "record", "fields": [["a", "int64"]], "defaults": {"b": 1}}}},
     "operators.loyalty.states['t'].codec.defaults"),
    ({"t": {**GOOD, "codec": {"type": "record", "fields": []}}}, "operators.loyalty.states['t'].codec.fields"),
    ({"t": {**GOOD, "ttl": {"seconds": -1, "update": "on_write", "clock": "event"}}},
     "operators.loyalty.states['t'].ttl.seconds"),
    ({"t": {**GOOD, "ttl": {"seconds": 1, "update": "sometimes", "clock": "event"}}},
     "operators.loyalty.states['t'].ttl.update"),
    ({"t": {**GOOD, "key_type": 7}}, "operators.loyalty.states['t'].key_type"),
    ({"t": {**GOOD, "codec": {"type": "struct", "format": 5}}}, "operators.loyalty.states['t'].codec.format"),
    ({"default": GOOD}, "operators.loyalty.states['default']"),
])
def test_hostile_state_declarations_in_metadata_are_refused_naming_the_field(states, field):
    with OperatorHarness(loy.loyalty_v1) as h:
        h.process(loy.batch(0))
        meta = h.snapshot().metadata()
    with pytest.raises(MetadataError) as e:
        CheckpointMetadata.loads(_with_states(meta, states))
    assert f"field `{field}`" in str(e.value)
    assert CheckpointMetadata.loads(_with_states(meta, {"t": GOOD})).operators["loyalty"].states == {"t": GOOD}


def _undeclared_scores(codec: RecordCodec, ttl: StateTtl | None = None) -> KeyedOperator:
    """An operator that opens a RecordCodec state without declaring it: per player the points
    scored and the games played, kept as whatever fields `codec` has."""
    def process(batch: pd.DataFrame, state: object) -> None:
        scores = state.value_state("scores", codec, ttl=ttl)  # type: ignore[attr-defined]
        agg = batch.groupby("player", sort=True).agg(points=("points", "sum"), games=("points", "size"))
        old = scores.get_many(agg.index.tolist())
        scores.put_many((p, {"points": (o or {}).get("points", 0) + int(pts), "games": (o or {}).get("games", 0) + n})
                        for p, pts, n, o in zip(agg.index, agg["points"], agg["games"], old))

    def export(state: object) -> pd.DataFrame:
        rows = [{"player": k.decode(), **v}
                for k, v in state.value_state("scores", codec, ttl=ttl).items()]  # type: ignore[attr-defined]
        return pd.DataFrame(rows, columns=["player", *codec.names]).sort_values("player").reset_index(drop=True)

    return KeyedOperator("scores", key="player", columns=("points",), process=process, export=export)


def _games(seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame({"player": [f"p{i}" for i in rng.integers(0, 40, 300)],
                         "points": rng.integers(0, 1000, 300)})


@pytest.mark.parametrize("ttl", [None, StateTtl(10 * 365 * 24 * 3600)])
def test_an_undeclared_record_state_evolves_at_its_first_open_after_a_rescaled_restore(ttl):
    # A record of numbers only has one width: int64 -> float64 read the old bytes as other numbers,
    # without an error, before the fields were recorded with the snapshot's facts.
    v1 = RecordCodec({"points": "int64", "games": "int32"})
    v2 = RecordCodec({"games": "int64", "points": "float64", "team": "string"})
    batches = [_games(s) for s in range(4)]
    with OperatorHarness(_undeclared_scores(v1, ttl), parallelism=2) as h:
        for b in batches[:2]:
            h.process(b)
        snap = h.snapshot()
    with OperatorHarness.restore(snap, parallelism=3, operator=_undeclared_scores(v2, ttl)) as h2:
        for b in batches[2:]:
            h2.process(b)
        got = h2.export()
        snap2 = h2.snapshot()
    every = pd.concat(batches).groupby("player", sort=True).agg(points=("points", "sum"), games=("points", "size"))
    assert got.player.tolist() == every.index.tolist()
    assert got.points.tolist() == [float(x) for x in every.points] and got.games.tolist() == every.games.tolist()
    assert got.team.isna().all()
    facts = {s.facts["states"]["scores"]["codec"]["fields"].__repr__()
             for s in snap2.metadata().operators["scores"].subtasks}
    assert facts == {repr([["games", "int64"], ["points", "float64"], ["team", "string"]])}
    narrowed = RecordCodec({"games": "int8", "points": "float64", "team": "string"})
    with OperatorHarness.restore(snap2, parallelism=1, operator=_undeclared_scores(narrowed, ttl)) as h3, \
            pytest.raises(StateSchemaIncompatible, match="state 'scores' of scores .* field games changed from int64 "
                                                         "to int8: a narrowing"):
        h3.process(batches[0])


def test_an_undeclared_same_width_change_reads_the_old_numbers_not_their_bytes():
    v1 = RecordCodec({"points": "int64", "games": "int64"})
    v2 = RecordCodec({"points": "float64", "games": "int64"})  # one width: the old bytes decode as floats
    with OperatorHarness(_undeclared_scores(v1), parallelism=1) as h:
        h.process(_games(7))
        snap = h.snapshot()
    with OperatorHarness.restore(snap, parallelism=1, operator=_undeclared_scores(v2)) as h2:
        got = h2.export()
    every = _games(7).groupby("player", sort=True).agg(points=("points", "sum"))
    assert got.points.tolist() == [float(x) for x in every.points]
    # Without its code, the state reads by the fields its snapshot recorded.
    raw = read_state(snap.checkpoints_url, "harness", "scores", raw=True).sort_values("key")
    assert raw.value.tolist() == [{"points": int(p), "games": int(g)} for p, g in
                                  zip(every.points, _games(7).groupby("player", sort=True).size())]


@pytest.mark.parametrize("codec, message", [
    ({"type": "json"}, "only a record codec is recorded here"),
    ({"type": "record", "fields": [["a", "no such type!"]]}, "is not an Arrow type name"),
    ({"type": "record", "fields": []}, "must list 1 to"),
])
def test_a_hostile_record_codec_in_a_snapshots_facts_is_refused_naming_the_field(codec, message):
    with OperatorHarness(_undeclared_scores(RecordCodec({"points": "int64", "games": "int64"})), parallelism=1) as h:
        h.process(_games(1))
        snap = h.snapshot()
    raw = json.loads(snap.metadata().dumps())
    raw["operators"]["scores"]["subtasks"][0]["facts"]["states"]["scores"]["codec"] = codec
    raw.pop("checksum", None)
    with pytest.raises(MetadataError, match=rf"facts\.states.*codec.*{message}"):
        CheckpointMetadata.loads(json.dumps(raw).encode())
