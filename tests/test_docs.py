"""The documentation site (`make docs`): it builds strictly, its generated pages follow the code,
every public name has a docstring the reference shows, and the Writing operators guide runs."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import logging
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

from tests.support.docs_text import DOCS, ROOT, page, python_blocks

MKDOCS = Path(sys.executable).parent / "mkdocs"
QUIET = {"NO_MKDOCS_2_WARNING": "1", "DISABLE_MKDOCS_2_WARNING": "true"}


@pytest.fixture(scope="module")
def gen() -> ModuleType:
    """docs/gen_pages.py, the script mkdocs-gen-files runs, imported as a module."""
    spec = importlib.util.spec_from_file_location("sparkpoint_docs_gen_pages", DOCS / "gen_pages.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def build(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(MKDOCS), "build", "--strict", "-f", str(root / "mkdocs.yml"), "-d", str(root / "site")],
                          cwd=root, capture_output=True, text=True, timeout=300, env={**os.environ, **QUIET})


# --- the guide --------------------------------------------------------------------------------------------


def test_every_example_of_the_writing_operators_guide_runs():
    """In order, in one namespace, as a reader would paste them; each asserts what the text says."""
    blocks = python_blocks(page("writing-operators.md"))
    assert len(blocks) >= 8
    namespace: dict[str, object] = {}
    for i, block in enumerate(blocks):
        exec(compile(block, f"docs/writing-operators.md (block {i + 1})", "exec"), namespace)


def test_the_guide_names_every_method_of_every_state_kind(gen: ModuleType):
    text = page("writing-operators.md")
    for module, path in (("value", "ValueState"), ("map", "MapState"), ("list", "ListState"),
                         ("reducing", "ReducingState")):
        for method in gen.MEMBERS[f"sparkpoint.state.kinds.{module}.{path}"]:
            assert f"`{method}`" in text, f"Writing operators does not name {path}.{method}"
    for must in ("checkpoint_id", "emits=True", "never called with an\nempty batch", "`export(state)`", "StateTtl",
                 "on_timer", "OperatorHarness", "RecordCodec", "StateDescriptor", "state.declared"):
        assert must in text, must


# --- generated pages --------------------------------------------------------------------------------------


def test_the_cli_reference_is_generated_from_the_parser(gen: ModuleType):
    from sparkpoint.cli import build_parser

    text = gen.cli_reference()
    for flag in ("--tick", "--allowed-lateness", "--storage-options", "--from-checkpoint", "--raw", "--repair"):
        assert f"`{flag}`" in text, flag
    assert "### `sparkpoint check-upgrade`" in text and "### `sparkpoint bootstrap`" in text

    parser = build_parser()  # a flag added to the parser appears, with its help, and no Markdown edited
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    sub.choices["run"].add_argument("--brand-new", metavar="N", help="a flag added after the docs were written")
    sub.add_parser("frobnicate", help="a command added after the docs were written")
    text = gen.cli_reference(parser)
    assert "| `--brand-new` | `N` | a flag added after the docs were written |" in text
    assert "### `sparkpoint frobnicate`" in text and "a command added after the docs were written" in text


def test_the_configuration_table_is_generated_from_the_settings(gen: ModuleType, monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture):
    from sparkpoint.pipeline import settings

    text = gen.configuration_table()
    row = next(line for line in text.splitlines() if line.startswith("| `num_retained` |"))
    assert "`state.checkpoints.num-retained`" in row and "| `2` |" in row and "`--retain`" in row
    assert all(f"| `{s.name}` |" in text for s in settings.SETTINGS if s.conf)

    brand_new = settings.Setting("brand_new", int | None, None, "a setting added after the docs were written", int,
                                 flink=("state.brand.new",))
    monkeypatch.setattr(settings, "SETTINGS", (*settings.SETTINGS, brand_new))
    assert "| `brand_new` | `state.brand.new` | none |  | a setting added after the docs were written |" in (
        gen.configuration_table())

    monkeypatch.setattr(settings, "SETTINGS", (*settings.SETTINGS[:-1], dataclasses.replace(brand_new,
                                                                                             description="")))
    with caplog.at_level(logging.WARNING):
        gen.configuration_table()
    assert "setting 'brand_new' has no description" in caplog.text


# --- docstrings ----------------------------------------------------------------------------------------------


def test_every_public_name_has_a_complete_docstring(gen: ModuleType):
    import sparkpoint
    import sparkpoint.airflow
    import sparkpoint.testing

    shown = {(p.package, p.name) for p in gen.public_names()}
    for package in (sparkpoint, sparkpoint.testing, sparkpoint.airflow):
        assert {(package.__name__, n) for n in package.__all__} <= shown
    handles = {"ValueState", "MapState", "ListState", "ReducingState", "TimerService"}
    assert handles <= {p.name for p in gen.public_names()}
    assert gen.undocumented() == []


def test_the_docstring_rule_names_what_is_missing(gen: ModuleType, tmp_path: Path):
    import griffe

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text(textwrap.dedent('''
        def bare(x): ...

        def summary_only(x: int) -> int:
            """Add one."""

        def complete(x: int) -> int:
            """Add one.

            Example:
                ```python
                complete(1)   # 2
                ```

            Args:
                x: a number.

            Returns:
                `x` plus one.
            """
    '''))
    pkg = griffe.load("pkg", search_paths=[str(tmp_path)], docstring_parser="google")
    assert gen.docstring_problems(pkg["bare"], "pkg.bare") == [
        "pkg.bare has no docstring: give it a one-line summary, an example and Args/Returns (STYLE.md)"]
    assert gen.docstring_problems(pkg["summary_only"], "pkg.summary_only") == [
        "pkg.summary_only: the docstring has no example (an `Example:` section or a code block)",
        "pkg.summary_only: `Args:` does not name x",
        "pkg.summary_only: the docstring has no `Returns:` (or `Yields:`) section"]
    assert gen.docstring_problems(pkg["complete"], "pkg.complete") == []


# --- the build ------------------------------------------------------------------------------------------------


def test_the_site_builds_strictly_and_shows_every_public_name(tmp_path: Path, gen: ModuleType):
    done = build_copy(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    site = tmp_path / "site"
    for public in gen.public_names():
        html = (site / "reference" / public.page / "index.html").read_text()
        assert f'id="{public.path}"' in html, public.path  # mkdocstrings' anchor of the object
    state = (site / "reference" / "state" / "index.html").read_text()
    assert 'id="sparkpoint.state.kinds.map.MapState.put_absent"' in state
    assert "Every command and option" in (site / "cli" / "index.html").read_text()
    assert "state.checkpoints.num-retained" in (site / "configuration" / "index.html").read_text()
    assert "sparkpoint generate --out input" in re.sub(r"<[^>]+>", "", (site / "index.html").read_text())


def test_the_strict_build_fails_on_an_undocumented_name_and_on_a_broken_link(tmp_path: Path):
    copy = tmp_path / "repo"
    ttl = copy / "sparkpoint" / "state" / "ttl.py"
    copy_repo(copy)
    source = ttl.read_text()
    start = source.index('    """How long an entry of a state lives')
    ttl.write_text(source[:start] + source[source.index('"""', start + 7) + 3:])
    done = build(copy)
    assert done.returncode != 0
    assert "undocumented public name: sparkpoint.StateTtl has no docstring" in done.stderr, done.stderr[-3000:]

    ttl.write_text(source)
    (copy / "docs" / "limits.md").write_text((copy / "docs" / "limits.md").read_text() + "\n[gone](no-such-page.md)\n")
    done = build(copy)
    assert done.returncode != 0 and "no-such-page.md" in done.stderr, done.stderr[-3000:]


def copy_repo(to: Path) -> None:
    """What the build reads: the package, the pages, the config, the README (the quick start)."""
    to.mkdir()
    shutil.copytree(ROOT / "sparkpoint", to / "sparkpoint", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(DOCS, to / "docs", ignore=shutil.ignore_patterns("__pycache__", "incoming"))
    for name in ("mkdocs.yml", "README.md"):
        shutil.copy(ROOT / name, to / name)


def build_copy(tmp_path: Path) -> subprocess.CompletedProcess[str]:
    copy_repo(tmp_path / "repo")
    done = build(tmp_path / "repo")
    if (tmp_path / "repo" / "site").exists():
        shutil.move(tmp_path / "repo" / "site", tmp_path / "site")
    return done
