"""How incremental are sparkpoint's checkpoints, and what do checkpoint and restore cost?

One subtask's RocksDB state (default about 1 GB of live SST bytes: 16-byte keys, 60-byte values
with a random payload so compression cannot hide the size) is loaded with `put_many`, fully
compacted, then for each change fraction (default 1% and 10% of the keys) the benchmark
overwrites that many random keys and takes an incremental checkpoint, `--checkpoints` times,
followed by one full checkpoint (`full=True`) of the same state. It measures:

* incremental checkpoint: mean wall time and mean bytes uploaded (`checkpointed_size`) against
  the state size; amplification = uploaded / (fraction x state size), 1.0 = only what changed;
* full checkpoint: wall time and bytes;
* restore of the latest checkpoint from the working database (no copy), from the task-local
  copy (hard links; sizes, fingerprints and CRC32s checked) and from primary storage (fresh local
  directory: download + CRC32 of every file); then 1,000 random reads of the restored state
  (`first_reads_s`): index and filter blocks are read at the first use, not at the open;
* the physical reference: the same checkpoint's files copied with plain fsspec `put` (to a
  fresh directory in the checkpoint storage) and `get` (back to local disk), no CRC, no fsync.

Storage is `file://` under a temp directory unless `--storage URL` says otherwise; everything the
run creates is removed afterwards. Local reads come from the page cache (24 GB RAM), so the
restore figures are warm-cache figures; dirty pages are written back (`sync`) before each restore
and reference copy so that none pays for the writes of the one before. The reference is also
timed until its writes reach the disk (`+sync`): checkpoint uploads fsync every file, plain
`put` does not, so on `file://` the `+sync` column is the fair comparison.

Run:

    .venv/bin/python -m benchmarks.bench_state_backend            # ~1 GB, several minutes
    .venv/bin/python -m benchmarks.bench_state_backend --quick    # 64 MB, 2 checkpoints, < 1 min
    .venv/bin/python -m benchmarks.bench_state_backend --state-mb 256 --changes 0.01,0.05 --checkpoints 10

It prints tables and writes JSON to benchmarks/results/state_backend.json
(state_backend_quick.json with --quick).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import rocksdict

from sparkpoint.checkpoint.coordinator import CheckpointCoordinator, CompletedCheckpoint
from sparkpoint.checkpoint.files import download_verified
from sparkpoint.checkpoint.metadata import FileHandle, KeyGroupRange, SubtaskStateHandle
from sparkpoint.checkpoint.storage import CRC32_IMPLEMENTATION, CheckpointStorage
from sparkpoint.state.backend import RocksDBStateBackend, take_checkpoint
from sparkpoint.state.codecs import StructCodec
from sparkpoint.state.engine.restore import FINGERPRINTS, local_copy_matches
from sparkpoint.state.engine.rocksdb import flush_all
from sparkpoint.state.kinds import ValueState

RESULTS = Path(__file__).parent / "results"
OPERATOR = "bench"
STATE = "values"
PAYLOAD = 35  # 1 version byte + 3 x 8 bytes + 35 = 60-byte values
CODEC = StructCodec[tuple[int, float, float, bytes]](f"<qdd{PAYLOAD}s")
BATCH = 100_000
CALIBRATION_KEYS = 200_000
MB = 1024 * 1024


def key(i: int) -> bytes:
    return b"key-%012d" % i  # 16 bytes


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- workload --------------------------------------------------------------------------------


def write_keys(state: ValueState[Any], ids: list[int], version: int) -> None:
    """Write `ids` with fresh random payloads, in batches of BATCH keys."""
    for start in range(0, len(ids), BATCH):
        chunk = ids[start : start + BATCH]
        payload = os.urandom(PAYLOAD * len(chunk))
        state.put_many(
            (key(i), (version, i * 0.5, version * 0.25, payload[n * PAYLOAD : (n + 1) * PAYLOAD]))
            for n, i in enumerate(chunk)
        )


def sst_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.glob("*.sst"))


def load(backend: RocksDBStateBackend, target_bytes: int) -> dict[str, Any]:
    """Load keys until the live SSTs hold about `target_bytes`, then compact fully.

    A first batch calibrates bytes per key; compacting afterwards means what follows measures
    churn, not the tail of the bulk load's own compactions.
    """
    state = backend.value_state(STATE, CODEC)
    started = time.perf_counter()
    calibration = min(CALIBRATION_KEYS, max(10_000, target_bytes // 100))
    write_keys(state, list(range(calibration)), version=0)
    assert backend.db is not None
    flush_all(backend.db, backend.state_names())
    per_key = sst_bytes(backend.db_path) / calibration
    num_keys = max(calibration, int(target_bytes / per_key))
    log(f"calibration: {per_key:.1f} SST bytes per key -> loading {num_keys:,} keys")
    for start in range(calibration, num_keys, 10 * BATCH):
        write_keys(state, list(range(start, min(num_keys, start + 10 * BATCH))), version=0)
    loaded = time.perf_counter() - started
    backend.compact()
    compacted = time.perf_counter() - started - loaded
    live = sst_bytes(backend.db_path)
    log(f"loaded {num_keys:,} keys in {loaded:.1f} s, compacted in {compacted:.1f} s: {live / MB:.0f} MB of SSTs")
    return {
        "keys": num_keys,
        "sst_bytes_per_key": per_key,
        "load_s": loaded,
        "keys_per_s": num_keys / loaded,
        "compact_s": compacted,
        "live_sst_bytes": live,
    }


# --- measurements ----------------------------------------------------------------------------


@dataclass
class Timed:
    done: CompletedCheckpoint
    wall_s: float

    def to_json(self) -> dict[str, Any]:
        stats = self.done.metadata.stats
        return {
            "checkpoint_id": self.done.checkpoint_id,
            "wall_s": self.wall_s,
            "coordinator_duration_s": self.done.duration_s,
            "uploaded_bytes": stats.checkpointed_size,
            "state_bytes": stats.state_size,
            "files_new": self.done.files_new,
            "files_reused": self.done.files_reused,
        }


def checkpoint(coordinator: CheckpointCoordinator, backend: RocksDBStateBackend, *, full: bool) -> Timed:
    started = time.perf_counter()
    done = take_checkpoint(coordinator, [backend], full=full)
    return Timed(done, time.perf_counter() - started)


def churn_phase(
    coordinator: CheckpointCoordinator,
    backend: RocksDBStateBackend,
    num_keys: int,
    fraction: float,
    checkpoints: int,
    rng: random.Random,
) -> dict[str, Any]:
    """`checkpoints` incremental checkpoints, each after overwriting `fraction` of the keys."""
    state = backend.value_state(STATE, CODEC)
    changed = max(1, round(fraction * num_keys))
    runs: list[Timed] = []
    write_s = 0.0
    for n in range(checkpoints):
        ids = sorted(rng.sample(range(num_keys), changed))
        started = time.perf_counter()
        write_keys(state, ids, version=n + 1)
        write_s += time.perf_counter() - started
        run = checkpoint(coordinator, backend, full=False)
        runs.append(run)
        stats = run.done.metadata.stats
        log(
            f"  {fraction:.0%} #{n + 1}: chk-{run.done.checkpoint_id} {run.wall_s:.2f} s, "
            f"uploaded {stats.checkpointed_size / MB:.1f} of {stats.state_size / MB:.1f} MB "
            f"({run.done.files_new} new / {run.done.files_reused} reused files)"
        )
    uploaded = [r.done.metadata.stats.checkpointed_size for r in runs]
    states = [r.done.metadata.stats.state_size for r in runs]
    mean_up = sum(uploaded) / len(runs)
    mean_state = sum(states) / len(runs)
    full = checkpoint(coordinator, backend, full=True)
    log(f"  {fraction:.0%} full: {full.wall_s:.2f} s, {full.done.metadata.stats.checkpointed_size / MB:.1f} MB")
    return {
        "fraction": fraction,
        "keys_changed": changed,
        "write_s_mean": write_s / checkpoints,
        "checkpoints": [r.to_json() for r in runs],
        "mean_wall_s": sum(r.wall_s for r in runs) / len(runs),
        "mean_uploaded_bytes": mean_up,
        "max_uploaded_bytes": max(uploaded),
        "mean_state_bytes": mean_state,
        "uploaded_over_state": mean_up / mean_state,
        "amplification": mean_up / (fraction * mean_state),
        "final_state_bytes": states[-1],
        "rewrites": sum(1 for u, s in zip(uploaded, states) if u > s / 2),  # checkpoints uploading > half
        "full": full.to_json(),
        "storage_bytes_after": None,  # filled in by the caller
    }


def settle() -> None:
    """Write back dirty pages first, so one measurement does not pay for the previous one's writes."""
    os.sync()


def timed_restore(backend: RocksDBStateBackend, meta: Any, expected: str, probe: list[int],
                  source: CheckpointStorage | None = None) -> dict[str, Any]:
    # A restarted process has no database open: the previous measurement's one is closed first
    # (closing waits for a compaction its open may have started, up to 0.13 s measured).
    backend.close()
    settle()
    started = time.perf_counter()
    result = backend.restore(meta, source=source)
    wall = time.perf_counter() - started
    if result.source != expected:
        raise RuntimeError(f"restore came from {result.source!r}, the benchmark expected {expected!r}")
    keys = [key(i) for i in probe]
    started = time.perf_counter()
    found = backend.value_state(STATE, CODEC).get_many(keys)
    first_reads = time.perf_counter() - started
    if any(v is None for v in found):
        raise RuntimeError(f"restore from {expected} lost keys: {sum(v is None for v in found)} of {len(probe)}")
    log(f"restore from {expected}: {wall:.3f} s ({result.files} files, {result.downloaded_bytes / MB:.0f} MB down), "
        f"then {len(probe)} reads {first_reads:.3f} s")
    return {"source": result.source, "wall_s": wall, "files": result.files, "downloaded_bytes": result.downloaded_bytes,
            "first_reads_s": first_reads}


def restores(
    storage: CheckpointStorage, backend: RocksDBStateBackend, meta: Any, work: Path, probe: list[int], repeat: int
) -> dict[str, Any]:
    """Restore `meta` three ways: working db as is, task-local copy, primary storage (the last two
    `repeat` times, interleaved; medians)."""
    out: dict[str, Any] = {"working": timed_restore(backend, meta, "working", probe)}
    runs: dict[str, list[dict[str, Any]]] = {"local": [], "primary": []}
    for n in range(repeat):
        (backend.dir / "working.json").unlink()  # db/ no longer counts as checkpoint N: use chk-N/
        runs["local"].append(timed_restore(backend, meta, "local", probe))
        fresh = RocksDBStateBackend(
            storage, OPERATOR, 0, parallelism=1, max_parallelism=backend.max_parallelism, local_dir=work / f"fresh-{n}"
        )
        try:
            runs["primary"].append(timed_restore(fresh, meta, "primary", probe))
        finally:
            fresh.dispose()
    for source, results in runs.items():
        out[source] = median_of(results)
    # The task-local restore's check, timed alone: as the restore runs it (SSTs with an unchanged
    # fingerprint are not read), and reading and checksumming every byte (`deep`).
    handle = next(h for h in meta.subtask_handles() if h.operator == OPERATOR)
    for key, deep in (("verify_s", False), ("verify_deep_s", True)):
        verify = []
        for _ in range(repeat):
            settle()
            started = time.perf_counter()
            assert not local_copy_matches(backend.dir / f"chk-{meta.checkpoint_id}", handle, deep=deep)
            verify.append(time.perf_counter() - started)
        out["local"][key] = statistics.median(verify)
    return out


def restores_from_s3(storage: CheckpointStorage, meta: Any, s3_url: str, options: dict[str, Any], work: Path,
                     probe: list[int], repeat: int) -> dict[str, Any]:
    """Primary restore when the primary copy is on S3 (moto on 127.0.0.1), as it is in production:
    a verified copy of `meta` (a savepoint) goes to S3, and fresh backends restore from it. Also
    counts the S3 requests of each restore, and probes what the restore model needs: the latency
    of one small GET and the throughput of one GET stream."""
    from sparkpoint.checkpoint.savepoint import take_savepoint

    # The savepoint goes to its target with the source's storage options: give the local storage
    # the S3 options too (the local filesystem ignores them).
    source = CheckpointStorage(storage.url, storage.job_id, options)
    saved = take_savepoint(source, checkpoint_id=meta.checkpoint_id, target=f"{s3_url}/primary-copy")
    on_s3 = CheckpointStorage(s3_url, "primary-copy", options)
    counter = RequestCounter(on_s3.fs)
    runs, requests = [], []
    for n in range(repeat):
        fresh = RocksDBStateBackend(
            storage, OPERATOR, 0, parallelism=1, max_parallelism=meta.operators[OPERATOR].max_parallelism,
            local_dir=work / f"fresh-s3-{n}",
        )
        try:
            counter.take()
            runs.append(timed_restore(fresh, saved.metadata, "primary", probe, source=on_s3))
            requests.append(counter.take())
        finally:
            fresh.dispose()
    return {**median_of(runs), "requests": requests[0], "probe": s3_probe(on_s3, saved.metadata, work, repeat)}


def s3_probe(on_s3: CheckpointStorage, meta: Any, work: Path, repeat: int) -> dict[str, Any]:
    """One small GET's latency (median of 50, one after the other) and one large file's GET on a
    single stream (median of `repeat`): the per-request and per-stream terms of the restore model."""
    files = sorted(meta.files(), key=lambda f: f.size)
    small, large = files[0], files[-1]
    latencies = []
    for _ in range(50):
        started = time.perf_counter()
        on_s3.read_bytes(small.path)
        latencies.append(time.perf_counter() - started)
    streams = []
    for n in range(repeat):
        target = work / f"probe-{n}"
        started = time.perf_counter()
        on_s3.fs.get_file(on_s3.abspath(large.path), str(target))
        streams.append(time.perf_counter() - started)
        target.unlink()
    out = {"small_get_bytes": small.size, "small_get_s": statistics.median(latencies), "large_get_bytes": large.size,
           "large_get_s": statistics.median(streams),
           "stream_mb_per_s": large.size / MB / statistics.median(streams)}
    log(f"s3 probe: a {small.size}-byte GET {out['small_get_s'] * 1000:.1f} ms, one stream "
        f"{out['stream_mb_per_s']:.0f} MB/s ({large.size / MB:.0f} MB)")
    return out


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {**runs[0], "wall_s": statistics.median(r["wall_s"] for r in runs), "runs_s": [r["wall_s"] for r in runs],
            "first_reads_s": statistics.median(r["first_reads_s"] for r in runs)}


def transfer(storage: CheckpointStorage, local_checkpoint: Path, work: Path, repeat: int) -> dict[str, Any]:
    """The same files through sparkpoint and through plain fsspec, `repeat` times, interleaved:

    * upload: `CheckpointStorage.upload` (CRC32 of every file, fsync on a local disk) against
      fsspec `put` of the list;
    * download: `restore.download_verified` (download, CRC32 and size checked against the handle)
      against fsspec `get` of the list.

    `+sync` times run until the page cache is written back: the fair comparison for uploads to a
    local disk, which fsync every file while `put` does not.
    """
    files = sorted(p for p in local_checkpoint.iterdir() if p.is_file() and p.name != FINGERPRINTS)
    total = sum(p.stat().st_size for p in files)
    fs = storage.fs
    runs: dict[str, list[float]] = {k: [] for k in ("upload", "upload_sync", "put", "put_sync", "download", "get")}
    for n in range(repeat):
        tag = uuid.uuid4().hex[:8]
        ours, theirs = f"transfer-{tag}", f"{storage.root}-reference-{tag}"
        fs.makedirs(theirs, exist_ok=True)
        back = work / f"transfer-{tag}"
        back.mkdir()
        try:
            handles: list[FileHandle] = []

            def upload(ours: str = ours, handles: list[FileHandle] = handles) -> None:
                handles.extend(storage.upload([(str(p), f"{ours}/{p.name}") for p in files], checkpoint_id=1))

            def put(theirs: str = theirs) -> None:
                fs.put([str(p) for p in files], [f"{theirs}/{p.name}" for p in files])

            pair = (("upload", upload), ("put", put))
            for name, fn in pair if n % 2 == 0 else pair[::-1]:
                settle()
                started = time.perf_counter()
                fn()
                runs[name].append(time.perf_counter() - started)
                settle()
                runs[f"{name}_sync"].append(time.perf_counter() - started)
            handle = SubtaskStateHandle(
                operator=OPERATOR, subtask=0, checkpoint_id=1, key_group_range=KeyGroupRange(0, 127),
                max_parallelism=128,
                shared=tuple(h for h in handles if h.local_name.endswith(".sst")),
                private=tuple(h for h in handles if not h.local_name.endswith(".sst")),
            )

            def download(back: Path = back, handle: SubtaskStateHandle = handle) -> None:
                download_verified(storage, handle, 1, back / "ours")

            def get(back: Path = back, theirs: str = theirs) -> None:
                (back / "theirs").mkdir()
                fs.get([f"{theirs}/{p.name}" for p in files], [str(back / "theirs" / p.name) for p in files])

            pair = (("download", download), ("get", get))
            for name, fn in pair if n % 2 == 0 else pair[::-1]:
                settle()
                started = time.perf_counter()
                fn()
                runs[name].append(time.perf_counter() - started)
        finally:
            fs.rm(theirs, recursive=True)
            if storage.exists(f"{ours}/CURRENT"):
                fs.rm(storage.abspath(ours), recursive=True)
            shutil.rmtree(back, ignore_errors=True)
    out: dict[str, Any] = {"files": len(files), "bytes": total, "repeat": repeat, "runs_s": runs}
    out.update({f"{k}_s": statistics.median(v) for k, v in runs.items()})
    out["upload_vs_put"] = out["put_s"] / out["upload_s"]
    out["upload_vs_put_sync"] = out["put_sync_s"] / out["upload_sync_s"]
    out["download_vs_get"] = out["get_s"] / out["download_s"]
    log(f"transfer on {storage.fs.protocol}: upload {out['upload_s']:.2f} s vs put {out['put_s']:.2f} s "
        f"(+sync {out['upload_sync_s']:.2f} vs {out['put_sync_s']:.2f}), download {out['download_s']:.2f} s vs get "
        f"{out['get_s']:.2f} s")
    return out


@contextmanager
def moto_s3(work: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """A moto S3 server in its own process on 127.0.0.1 (so it does not share our GIL), and an
    empty bucket: yields the checkpoints URL and its storage options."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            try:
                urllib.request.urlopen(endpoint, timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        options: dict[str, Any] = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": endpoint}}
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        fsspec.filesystem("s3", **options).mkdir(bucket)
        yield f"s3://{bucket}/checkpoints", options
    finally:
        server.terminate()
        server.wait(timeout=30)


class RequestCounter:
    """Counts the S3 API calls of an s3fs filesystem, by operation (retries are not counted)."""

    def __init__(self, fs: Any):
        self.counts: dict[str, int] = {}
        fs.connect()
        fs.s3.meta.events.register("before-call.s3", self._count)

    def _count(self, event_name: str, **_: Any) -> None:
        op = event_name.rsplit(".", 1)[-1]
        self.counts[op] = self.counts.get(op, 0) + 1

    def take(self) -> dict[str, int]:
        """The counts since the last `take`."""
        counts, self.counts = dict(sorted(self.counts.items())), {}
        return counts


def storage_bytes(storage: CheckpointStorage) -> int:
    return sum(f.size for f in storage.walk("shared")) + sum(
        f.size for cid in storage.checkpoint_dirs() for f in storage.walk(f"chk-{cid}")
    )


# --- report ----------------------------------------------------------------------------------


def table(title: str, header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    line = "  ".join("-" * w for w in widths)
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join([title, fmt.format(*header), line, *(fmt.format(*r) for r in rows), ""])


def mb(n: float) -> str:
    return f"{n / MB:,.1f}"


def rate(n: float, seconds: float) -> str:
    return f"{n / MB / seconds:,.0f}"


def report(r: dict[str, Any]) -> str:
    ld = r["load"]
    out = [
        f"state: {ld['keys']:,} keys, {mb(ld['live_sst_bytes'])} MB live SSTs after compaction "
        f"(load {ld['load_s']:.1f} s = {ld['keys_per_s']:,.0f} keys/s, compaction {ld['compact_s']:.1f} s); "
        f"initial checkpoint {r['initial']['wall_s']:.2f} s, {mb(r['initial']['uploaded_bytes'])} MB\n"
    ]
    out.append(
        table(
            "Incremental checkpoints (mean per checkpoint)",
            ["changed", "ckpts", "state MB", "wall s", "uploaded MB", "up/state", "amplif.", "max MB", ">half",
             "end/live", "stored MB"],
            [
                [f"{p['fraction']:.0%}", str(len(p["checkpoints"])), mb(p["mean_state_bytes"]),
                 f"{p['mean_wall_s']:.2f}", mb(p["mean_uploaded_bytes"]), f"{p['uploaded_over_state']:.3f}",
                 f"{p['amplification']:.2f}", mb(p["max_uploaded_bytes"]), str(p["rewrites"]),
                 f"{p['final_state_bytes'] / ld['live_sst_bytes']:.2f}", mb(p["storage_bytes_after"])]
                for p in r["phases"]
            ],
        )
    )
    out.append(
        table(
            "Full checkpoint of the same state (full=True)",
            ["after", "wall s", "uploaded MB", "MB/s", "vs mean incremental"],
            [
                [f"{p['fraction']:.0%}", f"{p['full']['wall_s']:.2f}", mb(p["full"]["uploaded_bytes"]),
                 rate(p["full"]["uploaded_bytes"], p["full"]["wall_s"]),
                 f"{p['full']['wall_s'] / p['mean_wall_s']:.1f}x slower"]
                for p in r["phases"]
            ],
        )
    )
    file_ref = next(iter(r["transfer"].values()))
    restore_bytes = file_ref["bytes"]
    rows = [
        [name, f"{x['wall_s']:.3f}", " ".join(f"{t:.3f}" for t in x.get("runs_s", [x["wall_s"]])), str(x["files"]),
         mb(x["downloaded_bytes"]), rate(restore_bytes, x["wall_s"]), f"{x['first_reads_s']:.3f}",
         f"{x['wall_s'] + x['first_reads_s']:.3f}"]
        for name, x in r["restore"].items()
    ]
    out.append(
        table(f"Restore of chk-{r['restore_checkpoint']} ({mb(restore_bytes)} MB; median of the runs)",
              ["source", "wall s", "runs s", "files", "downloaded MB", "state MB/s", "1,000 reads s",
               "restore + reads s"], rows)
    )
    if (s3 := r["restore"].get("primary on s3 (moto)")) and "requests" in s3:
        probe = s3["probe"]
        out.append(f"restore from S3 (moto): requests {s3['requests']}; one {probe['small_get_bytes']}-byte GET "
                   f"{probe['small_get_s'] * 1000:.1f} ms, one GET stream {probe['stream_mb_per_s']:.0f} MB/s\n")
    local = r["restore"]["local"]
    out.append(
        f"task-local restore: {local['wall_s']:.3f} s, of which {local['verify_s']:.3f} s checks the files (sizes and "
        f"fingerprints; CRC32 of MANIFEST, CURRENT, OPTIONS); reading and checksumming every byte would take "
        f"{local['verify_deep_s']:.3f} s. The rest is hard links and opening RocksDB\n"
    )
    out.append(
        table(
            "Transfers: sparkpoint (CRC32 of every file, checked on download) against plain fsspec put/get of the "
            "same files (median; +sync: until written back)",
            ["storage", "MB", "upload s", "+sync", "put s", "+sync", "upload/put", "+sync", "download s", "get s",
             "download/get"],
            [[name, mb(x["bytes"]), f"{x['upload_s']:.2f}", f"{x['upload_sync_s']:.2f}", f"{x['put_s']:.2f}",
              f"{x['put_sync_s']:.2f}", f"{x['upload_vs_put']:.0%}", f"{x['upload_vs_put_sync']:.0%}",
              f"{x['download_s']:.2f}", f"{x['get_s']:.2f}", f"{x['download_vs_get']:.0%}"]
             for name, x in r["transfer"].items()],
        )
    )
    out.append(
        table(
            "Targets (throughput ratios; the upload on a local disk is compared until durable, +sync)",
            ["target", "measured", "goal", "verdict"],
            [[t["name"], f"{t['measured']:.2f}", f">= {t['goal']:g}", "met" if t["met"] else "MISSED"]
             for t in r["targets"]],
        )
    )
    out.append(
        "amplif. = uploaded / (changed x state); >half = checkpoints uploading over half the state; "
        "end/live = state at the phase's end / compacted state after load; stored = bytes in checkpoint storage\n"
    )
    out.append(f"total runtime {r['runtime_s']:.0f} s")
    return "\n".join(out)


# --- main ------------------------------------------------------------------------------------


def run(args: argparse.Namespace, work: Path, url: str) -> dict[str, Any]:
    storage = CheckpointStorage(url, f"bench-{uuid.uuid4().hex[:8]}")
    coordinator = CheckpointCoordinator(storage, num_retained=2)
    backend = RocksDBStateBackend(storage, OPERATOR, 0, parallelism=1, local_dir=work / "local")
    rng = random.Random(args.seed)
    try:
        backend.restore(None)
        loaded = load(backend, args.state_mb * MB)
        initial = checkpoint(coordinator, backend, full=False)
        log(f"initial checkpoint: {initial.wall_s:.2f} s, {initial.done.metadata.stats.checkpointed_size / MB:.0f} MB")
        phases = []
        for fraction in args.changes:
            log(f"change fraction {fraction:.0%}: {args.checkpoints} incremental checkpoints, then one full")
            phase = churn_phase(coordinator, backend, loaded["keys"], fraction, args.checkpoints, rng)
            phase["storage_bytes_after"] = storage_bytes(storage)
            phases.append(phase)
        latest = coordinator.store.load_all().checkpoints[0]
        probe = rng.sample(range(loaded["keys"]), min(1000, loaded["keys"]))
        restored = restores(storage, backend, latest, work, probe, args.repeat)
        local_checkpoint = backend.dir / f"chk-{latest.checkpoint_id}"
        transfers = {storage.fs.protocol if isinstance(storage.fs.protocol, str) else storage.fs.protocol[0]:
                     transfer(storage, local_checkpoint, work, args.repeat)}
        if args.s3:
            with moto_s3(work) as (s3_url, options):
                s3 = CheckpointStorage(s3_url, storage.job_id, options)
                transfers["s3 (moto)"] = transfer(s3, local_checkpoint, work, args.repeat)
                restored["primary on s3 (moto)"] = restores_from_s3(storage, latest, s3_url, options, work, probe,
                                                                    args.repeat)
    finally:
        backend.dispose()
        if args.storage and not args.keep_storage and storage.job_dir_exists():  # the temp dir goes as a whole
            storage.fs.rm(storage.root, recursive=True)
    return {
        "storage": {"url": url, "job_id": storage.job_id, "kept": bool(args.storage and args.keep_storage)},
        "load": loaded,
        "initial": initial.to_json(),
        "phases": phases,
        "restore_checkpoint": latest.checkpoint_id,
        "restore": restored,
        "transfer": transfers,
    }


def targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    """The performance targets of issue 10, from this run's figures."""
    out = []

    def add(name: str, measured: float, goal: float) -> None:
        out.append({"name": name, "measured": measured, "goal": goal, "met": measured >= goal})

    for p in r["phases"]:
        if p["fraction"] == 0.01:
            add("incremental (1%) x faster than full", p["full"]["wall_s"] / p["mean_wall_s"], 10)
    for name, x in r["transfer"].items():
        local = name == "file"
        add(f"upload / put on {name}" + (" (+sync)" if local else ""),
            x["upload_vs_put_sync"] if local else x["upload_vs_put"], 0.8)
        add(f"download verified / get on {name}", x["download_vs_get"], 0.8)
    file_get = next((x["get_s"] for n, x in r["transfer"].items() if n == "file"), None)
    if file_get is not None:
        add("primary restore / get on file", file_get / r["restore"]["primary"]["wall_s"], 0.8)
    local = r["restore"]["local"]["wall_s"]
    add("task-local restore x faster than primary on file", r["restore"]["primary"]["wall_s"] / local, 20)
    if (s3 := r["restore"].get("primary on s3 (moto)")) is not None:
        add("task-local restore x faster than primary on s3 (moto)", s3["wall_s"] / local, 20)
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--state-mb", type=int, default=1024, help="live SST bytes to load, in MB (default 1024)")
    p.add_argument("--changes", default="0.01,0.1", help="fractions of keys changed per checkpoint (default 0.01,0.1)")
    p.add_argument("--checkpoints", type=int, default=5, help="incremental checkpoints per fraction (default 5)")
    p.add_argument("--storage", metavar="URL", help="fsspec URL for checkpoints (default: file:// in a temp dir)")
    p.add_argument("--keep-storage", action="store_true",
                   help="leave the checkpoints on --storage (bench_scale's task process restores them)")
    p.add_argument("--repeat", type=int, default=3, help="repetitions of each restore and transfer (default 3)")
    p.add_argument("--no-s3", dest="s3", action="store_false", help="skip the transfers to S3 (moto on 127.0.0.1)")
    p.add_argument("--quick", action="store_true", help="smoke test: 64 MB, 2 checkpoints per fraction")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, help="JSON output (default benchmarks/results/state_backend[_quick].json)")
    args = p.parse_args(argv)
    if args.quick:
        args.state_mb, args.checkpoints = 64, 2
    args.changes = [float(c) for c in args.changes.split(",")]
    if not all(0 < c <= 1 for c in args.changes) or min(args.checkpoints, args.state_mb, args.repeat) < 1:
        p.error("--changes must be fractions in (0, 1], --checkpoints, --state-mb and --repeat positive")
    args.out = args.out or RESULTS / ("state_backend_quick.json" if args.quick else "state_backend.json")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="sparkpoint-bench-"))
    url = args.storage or f"file://{work}/checkpoints"
    try:
        results = run(args, work, url)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results["runtime_s"] = time.perf_counter() - started
    results["targets"] = targets(results)
    results["config"] = {
        "state_mb": args.state_mb,
        "changes": args.changes,
        "checkpoints": args.checkpoints,
        "storage": args.storage or "file:// temp dir",
        "seed": args.seed,
        "repeat": args.repeat,
        "key_bytes": 16,
        "value_bytes": len(CODEC.encode((0, 0.0, 0.0, b""))),
    }
    results["machine"] = {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "rocksdict": getattr(rocksdict, "__version__", "unknown"),
        "fsspec": fsspec.__version__,
        "crc32": CRC32_IMPLEMENTATION,
    }
    print(report(results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
