"""Source offsets that do not grow with the job's history (issue 46, items 1 and 2): a floor in
name order and the names consumed above it; listings from the floor on (S3 `StartAfter` counted
by the moto server, date partitions); the rule for a late file; `--rescan`; version-1 offsets
converted with no file read twice or lost; hostile offsets refused. On the source alone (a batch
is "read" when `advance` records it), and one real Spark run of a user's pipeline."""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any

import fsspec
import pandas as pd
import pytest

from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.pipeline.driver import StatefulPipeline
from sparkpoint.spark import offsets as offsets_module
from sparkpoint.spark.offsets import OffsetsError, SourceError, SourceOffsets
from sparkpoint.spark.source import ParquetDirectorySource
from tests.conftest import s3_options
from tests.support import follow_pipeline as rain

TINY = pd.DataFrame({"k": ["a"], "v": [1]})


def land(root: Path, *names: str) -> None:
    for name in names:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        TINY.to_parquet(path)


def drain(source: ParquetDirectorySource, offsets: SourceOffsets, per_batch: int = 3
          ) -> tuple[SourceOffsets, list[str]]:
    """Every pending file, `per_batch` a checkpoint, through the offsets' JSON as `_metadata` keeps them."""
    read: list[str] = []
    while batch := source.pending(offsets)[:per_batch]:
        read += batch
        offsets = SourceOffsets.from_json(json.loads(json.dumps(source.advance(offsets, batch).to_json())))
    return offsets, read


def test_offsets_stay_bounded_and_every_file_is_read_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(offsets_module, "RECENT_NAMES", 4)
    land(tmp_path, *(f"f-{i:04d}.parquet" for i in range(40)))
    source = ParquetDirectorySource(str(tmp_path))
    offsets, read = drain(source, SourceOffsets(()))
    assert read == sorted(f"f-{i:04d}.parquet" for i in range(40)), "each once, in name order"
    raw = offsets.to_json()
    assert raw["version"] == 3 and raw["floor"] == "f-0035.parquet" and len(raw["consumed"]) == 4, raw
    assert all(offsets.includes(n) for n in read) and not offsets.includes("f-0040.parquet")
    assert offsets.mark == "f-0039.parquet"


def test_version_1_offsets_are_converted_with_no_file_read_twice_or_lost(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch):
    """A job checkpointed by the old code (every name, in the order read, one of them skipped by
    hand past a file still pending), then run by the new code."""
    monkeypatch.setattr(offsets_module, "RECENT_NAMES", 2)
    land(tmp_path, *(f"f-{i:02d}.parquet" for i in range(12)))
    old = {"version": 1, "consumed": [f"f-{i:02d}.parquet" for i in (0, 1, 2, 3, 4, 9)]}  # f-05..08 pending
    source = ParquetDirectorySource(str(tmp_path))
    offsets, read = drain(source, SourceOffsets.from_json(old), per_batch=2)
    assert read == ["f-05.parquet", "f-06.parquet", "f-07.parquet", "f-08.parquet", "f-10.parquet", "f-11.parquet"]
    assert offsets.to_json() == {"version": 3, "floor": "f-09.parquet", "consumed": ["f-10.parquet", "f-11.parquet"]}
    assert source.pending(offsets) == [], "nothing read twice"


def test_a_young_job_writes_version_3_with_no_floor_and_every_name(tmp_path: Path):
    land(tmp_path, "b.parquet", "a.parquet")
    source = ParquetDirectorySource(str(tmp_path))
    offsets = source.advance(SourceOffsets(()), source.pending(SourceOffsets(())))
    assert offsets.to_json() == {"version": 3, "floor": None, "consumed": ["a.parquet", "b.parquet"]}
    assert SourceOffsets.from_json(offsets.to_json()) == offsets
    assert SourceOffsets(()).to_json() == {"version": 1, "consumed": []}, "nothing consumed: what every version reads"


def test_the_floor_never_passes_a_file_a_listing_saw_unconsumed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(offsets_module, "RECENT_NAMES", 1)
    land(tmp_path, "a.parquet", "b.parquet", "c.parquet", "d.parquet")
    source = ParquetDirectorySource(str(tmp_path))
    assert source.pending(SourceOffsets(())) == ["a.parquet", "b.parquet", "c.parquet", "d.parquet"]
    skipped_ahead = source.advance(SourceOffsets(()), ["a.parquet", "c.parquet", "d.parquet"])  # b still pending
    assert skipped_ahead.floor == "a.parquet" and not skipped_ahead.includes("b.parquet")
    assert source.pending(skipped_ahead) == ["b.parquet"]


def test_a_late_file_above_the_floor_is_read_and_one_below_it_is_refused(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch):
    """The rule (docs/life.md): a late name above the floor is read once; at or below it, never."""
    monkeypatch.setattr(offsets_module, "RECENT_NAMES", 3)
    land(tmp_path, *(f"f-{i:02d}.parquet" for i in range(0, 20, 2)))
    source = ParquetDirectorySource(str(tmp_path))
    offsets, _ = drain(source, SourceOffsets(()))
    assert offsets.floor == "f-12.parquet"
    land(tmp_path, "f-15.parquet", "f-03.parquet")
    offsets, read = drain(source, offsets)
    assert read == ["f-15.parquet"], "above the floor: read; at or below it: refused"
    assert offsets.includes("f-03.parquet"), "a closed name: what cleanup may treat as consumed"


def test_rescan_lists_everything_and_names_the_late_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture):
    monkeypatch.setattr(offsets_module, "RECENT_NAMES", 2)
    days = ["2026-11-01", "2026-11-02", "2026-11-03"]
    land(tmp_path, *(f"date={d}/p-{i}.parquet" for d in days for i in range(3)))
    bounded = ParquetDirectorySource(str(tmp_path))
    offsets, read = drain(bounded, SourceOffsets(()))
    assert len(read) == 9 and offsets.floor == "date=2026-11-03/p-0.parquet"
    before = bounded.lister.requests
    assert bounded.pending(offsets) == []
    assert bounded.lister.requests - before == 2, "the top directory and the floor's partition: not the older days"
    old = tmp_path / "date=2026-11-01" / "p-1.parquet"
    os.utime(old, (old.stat().st_atime, old.stat().st_mtime + 3600))  # landed again, late
    land(tmp_path, "date=2026-11-03/p-9.parquet")
    rescan = ParquetDirectorySource(str(tmp_path), rescan=True)
    with caplog.at_level(logging.WARNING, "sparkpoint.spark.source"):
        assert rescan.pending(offsets) == ["date=2026-11-03/p-9.parquet"], "a rescan reads no name the floor closed"
    assert rescan.lister.requests == 4, "every partition listed"
    assert "date=2026-11-01/p-1.parquet" in caplog.text and "look late" in caplog.text


def test_rescan_reaches_the_source_from_the_cli_the_api_and_the_dagster_resource(tmp_path: Path):
    from sparkpoint.cli import build_parser
    from sparkpoint.cli.run import run_config
    from sparkpoint.pipeline.settings import of_role

    (tmp_path / "in").mkdir()
    base = ["run", "--input", str(tmp_path / "in"), "--checkpoints", str(tmp_path / "c"), "--job-id", "j"]
    assert run_config(build_parser().parse_args([*base, "--rescan"]))[1].rescan is True
    assert run_config(build_parser().parse_args(base))[1].rescan is False
    assert "rescan" in {s.name for s in of_role("source")}, "a field of the Dagster source resource"
    driver = StatefulPipeline(None, rain.rain_in(tmp_path, rescan=True).config(), (rain.rain_per_station,))
    assert isinstance(driver.source, ParquetDirectorySource) and driver.source.rescan


@pytest.mark.parametrize("raw, what", [
    ({"version": 3, "floor": "../../etc/passwd", "consumed": []}, "'..'"),
    ({"version": 3, "floor": None, "consumed": ["/abs.parquet"]}, "leading '/'"),
    ({"version": 3, "floor": "b", "consumed": ["a.parquet"]}, "is not above the floor"),
    ({"version": 3, "floor": None, "consumed": ["b.parquet", "a.parquet"]}, "name order"),
    ({"version": 3, "floor": None, "consumed": "a.parquet"}, "must be a list"),
    ({"version": 3, "floor": 7, "consumed": []}, "not an input file name"),
    ({"version": 3, "floor": None, "consumed": ["a\nb.parquet"]}, "control characters"),
    ({"version": 9, "consumed": []}, "version 1 or 3"),
    ({"version": 1, "consumed": ["a.parquet", "../../../etc/shadow"]}, "'..'"),
    ({"version": 1, "consumed": [3]}, "not an input file name"),
])
def test_hostile_offsets_are_refused_with_a_clear_error(raw: dict[str, Any], what: str):
    with pytest.raises(OffsetsError, match=what) as caught:
        SourceOffsets.from_json(raw)
    assert isinstance(caught.value, SourceError)


@pytest.mark.s3
def test_on_s3_a_run_lists_from_the_floor_whatever_lies_below(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch):
    """ListObjectsV2 requests, as the source counts them (the benchmark has the server count them)."""
    monkeypatch.setattr(offsets_module, "RECENT_NAMES", 5)
    fs = fsspec.filesystem("s3", **s3_options(s3_endpoint))
    bucket = "b" + uuid.uuid4().hex[:12]
    fs.mkdir(bucket)
    data = TINY.to_parquet()
    fs.pipe({f"{bucket}/in/f-{i:05d}.parquet": data for i in range(60)})
    source = ParquetDirectorySource(f"s3://{bucket}/in", s3_options(s3_endpoint))
    assert len(source.pending(SourceOffsets(()))) == 60 and source.lister.requests == 1
    offsets = source.advance(SourceOffsets(()), [f"f-{i:05d}.parquet" for i in range(58)])
    assert offsets.floor == "f-00052.parquet"
    fs.pipe(f"{bucket}/in/f-00040x.parquet", data)  # late, below the floor
    before = source.lister.requests
    assert source.pending(offsets) == ["f-00058.parquet", "f-00059.parquet"]
    assert source.lister.requests - before == 1, "one request, whatever the history"


@pytest.mark.spark
def test_a_job_checkpointed_with_version_1_offsets_goes_on_exactly_once(spark: Any, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch):
    """A real pipeline (rain per station): version-1 `_metadata` as the old code wrote it, then
    runs that convert it, read a late file above the floor, refuse one below it."""
    make = rain.rain_in(tmp_path, files_per_checkpoint=2)
    for i in range(4):
        rain.land(tmp_path, i)
    monkeypatch.setattr(SourceOffsets, "to_json", lambda self: {"version": 1, "consumed": list(self.consumed)})
    StatefulPipeline(spark, make.config(), (rain.rain_per_station,)).run()  # as the older code wrote them
    monkeypatch.undo()
    first = latest_offsets(make)
    assert first == {"version": 1, "consumed": [f"rain-{i:05d}.parquet" for i in range(4)]}
    monkeypatch.setattr(offsets_module, "RECENT_NAMES", 2)
    for i in (4, 5):
        rain.land(tmp_path, i)
    late_above = land_rows(tmp_path, "rain-00002x.parquet", 20)  # not consumed by the version-1 offsets
    StatefulPipeline(spark, make.config(), (rain.rain_per_station,)).run()
    assert latest_offsets(make) == {"version": 3, "floor": "rain-00003.parquet",
                                    "consumed": ["rain-00004.parquet", "rain-00005.parquet"]}
    land_rows(tmp_path, "rain-00001x.parquet", 30)  # late, below the floor: refused
    rain.land(tmp_path, 6)
    StatefulPipeline(spark, make.config(), (rain.rain_per_station,)).run()
    read = [pd.read_parquet(tmp_path / "in" / f"rain-{i:05d}.parquet") for i in range(7)] + [late_above]
    rain.assert_state(state_of(make, tmp_path), read)


def land_rows(tmp_path: Path, name: str, index: int) -> pd.DataFrame:
    rows = pd.DataFrame({"station": ["s1", "s9"], "mm": [float(index), 1.0]})
    rows["outage"] = str(tmp_path / "outage")
    rows.to_parquet(tmp_path / "in" / name)
    return rows


def latest_offsets(pipeline: Any) -> dict[str, Any]:
    latest = CompletedCheckpointStore(pipeline.storage()).latest()
    assert latest is not None
    return dict(latest.source_offsets["source"])


def state_of(pipeline: Any, tmp_path: Path) -> pd.DataFrame:
    from sparkpoint.cli import main

    out = tmp_path / "state.parquet"
    assert main(["state", "--pipeline", "tests.support.follow_pipeline:rain", "--checkpoints", str(tmp_path / "ckpt"),
                 "--job-id", "rain", "--operator", "rain_per_station", "--format", "parquet", "--out", str(out)]) == 0
    return pd.read_parquet(out)


def test_a_watch_sees_a_file_landing_in_the_newest_date_partition(tmp_path: Path):
    """A file landing in a partition leaves the input directory's own modification time alone:
    the watch looks at the newest partition's too."""
    land(tmp_path, "date=2026-11-28/a.parquet", "date=2026-11-29/b.parquet")
    past = time.time() - 30
    for directory in (tmp_path, tmp_path / "date=2026-11-28", tmp_path / "date=2026-11-29"):
        os.utime(directory, (past, past))
    watch = ParquetDirectorySource(str(tmp_path)).watch()
    assert watch.poll() == ["date=2026-11-28/a.parquet", "date=2026-11-29/b.parquet"]
    assert watch.poll() == [], "a new partition: listed once more, its time taken before the listing"
    assert watch.poll() == [] and watch.listings["full"] == 2, "nothing moved since: nothing listed"
    land(tmp_path, "date=2026-11-29/c.parquet")
    assert watch.poll() == ["date=2026-11-29/c.parquet"]
