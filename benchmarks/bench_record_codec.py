"""RecordCodec against StructCodec: reads and writes per second, vectorized, on real RocksDB.

The same records (`clicks` int64, `spend` float64, `avg` float64) go through both codecs' columnar
paths: StructCodec's `encode_many` / `decode_many` over NumPy records and RecordCodec's
`encode_table` / `decode_table` over Arrow tables, alone (codec only) and through a value state
(`put_many_table` / `get_many_table` against the two halves of `update_many_encoded` with the
struct codec: one multi-get, one WriteBatch each). A RecordCodec with a string field and one with nulls show what
they cost. Last, the schema migration a restore runs when fields changed (entries rewritten per
second, TTL stamps kept).

Run: .venv/bin/python -m benchmarks.bench_record_codec [--keys 200000] [--repeat 3]
Prints a table, writes benchmarks/results/record_codec.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.state.backend import RocksDBStateBackend
from sparkpoint.state.codecs import StructCodec
from sparkpoint.state.migration import migrate_records
from sparkpoint.state.record import RecordCodec

STRUCT = StructCodec[Any]("<qdd")
RECORD = RecordCodec({"clicks": "int64", "spend": "float64", "avg": "float64"})
WITH_TEXT = RecordCodec({"clicks": "int64", "spend": "float64", "avg": "float64", "tier": "string"})
WIDER = RecordCodec({"avg": "float64", "spend": "float64", "clicks": "int64", "tier": "string"},
                    defaults={"tier": "free"})


def best(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/record_codec.json")
    args = parser.parse_args()
    n = args.keys
    rng = np.random.default_rng(7)
    keys = [f"user-{i:08d}" for i in range(n)]
    records = np.zeros(n, dtype=STRUCT.dtype)
    records["f0"], records["f1"], records["f2"] = rng.integers(0, 1000, n), rng.random(n), rng.random(n)
    table = pa.table({"clicks": records["f0"], "spend": records["f1"], "avg": records["f2"]})
    text = table.append_column("tier", pa.array(rng.choice(["free", "silver", "gold"], n)))
    nulls = pa.table({"clicks": pa.array(records["f0"], mask=rng.random(n) < 0.2), "spend": records["f1"],
                      "avg": records["f2"]})
    rows: list[dict[str, Any]] = []

    def row(what: str, codec: str, seconds: float) -> None:
        rows.append({"what": what, "codec": codec, "records": n, "seconds": round(seconds, 4),
                     "per_second": round(n / seconds)})

    encoded_struct = STRUCT.encode_many(records)
    encoded_record = RECORD.encode_table(table)
    encoded_text = WITH_TEXT.encode_table(text)
    encoded_nulls = RECORD.encode_table(nulls)
    row("encode (codec only)", "StructCodec", best(lambda: STRUCT.encode_many(records), args.repeat))
    row("encode (codec only)", "RecordCodec", best(lambda: RECORD.encode_table(table), args.repeat))
    row("encode (codec only)", "RecordCodec + string", best(lambda: WITH_TEXT.encode_table(text), args.repeat))
    row("encode (codec only)", "RecordCodec, 20% nulls", best(lambda: RECORD.encode_table(nulls), args.repeat))
    row("decode (codec only)", "StructCodec", best(lambda: STRUCT.decode_many(encoded_struct), args.repeat))
    row("decode (codec only)", "RecordCodec", best(lambda: RECORD.decode_table(encoded_record), args.repeat))
    row("decode (codec only)", "RecordCodec + string", best(lambda: WITH_TEXT.decode_table(encoded_text),
                                                            args.repeat))
    row("decode (codec only)", "RecordCodec, 20% nulls", best(lambda: RECORD.decode_table(encoded_nulls),
                                                              args.repeat))

    with tempfile.TemporaryDirectory() as tmp:
        storage = CheckpointStorage(f"file://{tmp}/ckpt", "bench")
        with RocksDBStateBackend(storage, "bench", 0, parallelism=1, local_dir=f"{tmp}/local") as b:
            b.restore(None)
            s, r, t = b.value_state("s", STRUCT), b.value_state("r", RECORD), b.value_state("t", WITH_TEXT)
            # StructCodec's columnar paths through the state: what `update_many_encoded` does, read
            # and write apart (a multi-get and decode_many; encode_many and one WriteBatch).
            row("write (state)", "StructCodec",
                best(lambda: s._write(zip(s._prefixed_many(keys), STRUCT.encode_many(records))), args.repeat))
            row("write (state)", "RecordCodec", best(lambda: r.put_many_table(keys, table), args.repeat))
            row("write (state)", "RecordCodec + string", best(lambda: t.put_many_table(keys, text), args.repeat))
            row("read (state)", "StructCodec",
                best(lambda: STRUCT.decode_many(s._read(s._prefixed_many(keys))), args.repeat))
            row("read (state)", "RecordCodec", best(lambda: r.get_many_table(keys), args.repeat))
            row("read (state)", "RecordCodec + string", best(lambda: t.get_many_table(keys), args.repeat))
            started = time.perf_counter()
            migrated = migrate_records(b, "t", WITH_TEXT, WIDER)
            row("migrate at restore (reordered, widened)", "RecordCodec", time.perf_counter() - started)
            assert migrated == n

    width = max(len(r["what"]) for r in rows)
    print(f"{'operation':<{width}}  {'codec':<24} {'records/s':>12}")
    for r in rows:
        print(f"{r['what']:<{width}}  {r['codec']:<24} {r['per_second']:>12,}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"keys": n, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
