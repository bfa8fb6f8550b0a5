"""`Pipeline.code_version` follows what an operator's functions compute with, not only their
source: values a factory's closure captured, defaults, a `functools.partial`'s arguments, the
module constants and helpers they name; and it stays the same in another process."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd

from sparkpoint import KeyedOperator, Pipeline, StructCodec

ROOT = Path(__file__).resolve().parent.parent
COUNT = StructCodec[tuple[int]]("<q")


def export(state: object) -> pd.DataFrame:
    rows = [(k.decode(), v[0]) for k, v in state.value_state("big", COUNT).items()]  # type: ignore[attr-defined]
    return pd.DataFrame(rows, columns=["user", "big"])


def big_spenders(threshold: float, currency: str = "EUR") -> KeyedOperator:
    """An operator made by a factory: `process` closes over `threshold` and `currency`."""

    def process(batch: pd.DataFrame, state: object) -> None:
        big = batch[(batch["amount"] > threshold) & (batch["currency"] == currency)].groupby("user").size()
        state.value_state("big", COUNT).put_many((u, (int(n),)) for u, n in big.items())  # type: ignore[attr-defined]

    return KeyedOperator("big_spenders", key="user", columns=("amount", "currency"), process=process, export=export)


def capped(batch: pd.DataFrame, state: object, *, cap: int, labels: frozenset[str] = frozenset()) -> None:
    state.value_state("big", COUNT).put_many(  # type: ignore[attr-defined]
        (u, (min(int(n), cap),)) for u, n in batch.groupby("user").size().items() if u not in labels)


def with_default(batch: pd.DataFrame, state: object, limit: int = 10) -> None:
    state.value_state("big", COUNT).put_many((u, (limit,)) for u in batch["user"])  # type: ignore[attr-defined]


def version(*operators: KeyedOperator) -> str:
    return Pipeline("spend", list(operators)).code_version()


def partial_op(**keywords: object) -> KeyedOperator:
    return KeyedOperator("capped", key="user", process=functools.partial(capped, **keywords), export=export)


def test_operators_a_factory_made_with_other_values_have_other_code_versions():
    assert version(big_spenders(10)) != version(big_spenders(1000)), "the closure's threshold counts"
    assert version(big_spenders(10, "EUR")) != version(big_spenders(10, "USD"))
    assert version(big_spenders(10)) == version(big_spenders(10)), "the same values, the same version"
    assert version(big_spenders(10.0)) != version(big_spenders(10)), "10.0 and 10 are different values"


def test_partial_arguments_and_defaults_count_and_sets_are_read_in_a_stable_order():
    assert version(partial_op(cap=5)) != version(partial_op(cap=50))
    assert version(partial_op(cap=5, labels=frozenset({"a", "b", "c"}))) == \
        version(partial_op(cap=5, labels=frozenset({"c", "b", "a"})))
    assert version(partial_op(cap=5, labels=frozenset({"a"}))) != version(partial_op(cap=5, labels=frozenset({"b"})))

    def default_op(limit: int) -> KeyedOperator:
        return KeyedOperator("defaulted", key="user", process=lambda b, s, limit=limit: with_default(b, s, limit),
                             export=export)

    assert version(default_op(10)) != version(default_op(11)), "a default bound in the lambda is read"


def test_the_version_is_the_same_in_another_process():
    """A set's order and an object's address change from process to process; the version does not."""
    code = textwrap.dedent("""
        from tests.test_code_version_closures import big_spenders, partial_op, version
        print(version(big_spenders(10)), version(partial_op(cap=5, labels=frozenset({"x", "y", "z"}))))
    """)
    here = f"{version(big_spenders(10))} {version(partial_op(cap=5, labels=frozenset({'x', 'y', 'z'})))}"
    for seed in ("1", "2"):
        there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
                               env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": seed})
        assert there.stdout.strip() == here


def test_a_module_constant_or_helper_the_function_names_counts(tmp_path: Path):
    """The same source in a module of the same name, with another constant or another helper."""
    template = textwrap.dedent('''
        import pandas as pd
        from sparkpoint import KeyedOperator, Pipeline, StructCodec

        COUNT = StructCodec("<q")
        THRESHOLD = {threshold}

        def keep(batch):
            return batch[batch["amount"] > {helper}]

        def process(batch, state):
            kept = keep(batch)
            state.value_state("n", COUNT).put_many((u, (int(n),)) for u, n in kept.groupby("user").size().items())

        def export(state):
            return pd.DataFrame([(k.decode(), v[0]) for k, v in state.value_state("n", COUNT).items()])

        pipeline = Pipeline("spend", [KeyedOperator("n", key="user", process=process, export=export)])
        print(pipeline.code_version())
    ''')

    def version_of(threshold: int, helper: str) -> str:
        folder = tmp_path / f"{threshold}-{helper.replace(' ', '')}"
        folder.mkdir()
        (folder / "spend_ops.py").write_text(template.format(threshold=threshold, helper=helper))
        done = subprocess.run([sys.executable, "-c", "import spend_ops"], capture_output=True, text=True, check=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), str(ROOT)])})
        return done.stdout.strip()

    base = version_of(10, "THRESHOLD")
    assert len(base) == 16
    assert version_of(1000, "THRESHOLD") != base, "a module constant the helper names"
    assert version_of(10, "THRESHOLD + 1") != base, "the helper's own source"
