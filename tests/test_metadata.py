"""`_metadata` is strictly validated: every error names the field and the file."""

from __future__ import annotations

import json

import pytest

from sparkpoint.checkpoint.errors import MetadataError
from sparkpoint.checkpoint.metadata import (
    CheckpointMetadata,
    CheckpointStats,
    FileHandle,
    KeyGroupRange,
    OperatorState,
    RestoreLineage,
    SubtaskStateHandle,
)


def sample() -> CheckpointMetadata:
    f = FileHandle("000012.sst", "shared/op/0/abc.sst", 10, 0xDEADBEEF, 1)
    p = FileHandle("CURRENT", "chk-2/op/0/x/CURRENT", 16, 7, 2)
    h = SubtaskStateHandle("op", 0, 2, KeyGroupRange(0, 127), 128, (f,), (p,))
    return CheckpointMetadata(
        job_id="job", checkpoint_id=2, kind="checkpoint", created_at="2026-01-01T00:00:00Z",
        source_offsets={"files": ["a.parquet"]}, stats=CheckpointStats(26, 16, 1, 1),
        operators={"op": OperatorState(128, (h,))},
        lineage=RestoreLineage("chk-1/_metadata", "NO_CLAIM"), unowned=frozenset({"shared/op/0/abc.sst"}),
    )


def test_round_trip():
    meta = sample()
    assert CheckpointMetadata.loads(meta.dumps()) == meta
    handle = next(meta.subtask_handles())
    assert SubtaskStateHandle.loads(handle.dumps()) == handle


def mutate(path: list, value) -> bytes:
    raw = json.loads(sample().dumps())
    node = raw
    for key in path[:-1]:
        node = node[key]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return json.dumps(raw).encode()


SUB = ["operators", "op", "subtasks", 0]


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (["format"], "flink", "`format`"),
        (["version"], 99, "`version`"),
        (["checkpoint_id"], "2", "`checkpoint_id`"),
        (["checkpoint_id"], 0, "`checkpoint_id`"),
        (["kind"], "snapshot", "`kind`"),
        (["job_id"], KeyError, "`job_id` is missing"),
        (["stats", "state_size"], -1, "`stats.state_size`"),
        (["lineage", "claim_mode"], "MAYBE", "`lineage.claim_mode`"),
        ([*SUB, "shared", 0, "path"], "../../etc/passwd", "shared[0].path"),
        ([*SUB, "shared", 0, "path"], "/abs/file.sst", "shared[0].path"),
        ([*SUB, "shared", 0, "path"], "s3://other/x.sst", "shared[0].path"),
        ([*SUB, "shared", 0, "crc32"], 2**32, "shared[0].crc32"),
        ([*SUB, "shared", 0, "size"], True, "shared[0].size"),
        ([*SUB, "shared", 0, "local_name"], "../x", "shared[0].local_name"),
        ([*SUB, "shared", 0, "created_by"], 9, "later checkpoint"),
        ([*SUB, "key_group_range", "end"], 500, "key_group_range.end"),
        ([*SUB, "subtask"], 3, "subtasks"),
        ([*SUB, "private"], "nope", "private"),
        (["source_offsets"], {"x": float("nan")}, None),
    ],
)
def test_invalid_field_is_named(path, value, message):
    if message is None:  # NaN is not JSON; json.dumps writes it, we must refuse it
        data = mutate(path, value)
        with pytest.raises(MetadataError, match="source_offsets"):
            CheckpointMetadata.loads(data, where="s3://b/job/chk-2/_metadata")
        return
    with pytest.raises(MetadataError) as err:
        CheckpointMetadata.loads(mutate(path, value), where="s3://b/job/chk-2/_metadata")
    assert message in str(err.value)
    assert "s3://b/job/chk-2/_metadata" in str(err.value)


@pytest.mark.parametrize("data", [b"", b"\xff\xfe", b"[]", b"null", b'{"format": "sparkpoint-checkpoint"'])
def test_garbage_is_a_metadata_error(data):
    with pytest.raises(MetadataError):
        CheckpointMetadata.loads(data)


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ([*SUB, "shared", 0, "local_name"], "000012.sst\n"),
        ([*SUB, "shared", 0, "path"], "shared/op/0/abc.sst\n"),
        ([*SUB, "shared", 0, "path"], "shared//op/abc.sst"),
        ([*SUB, "shared", 0, "path"], "shared/op/../abc.sst"),
        ([*SUB, "shared", 0, "path"], "shared\\op\\abc.sst"),
        ([*SUB, "shared", 0, "path"], "shared/op/\x00abc.sst"),
    ],
)
def test_the_fast_path_refuses_what_the_checks_refuse(path, value):
    """Plain names are accepted by a regex fast path; a trailing newline (`$` matches before it) must not pass."""
    with pytest.raises(MetadataError, match=r"shared\[0\]"):
        CheckpointMetadata.loads(mutate(path, value))


def test_checksum_covers_the_written_bytes_and_other_layouts():
    data = sample().dumps()
    assert data.endswith(b'"}') and b'"checksum":"sha256:' in data
    # Indented (as earlier sparkpoint wrote it) and with the same checksum: still the same checkpoint.
    assert CheckpointMetadata.loads(json.dumps(json.loads(data), indent=1).encode()) == sample()
    # One changed byte ahead of an intact checksum field is refused.
    flipped = data.replace(b'"job":', b'"jpb":', 1) if b'"job":' in data else data.replace(b'"job"', b'"jab"', 1)
    assert flipped != data
    with pytest.raises(MetadataError, match="checksum"):
        CheckpointMetadata.loads(flipped)
