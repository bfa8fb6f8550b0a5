"""Does RocksDB, with sparkpoint's options, ever read a damaged SST without saying so?

The task-local restore takes an SST whose inode is unchanged without reading it (README,
"Task-local recovery"): what a fingerprint cannot see, RocksDB's own checks must. This damages
one SST of a fresh database at many offsets, one trial per offset, and classifies each trial:

* open: RocksDB refuses to open the damaged copy;
* read: a lookup or the scan raises (a block checksum, a bad index entry);
* harmless: every present key reads back its value, every absent key reads as absent, and a
  scan (iterator status checked) returns exactly the model;
* SILENT: anything else, a wrong value or a key missing or added without an error.

Two kinds of damage: one flipped bit every `--step` bytes (and every `--tail-step` bytes of the
last 4 KB, where the footer, index and filter live), and a 4 KB page of zeros every 1.5 KB. Each trial opens
a copy read-only with `RocksDBOptions()` (index and filter blocks in the block cache) unless
`--load-index-at-open` asks for RocksDB's default layout.

Run: .venv/bin/python -m benchmarks.bench_damage [--keys 20000] [--step 211]   (about 5 minutes)
Prints a table, writes benchmarks/results/damage.json (damage_load_at_open.json with
--load-index-at-open, a _quick suffix with --quick).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from rocksdict import ReadOptions

from sparkpoint.state.engine.rocksdb import RocksDBOptions, drop_cached_blocks, flush_all, open_db

RESULTS = Path(__file__).parent / "results"
PAGE = 4096
OUTCOMES = ("open", "read", "harmless", "SILENT")


def build(directory: Path, keys: int, seed: int) -> tuple[dict[bytes, bytes], Path]:
    """A database with one SST holding every even key; returns the model and the SST."""
    rng = random.Random(seed)
    model = {b"k%08d" % i: rng.randbytes(40) for i in range(0, 2 * keys, 2)}
    db = open_db(str(directory), ["s"], RocksDBOptions(), create=True)
    cf = db.get_column_family("s")
    for k, v in model.items():
        cf[k] = v
    flush_all(db, ["s"])
    cf.compact_range(None, None)
    del cf
    db.close()
    ssts = sorted(directory.glob("*.sst"))
    if len(ssts) != 1:
        raise RuntimeError(f"expected one SST after a full compaction, found {len(ssts)}")
    return model, ssts[0]


def trial(source: Path, sst_name: str, damage: Callable[[Path], None], model: dict[bytes, bytes],
          absent: list[bytes], options: RocksDBOptions, scratch: Path) -> str:
    shutil.rmtree(scratch, ignore_errors=True)
    shutil.copytree(source, scratch)
    damage(scratch / sst_name)
    drop_cached_blocks()  # each trial reads as a worker that never read the file: the copies share its unique id
    try:
        db = open_db(str(scratch), [], options, create=False, read_only=True)
    except Exception:  # noqa: BLE001  rocksdict raises bare Exception
        return "open"
    cf = db.get_column_family("s")
    try:
        present = cf.get(list(model))
        missing = cf.get(absent)
        it = cf.iter(ReadOptions())
        scanned = {}
        it.seek_to_first()
        while it.valid():
            scanned[bytes(it.key())] = bytes(it.value())
            it.next()
        it.status()
        del it
    except Exception:  # noqa: BLE001
        return "read"
    finally:
        del cf
        db.close()
    intact = present == list(model.values()) and all(v is None for v in missing) and scanned == model
    return "harmless" if intact else "SILENT"


def flip_at(offset: int) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        with open(path, "r+b") as f:
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0x10]))
    return damage


def zero_page_at(offset: int) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        with open(path, "r+b") as f:
            f.seek(offset)
            f.write(b"\0" * min(PAGE, path.stat().st_size - offset))
    return damage


def run(args: argparse.Namespace, work: Path) -> dict[str, object]:
    model, sst = build(work / "db", args.keys, args.seed)
    size = sst.stat().st_size
    absent = [b"k%08d" % i for i in range(1, 2 * args.keys, 2)][: args.keys // 4]
    options = RocksDBOptions(cache_index_and_filter_blocks=not args.load_index_at_open)
    kinds = {
        "bit flip": sorted(set(range(0, size, args.step)) | set(range(max(0, size - PAGE), size, args.tail_step))),
        "zeroed 4 KB page": list(range(0, size, PAGE * 3 // 8)),
    }
    makers = {"bit flip": flip_at, "zeroed 4 KB page": zero_page_at}
    out: dict[str, object] = {"sst_bytes": size, "keys": len(model), "step": args.step, "tail_step": args.tail_step,
                              "load_index_at_open": args.load_index_at_open}
    for kind, offsets in kinds.items():
        started = time.perf_counter()
        counts: Counter[str] = Counter()
        silent = []
        for offset in offsets:
            outcome = trial(work / "db", sst.name, makers[kind](offset), model, absent, options, work / "trial")
            counts[outcome] += 1
            if outcome == "SILENT":
                silent.append(offset)
        out[kind] = {"trials": len(offsets), **{k: counts[k] for k in OUTCOMES}, "silent_offsets": silent,
                     "wall_s": time.perf_counter() - started}
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--keys", type=int, default=20_000, help="entries in the SST (default 20000)")
    p.add_argument("--step", type=int, default=211, help="bytes between bit flips (default 211)")
    p.add_argument("--tail-step", type=int, default=1, help="bytes between bit flips in the last 4 KB (default 1)")
    p.add_argument("--load-index-at-open", action="store_true",
                   help="RocksDB's default layout: every open loads index and filter blocks")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: 2,000 keys, a flip every 2,003 bytes and every 31st byte of the last 4 KB")
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--out", type=Path,
                   help="JSON output (default benchmarks/results/damage[_load_at_open][_quick].json)")
    args = p.parse_args(argv)
    if args.quick:
        args.keys, args.step, args.tail_step = 2_000, 2_003, 31
    if args.keys < 100 or min(args.step, args.tail_step) < 1:
        p.error("--keys must be at least 100, --step and --tail-step positive")
    stem = "damage" + ("_load_at_open" if args.load_index_at_open else "") + ("_quick" if args.quick else "")
    out_path = args.out or RESULTS / f"{stem}.json"
    work = Path(tempfile.mkdtemp(prefix="sparkpoint-damage-"))
    try:
        result = run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"one SST of {result['sst_bytes']:,} bytes, {result['keys']:,} entries; "
          f"index and filters {'loaded by the open' if args.load_index_at_open else 'in the block cache'}")
    print(f"{'damage':18} {'trials':>7} " + " ".join(f"{k:>9}" for k in OUTCOMES))
    for kind in ("bit flip", "zeroed 4 KB page"):
        x = result[kind]
        assert isinstance(x, dict)
        print(f"{kind:18} {x['trials']:>7} " + " ".join(f"{x[k]:>9}" for k in OUTCOMES))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
