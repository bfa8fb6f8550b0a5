"""Opening RocksDB instances through rocksdict: raw mode, tuned for incremental checkpoints.

Compaction decides how incremental a checkpoint is: every SST a compaction writes is a new file
to upload. The default here is the setting measured best in FIELD-NOTES.md (universal
compaction, L0 trigger 8, a 10-bit bloom filter, no TTL or periodic rewrite); `leveled` is
RocksDB's own default, kept for comparison.

Blocks are compressed with zstd (RocksDB's default is Snappy, Spark's LZ4): on `user_totals`'
500k entries an SST takes 22% fewer bytes (10.0 against 12.8 MB written whole), and those bytes
are what every upload, task-local copy and restore moves. The block cache holds blocks
uncompressed, so a read that hits it pays nothing for it. With changelog checkpoints the working
database is also kept nearly compact (`size_amplification_percent`, set by the backend): its SSTs
are then a fair measure of what the state takes, against which the changelog chain is weighed
(`sparkpoint.state.engine.changelog.ChangelogOptions`).

Index and filter blocks live in the block cache, as in Flink's default
(`state.backend.rocksdb.memory.managed`), those of level-0 files pinned, instead of each open
loading every SST's whole index and filter into memory. An open then reads none of them, and what
they hold in memory is capped by the cache. Measured on a 1.5 GB state: the open takes 7 ms instead
of 26, and with its first 1,000 random reads 23 ms instead of 33.

Memory is the process's, as Flink's managed memory is the slot's: every database a process opens
(the working one, a staging snapshot, the databases a rescaling restore reads from) and every
column family in them share one block cache of `block_cache_mb` and one write buffer manager
that holds the memtables being written together to two write buffers (switched memtables wait
for their flush on top of that, without stalling writes). A task's RocksDB memory is then bounded
by those figures, whatever the state's size, its number of states, or how many databases a
restore opens. Whole-state scans (staging slices, a rescaling restore, counting) bypass the cache
(`scan_options`): they read every block once, and would only evict what the task's reads need.

The cache outlives a database: a Spark worker that ran subtask s before holds its blocks when it
runs subtask s again, and the reopened database is answered from them (RocksDB keys a cached block
by its SST's unique id, which the MANIFEST vouches for at the open, and the block's offset). A
cached block passed its checksum when it was read, so it is the content the checkpoint recorded;
an SST damaged on disk since is caught at the first read that misses the cache, by this worker or
any other, and that task runs again from stable storage. Emptying the cache at each restore, as
was done before, only moved that moment earlier, and made every batch read its blocks from disk again
(benchmarks/README.md, "Throughput at 10% churn").

Files are cut at about one key group's bytes of each state (`file_bytes_for`): keys are prefixed by
their key group, so a compacted state is then a run of files each holding a key group or two, and
the files that can hold one key are about 1/max_parallelism of the state whatever the parallelism.
That is what erasing a key reads and rewrites (`sparkpoint.state.erasure`). Not below
`min_file_mb` (a small state stays one file), not above RocksDB's own 64 MB.

A database whose SSTs are partly *placeholders* (sparse files of the recorded size, never to be
read: `placeholders=True`, `sparkpoint.state.engine.partial`) is opened so that RocksDB reads an
SST only when a read or a compaction needs it: no paranoid checks and no statistics read at the
open, a table cache of a few files, no automatic compaction, and manual compaction level by level
(leveled, without dynamic level sizes), which rewrites only the files overlapping its range.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sparkpoint.checkpoint.errors import StateBackendError
from sparkpoint.lazy import lazy_module

if TYPE_CHECKING:
    import rocksdict
    from rocksdict import Cache, Options, Rdict, ReadOptions, WriteBufferManager
else:
    rocksdict = lazy_module("rocksdict")

DEFAULT_CF = "default"
COMPACTION_STYLES = ("universal", "leveled")
COMPRESSIONS = ("zstd", "lz4", "snappy", "none")  # each a constructor of rocksdict's DBCompressionType
MAX_BLOCK_CACHE_MB = 1 << 20
# A materialization's SSTs (the slices of one in steps) hold every entry of the state, are written
# once and read by every restore after: 16 KB blocks instead of RocksDB's 4 KB and zstd level 6
# instead of 3 make them 18% smaller, measured on `user_totals`' 125k entries of a subtask (3.26
# against 2.65 MB; 16 KB at level 3: 2.92). A read that misses the block cache then decompresses
# 16 KB instead of 4 (the working database's own files keep 4 KB blocks).
MATERIALIZED_BLOCK_BYTES = 16 << 10
MATERIALIZED_ZSTD_LEVEL = 6


@dataclass(frozen=True)
class RocksDBOptions:
    compaction: str = "universal"
    level0_trigger: int = 8
    bloom_bits: int = 10
    write_buffer_mb: int = 64
    background_jobs: int = 2
    # The process's block cache, shared by every database it opens; index and filter blocks are
    # kept in it (False: each open loads them whole into memory, RocksDB's default).
    block_cache_mb: int = 256
    cache_index_and_filter_blocks: bool = True
    compression: str = "zstd"  # of every block written: one of COMPRESSIONS
    # Universal compaction rewrites everything once the newer sorted runs exceed this percentage
    # of the oldest (RocksDB's default 200: the database may hold 3x what it would compacted).
    size_amplification_percent: int = 200
    # SST files are cut at about a key group's bytes of each state, not below this (module text).
    min_file_mb: float = 1.0
    # Some SSTs are placeholders, never to be read (module text): what an erase opens.
    placeholders: bool = False

    def __post_init__(self) -> None:
        if self.compaction not in COMPACTION_STYLES:
            raise ValueError(f"compaction must be one of {COMPACTION_STYLES}, got {self.compaction!r}")
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {', '.join(COMPRESSIONS)}, got {self.compression!r}")
        if self.size_amplification_percent < 1:
            raise ValueError(f"size_amplification_percent must be at least 1, got {self.size_amplification_percent}")
        if not 0 < self.min_file_mb <= MAX_FILE_BYTES / (1 << 20):
            raise ValueError(f"min_file_mb must be above 0 and at most {MAX_FILE_BYTES >> 20}, got {self.min_file_mb}")
        if not 1 <= self.block_cache_mb <= MAX_BLOCK_CACHE_MB:  # above: an overflow inside the Spark task
            raise ValueError(
                f"block_cache_mb must be between 1 and {MAX_BLOCK_CACHE_MB} (1 TB), got {self.block_cache_mb}"
            )

    def build(self, *, create: bool, materialized: bool = False) -> Options:
        """RocksDB options, with the process's shared block cache and write buffer manager.

        `materialized`: for the SSTs of a materialization (`SstFileWriter`), written once and read
        by every restore of the checkpoints that list them: larger blocks, compressed harder
        (`MATERIALIZED_BLOCK_BYTES`, `MATERIALIZED_ZSTD_LEVEL`)."""
        cache, buffers = process_memory(self)
        opts = rocksdict.Options(raw_mode=True)
        opts.create_if_missing(create)
        opts.create_missing_column_families(create)
        if self.compaction == "universal":
            opts.set_compaction_style(rocksdict.DBCompactionStyle.universal())
            opts.set_level_zero_file_num_compaction_trigger(self.level0_trigger)
            opts.set_level_zero_slowdown_writes_trigger(max(40, self.level0_trigger * 4))
            opts.set_level_zero_stop_writes_trigger(max(60, self.level0_trigger * 6))
            universal = rocksdict.UniversalCompactOptions()
            universal.max_size_amplification_percent = self.size_amplification_percent
            opts.set_universal_compaction_options(universal)
        opts.set_compression_type(getattr(rocksdict.DBCompressionType, self.compression)())
        table = rocksdict.BlockBasedOptions()
        if materialized:
            table.set_block_size(MATERIALIZED_BLOCK_BYTES)
            if self.compression == "zstd":
                opts.set_compression_options(-14, MATERIALIZED_ZSTD_LEVEL, 0, 0)  # window bits: zstd's default
        if self.bloom_bits > 0:
            table.set_bloom_filter(self.bloom_bits, False)
        table.set_block_cache(cache)
        if self.placeholders:  # a file is cut after a whole block: the erase cuts its level-1 files fine
            table.set_block_size(PLACEHOLDER_BLOCK_BYTES)
        if self.cache_index_and_filter_blocks:
            table.set_cache_index_and_filter_blocks(True)
            table.set_pin_l0_filter_and_index_blocks_in_cache(True)
        opts.set_block_based_table_factory(table)
        opts.set_write_buffer_size(self.write_buffer_mb * 1024 * 1024)
        opts.set_write_buffer_manager(buffers)
        opts.set_max_background_jobs(self.background_jobs)
        opts.set_keep_log_file_num(2)
        if self.placeholders:
            opts.set_compaction_style(rocksdict.DBCompactionStyle.level())
            opts.set_level_compaction_dynamic_level_bytes(False)
            opts.set_disable_auto_compactions(True)
            opts.set_paranoid_checks(False)
            opts.set_skip_stats_update_on_db_open(True)
            opts.set_max_open_files(PLACEHOLDER_OPEN_FILES)
        return opts

    @property
    def min_file_bytes(self) -> int:
        return int(self.min_file_mb * (1 << 20))


MAX_FILE_BYTES = 64 << 20  # RocksDB's own target file size
PLACEHOLDER_BLOCK_BYTES = 1024
PLACEHOLDER_OPEN_FILES = 20  # RocksDB's least: a table cache of 10 files, 2 loaded at the open
LIVE_SST_BYTES = "rocksdb.live-sst-files-size"


def file_bytes_for(live_bytes: int, key_groups: int, options: RocksDBOptions) -> int:
    """The target size of a state's SST files: about one key group's bytes of it (module text)."""
    return max(options.min_file_bytes, min(MAX_FILE_BYTES, live_bytes // max(1, key_groups)))


_caches: dict[int, Cache] = {}
_buffers: dict[int, WriteBufferManager] = {}
_memory_lock = threading.Lock()


def _forget_parents_memory() -> None:
    """In a forked child (Spark's Python daemon forks its workers): the parent's cache and lock
    are not this process's to share, so it makes its own at its first open."""
    global _memory_lock
    _caches.clear()
    _buffers.clear()
    _memory_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_parents_memory)


def process_memory(options: RocksDBOptions) -> tuple[Cache, WriteBufferManager]:
    """This process's block cache of `block_cache_mb` and its write buffer manager (two write
    buffers for all memtables together), made at the first open that asks for them."""
    with _memory_lock:
        cache = _caches.get(options.block_cache_mb)
        if cache is None:
            cache = _caches[options.block_cache_mb] = rocksdict.Cache(options.block_cache_mb << 20)
        buffers = _buffers.get(options.write_buffer_mb)
        if buffers is None:
            buffers = _buffers[options.write_buffer_mb] = rocksdict.WriteBufferManager(
                2 * options.write_buffer_mb << 20, False)
        return cache, buffers


def drop_cached_blocks() -> None:
    """Empty this process's block caches of every block no open iterator or pinned level-0 file
    holds, so that the next reads go to disk as in a worker that never read these files. A restore
    does not need it (the module's docstring says why); a measure of what damage RocksDB's checks
    catch does, when it opens copies of one file in one process (`benchmarks/bench_damage.py`)."""
    with _memory_lock:
        for megabytes, cache in _caches.items():
            cache.set_capacity(0)
            cache.set_capacity(megabytes << 20)


def scan_options(upper: bytes | None = None) -> ReadOptions:
    """Read options for a scan of a whole state or key-group range: its blocks stay out of the
    block cache (RocksDB's advice for bulk scans), and the scan ends before `upper`.

    Keep the returned options referenced for as long as the iterator lives: the iterator reads
    the bound from them, and a bound freed under it stops bounding (a rescaling restore would
    then copy key groups that are not its own)."""
    opts = rocksdict.ReadOptions()
    opts.fill_cache(False)  # type: ignore[call-arg]  # a method taking the flag; the stubs say otherwise
    if upper is not None:
        opts.set_iterate_upper_bound(upper)
    return opts


def open_db(
    path: str,
    column_families: Iterable[str],
    options: RocksDBOptions,
    *,
    create: bool,
    read_only: bool = False,
    key_groups: int = 1,
) -> Rdict:
    """Open (or with `create`, create) the database at `path` with these column families.

    Never opens an empty database by accident: without `create`, a missing CURRENT is an error.
    Writes skip the WAL: the checkpoint is the durability, and a process that dies mid-batch
    is rolled back to the last completed checkpoint anyway. Each state's files are cut at about
    one of its `key_groups` key groups' bytes as they are now (`file_bytes_for`).
    """
    names = set(column_families) - {DEFAULT_CF}
    if not create:
        if not os.path.isfile(os.path.join(path, "CURRENT")):
            raise StateBackendError(f"{path} holds no RocksDB database (no CURRENT file)")
        try:
            names |= set(rocksdict.Rdict.list_cf(path, rocksdict.Options(raw_mode=True))) - {DEFAULT_CF}
        except Exception as e:  # its MANIFEST unreadable, or the open-file limit: said as the open says it
            raise StateBackendError(f"RocksDB cannot list the column families of {path}: {e}") from e
    cf_options = {name: options.build(create=create) for name in sorted(names)}
    try:
        db = rocksdict.Rdict(
            path,
            options=options.build(create=create),
            column_families=cf_options,
            access_type=rocksdict.AccessType.read_only() if read_only else rocksdict.AccessType.read_write(),
        )
    except Exception as e:  # rocksdict raises bare Exception with RocksDB's status text
        raise StateBackendError(f"RocksDB cannot open {path}: {e}") from e
    if not read_only:
        for name in sorted(names):
            # Universal compaction would otherwise rewrite every file once a month. Not on the
            # default column family: no state lives there, and each call rewrites the OPTIONS
            # file (~4 ms, paid on every open).
            cf = db.get_column_family(name)
            live = 0 if options.placeholders else int(cf.property_int_value(LIVE_SST_BYTES) or 0)
            cf.set_options({"ttl": "0", "periodic_compaction_seconds": "0",
                            "target_file_size_base": str(file_bytes_for(live, key_groups, options))})
            del cf
        write = rocksdict.WriteOptions()
        write.disable_wal = True  # type: ignore[method-assign, assignment]  # a property; the stubs say method
        db.set_write_options(write)
    return db


def is_corruption(error: BaseException) -> bool:
    """Whether `error`, or one it was raised from, is RocksDB reporting corrupt data (a block
    whose checksum does not match, an SST that is not the one the MANIFEST names). rocksdict
    raises such errors as a bare Exception carrying RocksDB's status text."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if type(current) is Exception and str(current).startswith("Corruption:"):
            return True
        current = current.__cause__ or current.__context__
    return False


def ensure_column_families(db: Rdict, path: str, names: Iterable[str], options: RocksDBOptions) -> None:
    """Create the named column families that the database lacks."""
    existing = set(rocksdict.Rdict.list_cf(path, rocksdict.Options(raw_mode=True)))
    for name in sorted(set(names) - existing - {DEFAULT_CF}):
        db.create_column_family(name, options.build(create=True))


def _every_cf(db: Rdict, column_families: Iterable[str]) -> list[Rdict]:
    names = sorted(set(column_families) - {DEFAULT_CF})
    return [db, *(db.get_column_family(name) for name in names)]


def flush_all(db: Rdict, column_families: Iterable[str]) -> None:
    """Flush every memtable to SSTs (releases the GIL while RocksDB works)."""
    for cf in _every_cf(db, column_families):
        cf.flush(True)


def compact_all(db: Rdict, column_families: Iterable[str]) -> None:
    """Full manual compaction of every column family (tests and benchmarks force it with this)."""
    for cf in _every_cf(db, column_families):
        cf.compact_range(None, None)


SIDECAR_PREFIX = b"\xff\xff"  # keys beyond every key group (at most 2**15): a state's own records


def count_keys(cf: Rdict) -> int:
    """The entries of a column family, its sidecar keys (a state's declaration, TTL format, sweep
    position: after every key group) left out. The iterator's status is asked at the end: at a
    bad block a plain `keys()` just stops, and the count would come out short without a word."""
    it = cf.iter(scan_options())
    try:
        it.seek_to_first()
        n = 0
        while it.valid():
            n += it.key()[:2] != SIDECAR_PREFIX
            it.next()
        it.status()
    finally:
        del it  # a live iterator holds the database open, even from a traceback
    return n


_RAW_SIZES = re.compile(r"raw (?:key|value) size=(\d+)")
_ENTRIES = re.compile(r"# entries=(\d+)")
_INTERNAL_KEY_SUFFIX = 8  # RocksDB's sequence number and type, counted in its raw key size


def raw_bytes(db: Rdict, column_families: Iterable[str]) -> int:
    """The bytes of the keys and values in the SSTs of `column_families`, uncompressed (RocksDB's
    table properties, summed over every file, without its own 8 bytes per key: what compression
    made of them is the files' size)."""
    total = 0
    for cf in _every_cf(db, column_families):
        properties = cf.property_value("rocksdb.aggregated-table-properties") or ""
        entries = _ENTRIES.search(properties)
        total += sum(int(n) for n in _RAW_SIZES.findall(properties))
        total -= _INTERNAL_KEY_SUFFIX * int(entries.group(1)) if entries else 0
    return total


def list_states(path: str) -> list[str]:
    """Names of the column families of the database at `path`, without `default`."""
    return sorted(set(rocksdict.Rdict.list_cf(path, rocksdict.Options(raw_mode=True))) - {DEFAULT_CF})


EXACT_UP_TO = 100_000  # entries counted one by one; above, RocksDB's estimate


def entry_count(cf: Rdict, *, exact_up_to: int = EXACT_UP_TO, sidecars: int | None = None) -> int:
    """A state's entries (its sidecar keys left out): counted when RocksDB estimates at most
    `exact_up_to`, else the estimate (`rocksdb.estimate-num-keys`, exact without overwrites)."""
    estimate = int(cf.property_int_value("rocksdb.estimate-num-keys") or 0)
    if estimate > exact_up_to:
        return estimate
    n, it = 0, cf.iter(scan_options())
    try:
        it.seek_to_first()
        while it.valid() and it.key()[:2] != SIDECAR_PREFIX:
            n += 1
            it.next()
        it.status()
    finally:
        del it
    return n
