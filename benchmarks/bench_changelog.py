"""Changelog checkpoints against RocksDB-file checkpoints, at the state-backend level (no Spark).

user_totals' state (one value state, 40-byte values, keys `u0000123`) of `--users` users over 4
subtasks: a first checkpoint of every user, then `--checkpoints` checkpoints, each after updating
a random `--churn` share of the users. Variants: RocksDB files only; the changelog materializing
at once (the whole materialization in the checkpoint that calls for it) at share 2; and the
changelog materializing in steps (slices over the next checkpoints, `sparkpoint.state.engine.staging`)
at each `--shares` materialize share. Per checkpoint: bytes uploaded (files created by it, staged
slices included, from `_metadata`) ÷ state (the files a restore of it reads, the chain left out),
then mean / median / max; max ÷ mean of the bytes uploaded per checkpoint (the spike a
materialization makes: goal <= 2); amplification = Σ uploaded ÷ Σ (churn × state); the job
directory's bytes ÷ state at the end and at most during the run; the wall time of the update
checkpoints; the time of a restore of the last checkpoint from primary storage (a fresh local
directory: download, verify, replay the chain).

The default 320 checkpoints let every changelog variant materialize several times (the chain
calls for it after 64 files at 1% churn, after about 30 at 10%), so the mean is that of whole
cycles more than of the first one, which has no materialization.

    .venv/bin/python -m benchmarks.bench_changelog                       # 200k users, 1% and 10%
    .venv/bin/python -m benchmarks.bench_changelog --quick               # 20k users, seconds

Tables on stdout; JSON in benchmarks/results/changelog.json (changelog_quick.json with --quick).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.state.backend import RocksDBStateBackend, take_checkpoint
from sparkpoint.state.engine.changelog import ChangelogOptions, is_changelog
from sparkpoint.state.keygroups import subtask_for_key
from sparkpoint.state.sample import TOTALS

RESULTS = Path(__file__).parent / "results"
PARALLELISM = 4


def run(users: int, churn: float, checkpoints: int, options: ChangelogOptions, root: Path) -> dict[str, Any]:
    shutil.rmtree(root, ignore_errors=True)
    storage = CheckpointStorage(f"file://{root}/checkpoints", "job")
    coord = CheckpointCoordinator(storage, num_retained=5)
    backends = [
        RocksDBStateBackend(storage, "user_totals", s, parallelism=PARALLELISM, local_dir=root / "local",
                            changelog=options)
        for s in range(PARALLELISM)
    ]
    for b in backends:
        b.restore(None)
    keys = [f"u{i:07d}" for i in range(users)]
    owner = {k: subtask_for_key(k, 128, PARALLELISM) for k in keys}
    rng = random.Random(0)

    def update(chosen: list[str]) -> None:
        per: list[list[str]] = [[] for _ in range(PARALLELISM)]
        for k in chosen:
            per[owner[k]].append(k)
        for b, mine in zip(backends, per):
            b.value_state("totals", TOTALS).put_many(
                (k, (rng.randrange(100), rng.random() * 1e3, rng.random(), rng.random() * 1e3,
                     1_767_225_600_000_000 + rng.randrange(10**10)))
                for k in sorted(mine)
            )

    update(keys)
    take_checkpoint(coord, backends)
    ratios, uploads, uploaded, ideal, dir_peak = [], [], 0, 0.0, 0.0
    started = time.perf_counter()
    for _ in range(checkpoints):
        update(rng.sample(keys, int(churn * users)))
        done = take_checkpoint(coord, backends)
        new = sum(f.size for f in done.metadata.files() if f.created_by == done.checkpoint_id)  # staged too
        state = sum(f.size for h in done.metadata.subtask_handles() for f in h.files()
                    if not is_changelog(f.local_name))
        ratios.append(new / state)
        uploads.append(new)
        uploaded += new
        ideal += churn * state
        dir_peak = max(dir_peak, storage_bytes(storage) / state)
    seconds = time.perf_counter() - started
    for b in backends:
        b.dispose()
    listing = [f for d in ("shared", *(f"chk-{i}" for i in storage.completed_checkpoint_ids()))
               for f in storage.walk(d)]
    latest = CompletedCheckpointStore(storage).latest()
    assert latest is not None
    t0 = time.perf_counter()
    for s in range(PARALLELISM):
        b = RocksDBStateBackend(storage, "user_totals", s, parallelism=PARALLELISM, local_dir=root / "fresh")
        b.restore(latest)
        b.dispose()
    restore = time.perf_counter() - t0
    return {
        "mean": statistics.mean(ratios), "median": statistics.median(ratios), "max": max(ratios),
        "max_over_mean_upload": max(uploads) / statistics.mean(uploads), "mean_upload_bytes": statistics.mean(uploads),
        "dir_over_state_peak": dir_peak, "per_checkpoint_bytes": uploads,
        "amplification": uploaded / ideal, "dir_over_state": sum(f.size for f in listing) / state,
        "state_bytes": state, "checkpoint_seconds": seconds / checkpoints, "restore_seconds": restore,
        "per_checkpoint": ratios,
    }


def storage_bytes(storage: CheckpointStorage) -> int:
    return sum(f.size for d in ("shared", *(f"chk-{i}" for i in storage.completed_checkpoint_ids()))
               for f in storage.walk(d))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=200_000)
    parser.add_argument("--churn", default="0.01,0.1", help="comma-separated shares of users per checkpoint")
    parser.add_argument("--checkpoints", type=int, default=320)
    parser.add_argument("--shares", default="1,2,4", help="materialize shares to compare, in steps")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    max_chain = 64
    if args.quick:  # a short chain, so that the few checkpoints still materialize
        args.users, args.checkpoints, max_chain = 20_000, 12, 4
    variants = [
        ("files", ChangelogOptions(enabled=False)),
        ("changelog at once share=2", ChangelogOptions(enabled=True, max_chain=max_chain, in_steps=False)),
    ] + [
        (f"changelog share={s}", ChangelogOptions(enabled=True, materialize_share=float(s), max_chain=max_chain))
        for s in args.shares.split(",")
    ]
    results: dict[str, Any] = {"users": args.users, "checkpoints": args.checkpoints, "runs": {}}
    with tempfile.TemporaryDirectory(prefix="bench-changelog-") as tmp:
        for churn in map(float, args.churn.split(",")):
            print(f"\n{args.users} users, {churn:.0%} updated per checkpoint, {args.checkpoints} checkpoints")
            print(f"{'variant':26s} {'mean':>7s} {'median':>7s} {'max':>6s} {'max/mean B':>10s} {'amp':>5s} "
                  f"{'dir/state end (peak)':>20s} {'s/chk':>6s} {'restore s':>9s}")
            for label, options in variants:
                r = run(args.users, churn, args.checkpoints, options, Path(tmp) / "run")
                results["runs"][f"{churn}/{label}"] = r
                print(f"{label:26s} {r['mean']:7.4f} {r['median']:7.4f} {r['max']:6.3f} "
                      f"{r['max_over_mean_upload']:10.2f} {r['amplification']:5.2f} "
                      f"{r['dir_over_state']:12.2f} ({r['dir_over_state_peak']:4.2f}) {r['checkpoint_seconds']:6.2f} "
                      f"{r['restore_seconds']:9.2f}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / ("changelog_quick.json" if args.quick else "changelog.json")
    path.write_text(json.dumps(results, indent=1))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
