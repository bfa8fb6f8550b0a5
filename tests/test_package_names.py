"""The package's namespace: `import sparkpoint` loads nothing but itself, and every name `dir()`
lists (the public API, and the submodules some import has loaded) resolves with `getattr`, in any
process, whatever that process imported before."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_every_name_dir_lists_resolves_in_a_fresh_interpreter():
    """A session that used the notebook API and the test tools sees `api`, `checkpoint`,
    `testing`, ... in `dir(sparkpoint)`; a fresh one (a notebook restarted, another script) gets
    each of them from `getattr` too instead of an AttributeError until it imports it."""
    used = json.loads(python(
        "import json, sparkpoint, sparkpoint.airflow\n"
        "sparkpoint.read_state, sparkpoint.StateTtl, sparkpoint.airflow.sparkpoint_dag\n"
        "import sparkpoint.testing\n"
        "print(json.dumps({'sparkpoint': dir(sparkpoint), 'airflow': dir(sparkpoint.airflow)}))\n"))
    assert {"api", "checkpoint", "state", "testing"} <= set(used["sparkpoint"])
    assert {"dags", "operators"} <= set(used["airflow"])
    failed = json.loads(python(
        "import json, sparkpoint\n"
        f"used = {used!r}\n"
        "failed = []\n"
        "for name in sorted(set(used['sparkpoint']) | set(dir(sparkpoint))):\n"
        "    try:\n"
        "        getattr(sparkpoint, name)\n"
        "    except AttributeError as e:\n"
        "        failed.append(str(e))\n"
        "import sparkpoint.airflow as af\n"
        "for name in sorted(set(used['airflow']) | set(dir(af))):\n"
        "    try:\n"
        "        getattr(af, name)\n"
        "    except AttributeError as e:\n"
        "        failed.append(str(e))\n"
        "print(json.dumps(failed))\n"))
    assert failed == []
    assert python("import sparkpoint, sys; print(sorted(m for m in sys.modules if m.startswith('sparkpoint')))") \
        == "['sparkpoint']\n", "import sparkpoint alone loads nothing more"


def test_a_name_that_is_neither_exported_nor_a_submodule_is_an_attribute_error():
    import sparkpoint

    for name in ("no_such_name", "_HOMES_x", "api.x"):
        try:
            getattr(sparkpoint, name)
        except AttributeError as e:
            assert repr(name) in str(e)
        else:
            raise AssertionError(f"sparkpoint.{name} resolved")
    assert not hasattr(sparkpoint, "__wrapped__")
