"""Which Spark Connect session a pipeline's runs share (`session_key`), and the package artifact
they ship (`ship_modules`): the same for the same job and code, another for any change to a
file of the operators' package, never for what Python compiles beside it."""

from __future__ import annotations

import importlib
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from sparkpoint.spark.session import _zip_package, session_key


@pytest.fixture
def package(tmp_path: Path) -> Iterator[Path]:
    root = tmp_path / "userpkg"
    (root / "sub").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "sub" / "__init__.py").write_text("")
    (root / "sub" / "helpers.py").write_text("def double(x):\n    return 2 * x\n")
    (root / "ops.py").write_text("from userpkg.sub.helpers import double\n\n"
                                 "def process(batch, state):\n    return double(batch)\n\n"
                                 "def export(state):\n    return state\n")
    sys.path.insert(0, str(tmp_path))
    try:
        yield root
    finally:
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m == "userpkg" or m.startswith("userpkg.")]:
            del sys.modules[name]


def key(job: str = "clicks") -> str:
    ops = importlib.import_module("userpkg.ops")
    return session_key(job, [SimpleNamespace(process=ops.process, export=ops.export)])


def test_the_key_follows_the_job_and_every_file_of_the_package_not_its_compiled_files(package: Path):
    first = key()
    assert key() == first, "the same job and code: the same session"
    assert key("pages") != first, "another job: another session"
    (package / "sub" / "__pycache__").mkdir()
    (package / "sub" / "__pycache__" / "helpers.cpython-311.pyc").write_bytes(b"\x00compiled")
    assert key() == first, "what Python compiles is no change of code"
    (package / "sub" / "helpers.py").write_text("def double(x):\n    return 3 * x\n")
    assert key() != first, "a helper the operators call changed: a session of its own"


def test_the_shipped_package_has_the_same_bytes_whenever_its_files_do(package: Path):
    a = _zip_package(package / "__init__.py", "userpkg").read_bytes()
    (package / "sub" / "__pycache__").mkdir()
    (package / "sub" / "__pycache__" / "helpers.cpython-311.pyc").write_bytes(b"\x00compiled")
    (package / "ops.py").touch()  # a new modification time, the same bytes
    b = _zip_package(package / "__init__.py", "userpkg")
    assert b.read_bytes() == a
    assert sorted(zipfile.ZipFile(b).namelist()) == ["userpkg/__init__.py", "userpkg/ops.py",
                                                     "userpkg/sub/__init__.py", "userpkg/sub/helpers.py"]


def test_settings_a_run_leaves_on_its_session_are_part_of_the_key(package: Path):
    ops = importlib.import_module("userpkg.ops")
    op = SimpleNamespace(process=ops.process, export=ops.export)
    plain = session_key("clicks", [op])
    assert session_key("clicks", [op], {}) == plain
    tuned = session_key("clicks", [op], {"spark.sql.shuffle.partitions": "8"})
    assert tuned != plain and session_key("clicks", [op], {"spark.sql.shuffle.partitions": 8}) == tuned


SHIP_TWICE = """
import sys
from pathlib import Path
from pyspark.sql import SparkSession
from sparkpoint.spark.session import ModuleChangedError, ship_modules

root = Path(sys.argv[1])
sys.path.insert(0, str(root))
import editedpkg.ops as ops

spark = SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false").getOrCreate()
try:
    ship_modules(spark, [ops.process])
    ship_modules(spark, [ops.process])  # the same bytes again: Spark takes them
    (root / "editedpkg" / "ops.py").write_text("def process(batch, state):\\n    return batch[:1]\\n")
    try:
        ship_modules(spark, [ops.process])
    except ModuleChangedError as e:
        print("REFUSED:", e)
finally:
    spark.stop()
"""


@pytest.mark.spark
def test_a_module_changed_since_a_classic_session_shipped_it_is_a_clear_error_not_sparks(tmp_path: Path):
    # A session of its own, in a process of its own: after the refusal Spark's session is no
    # good for any job (its executor cannot fetch the file), which is what the error says.
    (tmp_path / "editedpkg").mkdir()
    (tmp_path / "editedpkg" / "__init__.py").write_text("")
    (tmp_path / "editedpkg" / "ops.py").write_text("def process(batch, state):\n    return batch\n")
    done = subprocess.run([sys.executable, "-c", SHIP_TWICE, str(tmp_path)], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).parent.parent)
    refused = [line for line in done.stdout.splitlines() if line.startswith("REFUSED:")]
    assert done.returncode == 0 and refused, (done.stdout[-2000:], done.stderr[-3000:])
    assert "'editedpkg'" in refused[0] and "spark.stop()" in refused[0], refused[0]
