"""The bookkeeping's memory at scale: the registry grows with the files, not with how often they
are referenced, and loading the retained checkpoints holds one `_metadata`'s bytes at a time.

A job directory of 10^6 shared files (benchmarks/README.md, "At sizes one machine cannot hold") is
held by the coordinator's registry for the life of the process; each retained checkpoint's
`_metadata` is parsed into strings of its own.
"""

from __future__ import annotations

import gc
import tracemalloc
from pathlib import Path

from sparkpoint.checkpoint.metadata import (
    CheckpointMetadata,
    CheckpointStats,
    FileHandle,
    KeyGroupRange,
    OperatorState,
    SubtaskStateHandle,
    utc_now_iso,
)
from sparkpoint.checkpoint.registry import SharedStateRegistry
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore

FILES = 20_000
CHECKPOINTS = 10


def parsed_paths(checkpoint_id: int) -> dict[str, int]:
    """The references of one checkpoint as a parsed `_metadata` gives them: new string objects."""
    return {f"shared/op/{i % 32}/{i:032x}.sst": 1 for i in range(FILES)} | {f"chk-{checkpoint_id}/_metadata": 1}


def test_registry_memory_grows_with_distinct_files_not_with_references():
    registry = SharedStateRegistry()
    gc.collect()
    tracemalloc.start()
    try:
        for cid in range(1, CHECKPOINTS + 1):  # every checkpoint references the same FILES files
            registry.register_checkpoint(cid, parsed_paths(cid))
        gc.collect()
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    references = CHECKPOINTS * (FILES + 1)
    assert registry.count(f"shared/op/5/{5:032x}.sst") == CHECKPOINTS
    assert len(registry.paths()) == FILES + CHECKPOINTS
    # Measured: 27 bytes per reference (an entry of ~190 bytes per file, 8 per reference in its
    # checkpoint's path list); a copy of each path per checkpoint (+~90) or a set per checkpoint
    # (+~100) would each go past the bound. It was 163 with both.
    per_reference = held / references
    assert per_reference < 60, f"{per_reference:.0f} bytes per reference ({held / 2**20:.1f} MiB in all)"


def test_checkpoints_sharing_a_file_share_the_registrys_one_copy_of_its_path():
    registry = SharedStateRegistry()
    for cid in (1, 2, 3):
        registry.register_checkpoint(cid, parsed_paths(cid))
    path = f"shared/op/7/{7:032x}.sst"
    entry = registry.entry(path)
    assert entry is not None and entry.count == 3
    held = [next(p for p in registry.paths_of(cid) if p == path) for cid in (1, 2, 3)]
    assert all(p is entry.path for p in held)
    assert registry.release_checkpoint(1) == {"chk-1/_metadata"}
    assert registry.release_checkpoint(2) == {"chk-2/_metadata"}
    assert path in registry.release_checkpoint(3)


def write_checkpoints(storage: CheckpointStorage, checkpoints: int, files: int) -> int:
    """`checkpoints` committed `_metadata` of `files` shared files each (the files themselves are
    not needed to load them); returns their bytes in all."""
    written = 0
    for cid in range(1, checkpoints + 1):
        shared = tuple(FileHandle(f"{i:06d}.sst", f"shared/op/0/{cid:04d}{i:028x}.sst", 100, i, cid)
                       for i in range(files))
        handle = SubtaskStateHandle("op", 0, cid, KeyGroupRange(0, 127), 128, shared, ())
        meta = CheckpointMetadata(job_id=storage.job_id, checkpoint_id=cid, kind="checkpoint",
                                  created_at=utc_now_iso(), source_offsets={}, stats=CheckpointStats(0, 0),
                                  operators={"op": OperatorState(128, (handle,))})
        data = meta.dumps()
        storage.commit_exclusive(meta.metadata_path, data)
        written += len(data)
    return written


def test_loading_every_checkpoint_holds_one_metadata_files_bytes_at_a_time(tmp_path: Path):
    storage = CheckpointStorage(f"file://{tmp_path}/checkpoints", "job")
    metadata_bytes = write_checkpoints(storage, checkpoints=10, files=3000)
    store = CompletedCheckpointStore(storage)
    gc.collect()
    tracemalloc.start()
    try:
        listing = store.load_all()
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(listing.checkpoints) == 10 and not listing.unreadable
    assert sum(len(m.paths()) for m in listing.checkpoints) == 30_000
    # Beyond what it returns, loading holds one file's bytes and its JSON tree at a time (0.55 of
    # all ten files' bytes, measured), not every file's bytes until the last is parsed (1.45).
    assert peak - held < 0.8 * metadata_bytes, f"{(peak - held) / metadata_bytes:.2f} of {metadata_bytes:,} bytes"


def write_history(storage: CheckpointStorage, ids: range, consumed: int) -> int:
    """Committed `_metadata` `ids` of a few files each whose source offsets list `consumed` input
    names (a long job's history, as directory offsets kept it); their bytes in all."""
    names = [f"events-{i:09d}.parquet" for i in range(consumed)]
    written = 0
    for cid in ids:
        shared = tuple(FileHandle(f"{i:06d}.sst", f"shared/op/0/{cid:04d}{i:028x}.sst", 100, i, cid) for i in range(8))
        handle = SubtaskStateHandle("op", 0, cid, KeyGroupRange(0, 127), 128, shared, ())
        offsets = {"source": {"version": 1, "consumed": names}}
        meta = CheckpointMetadata(job_id=storage.job_id, checkpoint_id=cid, kind="checkpoint", created_at=utc_now_iso(),
                                  source_offsets=offsets, stats=CheckpointStats(0, 0),
                                  operators={"op": OperatorState(128, (handle,))})
        data = meta.dumps()
        storage.commit_exclusive(meta.metadata_path, data)
        written += len(data)
    return written


def traced(fn):
    """(what `fn()` returns, bytes it left allocated, its peak above the start)."""
    gc.collect()
    tracemalloc.start()
    try:
        out = fn()
        gc.collect()
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return out, held, peak


def test_a_rebuild_and_a_sweep_hold_a_window_of_metadata_not_every_retained_checkpoints_history(tmp_path: Path):
    from sparkpoint.checkpoint.sweep import referenced_paths

    storage = CheckpointStorage(f"file://{tmp_path}/checkpoints", "job")
    store = CompletedCheckpointStore(storage)
    peaks: dict[str, list[float]] = {"rebuild": [], "sweep": [], "whole listing": []}
    for ids in (range(1, 9), range(9, 17)):  # 8 retained checkpoints, then 16
        one = write_history(storage, ids, consumed=5_000) / len(ids)
        registry, held, peak = traced(lambda: store.rebuild().registry)  # what a coordinator keeps of it
        referenced, swept_held, swept_peak = traced(lambda: referenced_paths(storage)[0])
        _, _, whole_peak = traced(lambda: store.rebuild_registry(store.load_all()))  # every parsed one held
        assert registry.paths() == referenced and len(referenced) == 9 * ids[-1]  # 8 files and a `_metadata` each
        # what stays is the registry or the paths (~0.15 of one file here): no parsed `_metadata` (~3 each)
        assert held < 0.5 * one and swept_held < 0.5 * one, (held / one, swept_held / one)
        for name, value in zip(peaks, (peak, swept_peak, whole_peak)):
            peaks[name].append(value / one)
    # Measured, in `_metadata` files' bytes at 8 and 16 checkpoints: rebuild ~17 and ~17 (a window
    # of 4 read, one parsed at a time), sweep ~14 and ~14, against 29 and 53 with every parsed
    # checkpoint held at once.
    print({name: [round(v, 1) for v in values] for name, values in peaks.items()})
    assert peaks["rebuild"][1] < 1.25 * peaks["rebuild"][0] and peaks["sweep"][1] < 1.25 * peaks["sweep"][0], peaks
    assert peaks["whole listing"][1] > 1.6 * peaks["whole listing"][0], peaks


def test_the_parquet_sink_keeps_only_the_output_above_the_checkpoint_a_start_resumes_from(tmp_path: Path):
    from sparkpoint.tables.parquet import ExactlyOnceParquetSink, part_name

    out = tmp_path / "out"
    out.mkdir()
    for cid in range(1, 201):  # a long job's output, and a neighbour job's beside it
        for job in ("etl", "etl-2"):
            (out / part_name(job, cid, "totals", 0)).write_bytes(b"")
    sink = ExactlyOnceParquetSink.at(str(out), "etl")

    assert sorted(sink.committed(after=198)) == [199, 200]
    assert sink.rollback(after=199) == [200] and sorted(sink.committed(after=190)) == list(range(191, 200))
    assert len(sink.committed()) == 199
