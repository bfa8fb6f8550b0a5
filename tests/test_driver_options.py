"""The driver JVM's options: ours (the class archive, the quiet logging) join what the user's
spark-defaults.conf gives `spark.driver.extraJavaOptions` instead of replacing it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sparkpoint.spark.properties import read_properties, spark_defaults

ROOT = Path(__file__).resolve().parent.parent

CHILD = """
import json
import sys
from sparkpoint.spark.session import spark_session
spark = spark_session("local[1]")
jvm = spark.sparkContext._jvm
args = list(jvm.java.lang.management.ManagementFactory.getRuntimeMXBean().getInputArguments())
# To a file: the JVM writes to the same standard output from its own threads, mid-line.
with open(sys.argv[1], "w") as out:
    json.dump({"flag": jvm.java.lang.System.getProperty("sparkpoint.test.flag"),
               "other": jvm.java.lang.System.getProperty("sparkpoint.test.other"),
               "count": spark.range(7).count(), "args": args}, out)
spark.stop()
"""


@pytest.mark.spark
def test_the_users_driver_java_options_reach_the_jvm_with_ours(tmp_path: Path):
    conf = tmp_path / "conf"
    conf.mkdir()
    # -verbose:class: the JVM writes some MB to its standard output before PySpark's launch
    # returns, far more than a pipe holds: nothing may wait for a reader that is not there yet.
    (conf / "spark-defaults.conf").write_bytes(
        b"# the user's cluster defaults, caf\xe9 in Latin-1\n"
        b"spark.driver.extraJavaOptions  -Dsparkpoint.test.flag=kept \\\n"
        b"    -Dsparkpoint.test.other=too -verbose:class\n"
        b"spark.sql.shuffle.partitions 3\n")
    env = {k: v for k, v in os.environ.items() if k != "SPARKPOINT_VERBOSE"}
    result = tmp_path / "result.json"
    done = subprocess.run([sys.executable, "-c", CHILD, str(result)], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env={**env, "PYTHONPATH": str(ROOT), "SPARK_CONF_DIR": str(conf)})
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(result.read_text())
    assert got["flag"] == "kept" and got["other"] == "too" and got["count"] == 7
    assert any(a.startswith("-Dlog4j2.configurationFile=") for a in got["args"]), "ours are there too"
    assert done.stdout.count("[class,load]") > 1000, "the JVM's standard output comes through the driver"


def test_spark_defaults_are_read_as_a_java_properties_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    assert read_properties(
        "! a comment\n"
        "   # an indented comment ending in a backslash \\\n"
        "spark.a   1\n"
        "spark.b=2\r\n"
        "spark.c : three  \n"
        "spark.d    -Dx=1 \\\n"
        "           -Dy=2\n"
        "spark.e    C:\\\\tmp\n"
        "spark.f    -Dname=caf\\u00e9\fx\n"  # a form feed is no line end in Java
        "spark.g    not continued \\  \n"  # whitespace after the backslash
        "spark.h    ends the file \\") == {
        "spark.a": "1", "spark.b": "2", "spark.c": "three", "spark.d": "-Dx=1 -Dy=2", "spark.e": "C:\\tmp",
        "spark.f": "-Dname=caf\u00e9\fx", "spark.g": "not continued", "spark.h": "ends the file"}

    monkeypatch.delenv("PYSPARK_SUBMIT_ARGS", raising=False)
    monkeypatch.setenv("SPARK_CONF_DIR", str(tmp_path / "conf"))
    assert spark_defaults(tmp_path) == {}, "no file: no settings"
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "spark-defaults.conf").mkdir()  # not a file: no settings, no error
    assert spark_defaults(tmp_path) == {}
    (tmp_path / "mine.conf").write_bytes(b"# \xff odd byte\nspark.x 1\n")
    monkeypatch.setenv("PYSPARK_SUBMIT_ARGS", f"--properties-file {tmp_path / 'mine.conf'} pyspark-shell")
    assert spark_defaults(tmp_path) == {"spark.x": "1"}, "the file spark-submit is told to read"
