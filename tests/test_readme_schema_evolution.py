"""The "Schema evolution" example of docs/upgrading.md runs as written (no Spark: the operator harness)."""

from __future__ import annotations

from tests.support.docs_text import python_blocks, section


def test_the_schema_evolution_example_of_the_guide_runs():
    blocks = python_blocks(section("upgrading.md", "## Schema evolution"))
    assert blocks
    namespace: dict[str, object] = {}
    for block in blocks:
        exec(compile(block, "docs/upgrading.md", "exec"), namespace)
