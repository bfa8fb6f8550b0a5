"""The driver JVM's class archive (`sparkpoint.spark.classcache`): recorded by a first start, mapped
by the next ones, and never mapped when it is not whole, not ours, or reached through a link."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sparkpoint.spark import classcache
from sparkpoint.spark.classcache import WRITTEN, ClassArchive, archive_key, usable_archive
from tests.support.waiting import wait_for

ROOT = Path(__file__).resolve().parent.parent
KEY = "k" * 24

# A new process: a Spark session of its own, one Python job whose answer is known, and what its
# JVM was told about the archive.
CHILD = """
import json
from sparkpoint.spark.session import spark_session
spark = spark_session("local[1]")
total = spark.range(0, 1000, numPartitions=2).mapInPandas(
    lambda it: (b.assign(id=b.id * 3) for b in it), "id long").groupBy().sum("id").collect()[0][0]
args = list(spark.sparkContext._jvm.java.lang.management.ManagementFactory.getRuntimeMXBean().getInputArguments())
print(json.dumps({"total": total, "args": [a for a in args if "Archive" in a or "Shared" in a]}))
spark.stop()
"""


def spawn_spark(cache: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env={**os.environ, classcache.ENV: str(cache)}, stdin=subprocess.DEVNULL)


def finished(child: subprocess.Popen[str]) -> tuple[dict[str, object], str]:
    """The child's answer (its last line) and its whole output, once it has exited."""
    out, err = child.communicate(timeout=300)
    assert child.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1]), out + err


def wait_for_recording(cache: Path) -> None:
    wait_for(lambda: any(WRITTEN in p.read_bytes() for p in cache.glob("*.log")),
             240, 1, "a recording (the JVM writes it after the driver has exited)",
             last=lambda: sorted(p.name for p in cache.iterdir()))


@pytest.mark.spark
def test_the_first_start_records_an_archive_the_next_maps_and_a_damaged_one_is_refused(tmp_path: Path):
    cache = tmp_path / "jvm"
    first, output = finished(spawn_spark(cache))
    assert first["total"] == 3 * sum(range(1000))
    assert any(a.startswith("-XX:ArchiveClassesAtExit=") for a in first["args"]), first  # type: ignore[attr-defined]
    assert "cds" not in output and "Skipping" not in output, output[-2000:]  # the JVM's notes stay off the terminal
    # The caller's pipes closed when the driver exited, while its JVM was still writing the
    # archive (about 20 s here): nobody reading a run's output waits for the recording.
    (recording_log,) = cache.glob("*.log")
    assert WRITTEN not in recording_log.read_bytes(), "the run's output ended only once the archive was written"
    wait_for_recording(cache)

    on_whole = spawn_spark(cache)  # adopts the recording as the archive, then maps it
    (archive,) = wait_for(lambda: list(cache.glob("*.jsa")), 120, 0.2, "the next start adopting the recording",
                          stop=lambda: "it exited" if on_whole.poll() is not None else None)
    assert archive.stat().st_size == int(archive.name.split(".")[1])
    # A copy damaged in place, same size, in a cache of its own: its start runs beside the start
    # on the whole archive (two JVM starts at once, not one after the other).
    damaged_cache = tmp_path / "damaged"
    damaged_cache.mkdir(mode=0o700)
    damaged = damaged_cache / archive.name
    shutil.copyfile(archive, damaged)
    with open(damaged, "r+b") as f:
        f.seek(damaged.stat().st_size // 2)
        f.write(b"\xff" * 4096)
    on_damaged = spawn_spark(damaged_cache)
    (second, output), (third, damaged_output) = finished(on_whole), finished(on_damaged)
    assert f"-XX:SharedArchiveFile={archive}" in second["args"], second
    assert second["total"] == first["total"]
    assert "cds" not in output, output[-2000:]

    # Damaged: the JVM is given it and checks it (-XX:+VerifySharedSpaces refused such a file when
    # measured), and the job's answer is still right.
    assert f"-XX:SharedArchiveFile={damaged}" in third["args"] and third["total"] == first["total"]
    assert "cds" not in damaged_output, damaged_output[-2000:]
    # Truncated, a JVM that mapped it would die of SIGBUS: `usable_archive` never passes a file
    # shorter than its name says (below).


def test_an_archive_is_used_only_whole_regular_and_of_its_own_key(tmp_path: Path):
    good = tmp_path / f"{KEY}.10.jsa"
    good.write_bytes(b"x" * 10)
    assert usable_archive(tmp_path, KEY) == good
    assert usable_archive(tmp_path, "other" + KEY[5:]) is None
    good.write_bytes(b"x" * 9)  # shorter than its name says
    assert usable_archive(tmp_path, KEY) is None
    good.unlink()
    outside = tmp_path / "outside.jsa"
    outside.write_bytes(b"x" * 10)
    (tmp_path / f"{KEY}.10.jsa").symlink_to(outside)  # a planted link is never followed
    assert usable_archive(tmp_path, KEY) is None


def test_a_recording_is_adopted_only_once_its_jvm_logged_it_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(classcache.ENV, str(tmp_path / "jvm"))
    monkeypatch.setattr(classcache, "archive_key", lambda spark_home: KEY)
    first = ClassArchive("unused")
    assert first.use is None and first.record is not None and "ArchiveClassesAtExit" in first.java_options()
    first.record.write_bytes(b"y" * 1234)  # the JVM's dump, but no log line yet: maybe cut short
    log_file = first.record.with_name(first.record.name.replace(".jsa.tmp", ".log"))
    log_file.write_bytes(b"[info][cds,dynamic] Gathering classes\n")
    second = ClassArchive("unused")
    assert second.use is None and second.record != first.record
    log_file.write_bytes(b"[info][cds,dynamic] " + WRITTEN + b" 0x800b - 0x900b\n")
    third = ClassArchive("unused")
    assert third.use == tmp_path / "jvm" / f"{KEY}.1234.jsa" and third.record is None
    assert "-XX:SharedArchiveFile=" in third.java_options() and "VerifySharedSpaces" in third.java_options()
    assert not log_file.exists() and not first.record.exists()

    # Two starts recorded at once: the one left over once an archive exists is removed, not kept.
    late = tmp_path / "jvm" / f"{KEY}.late.jsa.tmp"
    late.write_bytes(b"z" * 99)
    late.with_name(f"{KEY}.late.log").write_bytes(WRITTEN + b"\n")
    assert ClassArchive("unused").use == third.use
    assert sorted(p.name for p in (tmp_path / "jvm").iterdir()) == [f"{KEY}.1234.jsa"]


def test_no_recording_where_the_jvm_would_refuse_to_write_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(classcache.ENV, str(tmp_path / "jvm"))
    monkeypatch.setattr(classcache, "archive_key", lambda spark_home: KEY)
    spark_home = tmp_path / "spark"
    (spark_home / "conf").mkdir(parents=True)
    assert ClassArchive(spark_home).record is not None  # an empty conf directory is fine
    (spark_home / "conf" / "spark-defaults.conf.template").write_text("# a distribution's template\n")
    assert ClassArchive(spark_home).java_options() == ""  # JDK 17: non-empty directory on the class path


def test_no_archive_in_a_directory_others_can_write_or_when_turned_off(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(classcache, "archive_key", lambda spark_home: KEY)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv(classcache.ENV, str(shared))
    assert ClassArchive("unused").java_options() == ""
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    monkeypatch.setenv(classcache.ENV, str(tmp_path / "link"))
    assert ClassArchive("unused").java_options() == ""
    monkeypatch.setenv(classcache.ENV, "off")
    assert ClassArchive("unused").java_options() == ""
    for odd in ("with space", "with:colon", "with,comma", "with=equals", "brackets[1]"):
        monkeypatch.setenv(classcache.ENV, str(tmp_path / odd))  # the JVM's options cannot quote these
        assert ClassArchive("unused").java_options() == "", odd
        assert not (tmp_path / odd).exists()


def test_another_spark_gets_an_archive_of_its_own(tmp_path: Path):
    (tmp_path / "jars").mkdir()
    (tmp_path / "jars" / "spark-core.jar").write_bytes(b"a" * 10)
    before = archive_key(tmp_path)
    assert before is not None
    (tmp_path / "jars" / "spark-core.jar").write_bytes(b"a" * 11)
    assert archive_key(tmp_path) not in (None, before)
    resized = archive_key(tmp_path)
    os.utime(tmp_path / "jars" / "spark-core.jar", ns=(1, 1))  # same size, another mtime: the JVM would refuse
    assert archive_key(tmp_path) not in (None, resized)
    assert archive_key(tmp_path / "no-spark-here") is None


def test_archives_of_another_key_unused_for_30_days_go_and_ours_is_marked_used(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch):
    cache = tmp_path / "jvm"
    cache.mkdir(mode=0o700)
    monkeypatch.setenv(classcache.ENV, str(cache))
    monkeypatch.setattr(classcache, "archive_key", lambda spark_home: KEY.replace("k", "a"))
    ours = cache / f"{'a' * 24}.10.jsa"
    ours.write_bytes(b"x" * 10)
    other = "b" * 24  # an upgraded-away Spark
    stale = [cache / f"{other}.20.jsa", cache / f"{other}.0123456789ab.jsa.tmp", cache / f"{other}.0123456789ab.log"]
    recent = cache / f"{'c' * 24}.30.jsa"  # another installation that still uses its archive
    foreign = cache / "notes.jsa"  # not a name this module gives: the user's
    for path in (*stale, recent, foreign):
        path.write_bytes(b"y" * 3)
    month_ago = time.time() - 31 * 86400
    for path in (*stale, foreign, ours):
        os.utime(path, (month_ago, month_ago))

    assert ClassArchive("unused").use == ours
    assert sorted(p.name for p in cache.iterdir()) == sorted([ours.name, recent.name, foreign.name])
    assert ours.stat().st_mtime > time.time() - 60, "mapping it marks it used"
