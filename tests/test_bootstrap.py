"""Initial state (issue 32): `bootstrap=fn(table, state)` and `sparkpoint bootstrap` write a savepoint
through Spark that a job starts from with `--from-checkpoint`, at another parallelism, and whose
bootstrapped value state, list state and timers carry on as if the job had processed the table.

A user's own operator (`tests.support.accounts_pipeline`: balances with a history and a welcome timer),
real local Spark, real RocksDB, real files. Bad input is refused before any Spark work."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sparkpoint.checkpoint.errors import StateBackendError
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.cli import EXIT_BAD_INPUT, main
from sparkpoint.pipeline.bootstrap import CLAIM_FILE, bootstrap_savepoint
from sparkpoint.pipeline.driver import StatefulPipeline
from sparkpoint.state.backend import RocksDBStateBackend
from sparkpoint.state.operators import KeyedOperator, run_bootstrap
from tests.support import accounts_pipeline as acc
from tests.support.backends import make_backend
from tests.support.docs_text import page, python_blocks

PIPELINE = "tests.support.accounts_pipeline:accounts"


def opening_table(directory: Path) -> pd.DataFrame:
    """Opening transactions of accounts a00..a29 in two Parquet files (and a `_SUCCESS` to skip)."""
    directory.mkdir(parents=True)
    rows = pd.DataFrame({"account": [f"a{i % 30:02d}" for i in range(90)],
                         "amount": [float(i % 7) * 10 + i / 100 for i in range(90)],
                         "note": [f"n{i}" for i in range(90)]})  # a column `process` never reads
    rows.iloc[:50].to_parquet(directory / "part-0.parquet", index=False)
    rows.iloc[50:].to_parquet(directory / "part-1.parquet", index=False)
    (directory / "_SUCCESS").write_text("")
    return rows


def land_batches(directory: Path, n: int) -> list[pd.DataFrame]:
    """Batches touching old accounts and new ones (a25..a39)."""
    directory.mkdir(parents=True, exist_ok=True)
    batches = []
    for b in range(n):
        batch = pd.DataFrame({"account": [f"a{(25 + 3 * b + i) % 40:02d}" for i in range(12)],
                              "amount": [float(b * 100 + i) for i in range(12)]})
        batch.to_parquet(directory / f"batch-{b:03d}.parquet", index=False)
        batches.append(batch)
    return batches


def expected_balances(rows: list[pd.DataFrame], initial: set[str]) -> pd.DataFrame:
    """The pandas recomputation: balance and amounts in order over the table then the batches."""
    every = pd.concat([r[["account", "amount"]] for r in rows], ignore_index=True)
    grouped = every.groupby("account", sort=True)["amount"]
    return pd.DataFrame({"account": grouped.sum().index, "balance": grouped.sum().values,
                         "amounts": [list(v) for v in grouped.apply(list).values],
                         "welcomed": [a in initial for a in grouped.sum().index]})


def output_rows(out: Path) -> pd.DataFrame:
    return pd.concat([pd.read_parquet(f) for f in sorted(out.glob("part-*.parquet"))], ignore_index=True)


@pytest.mark.spark
def test_a_bootstrapped_savepoint_starts_a_job_at_another_parallelism_with_state_lists_and_timers(
    spark, tmp_path: Path
):
    initial = opening_table(tmp_path / "initial")
    pipeline = acc.accounts_pipeline(tmp_path)
    result = bootstrap_savepoint(spark, pipeline, "balances", str(tmp_path / "initial"),
                                 f"file://{tmp_path}/savepoints/opening", parallelism=2)

    assert result.url == f"file://{tmp_path}/savepoints/opening/chk-1"
    assert result.metadata.kind == "savepoint" and result.rows == 90
    # Every operator of the pipeline, at the bootstrap's parallelism; no input consumed.
    assert {n: len(op.subtasks) for n, op in result.metadata.operators.items()} == {"balances": 2, "audit": 2}
    assert result.metadata.source_offsets["source"]["consumed"] == []
    # Self-contained: full snapshots, no changelog, every file inside the savepoint's directory.
    saved = CheckpointStorage(f"file://{tmp_path}/savepoints", "opening")
    assert all(not f.local_name.startswith("changelog") for f in result.metadata.files())
    assert {f.path for f in result.metadata.files()} <= {f.path for top in ("shared", "chk-1")
                                                        for f in saved.walk(top)}
    assert main(["verify", "--checkpoints", f"file://{tmp_path}/savepoints", "--job-id", "opening"]) == 0

    batches = land_batches(tmp_path / "in", 3)
    started = pipeline.with_(parallelism=3, from_checkpoint=result.url)
    reports = StatefulPipeline(spark, started.config(), started.operators).run()
    assert [r.checkpoint_id for r in reports] == [1, 2, 3]

    accounts = set(initial["account"])
    want = expected_balances([initial, *batches], accounts)
    got = started.read_state("balances").sort_values("account").reset_index(drop=True)
    pd.testing.assert_frame_equal(got[["account", "balance", "welcomed"]], want[["account", "balance", "welcomed"]])
    assert got["amounts"].tolist() == want["amounts"].tolist()  # the bootstrapped list, then the appends
    audit = started.read_state("audit").set_index("account")["transactions"].to_dict()
    assert audit == pd.concat(batches).groupby("account").size().to_dict()  # it started empty

    # Exactly-once output: one welcome per bootstrapped account, fired after the first batch;
    # the last balance each account reported is its balance.
    out = output_rows(tmp_path / "out")
    welcomes = out[out["event"] == "welcome"]
    assert sorted(welcomes["account"]) == sorted(accounts)
    last = out[out["event"] == "balance"].groupby("account")["value"].last()
    touched = sorted(set(pd.concat(batches)["account"]))
    assert last.loc[touched].tolist() == pytest.approx(want.set_index("account").loc[touched, "balance"].tolist())
    # The job read the savepoint, never wrote or deleted in it.
    assert main(["verify", "--checkpoints", f"file://{tmp_path}/savepoints", "--job-id", "opening"]) == 0


@pytest.mark.spark
def test_a_failing_bootstrap_leaves_no_savepoint_so_the_same_command_can_run_again(spark, tmp_path: Path):
    opening_table(tmp_path / "initial")
    refusing = dataclasses.replace(acc.balances, bootstrap=acc.refuse)
    pipeline = acc.accounts_pipeline(tmp_path).with_(operators=(refusing, acc.audit))
    new, empty = tmp_path / "savepoints" / "opening", tmp_path / "savepoints" / "made-by-hand"
    empty.mkdir(parents=True)  # an empty directory is taken as a target, and left as it was
    for target in (new, empty):
        with pytest.raises(Exception, match="opening transactions refused"):
            bootstrap_savepoint(spark, pipeline, "balances", str(tmp_path / "initial"), f"file://{target}")
    assert not new.exists()
    assert list(empty.iterdir()) == []


# --- bad input: a clear error, exit code 2, before any Spark work --------------------------------


def write(path: Path, frame: pd.DataFrame) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    frame.to_parquet(path, index=False)
    return path


def case_missing(tmp: Path) -> str:
    return str(tmp / "nowhere")


def case_empty_dir(tmp: Path) -> str:
    (tmp / "empty").mkdir()
    return str(tmp / "empty")


def case_no_parquet_in_dir(tmp: Path) -> str:
    (tmp / "csvs").mkdir()
    (tmp / "csvs" / "accounts.csv").write_text("account,amount\na,1\n")
    return str(tmp / "csvs")


def case_not_parquet(tmp: Path) -> str:
    (tmp / "fake.parquet").write_text("account,amount\na,1\n")
    return str(tmp / "fake.parquet")


def case_no_key_column(tmp: Path) -> str:
    return str(write(tmp / "t" / "x.parquet", pd.DataFrame({"customer": ["a"], "amount": [1.0]})))


def case_null_keys(tmp: Path) -> str:
    return str(write(tmp / "t" / "x.parquet", pd.DataFrame({"account": ["a", None], "amount": [1.0, 2.0]})))


def case_no_rows(tmp: Path) -> str:
    empty = pa.table({"account": pa.array([], pa.string()), "amount": pa.array([], pa.float64())})
    (tmp / "t").mkdir()
    pq.write_table(empty, tmp / "t" / "x.parquet")
    return str(tmp / "t")


GOOD = pd.DataFrame({"account": ["a", "b"], "amount": [1.0, 2.0]})


@pytest.mark.parametrize(("operator", "source", "message"), [
    ("ledger", None, "pipeline 'accounts' has no operator 'ledger'; it has: balances, audit"),
    ("audit", None, "operator 'audit' of pipeline 'accounts' has no bootstrap function"),
    ("balances", case_missing, "nowhere does not exist"),
    ("balances", case_empty_dir, "holds no Parquet file (*.parquet, names starting with _ or . skipped): it is empty"),
    ("balances", case_no_parquet_in_dir, "holds no Parquet file (*.parquet, names starting with _ or . skipped); "
                                         "skipped: accounts.csv"),
    ("balances", case_not_parquet, "fake.parquet is not a readable Parquet file"),
    ("balances", case_no_key_column, "lacks the key column 'account' of operator 'balances'; it has: customer, amount"),
    ("balances", case_null_keys, "column 'account' has null keys"),
    ("balances", case_no_rows, "holds no rows: nothing to bootstrap balances from"),
])
def test_bad_input_is_refused_before_spark_starts(tmp_path: Path, capsys, monkeypatch, operator, source, message):
    monkeypatch.setattr("sparkpoint.spark.session.spark_session", _no_spark)
    table = source(tmp_path) if source else str(write(tmp_path / "good.parquet", GOOD))
    target = tmp_path / "savepoints" / "sp"
    code = main(["bootstrap", "--pipeline", PIPELINE, "--operator", operator, "--from", table, "--to", str(target)])
    assert (code, capsys.readouterr().err.count(message)) == (EXIT_BAD_INPUT, 1)
    assert not target.exists()


def test_an_existing_target_is_never_overwritten(tmp_path: Path, capsys, monkeypatch):
    monkeypatch.setattr("sparkpoint.spark.session.spark_session", _no_spark)
    table = write(tmp_path / "good.parquet", GOOD)
    target = tmp_path / "savepoints" / "sp"
    (target / "chk-1").mkdir(parents=True)
    (target / "chk-1" / "_metadata").write_text("someone's")
    code = main(["bootstrap", "--pipeline", PIPELINE, "--operator", "balances", "--from", str(table),
                 "--to", f"file://{target}"])
    assert code == EXIT_BAD_INPUT
    assert f"savepoint target file://{target} exists already" in capsys.readouterr().err
    assert (target / "chk-1" / "_metadata").read_text() == "someone's"


def _no_spark(*args, **kwargs):
    raise AssertionError("Spark started although the input is bad")


def test_timers_registered_in_bootstrap_need_on_timer(tmp_path: Path):
    def remind(table: pd.DataFrame, state: RocksDBStateBackend) -> None:
        state.timers.register_many((a, 0) for a in table["account"])

    op = KeyedOperator("reminders", key="account", process=acc.process, export=acc.export, bootstrap=remind)
    storage = CheckpointStorage(f"file://{tmp_path}/ckpt", "job")
    with make_backend(storage, tmp_path / "local", operator="reminders") as state:
        state.restore(None)
        with pytest.raises(StateBackendError, match="registered 2 timer.*has no on_timer"):
            run_bootstrap(op, state, GOOD, processing_us=0)


def test_the_code_version_covers_bootstrap_only_when_an_operator_has_one():
    plain = dataclasses.replace(acc.balances, bootstrap=None)
    versions = {fn: acc.accounts_pipeline(Path("/x")).with_(operators=(dataclasses.replace(plain, bootstrap=fn),))
                .code_version() for fn in (None, acc.opening, acc.refuse)}
    assert len(set(versions.values())) == 3


# --- the command, end to end (last: `run` stops the process's Spark session) --------------------


@pytest.mark.spark
def test_the_command_prints_the_savepoint_that_run_starts_from(spark, tmp_path: Path, capsys):
    initial = opening_table(tmp_path / "initial")
    target = f"file://{tmp_path}/savepoints/opening"
    assert main(["bootstrap", "--pipeline", PIPELINE, "--operator", "balances", "--from", str(tmp_path / "initial"),
                 "--to", target, "--master", "local[2]"]) == 0
    printed = capsys.readouterr()
    assert printed.out == f"{target}/chk-1\n"
    assert "balances bootstrapped from 90 rows at parallelism 2" in printed.err
    assert (tmp_path / "savepoints" / "opening" / CLAIM_FILE).exists()  # what it was made from

    batches = land_batches(tmp_path / "in", 2)
    assert main(["run", "--pipeline", PIPELINE, "--from-checkpoint", printed.out.strip(), "--parallelism", "3",
                 "--input", str(tmp_path / "in"), "--checkpoints", f"file://{tmp_path}/ckpt", "--job-id", "accounts",
                 "--output", str(tmp_path / "out"), "--local-dir", str(tmp_path / "local"),
                 "--master", "local[2]"]) == 0
    got = acc.accounts_pipeline(tmp_path).read_state("balances").sort_values("account").reset_index(drop=True)
    want = expected_balances([initial, *batches], set(initial["account"]))
    assert got["balance"].tolist() == pytest.approx(want["balance"].tolist())
    assert got["amounts"].tolist() == want["amounts"].tolist()


def test_the_guide_bootstrap_example_writes_the_initial_clicks(tmp_path: Path):
    blocks = python_blocks(page("pipeline.md"))
    namespace: dict[str, object] = {}
    for block in (blocks[0], next(b for b in blocks if "bootstrap=" in b)):
        exec(compile(block, "docs/pipeline.md", "exec"), namespace)
    op = namespace["clicks"].operator("clicks_per_user")  # type: ignore[attr-defined]
    table = pd.DataFrame({"user": ["u1", "u2", "u1"], "clicks": [3, 4, 5]})
    storage = CheckpointStorage(f"file://{tmp_path}/ckpt", "job")
    with make_backend(storage, tmp_path / "local", operator=op.name) as state:
        state.restore(None)
        run_bootstrap(op, state, table, processing_us=0)
        assert op.export(state).set_index("user")["clicks"].to_dict() == {"u1": 8, "u2": 4}
