"""Damage to a stable-storage file while the job keeps running from its working database (which
never reads the stable copy): the next checkpoint notices it, repairs it from the task-local copy or
uploads the state whole, so that after the local disk is lost the latest checkpoint still restores
exactly. With and without the changelog."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest

from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.state.backend import RocksDBStateBackend, restore_with_fallback, take_checkpoint
from sparkpoint.state.codecs import StructCodec
from sparkpoint.state.engine.changelog import ChangelogOptions
from sparkpoint.state.engine.verify import verify_checkpoint
from sparkpoint.state.sample import SAMPLE_OPERATORS
from tests.support.backends import make_backend

COUNTS = StructCodec[tuple[int]]("<q")


def backend(storage: CheckpointStorage, local: Path, changelog: bool) -> RocksDBStateBackend:
    return make_backend(storage, local, max_parallelism=32, changelog=ChangelogOptions(enabled=changelog))


def update(b: RocksDBStateBackend, model: dict[str, int], rng: random.Random) -> None:
    keys = sorted({f"user-{rng.randrange(3000):05d}" for _ in range(400)})
    for k in keys:
        model[k] = model.get(k, 0) + 1
    b.value_state("count", COUNTS).put_many((k, (model[k],)) for k in keys)


def damage(storage: CheckpointStorage, path: str, how: str) -> None:
    full = Path(storage.abspath(path))
    if how == "delete":
        full.unlink()
    else:
        full.write_bytes(full.read_bytes()[: full.stat().st_size // 2])


@pytest.mark.parametrize("changelog", [True, False], ids=["changelog", "files"])
@pytest.mark.parametrize("local_copy", [True, False], ids=["repairable", "no-local-copy"])
@pytest.mark.parametrize("how", ["delete", "truncate"])
def test_damage_to_a_reused_stable_file_is_noticed_while_local_state_is_used(
    tmp_path: Path, changelog: bool, local_copy: bool, how: str
):
    storage = CheckpointStorage(f"file://{tmp_path}/ckpt", "job")
    coord = CheckpointCoordinator(storage, num_retained=1)  # retention keeps nothing to fall back to
    local = tmp_path / "local"
    rng, model = random.Random(7), {}
    with backend(storage, local, changelog) as b:
        b.restore(None)
        for _ in range(3):
            update(b, model, rng)
            take_checkpoint(coord, [b])
        latest = CompletedCheckpointStore(storage).latest()
        assert latest is not None
        victim = max((f for f in latest.files() if f.created_by < latest.checkpoint_id), key=lambda f: f.created_by)
        damage(storage, victim.path, how)
        if not local_copy:  # nothing on this machine can rewrite it
            for copy in (local / "job" / "counts" / "0").glob("chk-*"):
                shutil.rmtree(copy)
        for _ in range(3):  # the job goes on from its working database
            update(b, model, rng)
            take_checkpoint(coord, [b])
    store = CompletedCheckpointStore(storage)
    latest = store.latest()
    assert latest is not None and latest.checkpoint_id == 6
    assert verify_checkpoint(storage, latest) == [], "the latest checkpoint is whole on stable storage"
    if local_copy:
        assert verify_checkpoint(storage, latest) == [] and storage.exists(victim.path), "repaired in place"
    shutil.rmtree(local)  # the local disk is lost
    with backend(storage, tmp_path / "new-local", changelog) as fresh:
        restore_with_fallback([fresh], store.load_all().checkpoints)
        restored = {k.decode(): v[0] for k, v in fresh.value_state("count", COUNTS).items()}
    assert restored == model


@pytest.mark.spark
@pytest.mark.parametrize("local_copy", [True, False], ids=["repaired", "fell-back"])
def test_sparkpoint_run_checks_each_checkpoint_it_commits(spark, tmp_path: Path, local_copy: bool):
    """A file the new checkpoint re-references vanishes while it commits: `run` notices it at once
    (as the Dagster blocking check does), repairs it or falls back, and ends exactly right."""
    import pandas as pd

    from sparkpoint.pipeline.driver import StatefulPipeline
    from sparkpoint.pipeline.runtime import PipelineConfig
    from sparkpoint.spark.generate import generate
    from sparkpoint.state.extract import operator_states
    from sparkpoint.state.sample import user_totals
    from tests.support import oracle

    generate(str(tmp_path / "in"), batches=4, events_per_batch=2000, users=300, items=40, seed=11)
    config = PipelineConfig(
        input_url=str(tmp_path / "in"), checkpoints_url=f"file://{tmp_path}/ckpt", job_id="job", parallelism=2,
        local_dir=str(tmp_path / "local"), output_url=f"file://{tmp_path}/out", num_retained=2,
    )
    pipeline = StatefulPipeline(spark, config, SAMPLE_OPERATORS)
    commit = pipeline.storage.commit_exclusive

    def lose_a_reused_file(rel: str, data: bytes) -> None:
        commit(rel, data)
        if rel == "chk-3/_metadata":
            meta = CompletedCheckpointStore(pipeline.storage).load(3)
            victim = max((f for f in meta.files() if f.created_by < 3), key=lambda f: (f.created_by, f.path))
            assert victim.created_by == 2  # chk-1 does not need it: a fallback to chk-1 can help
            pipeline.storage.delete([victim.path])
            if not local_copy:
                shutil.rmtree(tmp_path / "local")

    pipeline.storage.commit_exclusive = lose_a_reused_file  # type: ignore[method-assign]
    reports = pipeline.run()
    # Repaired: four checkpoints. Fallen back: chk-3 (and chk-2, which needs the lost file too)
    # discarded, batches 2-4 replayed from chk-1.
    batches_done = [r.files[0] for r in reports]
    if local_copy:
        assert [r.checkpoint_id for r in reports] == [1, 2, 3, 4]
    else:
        assert batches_done[2:] == batches_done[1:2] + sorted(f for f in batches_done if f > batches_done[1])[:2]
        assert len(reports) == 5 and CompletedCheckpointStore(pipeline.storage).latest().checkpoint_id > 4
    store = CompletedCheckpointStore(pipeline.storage)
    assert all(verify_checkpoint(pipeline.storage, m) == [] for m in store.load_all().checkpoints)
    latest = store.latest()
    assert latest is not None and len(latest.source_offsets["source"]["consumed"]) == 4
    events = pd.concat(oracle.read_batches(str(tmp_path / "in")), ignore_index=True)
    with operator_states(pipeline.storage, latest, user_totals.name) as backends:
        oracle.assert_totals_equal(pd.concat([user_totals.export(b) for b in backends]), oracle.user_totals(events))
    output = pd.read_parquet(tmp_path / "out")  # exactly once: each batch's rows, in batch order
    batches = oracle.read_batches(str(tmp_path / "in"))
    per_checkpoint = [output[output["checkpoint_id"] == cid].drop(columns="checkpoint_id")
                      for cid in sorted(output["checkpoint_id"].unique())]
    assert len(per_checkpoint) == 4
    for actual, expected in zip(per_checkpoint, oracle.sink_rows(batches)):
        oracle.assert_totals_equal(actual, expected)


@pytest.mark.parametrize("changelog", [True, False], ids=["changelog", "files"])
def test_a_flipped_byte_in_a_reused_file_keeps_the_last_checkpoint_without_it(tmp_path: Path, changelog: bool):
    """Rule 15 (issue 43, item 7): a byte flips in a file chk-2 uploaded (its size stays); a
    completer that restored from its task-local copy never reads it, and chk-3 reuses it. Retention
    (two kept) would subsume chk-1, the only checkpoint without it, and leave no checkpoint that
    restores once the local disk is gone; it checks the file's CRC32 first and keeps chk-1."""
    storage = CheckpointStorage(f"file://{tmp_path}/ckpt", "job")
    local = tmp_path / "local"
    rng, model = random.Random(11), {}
    with backend(storage, local, changelog) as b:
        b.restore(None)
        update(b, model, rng)
        take_checkpoint(CheckpointCoordinator(storage, num_retained=2), [b])
        at_chk1 = dict(model)
        update(b, model, rng)
        take_checkpoint(CheckpointCoordinator(storage, num_retained=2), [b])
    store = CompletedCheckpointStore(storage)
    victim = max((f for f in store.load(2).files() if f.created_by == 2 and f.path.startswith("shared/")),
                 key=lambda f: f.size)
    full = Path(storage.abspath(victim.path))
    data = bytearray(full.read_bytes())
    data[len(data) // 2] ^= 0x40
    full.write_bytes(bytes(data))
    for marker in local.rglob("working.json"):  # the working database is not trusted (another executor's slot)
        marker.unlink()
    with backend(storage, local, changelog) as b:  # the next run, on the same host
        assert b.restore(store.load(2)).source == "local"
        update(b, model, rng)
        coordinator = CheckpointCoordinator(storage, num_retained=2)
        done = take_checkpoint(coordinator, [b])
    assert victim.path in store.load(3).paths(), "chk-3 reuses the damaged file"
    assert store.checkpoint_ids() == [3, 2, 1], "chk-1, the last checkpoint without it, is kept"
    assert done.deletion_blocked is not None and "DAMAGED SHARED FILE" in done.deletion_blocked
    assert victim.path in done.deletion_blocked and "CRC32" in done.deletion_blocked
    shutil.rmtree(local)  # the local disk is lost: chk-3 and chk-2 cannot be restored, chk-1 can
    with backend(storage, tmp_path / "new-local", changelog) as fresh:
        results = restore_with_fallback([fresh], store.load_all().checkpoints)
        restored = {k.decode(): v[0] for k, v in fresh.value_state("count", COUNTS).items()}
    assert results[0].checkpoint_id == 1 and results[0].fell_back_from == (3, 2)
    assert restored == at_chk1
