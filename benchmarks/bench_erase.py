"""Erasing keys costs what their key groups hold (`sparkpoint.erase_keys`).

A user's operator (`viewer_profiles`, keyed by `viewer`: a profile blob in a value state and the
titles watched in a map state) at max_parallelism 128 and parallelism 128, so each key group is
one subtask's RocksDB and its own files. Two retained checkpoints: chk-1 full, chk-2 an
incremental one after a round that touched 5% of the viewers (most of its files are chk-1's,
shared). The state is built in process (no Spark) to `--megabytes` (default 64 MB, under a
minute here), copied afresh for each run, and 1, 100 and 10,000 keys are erased: the keys of the
1 and 100 runs sit in distinct key groups, the 10,000 (distinct viewers, 18% of them at 64 MB)
cover all 128. Per checkpoint it prints
and writes (`benchmarks/results/erase.json`) the time, the bytes the erase read and wrote, and
their share of the state the checkpoint references; the expectation is about k/128 of it for k
keys in distinct key groups, capped at the whole. The verification's reads are counted apart.

Then the same state at parallelism 4 (`low_parallelism` in the JSON): 32 key groups per subtask,
its first round compacted (a long-running job's state, cut into files of about a key group: the
floor of that cut, `RocksDBOptions.min_file_mb`, is set to 1/16 MB for this 64 MB state), chk-2 a
level-0 flush of the 5% round on top. An erase of k keys in distinct groups now reads, per
checkpoint, the key groups' files and the level-0 flushes of their subtasks: about k/128 of the
state plus the flushes, not k/4 (`--low-keys`, default 1 and 8).

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.bench_erase                # ~7 min on 2 busy cores
    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.bench_erase --keys 1 100   # ~3.5 min
    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.bench_erase --low-only     # ~40 s: parallelism 4 only
    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.bench_erase --quick        # ~1 min, 4 MB, 1 key
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd

import sparkpoint
from benchmarks.bench_state_backend import table
from sparkpoint import BytesCodec, JsonCodec, KeyedOperator, Pipeline
from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.state.backend import RocksDBStateBackend, take_checkpoint
from sparkpoint.state.engine.rocksdb import RocksDBOptions
from sparkpoint.state.keygroups import key_group_for

RESULTS = Path(__file__).parent / "results"
MAX_P = 128
JOB = "watch"
UID = "viewer-profiles-v1"
PROFILE_BYTES = 1024  # one viewer's value-state entry (random: RocksDB cannot compress it away)
TITLES = 4  # map entries per viewer
KS = (1, 100, 10_000)
LOW_P = 4
LOW_KS = (1, 8)
LOW_MIN_FILE_MB = 1 / 16  # the files' floor, scaled to the 64 MB state (the default 1 MB is for larger ones)
MB = 1024 * 1024


def _process(batch: pd.DataFrame, state: RocksDBStateBackend) -> None:
    """Not run here (the state is built directly); the operator is what erase_keys is given."""


def _export(state: RocksDBStateBackend) -> pd.DataFrame:
    return pd.DataFrame([(k.decode(), len(v)) for k, v in state.value_state("profile", BytesCodec()).items()],
                        columns=["viewer", "profile_bytes"])


viewer_profiles = KeyedOperator("viewer_profiles", key="viewer", process=_process, export=_export, uid=UID)


def pipeline(root: Path, parallelism: int = MAX_P) -> Pipeline:
    return Pipeline(JOB, [viewer_profiles], input_url=str(root / "in"), checkpoints_url=str(root / "ckpt"),
                    local_dir=str(root / "local"), max_parallelism=MAX_P, parallelism=parallelism)


def viewers_for(megabytes: float) -> int:
    return max(MAX_P * 4, int(megabytes * MB / (PROFILE_BYTES + TITLES * 40)))


def build(root: Path, megabytes: float, seed: int = 7, parallelism: int = MAX_P) -> dict[str, Any]:
    """The job's two checkpoints; returns how many viewers and how long it took. Below 128
    subtasks, the first round is compacted into files of about a key group (see the module)."""
    started = time.perf_counter()
    rng = random.Random(seed)
    viewers = [f"viewer-{i:08d}" for i in range(viewers_for(megabytes))]
    by_group: dict[int, list[str]] = {}
    for v in viewers:
        by_group.setdefault(key_group_for(v, MAX_P), []).append(v)
    storage = CheckpointStorage(str(root / "ckpt"), JOB)
    coordinator = CheckpointCoordinator(storage, num_retained=2)
    options = RocksDBOptions(min_file_mb=LOW_MIN_FILE_MB) if parallelism < MAX_P else None
    backends = [RocksDBStateBackend(storage, UID, i, parallelism=parallelism, max_parallelism=MAX_P,
                                    local_dir=root / "build", options=options) for i in range(parallelism)]
    for b in backends:
        b.restore(None)
    for round_, share in ((1, 1.0), (2, 0.05)):
        for b in backends:
            groups = range(b.key_group_range.start, b.key_group_range.end + 1)
            mine = [v for g in groups for v in by_group.get(g, []) if rng.random() < share]
            b.value_state("profile", BytesCodec()).put_many((v, rng.randbytes(PROFILE_BYTES)) for v in mine)
            b.map_state("watched", JsonCodec()).put_many(
                (v, f"title-{rng.randrange(10_000)}", round_) for v in mine for _ in range(TITLES))
            if round_ == 1 and parallelism < MAX_P:
                b.close()  # reopened by the compaction, which then cuts at a key group's bytes
                b.compact()
        take_checkpoint(coordinator, backends)
    for b in backends:
        b.dispose()
    shutil.rmtree(root / "build", ignore_errors=True)
    return {"viewers": len(viewers), "build_s": round(time.perf_counter() - started, 1), "by_group": by_group}


def referenced_bytes(root: Path) -> dict[int, int]:
    """Bytes of state each retained checkpoint references, by id."""
    storage = CheckpointStorage(str(root / "ckpt"), JOB)
    return {meta.checkpoint_id: sum(f.size for f in meta.files())
            for meta in CompletedCheckpointStore(storage).load_all().checkpoints}


def chosen_keys(by_group: dict[int, list[str]], k: int, seed: int = 11) -> list[str]:
    """k viewers: in distinct key groups while k <= 128, then spread over all of them."""
    rng = random.Random(seed + k)
    groups = sorted(by_group)
    rng.shuffle(groups)
    if k <= len(groups):
        return [rng.choice(by_group[g]) for g in groups[:k]]
    every = [v for g in groups for v in by_group[g]]
    return rng.sample(every, min(k, len(every)))


def erase_run(built: Path, work: Path, keys: list[str], parallelism: int = MAX_P) -> dict[str, Any]:
    """Erase `keys` from a fresh copy of the built job; the report's figures per checkpoint."""
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(built, work)
    state = referenced_bytes(work)
    started = time.perf_counter()
    report = sparkpoint.erase_keys(pipeline(work, parallelism), keys)
    seconds = time.perf_counter() - started
    rows = []
    for c in report.checkpoints:
        whole = state[c.original_id]
        rows.append({"checkpoint": c.original_id, "kind": c.kind, "new_id": c.new_id,
                     "entries_removed": c.entries_removed, "files_rewritten": c.files_rewritten,
                     "bytes_read": c.bytes_read, "bytes_written": c.bytes_written, "state_bytes": whole,
                     "read_share": round(c.bytes_read / whole, 4) if whole else None,
                     "written_share": round(c.bytes_written / whole, 4) if whole else None,
                     "routes": sorted({s.route for s in c.subtasks})})
    return {"keys": len(keys), "key_groups": len({key_group_for(k, MAX_P) for k in keys}),
            "expected_share": round(min(1.0, len({key_group_for(k, MAX_P) for k in keys}) / MAX_P), 4),
            "seconds": round(seconds, 2), "verified": report.verified,
            "verification_bytes": sum(v.bytes_checked for v in report.verification), "checkpoints": rows}


def measure(tmp: Path, megabytes: float, parallelism: int, ks: tuple[int, ...], result: dict[str, Any],
            write: Callable[[], None]) -> dict[str, Any]:
    """Build the job at `parallelism`, then erase each k of `ks` from a copy; fills `result`
    (written by `write` after each run)."""
    built = tmp / f"built-p{parallelism}"
    facts = build(built, megabytes, parallelism=parallelism)
    by_group = facts.pop("by_group")
    state = referenced_bytes(built)
    result.update({"max_parallelism": MAX_P, "parallelism": parallelism, "megabytes_asked": megabytes, **facts,
                   "state_bytes": {str(cid): n for cid, n in state.items()}, "runs": []})
    if parallelism < MAX_P:
        result["min_file_mb"] = LOW_MIN_FILE_MB
    for k in ks:  # the JSON is written after each run: a long 10,000-key run keeps the others'
        result["runs"].append(erase_run(built, tmp / f"p{parallelism}-k{k}", chosen_keys(by_group, k), parallelism))
        write()
    return facts


def rows_of(result: dict[str, Any]) -> list[list[str]]:
    return [[str(r["keys"]), str(r["key_groups"]), f"{r['expected_share']:.3f}", f"{r['seconds']:.1f}",
             f"chk-{c['checkpoint']}", f"{c['state_bytes'] / MB:,.1f}", f"{c['bytes_read'] / MB:,.2f}",
             f"{c['read_share']:.3f}", f"{c['bytes_written'] / MB:,.2f}", f"{c['written_share']:.3f}",
             ",".join(c.get("routes", []))]
            for r in result["runs"] for c in r["checkpoints"]]


HEADERS = ["keys", "groups", "k/128", "time s", "checkpoint", "state MB", "read MB", "read share",
           "written MB", "written share", "route"]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--megabytes", type=float, default=64.0, help="the state's size to build")
    parser.add_argument("--keys", type=int, nargs="+", default=list(KS), help="how many keys each run erases")
    parser.add_argument("--low-keys", type=int, nargs="+", default=list(LOW_KS),
                        help=f"how many keys each run at parallelism {LOW_P} erases")
    parser.add_argument("--low-only", action="store_true",
                        help=f"only the parallelism-{LOW_P} runs (the others kept from --out)")
    parser.add_argument("--quick", action="store_true", help="4 MB, 1 key (a smoke run)")
    parser.add_argument("--out", default=str(RESULTS / "erase.json"))
    args = parser.parse_args(argv)
    megabytes, ks = (4.0, KS[:1]) if args.quick else (args.megabytes, tuple(args.keys))
    low_ks = LOW_KS[:1] if args.quick else tuple(args.low_keys)
    out = Path(args.out)
    result: dict[str, Any] = json.loads(out.read_text()) if args.low_only and out.exists() else {}
    low: dict[str, Any] = {}

    def write() -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({**result, "low_parallelism": low}, indent=2) + "\n")

    with tempfile.TemporaryDirectory(prefix="bench-erase-") as tmp:
        if not args.low_only:
            facts = measure(Path(tmp), megabytes, MAX_P, ks, result, write)
            print(table(f"erase_keys on {facts['viewers']:,} viewers, max_parallelism {MAX_P}, parallelism {MAX_P} "
                        f"(built in {facts['build_s']} s)", HEADERS, rows_of(result)))
        facts = measure(Path(tmp), megabytes, LOW_P, low_ks, low, write)
        print(table(f"erase_keys on {facts['viewers']:,} viewers, max_parallelism {MAX_P}, parallelism {LOW_P} "
                    f"(built in {facts['build_s']} s)", HEADERS, rows_of(low)))
    return {**result, "low_parallelism": low}


if __name__ == "__main__":
    main()
