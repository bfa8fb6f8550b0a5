"""DELETE requests per subsumption: one request per file (before) against DeleteObjects batches of
1,000 keys (after, `sparkpoint.checkpoint.deletes`), on S3.

Measured on moto (a server process on 127.0.0.1, requests counted as the s3fs client sends them):
a real coordinator commits chk-1 referencing N shared files, then chk-2 referencing none of them
with `num_retained=1`, so completing chk-2 subsumes chk-1 and deletes its N shared files, its private
file and its `_metadata`. "Before" is the same subsumption through a wrapper filesystem that passes
every call on but is no s3fs (`FaultyFileSystem` at rate 0): one `DeleteObject` per file, as every
delete was sent before the batches. N = 10^4 is measured (`--measure` adds sizes); 10^6 is modelled
from the batch size as the measured runs send them (N + 2 requests before; after, one for the
`_metadata` the subsumption deletes first and ceil((N + 1) / 1000) for the rest), since
10^6 PUTs to moto to set it up take hours on this machine: said in the table and the JSON.

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.bench_deletes            # ~6 min
    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.bench_deletes --quick    # N = 2,000
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
import uuid
import zlib
from pathlib import Path
from typing import Any

from benchmarks.bench_state_backend import RequestCounter, moto_s3, table
from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.deletes import S3_BATCH
from sparkpoint.checkpoint.metadata import FileHandle, KeyGroupRange, SubtaskStateHandle
from sparkpoint.checkpoint.paths import private_dir, shared_dir
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.testing.faultyfs import FaultyFileSystem

RESULTS = Path(__file__).parent / "results"
MODELLED = (10**6,)
DELETE_OPS = ("DeleteObject", "DeleteObjects")


def handle(storage: CheckpointStorage, checkpoint_id: int, files: int) -> SubtaskStateHandle:
    """A subtask's handle of `files` shared files and one private file, each a few bytes, put on
    storage in one listed `pipe` (the setup is not what is measured)."""
    data = b"sst"
    shared = [f"{shared_dir('op', 0)}/{uuid.uuid4().hex}.sst" for _ in range(files)]
    private = f"{private_dir(checkpoint_id, 'op', 0)}/MANIFEST-000001"
    storage.fs.pipe({storage.abspath(p): data for p in [*shared, private]})
    crc = zlib.crc32(data)

    def made(path: str, name: str) -> FileHandle:
        return FileHandle(local_name=name, path=path, size=len(data), crc32=crc, created_by=checkpoint_id)

    return SubtaskStateHandle(
        operator="op", subtask=0, checkpoint_id=checkpoint_id, key_group_range=KeyGroupRange(0, 127),
        max_parallelism=128, shared=tuple(made(p, f"{i:06d}.sst") for i, p in enumerate(shared)),
        private=(made(private, "MANIFEST-000001"),),
    )


def one_subsumption(url: str, options: dict[str, Any], files: int, *, batched: bool) -> dict[str, Any]:
    """chk-1 with `files` shared files, then chk-2 subsuming it: the requests chk-2's completion sent."""
    job = f"job-{uuid.uuid4().hex[:6]}"
    plain = CheckpointStorage(url, job, options)
    storage = plain if batched else CheckpointStorage(url, job, options, filesystem=FaultyFileSystem(plain.fs, rate=0))
    coordinator = CheckpointCoordinator(storage, num_retained=1)
    for cid, n in ((1, files), (2, 0)):
        pending = coordinator.trigger(expected={"op": 1})
        assert pending.checkpoint_id == cid
        coordinator.acknowledge(cid, handle(plain, cid, n))
        if cid == 2:
            counter = RequestCounter(plain.fs)
            started = time.perf_counter()
        coordinator.complete(cid)
    seconds = time.perf_counter() - started
    counts = counter.take()
    plain.fs.invalidate_cache()
    left = len(plain.walk("shared"))
    return {"files": files, "route": "batched" if batched else "one per file", "measured": True,
            "delete_requests": sum(counts.get(op, 0) for op in DELETE_OPS), "requests": counts,
            "seconds": round(seconds, 2), "shared_files_left": left}


def modelled(files: int) -> list[dict[str, Any]]:
    """The requests at `files` as the measured runs send them: chk-1's `_metadata` deleted first (one
    request), then its shared files and private file (one each before, batches of 1,000 after)."""
    return [{"files": files, "route": "one per file", "measured": False, "delete_requests": files + 2},
            {"files": files, "route": "batched", "measured": False,
             "delete_requests": 1 + math.ceil((files + 1) / S3_BATCH)}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N = 2,000 only (a smoke run)")
    parser.add_argument("--measure", type=int, nargs="*", default=None, help="the N to measure (default 10000)")
    args = parser.parse_args()
    sizes = [2_000] if args.quick else (args.measure or [10_000])
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as work, moto_s3(Path(work)) as (url, options):
        for n in sizes:
            for batched in (False, True):
                rows.append(one_subsumption(url, options, n, batched=batched))
                print(json.dumps(rows[-1]), flush=True)
    if not args.quick:
        rows += [r for n in MODELLED for r in modelled(n)]
    shown = table("DELETE requests per subsumption (S3: moto on 127.0.0.1; measured or modelled from 1,000 keys "
                  "a request)", ["shared files", "route", "DELETE requests", "seconds", "how"],
                  [[f"{r['files']:,}", r["route"], f"{r['delete_requests']:,}", str(r.get("seconds", "")),
                    "measured" if r["measured"] else "modelled"] for r in rows])
    print(shown)
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / ("deletes_quick.json" if args.quick else "deletes.json")
    out.write_text(json.dumps({"batch": S3_BATCH, "rows": rows}, indent=1) + "\n")
    out.with_suffix(".txt").write_text(shown)
    print(f"wrote {out} and {out.with_suffix('.txt').name}")


if __name__ == "__main__":
    main()
