"""The keys one RocksDB SST file holds, read in Python: its column family, every point entry's key
(puts and deletes alike, with its value, sequence number and type) and its range deletions.

rocksdict reads a database, never one file on its own (it has no `SstFileReader`, and refuses to
ingest a file a database wrote). A state diff needs exactly that: the keys written in the files
one snapshot has and the other has not. The block-based table format is small enough to read
here: the footer names the metaindex, which names the index, the properties and the range
deletions; the index names the data blocks; a block is prefix-compressed entries followed by its
restart points, compressed with Snappy, LZ4 or Zstd.

Anything unexpected (another table format, a block type this does not know, counts that do not
match the file's own properties) raises SstFormatError: the diff then reads the snapshots whole.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from sparkpoint.checkpoint.errors import SparkpointError

_MAGIC = 0x88E241B785F4CFF7  # kBlockBasedTableMagicNumber
_LEGACY_MAGIC = 0xDB4775248B80FB57
_EXTENDED_MAGIC = b"\x3e\x00\x7a\x00"  # format_version >= 6
_FOOTER = 53  # checksum type, handles or extended magic, padding, format version, magic
_TRAILER = 5  # after every block: compression type (1) and checksum (4)
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_CODECS = {1: "snappy", 4: "lz4_raw", 5: "lz4_raw", 7: "zstd"}  # RocksDB's CompressionType values


class SstFormatError(SparkpointError):
    """An SST file this reader does not understand (or a damaged one)."""


@dataclass(frozen=True)
class SstKeys:
    """What one SST file writes: the column family, each point entry's user key, the range deletes."""

    column_family: str
    keys: list[bytes]
    ranges: list[tuple[bytes, bytes]]


@dataclass(frozen=True)
class SstEntries:
    """What one SST file holds, entry by entry: the column family, each point entry as (internal
    key, value) — the user key, then 8 bytes of sequence number and type — and the range deletes."""

    column_family: str
    entries: list[tuple[bytes, bytes]]
    ranges: list[tuple[bytes, bytes]]


PUT = 1  # RocksDB's kTypeValue; 0 is a deletion


def entry_type(internal_key: bytes) -> int:
    return internal_key[-8]


def sequence(internal_key: bytes) -> int:
    return int(_U64.unpack_from(internal_key, len(internal_key) - 8)[0]) >> 8


def read_sst_keys(path: str | Path) -> SstKeys:
    """Every key SST file `path` holds an entry for (put or delete) and its range deletions."""
    read = read_sst_entries(path)
    return SstKeys(read.column_family, [k[:-8] for k, _ in read.entries], read.ranges)


def read_sst_entries(path: str | Path) -> SstEntries:
    """Every entry of SST file `path`, with its value, sequence number and type (`SstEntries`)."""
    data = Path(path).read_bytes()
    try:
        return _read(data)
    except SstFormatError as e:
        raise SstFormatError(f"{Path(path).name}: {e}") from None
    except (IndexError, ValueError, struct.error, OSError, pa.ArrowException) as e:
        raise SstFormatError(f"{Path(path).name}: malformed SST ({e})") from e


def _properties(data: bytes) -> tuple[dict[bytes, bytes], dict[bytes, bytes], tuple[int, int] | None]:
    """(the metaindex, the properties, the index handle when the footer has it)."""
    meta_handle, index_handle = _footer(data)
    meta = dict(_entries(_block(data, meta_handle)))
    return meta, dict(_entries(_block(data, _handle(meta[b"rocksdb.properties"])))), index_handle


def _column_family(props: dict[bytes, bytes]) -> str:
    return props.get(b"rocksdb.column.family.name", b"default").decode()


def _read(data: bytes) -> SstEntries:
    meta, props, index_handle = _properties(data)
    if index_handle is None:  # format_version 6 moved the index handle into the metaindex
        index_handle = _handle(meta[b"rocksdb.index"])
    if props.get(b"rocksdb.index.partitions", b"\x00") not in (b"", b"\x00") or props.get(
            b"rocksdb.block.based.table.index.type", b"\x00\x00\x00\x00") not in (b"\x00\x00\x00\x00",):
        raise SstFormatError("only the binary-search index is read (not partitioned or hashed indexes)")
    delta = props.get(b"rocksdb.index.value.is.delta.encoded", b"\x00") != b"\x00"
    keys: list[tuple[bytes, bytes]] = []
    blocks = _index_handles(_block(data, index_handle), delta)
    if b"rocksdb.num.data.blocks" in props and len(blocks) != _varint(props[b"rocksdb.num.data.blocks"], 0)[0]:
        raise SstFormatError(f"the index lists {len(blocks)} data blocks, the file's properties say otherwise")
    for offset, size in blocks:
        keys.extend(_entries(_block(data, (offset, size))))
    ranges = []
    if b"rocksdb.range_del" in meta:
        ranges = [(k[:-8], v) for k, v in _entries(_block(data, _handle(meta[b"rocksdb.range_del"])))]
    expected = _varint(props.get(b"rocksdb.num.entries", b""), 0)[0]
    if len(keys) + len(ranges) != expected:
        raise SstFormatError(f"read {len(keys)} entries and {len(ranges)} range deletions, "
                             f"the file's properties say {expected} in all")
    return SstEntries(_column_family(props), keys, ranges)


def _footer(data: bytes) -> tuple[tuple[int, int], tuple[int, int] | None]:
    if len(data) < _FOOTER:
        raise SstFormatError("shorter than a footer")
    footer = data[-_FOOTER:]
    magic = _U64.unpack_from(footer, _FOOTER - 8)[0]
    if magic == _LEGACY_MAGIC or magic != _MAGIC:
        raise SstFormatError("not a block-based table of format version >= 1")
    if footer[1:5] == _EXTENDED_MAGIC:  # format_version >= 6: the metaindex ends where the footer starts
        size = _U32.unpack_from(footer, 13)[0]
        return (len(data) - _FOOTER - _TRAILER - size, size), None
    meta_offset, pos = _varint(footer, 1)
    meta_size, pos = _varint(footer, pos)
    index_offset, pos = _varint(footer, pos)
    index_size, pos = _varint(footer, pos)
    return (meta_offset, meta_size), (index_offset, index_size)


def _handle(value: bytes) -> tuple[int, int]:
    offset, pos = _varint(value, 0)
    return offset, _varint(value, pos)[0]


def _block(data: bytes, handle: tuple[int, int]) -> bytes:
    offset, size = handle
    if offset < 0 or offset + size + _TRAILER > len(data):
        raise SstFormatError(f"a block at {offset} of {size} bytes lies outside the file")
    raw, kind = data[offset : offset + size], data[offset + size]
    if kind == 0:
        return raw
    codec = _CODECS.get(kind)
    if codec is None:
        raise SstFormatError(f"a block compressed with RocksDB compression type {kind}")
    if codec == "snappy":
        length, start = _varint(raw, 0)  # Snappy's own header
        return bytes(pa.Codec(codec).decompress(raw, decompressed_size=length, asbytes=True))
    length, start = _varint(raw, 0)  # format_version >= 2: the size before the compressed bytes
    return bytes(pa.Codec(codec).decompress(raw[start:], decompressed_size=length, asbytes=True))


def _restarts(block: bytes) -> tuple[int, list[int]]:
    """(where the entries end, the restart offsets)."""
    packed = _U32.unpack_from(block, len(block) - 4)[0]
    if packed >> 31:
        raise SstFormatError("a data block with a hash index")
    n = packed & 0x7FFFFFFF
    end = len(block) - 4 - 4 * n
    if end < 0:
        raise SstFormatError("a block's restart array is larger than the block")
    return end, [_U32.unpack_from(block, end + 4 * i)[0] for i in range(n)]


def _entries(block: bytes) -> list[tuple[bytes, bytes]]:
    """(key, value) of every entry of a block whose entries carry their value length."""
    end, _ = _restarts(block)
    out: list[tuple[bytes, bytes]] = []
    key = b""
    pos = 0
    while pos < end:
        shared, pos = _varint(block, pos)
        unshared, pos = _varint(block, pos)
        length, pos = _varint(block, pos)
        key = key[:shared] + block[pos : pos + unshared]
        pos += unshared
        out.append((key, block[pos : pos + length]))
        pos += length
    if pos != end:
        raise SstFormatError("a block's entries overrun its restart array")
    return out


def _index_handles(block: bytes, delta: bool) -> list[tuple[int, int]]:
    """The (offset, size) of every data block the index lists, in order."""
    if not delta:
        return [_handle(v) for _, v in _entries(block)]
    end, restarts = _restarts(block)
    starts = set(restarts)
    out: list[tuple[int, int]] = []
    pos = 0
    while pos < end:
        full = pos in starts
        _, pos = _varint(block, pos)  # shared
        unshared, pos = _varint(block, pos)
        pos += unshared  # the separator key: not needed
        if full or not out:
            offset, pos = _varint(block, pos)
            size, pos = _varint(block, pos)
        else:  # the size as a signed difference; the block follows the previous one
            zigzag, pos = _varint(block, pos)
            prev_offset, prev_size = out[-1]
            offset, size = prev_offset + prev_size + _TRAILER, prev_size + ((zigzag >> 1) ^ -(zigzag & 1))
        out.append((offset, size))
    return out


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise SstFormatError("a truncated varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
