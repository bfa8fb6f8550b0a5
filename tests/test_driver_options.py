"""The driver JVM's options: ours (the class archive, the quiet logging) join what the user's
spark-defaults.conf gives `spark.driver.extraJavaOptions` instead of replacing it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sparkpoint.spark.session import spark_defaults

ROOT = Path(__file__).resolve().parent.parent

CHILD = """
import json
from sparkpoint.spark.session import spark_session
spark = spark_session("local[1]")
jvm = spark.sparkContext._jvm
args = list(jvm.java.lang.management.ManagementFactory.getRuntimeMXBean().getInputArguments())
print(json.dumps({"flag": jvm.java.lang.System.getProperty("sparkpoint.test.flag"),
                  "other": jvm.java.lang.System.getProperty("sparkpoint.test.other"),
                  "count": spark.range(7).count(), "args": args}))
spark.stop()
"""


@pytest.mark.spark
def test_the_users_driver_java_options_reach_the_jvm_with_ours(tmp_path: Path):
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "spark-defaults.conf").write_text(
        "# the user's cluster defaults\n"
        "spark.driver.extraJavaOptions  -Dsparkpoint.test.flag=kept \\\n"
        "    -Dsparkpoint.test.other=too\n"
        "spark.sql.shuffle.partitions 3\n")
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "SPARK_CONF_DIR": str(conf)})
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["flag"] == "kept" and got["other"] == "too" and got["count"] == 7
    assert any(a.startswith("-Dlog4j2.configurationFile=") for a in got["args"]), "ours are there too"


def test_spark_defaults_are_read_as_a_java_properties_file(tmp_path: Path):
    (tmp_path / "spark-defaults.conf").write_text(
        "! a comment\n"
        "   # an indented comment ending in a backslash \\\n"
        "spark.a   1\n"
        "spark.b=2\n"
        "spark.c : three  \n"
        "spark.d    -Dx=1 \\\n"
        "           -Dy=2\n"
        "spark.e    C:\\\\tmp\n"
        "\n")
    assert spark_defaults(tmp_path) == {"spark.a": "1", "spark.b": "2", "spark.c": "three",
                                        "spark.d": "-Dx=1 -Dy=2", "spark.e": "C:\\tmp"}
    assert spark_defaults(tmp_path / "missing") == {}
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "spark-defaults.conf").mkdir()  # not a file: no settings, no error
    assert spark_defaults(tmp_path / "dir") == {}
