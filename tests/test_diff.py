"""`sparkpoint diff` / `diff_state`: the rows of an operator's state that differ between two
snapshots, checked against a pandas comparison of the two full exports, on random workloads of a
user's own operator (wallets: a value, a map and a list state per account).

Same job and layout: by the changed files, without reading the files both snapshots share;
across a rescale and between a savepoint and a checkpoint: by full exports."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pandas as pd
import pytest

from sparkpoint import Pipeline, RecordCodec, StateDescriptor, api
from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.errors import CheckpointNotFound, OperatorStateMismatch
from sparkpoint.checkpoint.savepoint import take_savepoint
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.cli import main
from sparkpoint.state.backend import RocksDBStateBackend, take_checkpoint
from sparkpoint.state.codecs import JsonCodec
from sparkpoint.state.diff import CHANGED_FILES, FULL, diff_snapshots, locate
from sparkpoint.state.engine.changelog import ChangelogOptions
from sparkpoint.state.engine.sstfile import read_sst_keys
from sparkpoint.state.keygroups import subtasks_of
from sparkpoint.state.operators import KeyedOperator
from sparkpoint.state.schema import StateSchemaIncompatible
from tests.support.backends import make_backends

CODEC = JsonCodec()


def wallets_process(batch: pd.DataFrame, state: RocksDBStateBackend) -> None:
    balance = state.value_state("balance", CODEC)
    tags = state.map_state("tags", CODEC)
    history = state.list_state("history", CODEC)
    for row in batch.itertuples(index=False):
        if row.op == "close":
            balance.delete(row.account)
            tags.remove_key(row.account)
            history.delete(row.account)
            continue
        balance.put(row.account, (balance.get(row.account) or 0) + int(row.amount))
        tags.put(row.account, row.tag, (tags.get(row.account, row.tag) or 0) + 1)
        history.add(row.account, int(row.amount))


def wallets_export(state: RocksDBStateBackend) -> pd.DataFrame:
    balance = dict(state.value_state("balance", CODEC).items())
    tags: dict[bytes, dict[str, int]] = {}
    for key, tag, n in state.map_state("tags", CODEC).items():
        tags.setdefault(key, {})[tag.decode()] = n
    history = dict(state.list_state("history", CODEC).items())
    keys = sorted(set(balance) | set(tags) | set(history))
    return pd.DataFrame({
        "account": [k.decode() for k in keys],
        "balance": pd.array([balance.get(k) for k in keys], dtype="Int64"),
        "tags": [json.dumps(tags.get(k, {}), sort_keys=True) for k in keys],
        "history": [json.dumps(history.get(k, [])) for k in keys],
    })


WALLETS = KeyedOperator("wallets", "account", wallets_process, wallets_export, columns=("op", "amount", "tag"))


def workload(rng: random.Random, n: int, accounts: int) -> pd.DataFrame:
    rows = [("close" if rng.random() < 0.15 else "pay", f"acct-{rng.randrange(accounts):04d}", rng.randrange(1, 99),
             rng.choice("abcde")) for _ in range(n)]
    return pd.DataFrame(rows, columns=["op", "account", "amount", "tag"])


class Job:
    """A user's job without Spark: P subtasks of WALLETS, a checkpoint per batch."""

    def __init__(self, storage: CheckpointStorage, local: Path, parallelism: int, *, changelog: bool = False,
                 restore_from=None, source=None):
        self.storage, self.local, self.parallelism = storage, local, parallelism
        self.coordinator = CheckpointCoordinator(storage, num_retained=100)
        self.backends = make_backends(storage, local, parallelism, operator="wallets", max_parallelism=32,
                                      changelog=ChangelogOptions(enabled=changelog))
        for b in self.backends:
            b.restore(restore_from, source=source, claim_mode="NO_CLAIM" if source else "CLAIM")

    def batch(self, df: pd.DataFrame) -> int:
        owner = subtasks_of(df["account"].tolist(), 32, self.parallelism)
        for i, b in enumerate(self.backends):
            wallets_process(df[owner == i], b)
        return take_checkpoint(self.coordinator, self.backends).checkpoint_id

    def close(self) -> None:
        for b in self.backends:
            b.close()


def expected(storage: CheckpointStorage, a, b, a_storage=None) -> pd.DataFrame:
    """The pandas comparison of the two full exports, as a user would write it."""
    old = api.read_state((a_storage or storage).url, (a_storage or storage).job_id, WALLETS, a)
    new = api.read_state(storage.url, storage.job_id, WALLETS, b)
    merged = old.merge(new, on="account", how="outer", suffixes=("_old", ""), indicator=True)
    value_cols = ["balance", "tags", "history"]
    differs = pd.Series(False, index=merged.index)
    for c in value_cols:
        differs |= merged[c].astype(str) != merged[f"{c}_old"].astype(str)
    change = merged["_merge"].map({"left_only": "removed", "right_only": "added", "both": "changed"})
    merged["change"] = change.astype(str)
    keep = (merged["_merge"] != "both") | differs
    return merged[keep][["account", "change"]].sort_values("account").reset_index(drop=True)


def same_rows(diff: pd.DataFrame, want: pd.DataFrame, storage: CheckpointStorage, a, b) -> None:
    got = list(diff[["account", "change"]].itertuples(index=False, name=None))
    assert got == list(want.itertuples(index=False, name=None)), (diff, want)
    old = api.read_state(storage.url, storage.job_id, WALLETS, a).set_index("account") if isinstance(a, int) else None
    new = api.read_state(storage.url, storage.job_id, WALLETS, b).set_index("account")
    for row in diff.itertuples(index=False):
        if row.change != "removed":
            assert row.balance == new.loc[row.account, "balance"] and row.history == new.loc[row.account, "history"]
        if row.change == "changed" and old is not None:
            assert row.balance_old == old.loc[row.account, "balance"]
            assert row.tags_old == old.loc[row.account, "tags"]


@pytest.mark.parametrize("changelog", [False, True], ids=["sst", "changelog"])
@pytest.mark.parametrize("seed", [1, pytest.param(2, marks=pytest.mark.soak)])  # a second history: make soak
def test_diff_of_two_checkpoints_equals_the_pandas_comparison_of_their_exports(
        tmp_path: Path, local_storage: CheckpointStorage, seed: int, changelog: bool):
    rng = random.Random(seed)
    job = Job(local_storage, tmp_path / "local", 2, changelog=changelog)
    ids = [job.batch(workload(rng, 400, 150))]
    for _ in range(5):
        ids.append(job.batch(workload(rng, rng.choice([5, 40, 200]), 150)))
        if rng.random() < 0.3:
            for b in job.backends:
                b.compact()  # compaction rewrites SSTs: the differing files then hold unchanged keys too
    job.close()
    methods = []
    for a, b in [(ids[0], ids[-1]), (ids[2], ids[3]), (ids[-1], ids[1]), (ids[4], ids[4]), (ids[4], ids[5])]:
        result = diff_snapshots(locate(a, local_storage), locate(b, local_storage), WALLETS)
        assert result.method == CHANGED_FILES or result.reason == "the snapshots share no file"  # compacted since
        methods.append(result.method)
        same_rows(result.table, expected(local_storage, a, b), local_storage, a, b)
        full = diff_snapshots(locate(a, local_storage), locate(b, local_storage), WALLETS, method=FULL)
        assert full.method == FULL
        pd.testing.assert_frame_equal(result.table.astype(str), full.table.astype(str))
    assert CHANGED_FILES in methods


def test_two_close_checkpoints_are_diffed_without_reading_the_files_they_share(
        tmp_path: Path, local_storage: CheckpointStorage):
    rng = random.Random(7)
    job = Job(local_storage, tmp_path / "local", 2)
    job.batch(workload(rng, 3000, 1000))
    first = job.batch(workload(rng, 20, 1000))
    second = job.batch(workload(rng, 20, 1000))  # its task-local copy stays in tmp_path/local
    job.close()
    result = diff_snapshots(locate(first, local_storage), locate(second, local_storage), WALLETS,
                            local_dir=tmp_path / "local")
    assert result.method == CHANGED_FILES
    assert result.shared_bytes > 5 * result.changed_bytes and result.bytes_scanned == result.changed_bytes
    old, new = (locate(c, local_storage).meta.operators["wallets"] for c in (first, second))
    only_old = {f.path: f.size for h in old.subtasks for f in h.files()}
    for h in new.subtasks:
        for f in h.files():
            only_old.pop(f.path, None)
    assert 0 < result.bytes_read <= sum(only_old.values())  # the rest is the task-local copy of `second`
    same_rows(result.table, expected(local_storage, first, second), local_storage, first, second)
    without_copy = diff_snapshots(locate(first, local_storage), locate(second, local_storage), WALLETS)
    assert without_copy.bytes_local == 0 and without_copy.table.equals(result.table)


def test_a_rescale_and_a_savepoint_are_diffed_by_full_exports(tmp_path: Path, local_storage: CheckpointStorage):
    rng = random.Random(3)
    job = Job(local_storage, tmp_path / "local", 2)
    job.batch(workload(rng, 500, 200))
    before = job.batch(workload(rng, 100, 200))
    job.close()
    saved = take_savepoint(local_storage, target=f"{local_storage.url}/sp-1")
    rescaled = Job(local_storage, tmp_path / "local3", 3, restore_from=locate(before, local_storage).meta)
    after = rescaled.batch(workload(rng, 100, 200))
    rescaled.close()

    across = diff_snapshots(locate(before, local_storage), locate(after, local_storage), WALLETS)
    assert across.method == FULL and "rescale" in across.reason
    same_rows(across.table, expected(local_storage, before, after), local_storage, before, after)

    table = api.diff_state(local_storage.url, local_storage.job_id, WALLETS, saved.url, after)
    assert table.attrs["method"] == FULL and "savepoint" in table.attrs["reason"]
    same_rows(table, expected(local_storage, before, after), local_storage, before, after)
    assert api.diff_state(local_storage.url, "job", WALLETS, saved.url, f"{local_storage.job_url}/chk-{before}").empty


def test_ids_and_urls_name_the_same_snapshots(local_storage: CheckpointStorage, tmp_path: Path):
    rng = random.Random(5)
    job = Job(local_storage, tmp_path / "local", 1)
    a, b = job.batch(workload(rng, 200, 50)), job.batch(workload(rng, 30, 50))
    job.close()
    by_id = api.diff_state(local_storage.url, "job", WALLETS, a, b)
    by_url = api.diff_state(local_storage.url, "job", WALLETS, f"{local_storage.job_url}/chk-{a}",
                            f"{local_storage.job_url}/chk-{b}/_metadata")
    assert by_id.attrs["method"] == by_url.attrs["method"] == CHANGED_FILES
    assert by_id.equals(by_url) and len(by_id)
    assert set(by_id.columns) == {"account", "balance", "tags", "history", "change", "balance_old", "tags_old",
                                  "history_old"}


def test_cli_writes_json_csv_and_parquet(local_storage: CheckpointStorage, tmp_path: Path, capsys, monkeypatch):
    rng = random.Random(9)
    job = Job(local_storage, tmp_path / "local", 2)
    a, b = job.batch(workload(rng, 200, 60)), job.batch(workload(rng, 30, 60))
    job.close()
    monkeypatch.setattr("sparkpoint.sample.operator", lambda name: WALLETS)
    base = ["diff", "--checkpoints", local_storage.url, "--job-id", "job", "--operator", "wallets",
            "--from", str(a), "--to", str(b)]
    assert main([*base, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    want = expected(local_storage, a, b)
    assert out["method"] == "changed files" and out["from"]["checkpoint_id"] == a and out["to"]["checkpoint_id"] == b
    assert [(r["account"], r["change"]) for r in out["rows"]] == list(want.itertuples(index=False, name=None))
    assert out["changes"] == {c: int((want["change"] == c).sum()) for c in ("added", "removed", "changed")}
    assert main([*base, "--out", str(tmp_path / "d.parquet")]) == 0
    assert list(pd.read_parquet(tmp_path / "d.parquet")["account"]) == list(want["account"])
    assert main(base) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("account,balance,tags,history,change,") and "changed files" in captured.err


def test_errors_say_what_is_wrong(local_storage: CheckpointStorage, tmp_path: Path, capsys):
    job = Job(local_storage, tmp_path / "local", 1)
    a = job.batch(workload(random.Random(1), 50, 20))
    job.close()
    other = KeyedOperator("nobody", "account", wallets_process, wallets_export)
    with pytest.raises(OperatorStateMismatch, match="no operator 'nobody'.*wallets"):
        api.diff_state(local_storage.url, "job", other, a, a)
    with pytest.raises(CheckpointNotFound, match="checkpoint 9 does not exist"):
        api.diff_state(local_storage.url, "job", WALLETS, a, 9)
    with pytest.raises(CheckpointNotFound):
        api.diff_state(local_storage.url, "job", WALLETS, a, f"file://{tmp_path}/nowhere/chk-1")
    base = ["diff", "--checkpoints", local_storage.url, "--job-id", "job", "--operator", "user_totals"]
    assert main([*base, "--from", str(a), "--to", "7"]) == 2
    assert "error" in capsys.readouterr().err


def test_sst_reader_lists_puts_deletes_and_range_deletes(tmp_path: Path):
    from sparkpoint.state.engine.rocksdb import RocksDBOptions, open_db

    db = open_db(str(tmp_path / "db"), ["s"], RocksDBOptions(), create=True)
    cf = db.get_column_family("s")
    for i in range(5000):
        cf.put(b"k%05d" % i, b"v" * (i % 50))
    cf.delete(b"k00007")
    cf.delete(b"absent")
    cf.delete_range(b"k01000", b"k01100")
    cf.flush(True)
    names = [f["name"] for f in db.live_files()]
    db.close()
    found = read_sst_keys(str(tmp_path / "db") + names[0])
    assert found.column_family == "s"
    assert b"k00007" in found.keys and b"absent" in found.keys and b"k04999" in found.keys
    assert found.ranges == [(b"k01000", b"k01100")]


# --- an operator that declares its states, diffed across an upgrade of their schema -------------------

PAGE_VIEWS_V1 = RecordCodec({"views": "int32", "last_visitor": "string"})
PAGE_VIEWS_V2 = RecordCodec({"views": "int64", "last_visitor": "string", "bounces": "int64"},
                            defaults={"bounces": 0})  # version 2: a field added with its default, one widened


def pages_operator(counts: RecordCodec, *, reads_declared: bool = True) -> KeyedOperator:
    """A user's operator: per page its views (a RecordCodec value state) and per visitor of the page
    their views (a map state), both declared; its export reads them with `state.declared`, or with
    `value_state`/`map_state` as declared (`reads_declared=False`)."""
    def states(state: RocksDBStateBackend) -> tuple:
        if reads_declared:
            return state.declared("counts"), state.declared("visitors")
        return state.value_state("counts", counts), state.map_state("visitors", CODEC)

    def process(batch: pd.DataFrame, state: RocksDBStateBackend) -> None:
        totals, visitors = states(state)
        for row in batch.itertuples(index=False):
            old = totals.get(row.page) or {}
            new = {"views": (old.get("views") or 0) + 1, "last_visitor": row.visitor}
            if "bounces" in counts.names:
                new["bounces"] = (old.get("bounces") or 0) + int(row.bounced)
            totals.put(row.page, new)
            visitors.put(row.page, row.visitor, (visitors.get(row.page, row.visitor) or 0) + 1)

    def export(state: RocksDBStateBackend) -> pd.DataFrame:
        totals, visitors = states(state)
        per_page: dict[bytes, dict[str, int]] = {}
        for page, visitor, n in visitors.items():
            per_page.setdefault(page, {})[visitor.decode()] = n
        rows = [{"page": page.decode(), **fields, "visitors": json.dumps(per_page.get(page, {}), sort_keys=True)}
                for page, fields in totals.items()]
        return pd.DataFrame(rows, columns=["page", *counts.names, "visitors"])

    return KeyedOperator("pages", "page", process, export, columns=("visitor", "bounced"), key_type="string",
                         states={"counts": counts, "visitors": StateDescriptor("map", CODEC)})


PAGES_V1, PAGES_V2 = pages_operator(PAGE_VIEWS_V1), pages_operator(PAGE_VIEWS_V2)
PAGES_PIPELINE = Pipeline("pages", [PAGES_V2])  # `sparkpoint diff --pipeline tests.test_diff:PAGES_PIPELINE`


def page_views(rng: random.Random, n: int) -> pd.DataFrame:
    return pd.DataFrame({"page": [f"/p{rng.randrange(60)}" for _ in range(n)],
                         "visitor": [f"v{rng.randrange(12)}" for _ in range(n)],
                         "bounced": [rng.random() < 0.3 for _ in range(n)]})


class PagesJob:
    """Two subtasks of a version of the pages operator, restored from a checkpoint of the job."""

    def __init__(self, storage: CheckpointStorage, local: Path, op: KeyedOperator, restore_from: int | None = None):
        self.storage, self.op = storage, op
        self.coordinator = CheckpointCoordinator(storage, num_retained=100)
        self.backends = make_backends(storage, local, operator="pages", max_parallelism=32, states=op.states,
                                      key_type=op.key_type)
        meta = locate(restore_from, storage).meta if restore_from is not None else None
        for b in self.backends:
            b.restore(meta)

    def batch(self, df: pd.DataFrame) -> int:
        owner = subtasks_of(df["page"].tolist(), 32, 2)
        for i, b in enumerate(self.backends):
            self.op.process(df[owner == i], b)
        return take_checkpoint(self.coordinator, self.backends).checkpoint_id

    def close(self) -> None:
        for b in self.backends:
            b.close()


def pages_state(batches: list[pd.DataFrame], v2_from: int | None = None) -> pd.DataFrame:
    """What the pages state holds after `batches`, in version 2's fields (pandas): bounces counted
    from batch `v2_from` on, 0 (the default) before; None: the state holds version 1's fields."""
    every = pd.concat([b.assign(batch=i) for i, b in enumerate(batches)], ignore_index=True)
    rows = []
    for page, g in every.groupby("page", sort=True):
        row = {"page": page, "views": len(g), "last_visitor": g["visitor"].iloc[-1]}
        if v2_from is not None:
            row["bounces"] = int(g[g["batch"] >= v2_from]["bounced"].sum())
        row["visitors"] = json.dumps({v: int(n) for v, n in g.groupby("visitor").size().items()}, sort_keys=True)
        rows.append(row)
    return pd.DataFrame(rows).set_index("page")


def assert_pages_diff(table: pd.DataFrame, old: pd.DataFrame, new: pd.DataFrame) -> None:
    """`table` is the diff of the two pandas states: every page added, removed or changed, with both values."""
    fields = [c for c in new.columns]
    want = {p: ("added" if p not in old.index else "changed") for p in new.index
            if p not in old.index or old.loc[p].tolist() != new.loc[p].tolist()}
    want.update({p: "removed" for p in old.index if p not in new.index})
    assert dict(zip(table["page"], table["change"])) == want
    for row in table.to_dict("records"):
        assert [row[c] for c in fields] == new.loc[row["page"]].tolist()
        if row["change"] == "changed":
            assert [row[f"{c}_old"] for c in fields] == old.loc[row["page"]].tolist()


def test_an_operator_whose_export_reads_its_declared_states_is_diffed(tmp_path: Path,
                                                                       local_storage: CheckpointStorage):
    rng = random.Random(11)
    batches = [page_views(rng, 300), page_views(rng, 40)]
    job = PagesJob(local_storage, tmp_path / "local", PAGES_V1)
    a, b = (job.batch(df) for df in batches)
    job.close()
    old, new = pages_state(batches[:1]), pages_state(batches)
    for method in (CHANGED_FILES, FULL):
        result = diff_snapshots(locate(a, local_storage), locate(b, local_storage), PAGES_V1, method=method)
        assert result.method == method
        assert_pages_diff(result.table, old, new)


@pytest.mark.parametrize("reads_declared", [True, False], ids=["declared", "as-declared"])
def test_a_diff_across_a_record_codec_upgrade_reads_each_side_in_the_fields_it_recorded(
        tmp_path: Path, local_storage: CheckpointStorage, capsys, reads_declared: bool):
    rng = random.Random(12)
    batches = [page_views(rng, 300), page_views(rng, 40), page_views(rng, 40), page_views(rng, 30)]
    v1, v2 = (pages_operator(c, reads_declared=reads_declared) for c in (PAGE_VIEWS_V1, PAGE_VIEWS_V2))
    job = PagesJob(local_storage, tmp_path / "local", v1)
    before = [job.batch(df) for df in batches[:2]][-1]
    job.close()
    upgraded = PagesJob(local_storage, tmp_path / "local", v2, restore_from=before)
    after = [upgraded.batch(df) for df in batches[2:]][-1]
    upgraded.close()
    fields = [locate(c, local_storage).meta.operators["pages"].states["counts"]["codec"]["fields"]
              for c in (before, after)]
    assert fields[0] != fields[1]  # the two sides recorded other fields for the same state

    # Each side through the fields it recorded: version 1's entries read as version 2 reads them.
    old, new = pages_state(batches[:2], v2_from=2), pages_state(batches, v2_from=2)
    for method in (CHANGED_FILES, FULL):
        result = diff_snapshots(locate(before, local_storage), locate(after, local_storage), v2, method=method)
        assert result.method == method
        assert_pages_diff(result.table, old, new)
    table = api.diff_state(local_storage.url, "job", v2, before, after)
    assert_pages_diff(table, old, new)
    # The old code cannot read what the new one wrote (views int64 -> int32): said, naming the way out.
    with pytest.raises(StateSchemaIncompatible, match=r"views changed from int64 to int32.*newer version"):
        diff_snapshots(locate(before, local_storage), locate(after, local_storage), v1)

    if reads_declared:  # the command, with the pipeline that holds version 2
        assert main(["diff", "--pipeline", "tests.test_diff:PAGES_PIPELINE", "--checkpoints", local_storage.url,
                     "--job-id", "job", "--operator", "pages", "--from", str(before), "--to", str(after),
                     "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["method"] == CHANGED_FILES and out["from"]["checkpoint_id"] == before
        assert_pages_diff(pd.DataFrame(out["rows"]), old, new)
