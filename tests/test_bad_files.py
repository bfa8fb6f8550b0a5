"""Bad input files (issue 34, item 2), on a user's own pipeline (smart meters, `tests.support.meters_pipeline`):
every check of a file (readable Parquet, columns, the declared key type, null keys, the event-time
column) runs before any Spark work; `on_bad_file="fail"` stops before any upload naming the file,
the check and the fix; `"skip"` consumes a bad file exactly once, recorded in `_metadata`, and the
state equals a pandas recomputation over the good files only; `sparkpoint skip FILE --reason`
commits a checkpoint of no input, without a JVM; a hostile `skipped_files` is refused."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import textwrap
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from sparkpoint.checkpoint.errors import MetadataError
from sparkpoint.checkpoint.metadata import content_checksum
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.pipeline.attempt import AttemptError, PendingAttempt
from sparkpoint.pipeline.driver import StatefulPipeline
from sparkpoint.pipeline.runtime import PipelineError
from sparkpoint.pipeline.skipping import skip_file
from sparkpoint.spark.offsets import SourceError
from sparkpoint.spark.source import BadInputFile
from tests.support.helpers import cli
from tests.support.meters_pipeline import BAD, bad, good, meters, settled, state_of, totals

ROOT = Path(__file__).resolve().parent.parent


def uploaded(tmp_path: Path) -> list[Path]:
    return [p for p in (tmp_path / "ckpt").rglob("*") if p.is_file()] if (tmp_path / "ckpt").exists() else []


# --- "fail": before Spark, before any upload ----------------------------------------------------


@pytest.mark.parametrize("kind", sorted(BAD))
def test_a_bad_file_fails_its_batch_before_spark_and_before_any_upload(tmp_path: Path, kind: str):
    pipeline = meters(tmp_path)
    check = bad(tmp_path, "r-000.parquet", kind)
    good(tmp_path, "r-001.parquet")
    driver = StatefulPipeline(None, pipeline.config(), pipeline.operators)  # no Spark: reaching it would raise
    with pytest.raises(BadInputFile) as raised:
        driver.run()
    error = raised.value
    assert (error.file, error.check) == ("r-000.parquet", check)
    message = str(error)
    assert "\n" not in message
    for said in ("r-000.parquet", f"check {check!r}", "nothing was uploaded",
                 "sparkpoint skip --pipeline MODULE:ATTR r-000.parquet --reason", 'on_bad_file="skip"'):
        assert said in message, (said, message)
    assert uploaded(tmp_path) == [], "nothing was triggered or uploaded"
    assert not (tmp_path / "local").exists(), "no subtask ran"
    assert driver.pending_files() == ["r-000.parquet", "r-001.parquet"], "the bad file is still pending"


@pytest.mark.parametrize("frame, check, said", [
    (pd.DataFrame({"meter": ["m1", "m2"], "kwh": [1.0, 2.0], "read_at": [pd.Timestamp("2026-03-01", tz="UTC"), None]}),
     "null_event_times", "event-time column 'read_at' has 1 null value(s)"),
    (pd.DataFrame({"meter": ["m1"], "kwh": [1.0], "read_at": ["2026-03-01"]}),
     "types", "event-time column 'read_at' is "),
    (pd.DataFrame({"meter": ["m1"], "kwh": [1.0]}), "columns", "has no event-time column 'read_at'"),
])
def test_the_event_time_column_is_checked_with_the_others(tmp_path: Path, frame: pd.DataFrame, check: str, said: str):
    pipeline = meters(tmp_path, event_time="read_at")
    frame.to_parquet(tmp_path / "in" / "r-000.parquet")
    settled(tmp_path / "in" / "r-000.parquet")
    with pytest.raises(BadInputFile, match=re.escape(said)) as raised:
        StatefulPipeline(None, pipeline.config(), pipeline.operators).run()
    assert raised.value.check == check
    assert uploaded(tmp_path) == []


def test_event_times_in_nanoseconds_pass_the_checks_with_their_highest_time_cut_to_microseconds(tmp_path: Path):
    # pandas writes nanoseconds; the footer's highest event time does not fit microseconds exactly.
    pipeline = meters(tmp_path, event_time="read_at")
    at = pd.Timestamp("2026-03-01T00:00:00.123456789Z")
    pd.DataFrame({"meter": ["m1", "m2"], "kwh": [1.0, 2.0], "read_at": [at - pd.Timedelta(1, "s"), at]}).to_parquet(
        tmp_path / "in" / "r-000.parquet")
    driver = StatefulPipeline(None, pipeline.config(), pipeline.operators)
    (verdict,) = driver.file_verdicts(["r-000.parquet"])
    assert verdict.ok, verdict.reason
    assert verdict.max_event_time == at.value // 1000
    assert verdict.size == (tmp_path / "in" / "r-000.parquet").stat().st_size


def test_a_footers_nanoseconds_are_floored_as_the_tasks_floor_them_before_1970_too():
    import pyarrow as pa

    from sparkpoint.spark.source import _micros
    from sparkpoint.state.eventtime import event_micros

    for ns in (-1_500, -1_000_000_001, 1_500, 0):
        frame = pd.DataFrame({"t": pd.to_datetime([ns], unit="ns", utc=True)})
        assert _micros(pa.scalar(ns, pa.timestamp("ns", tz="UTC"))) == event_micros(frame, "t", "x")[0]


def test_a_file_that_cannot_be_reached_is_no_verdict_and_is_never_skipped(tmp_path: Path, monkeypatch):
    """A read error (a timeout, a 503) is not a bad file: under "skip" too the run fails and
    the file stays pending, to be read once it can be (DESIGN rule 10)."""
    pipeline = meters(tmp_path, on_bad_file="skip")
    good(tmp_path, "r-000.parquet")
    driver = StatefulPipeline(None, pipeline.config(), pipeline.operators)

    def unreachable(*args: Any, **kwargs: Any) -> Any:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(driver.source.fs, "open", unreachable)
    with pytest.raises(SourceError, match="nothing was skipped") as raised:
        driver.run()
    assert not isinstance(raised.value, BadInputFile)
    assert uploaded(tmp_path) == [] and driver.pending_files() == ["r-000.parquet"]


def test_on_bad_file_is_a_setting_with_flink_style_names_and_a_checked_value(tmp_path: Path):
    pipeline = meters(tmp_path)
    assert pipeline.on_bad_file == "fail" and pipeline.config().on_bad_file == "fail"
    assert pipeline.with_settings({"on-bad-file": "SKIP"}).config().on_bad_file == "skip"
    with pytest.raises(PipelineError, match="on_bad_file must be one of fail, skip, got 'ignore'"):
        meters(tmp_path, on_bad_file="ignore")


# --- "skip": consumed exactly once, recorded, never processed ---------------------------------------


@pytest.mark.spark
def test_skip_consumes_bad_files_once_and_the_state_and_output_hold_only_good_rows(tmp_path: Path, spark):
    pipeline = meters(tmp_path, on_bad_file="skip", files_per_checkpoint=2)
    goods = [good(tmp_path, "r-000.parquet", 0)]
    checks = {"r-001.parquet": bad(tmp_path, "r-001.parquet", "null keys")}
    goods.append(good(tmp_path, "r-002.parquet", 10))
    checks["r-003.parquet"] = bad(tmp_path, "r-003.parquet", "not parquet")
    checks["r-004.parquet"] = bad(tmp_path, "r-004.parquet", "wrong key type")  # a batch of bad files only
    checks["r-005.parquet"] = bad(tmp_path, "r-005.parquet", "missing column")
    goods.append(good(tmp_path, "r-006.parquet", 20))
    checks["r-007.parquet"] = bad(tmp_path, "r-007.parquet", "null keys, no statistics")

    reports = StatefulPipeline(spark, pipeline.config(), pipeline.operators).run()
    assert [r.checkpoint_id for r in reports] == [1, 2, 3, 4]
    assert [r.files for r in reports] == [("r-000.parquet",), ("r-002.parquet",), (), ("r-006.parquet",)]
    assert [[s.file for s in r.skipped] for r in reports] == [["r-001.parquet"], ["r-003.parquet"],
                                                               ["r-004.parquet", "r-005.parquet"], ["r-007.parquet"]]
    assert reports[2].rows == 0 and "batch=(none)" in reports[2].line() and "skipped=r-004.parquet" in reports[2].line()
    assert state_of(pipeline) == pytest.approx(totals(goods))
    assert "mX" not in state_of(pipeline), "no row of a bad file reached the state"
    output = pd.read_parquet(tmp_path / "out")
    assert "mX" not in set(output["meter"]) and sorted(output["checkpoint_id"].unique()) == [1, 2, 4]

    latest = CompletedCheckpointStore(pipeline.storage()).latest()
    assert latest is not None
    assert {s.file: s.check for s in latest.skipped_files} == checks
    assert [(s.file, s.checkpoint_id) for s in latest.skipped_files] == [
        ("r-001.parquet", 1), ("r-003.parquet", 2), ("r-004.parquet", 3), ("r-005.parquet", 3), ("r-007.parquet", 4)]
    reasons = {s.file: s.reason for s in latest.skipped_files}
    assert "key column 'meter' has 1 null value(s)" in reasons["r-001.parquet"]
    assert "not a readable Parquet file" in reasons["r-003.parquet"]
    assert "key column 'meter' is int64, operator 'kwh_per_meter' keys by string" in reasons["r-004.parquet"]
    assert "lacks column kwh" in reasons["r-005.parquet"]
    written = json.loads((tmp_path / "ckpt" / "meters" / "chk-4" / "_metadata").read_text())
    assert written["version"] == 6, "a skipped file's size and modification time came with format 6"
    on_disk = (tmp_path / "in" / "r-007.parquet").stat()
    assert written["skipped_files"][-1]["size"] == on_disk.st_size
    assert written["skipped_files"][-1]["modified"] == pytest.approx(on_disk.st_mtime)

    # A rerun, and a restore from stable storage alone (the local state is gone), never offer them again.
    assert StatefulPipeline(spark, pipeline.config(), pipeline.operators).run() == []
    shutil.rmtree(tmp_path / "local")
    goods.append(good(tmp_path, "r-008.parquet", 30))
    again = StatefulPipeline(spark, pipeline.config(), pipeline.operators)
    assert again.pending_files() == ["r-008.parquet"]
    assert [r.files for r in again.run()] == [("r-008.parquet",)]
    assert state_of(pipeline) == pytest.approx(totals(goods))
    assert len(CompletedCheckpointStore(pipeline.storage()).latest().skipped_files) == 5, "carried forward"


# --- a file still being written: no verdict until it has settled (DESIGN rule 18) ----------------


def half_copied(tmp_path: Path, name: str, first: int = 0) -> tuple[Path, bytes, pd.DataFrame]:
    """A good batch file `name` of which only the first half is written yet (no Parquet footer):
    (its path, the rest of its bytes, its rows)."""
    rows = good(tmp_path, name, first)
    path = tmp_path / "in" / name
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path, data[len(data) // 2:], rows


@pytest.mark.parametrize("on_bad_file", ["skip", "fail"])
def test_a_file_still_being_copied_is_neither_skipped_nor_refused_and_stays_pending(tmp_path: Path, on_bad_file: str,
                                                                                     caplog):
    pipeline = meters(tmp_path, on_bad_file=on_bad_file, files_per_checkpoint=2)
    half_copied(tmp_path, "r-000.parquet")
    good(tmp_path, "r-001.parquet")
    driver = StatefulPipeline(None, pipeline.config(), pipeline.operators)  # no Spark: reaching it would raise
    assert driver.run() == [], "no checkpoint: the batch ends before the file being copied"
    assert uploaded(tmp_path) == []
    assert driver.pending_files() == ["r-000.parquet", "r-001.parquet"]
    assert driver.waiting_for is not None and "r-000.parquet fails its checks (parquet)" in driver.waiting_for
    assert "may still be being written" in caplog.text and "it is not consumed" in caplog.text


def test_a_file_being_copied_to_a_server_whose_clock_lags_is_judged_only_after_a_second_look(tmp_path: Path):
    """A file server whose clock runs behind ours dates a file being written minutes ago: its
    modification time alone would call it settled. A second look, the settle time later, sees it
    grow, and the batch ends before it instead of skipping it for good."""
    from sparkpoint.pipeline.badfiles import FileChecks
    from sparkpoint.spark.source import InputNeeds, ParquetDirectorySource

    pipeline = meters(tmp_path, on_bad_file="skip", files_per_checkpoint=2)
    copying, rest, _ = half_copied(tmp_path, "r-000.parquet")
    settled(copying)  # dated an hour ago, as a lagging server clock would date it
    good(tmp_path, "r-001.parquet")
    source = ParquetDirectorySource(str(tmp_path / "in"))

    def the_copy_goes_on(seconds: float) -> None:
        with open(copying, "ab") as f:
            f.write(rest[: len(rest) // 2])
        settled(copying)  # the server dates the new bytes in its past too

    checks = FileChecks(InputNeeds({}, {}), "skip", sleep=the_copy_goes_on)
    assert checks.take(source, ["r-000.parquet", "r-001.parquet"]) == [], "ends before the growing file"
    assert checks.waiting is not None and "changed between two looks" in checks.waiting
    driver = StatefulPipeline(None, pipeline.config(), pipeline.operators)
    driver._file_checks._sleep = the_copy_goes_on
    assert driver.run() == [] and driver.pending_files() == ["r-000.parquet", "r-001.parquet"], "nothing skipped"


def test_the_settle_time_is_one_setting_for_the_sensor_and_the_runs_it_launches(tmp_path: Path):
    """A writer that pauses half a minute mid-file: `settle_seconds` (or the factory's
    `landing_settle_seconds`) makes every run wait that long before a failing check counts, not
    only the input sensor's first look."""
    from sparkpoint.cli import build_parser
    from sparkpoint.factory import pipeline_defs

    patient = meters(tmp_path, on_bad_file="skip", settle_seconds=30)
    copying, _, _ = half_copied(tmp_path, "r-000.parquet")
    settled(copying, seconds_ago=10)  # its writer paused ten seconds ago
    driver = StatefulPipeline(None, patient.config(), patient.operators)
    assert driver.run() == [] and driver.pending_files() == ["r-000.parquet"], "not skipped: it may go on"
    assert driver.waiting_for is not None and "of 30 s" in driver.waiting_for
    defs = pipeline_defs(meters(tmp_path), landing_settle_seconds=30)
    assert defs.scope.pipeline.settle_seconds == 30
    assert [r for k, r in defs.resources.items() if k.endswith("source")][0].settle_seconds == 30
    assert build_parser().parse_args(["run", "--settle-seconds", "30"]).settle_seconds == 30.0
    assert meters(tmp_path).with_settings({"settle-seconds": "45"}).config().settle_seconds == 45.0


@pytest.mark.spark
def test_a_batch_ends_before_a_file_being_copied_and_the_complete_file_is_processed_later(tmp_path: Path, spark):
    # A writer may pause 10 minutes: however long the first batch takes (a cold Spark's first job
    # outlasts the default 2 s), the half-copied file is still one being written when it ends.
    pipeline = meters(tmp_path, on_bad_file="skip", files_per_checkpoint=3, settle_seconds=600)
    goods = [good(tmp_path, "r-000.parquet")]
    copying, rest, rows = half_copied(tmp_path, "r-001.parquet", 10)
    goods += [rows, good(tmp_path, "r-002.parquet", 20)]

    first = StatefulPipeline(spark, pipeline.config(), pipeline.operators).run()
    assert [(r.files, r.skipped) for r in first] == [(("r-000.parquet",), ())], "the files before it, nothing skipped"

    with open(copying, "ab") as f:  # the copy completes
        f.write(rest)
    settled(copying)
    second = StatefulPipeline(spark, pipeline.config(), pipeline.operators).run()
    assert [(r.files, r.skipped) for r in second] == [(("r-001.parquet", "r-002.parquet"), ())]
    assert state_of(pipeline) == pytest.approx(totals(goods)), "every row of the completed file was processed"
    assert CompletedCheckpointStore(pipeline.storage()).latest().skipped_files == ()


def test_a_skipped_file_that_changes_later_is_warned_of_at_every_start_until_it_is_moved(tmp_path: Path, caplog):
    from sparkpoint.pipeline.badfiles import changed_skips

    pipeline = meters(tmp_path, on_bad_file="skip")
    path = tmp_path / "in" / "r-000.parquet"
    path.write_bytes(b"PAR1 a copy that stopped for a while")
    settled(path, 10.0)  # unchanged for 10 s: it looks complete, and is skipped
    before = path.stat()
    (report,) = StatefulPipeline(None, pipeline.config(), pipeline.operators).run()  # no rows to read: no JVM
    assert [(s.file, s.size, s.modified) for s in report.skipped] == [
        ("r-000.parquet", before.st_size, pytest.approx(before.st_mtime))]

    good(tmp_path, "r-000.parquet")  # ... then the copy went on
    caplog.clear()
    later = StatefulPipeline(None, pipeline.config(), pipeline.operators)
    assert later.run() == []
    assert len(later.changed_skips) == 1
    said = later.changed_skips[0]
    for part in ("r-000.parquet was skipped by chk-1 (parquet)", f"at {before.st_size} bytes",
                 f"now {path.stat().st_size} bytes", "it was still being written", "move it to a new name"):
        assert part in said, (part, said)
    assert said in caplog.text, "a warning, not a silent record"

    path.rename(tmp_path / "in" / "r-000-complete.parquet")  # the way on the warning names
    again = StatefulPipeline(None, pipeline.config(), pipeline.operators)
    assert changed_skips(again.source, again.store.latest()) == []
    assert again.pending_files() == ["r-000-complete.parquet"], "processed as a new batch by the next run"


# --- `sparkpoint skip`, then a run ---------------------------------------------------------------


MODULE = textwrap.dedent('''
    """meters_app: a user's module naming the meters pipeline, importable where the command runs."""
    from pathlib import Path

    from tests.support.meters_pipeline import meters

    pipeline = meters(Path(__file__).resolve().parent)
''')


@pytest.mark.spark
def test_sparkpoint_skip_consumes_one_file_without_a_jvm_then_run_goes_on(tmp_path: Path):
    (tmp_path / "meters_app.py").write_text(MODULE)
    ref = ("--pipeline", "meters_app:pipeline")
    pipeline = meters(tmp_path)
    bad(tmp_path, "r-000 bad.parquet", "null keys")  # a name with a space, taken literally
    goods = [good(tmp_path, "r-001.parquet"), good(tmp_path, "r-002.parquet", 5)]
    (tmp_path / "in" / "notes.csv").write_text("not a batch\n")

    failed = cli(tmp_path, "run", *ref)  # no JVM can start: the check comes first
    assert failed.returncode == 2, failed.stderr
    lines = [line for line in failed.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in failed.stderr, failed.stderr
    for said in ("r-000 bad.parquet", "check 'null_keys'",
                 "`sparkpoint skip --pipeline meters_app:pipeline 'r-000 bad.parquet' --reason TEXT`"):
        assert said in lines[0], (said, lines[0])
    assert uploaded(tmp_path) == [] and not (tmp_path / "local").exists()

    refused = {
        "not in the input": cli(tmp_path, "skip", *ref, "r-404.parquet", "--reason", "gone"),
        "is not a batch file": cli(tmp_path, "skip", *ref, "notes.csv", "--reason", "not ours"),
        "reason must be a non-empty string": cli(tmp_path, "skip", *ref, "r-000 bad.parquet", "--reason", " "),
        "holds a control character": cli(tmp_path, "skip", *ref, "r-000 bad.parquet", "--reason", "a\x1b[31mb"),
        "the following arguments are required: --reason": cli(tmp_path, "skip", *ref, "r-000 bad.parquet"),
    }
    for said, done in refused.items():
        assert done.returncode == 2 and said in done.stderr, (said, done.stderr)
    assert "Unconsumed batch files: r-000 bad.parquet, r-001.parquet, r-002.parquet" in \
        refused["not in the input"].stderr
    assert uploaded(tmp_path) == []

    skipped = cli(tmp_path, "skip", *ref, "r-000 bad.parquet", "--reason", "gateway sent nulls; ticket OPS-12",
                  "--json")
    assert skipped.returncode == 0, skipped.stderr
    report = json.loads(skipped.stdout)
    assert report["checkpoint_id"] == 1 and report["batch"] == [] and report["rows"] == 0
    assert report["skipped"] == [{"file": "r-000 bad.parquet", "check": "manual",
                                  "reason": "gateway sent nulls; ticket OPS-12"}]
    twice = cli(tmp_path, "skip", *ref, "r-000 bad.parquet", "--reason", "again")
    assert twice.returncode == 2
    assert "chk-1 has consumed it already (skipped by chk-1 (manual: gateway sent nulls; ticket OPS-12))" in \
        twice.stderr

    listed = json.loads(cli(tmp_path, "list", *ref, "--json").stdout)["checkpoints"]
    assert listed[0]["skipped_files"] == [{"file": "r-000 bad.parquet", "check": "manual",
                                           "reason": "gateway sent nulls; ticket OPS-12", "checkpoint_id": 1}]
    table = cli(tmp_path, "list", *ref).stdout
    assert "chk-1 skipped r-000 bad.parquet: manual: gateway sent nulls; ticket OPS-12" in table
    chk = str(tmp_path / "ckpt" / "meters" / "chk-1")
    assert json.loads(cli(tmp_path, "inspect", chk, "--json").stdout)["skipped_files"][0]["file"] == "r-000 bad.parquet"
    assert "gateway sent nulls" in cli(tmp_path, "inspect", chk).stdout

    ran = cli(tmp_path, "run", *ref, "--json", java=True)
    assert ran.returncode == 0, ran.stderr
    batches = [json.loads(line)["batch"] for line in ran.stdout.splitlines() if line.startswith("{")]
    assert batches == [["r-001.parquet"], ["r-002.parquet"]], "the skipped file is never processed"
    assert state_of(pipeline) == pytest.approx(totals(goods))


def test_the_bad_file_error_names_the_skip_of_the_pipeline_and_input_the_run_read(tmp_path: Path):
    """A run given another input than the pipeline's: its error names the command that skips the
    file there (the actual pipeline, that input); a skip that looks elsewhere names where it
    looked and the flag to pass."""
    (tmp_path / "meters_app.py").write_text(MODULE)
    meters(tmp_path)
    landing = tmp_path / "landing zone"  # not the pipeline's input_url
    landing.mkdir()
    bad(tmp_path, "r-000.parquet", "missing column")
    (tmp_path / "in" / "r-000.parquet").rename(landing / "r-000.parquet")
    failed = cli(tmp_path, "run", "--pipeline", "meters_app:pipeline", "--input", str(landing))
    assert failed.returncode == 2, failed.stderr
    command = f"sparkpoint skip --pipeline meters_app:pipeline --input '{landing}' r-000.parquet --reason TEXT"
    assert f"`{command}`" in failed.stderr, failed.stderr
    assert "MODULE:ATTR" not in failed.stderr

    elsewhere = cli(tmp_path, "skip", "--pipeline", "meters_app:pipeline", "r-000.parquet", "--reason", "OPS-12")
    assert elsewhere.returncode == 2
    for said in (f"is not in the input file://{tmp_path}/in, where this looked", "with --input"):
        assert said in elsewhere.stderr, (said, elsewhere.stderr)

    done = cli(tmp_path, *[w if w != "TEXT" else "OPS-12" for w in shlex.split(command)[1:]])  # as the error says
    assert done.returncode == 0, done.stderr
    assert "r-000.parquet is consumed as skipped" in done.stdout


# --- hostile `skipped_files` --------------------------------------------------------------------


@pytest.fixture
def skipped_checkpoint(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    """A real chk-1 whose `_metadata` lists one skipped file (made by `skip_file`, no Spark); its JSON."""
    pipeline = meters(tmp_path)
    bad(tmp_path, "r-000.parquet", "null keys")
    skip_file(StatefulPipeline(None, pipeline.config(), pipeline.operators), "r-000.parquet", "bad gateway day")
    path = tmp_path / "ckpt" / "meters" / "chk-1" / "_metadata"
    return path, json.loads(path.read_text())


@pytest.mark.parametrize("change, said", [
    (lambda m: m.update(skipped_files={"r-000.parquet": "x"}), "`skipped_files` must be an array"),
    (lambda m: m["skipped_files"][0].update(file="../../etc/passwd"), "is not one name in the input directory"),
    (lambda m: m["skipped_files"][0].update(file=""), "file must be a non-empty string"),
    (lambda m: m["skipped_files"][0].update(file=7), "file must be a non-empty string"),
    (lambda m: m["skipped_files"][0].update(reason="\x1b]0;owned\x07"), "holds a control character"),
    (lambda m: m["skipped_files"][0].update(reason="x" * 5000), "more than 2000"),
    (lambda m: m["skipped_files"][0].update(check="rm -rf"), "check must be one of parquet, columns, types"),
    (lambda m: m["skipped_files"][0].update(checkpoint_id=0), "must be >= 1"),
    (lambda m: m["skipped_files"][0].update(checkpoint_id="1"), "must be an integer"),
    (lambda m: m["skipped_files"][0].update(extra=1), "has unknown fields ['extra']"),
    (lambda m: m["skipped_files"][0].pop("reason"), "`skipped_files[0].reason` is missing"),
    (lambda m: m["skipped_files"].append(dict(m["skipped_files"][0])), "a second time: a file is consumed once"),
    (lambda m: m.update(version=4), "only version 5 has"),
    (lambda m: m["skipped_files"][0].update(size=3, modified=1.0), "records its size, which only version 6 has"),
    (lambda m: (m.update(version=6), m["skipped_files"][0].update(size=-1)), "must be between 0 and"),
    (lambda m: (m.update(version=6), m["skipped_files"][0].update(size=3, modified="soon")),
     "must be a number of seconds or null"),
    (lambda m: (m.update(version=6), m["skipped_files"][0].update(modified=1.0)), "is given without `size`"),
])
def test_a_hostile_skipped_files_field_is_refused_naming_it(skipped_checkpoint, change, said):
    path, body = skipped_checkpoint
    assert body["version"] == 5 and body["skipped_files"][0]["file"] == "r-000.parquet"
    change(body)
    body.pop("checksum")
    body["checksum"] = content_checksum(body)  # what still parses and checks out: the field alone is hostile
    path.write_text(json.dumps(body))
    with pytest.raises(MetadataError, match="skipped_files|version") as raised:
        CompletedCheckpointStore(meters(path.parents[3]).storage()).load(1)
    assert said in str(raised.value), str(raised.value)


def test_a_pending_attempt_with_a_hostile_skipped_files_field_is_refused(skipped_checkpoint):
    _, body = skipped_checkpoint
    attempt = {"format": "sparkpoint-pending-attempt", "version": 1, "job_id": "meters", "checkpoint_id": 2,
               "attempt_id": "a1", "expected": {}, "handles": [], "staged": [],
               "source_offsets": {"version": 1, "consumed": []}, "files": [], "subtasks": [], "rows": 0,
               "started_at": 0.0, "skipped_files": [{"file": "a/b.parquet", "check": "manual", "reason": "r",
                                                     "checkpoint_id": 2}]}
    with pytest.raises(AttemptError, match="is not one name in the input directory"):
        PendingAttempt.from_json(attempt)
