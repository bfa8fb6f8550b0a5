"""A changelog file whose checksum is valid but whose frames expand to far more than its
checkpoint's state can hold (a decompression bomb) is refused before it is decompressed."""

from __future__ import annotations

import json
import subprocess
import sys
import zlib
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pytest

from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.errors import CheckpointCorrupted
from sparkpoint.checkpoint.metadata import metadata_path
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.state.backend import restore_with_fallback, take_checkpoint
from sparkpoint.state.codecs import StructCodec
from sparkpoint.state.engine.changelog import MAGIC, ChangelogFormatError, ChangelogOptions, decode
from sparkpoint.state.engine.verify import verify_checkpoint
from tests.support.backends import make_backend

COUNTS = StructCodec[tuple[int]]("<q")
FRAME = 16 * 1024 * 1024


def bomb(frames: int) -> bytes:
    """`frames` frames of 16 MiB of zeros each: a few KB on disk."""
    one = pa.Codec("zstd", compression_level=19).compress(bytes(FRAME), asbytes=True)
    header = {"version": 1, "raw_size": frames * FRAME, "frames": [[len(one), FRAME]] * frames,
              "states": [{"name": "count", "ranges": 0, "entries": 1}]}
    head = json.dumps(header).encode()
    return MAGIC + len(head).to_bytes(4, "little") + head + one * frames


def test_decode_refuses_a_body_larger_than_allowed_before_decompressing():
    data = bomb(40)  # 640 MiB declared
    assert len(data) < 100_000
    with pytest.raises(ChangelogFormatError, match="decompression bomb"):
        decode(data, "changelog-000000000002", max_raw=64 * 1024 * 1024)


def test_a_checksum_valid_bomb_in_a_checkpoint_is_reported_by_verify_and_refused_by_restore(tmp_path: Path):
    storage = CheckpointStorage(f"file://{tmp_path}/ckpt", "job")
    coord = CheckpointCoordinator(storage, num_retained=2)
    with make_backend(storage, tmp_path / "local", max_parallelism=32, changelog=ChangelogOptions(enabled=True)) as b:
        b.restore(None)
        for n, keys in enumerate((300, 30)):  # 10% churn: checkpoint 2 is a changelog one
            b.value_state("count", COUNTS).put_many((f"k{i}", (i + n,)) for i in range(keys))
            take_checkpoint(coord, [b])
    store = CompletedCheckpointStore(storage)
    meta = store.load(2)
    (victim,) = [f for f in meta.files() if f.local_name.startswith("changelog-") and f.created_by == 2]
    data = bomb(40)
    storage.delete([victim.path])
    storage.write_bytes(victim.path, data)
    forged = replace(victim, size=len(data), crc32=zlib.crc32(data) & 0xFFFFFFFF)
    operators = {name: replace(op, subtasks=tuple(
        replace(h, shared=tuple(forged if f.path == victim.path else f for f in h.shared)) for h in op.subtasks))
        for name, op in meta.operators.items()}
    storage.delete([metadata_path(2)])
    storage.commit_exclusive(metadata_path(2), replace(meta, operators=operators).dumps())

    problems = verify_checkpoint(storage, store.load(2))
    assert [p.path for p in problems] == [victim.path] and "decompression bomb" in problems[0].problem
    with make_backend(storage, tmp_path / "fresh", max_parallelism=32,
                      changelog=ChangelogOptions(enabled=True)) as fresh:
        with pytest.raises(CheckpointCorrupted, match="does not decode"):
            fresh.restore(store.load(2))
        restored = restore_with_fallback([fresh], store.load_all().checkpoints)  # falls back to chk-1
        assert restored[0].checkpoint_id == 1 and fresh.value_state("count", COUNTS).get("k5") == (5,)


def test_verify_of_a_bomb_stays_small_in_memory(tmp_path: Path):
    """The CLI's verify over the bomb above, in its own process: peak RSS well under the 640 MiB
    the file declares."""
    test_a_checksum_valid_bomb_in_a_checkpoint_is_reported_by_verify_and_refused_by_restore(tmp_path)
    # VmHWM, not ru_maxrss: the latter keeps the forking parent's size across exec.
    done = subprocess.run(
        [sys.executable, "-c", "import re, sys; from sparkpoint.cli import main; "
         f"code = main(['verify', '--checkpoints', 'file://{tmp_path}/ckpt', '--job-id', 'job']); "
         "print(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1)); sys.exit(code)"],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 1, done.stderr[-2000:]
    peak_mib = int(done.stdout.strip().splitlines()[-1]) / 1024
    assert peak_mib < 400, f"verify peaked at {peak_mib:.0f} MiB"
