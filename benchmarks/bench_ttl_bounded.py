"""Bounded state with an event-time TTL: live state bytes and bytes uploaded per checkpoint stay
flat while keys keep arriving, where the same job without a TTL grows linearly (issue 32).

`last_seen` keeps per key (last event time, count, total amount) in a value state. The input is
`--batches` Parquet files of `--keys` distinct keys each: half of them new keys, half repeats of
keys first seen in the `RECENT` batches before (batch 1 is all new); batch i's event times lie in
[i, i + 1) x `BATCH_SECONDS`, so the watermark (allowed lateness 0) advances one batch of event
time per batch and no row is late. Two runs of the real pipeline on local Spark (`local[2]`,
parallelism 2, changelog checkpoints, the defaults), on the same files:

* ttl: `StateTtl(TTL_BATCHES x BATCH_SECONDS, clock="event")`: a key not written for 10 batches
  of event time expires, and the bounded sweep (`sparkpoint.state.kinds.base.SWEEP_LIMIT` entries
  per state, subtask and batch) deletes it;
* no-ttl: the same operator without a TTL;
* ttl/files, no-ttl/files: the same two with changelog checkpoints off (RocksDB files only).

Per checkpoint, from `BatchReport` and the checkpoint's `_metadata`: the bytes a restore reads
(its handles' files: RocksDB SSTs, changelog files, the rest), `state_size` (every file the
checkpoint references: those, plus the staged slices of a materialization in progress), bytes
uploaded (`checkpointed_size`), the state's entries and what the TTL sweep
removed (the subtasks' `facts`; RocksDB's estimate above `EXACT_UP_TO` entries per subtask).
Bytes are exact, timings noisy (2 shared cores); `--repeat N` runs each variant N times
(alternating) and the tables show per-batch medians.

Flat or not (issue 48): the largest referenced state (what a restore reads; and `state_size`, which
adds a materialization's staged slices) from batch 20 on ÷ its mean over the same batches, goal
≤ 1.3 in every mode; and the TTL'd state ÷ the same state without TTL, beside Spark's
`transformWithStateInPandas` with a TTL'd value state, whose state grows to 1.7-2.2x its no-TTL
state (quoted from issue 48, where it was measured with Spark 4.3 on this machine; this benchmark
does not run Spark's).

Run (about 10 minutes with --repeat 2; --quick: 12 batches of 500 keys, a smoke test):

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.bench_ttl_bounded [--repeat 2] [--keys 5000]

Prints a table, writes benchmarks/results/ttl_bounded.json (ttl_bounded_quick.json with --quick).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from sparkpoint import KeyedOperator, Pipeline, StateTtl, StructCodec
from sparkpoint.checkpoint.metadata import state_facts
from sparkpoint.checkpoint.paths import is_changelog_name
from sparkpoint.checkpoint.store import CompletedCheckpointStore

RESULTS = Path(__file__).parent / "results"
BATCH_SECONDS = 60  # event time per batch
TTL_BATCHES = 10
RECENT = 5  # repeats come from keys first seen in the last RECENT batches
START = pd.Timestamp("2026-11-01", tz="UTC")
SHOWN = (1, 10, 20, 40, 60, 80, 100)
PARALLELISM = 2

STEADY_FROM = 20  # batches from which the TTL'd state is in its steady state (2 x TTL_BATCHES)
SPARK_TWS_TTL_OVER_NO_TTL = (1.7, 2.2)  # quoted: issue 48 (Spark 4.3 transformWithStateInPandas, TTL'd value state)

SEEN = StructCodec[tuple[int, int, float]]("<qqd")  # last event time (µs), count, total amount
TTL = StateTtl(TTL_BATCHES * BATCH_SECONDS, clock="event")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- the operator ------------------------------------------------------------------------------


def _update(batch: pd.DataFrame, state: Any, ttl: StateTtl | None) -> None:
    seen = state.value_state("last_seen", SEEN, ttl=ttl)
    at = batch["ts"].astype("datetime64[us, UTC]").astype("int64")
    per_key = batch.assign(at=at).groupby("key", sort=False).agg(at=("at", "max"), n=("at", "size"),
                                                                 amount=("amount", "sum"))
    keys = per_key.index.astype(str).tolist()
    old = seen.get_many(keys)
    new = []
    for key, last, n, amount, before in zip(keys, per_key["at"].tolist(), per_key["n"].tolist(),
                                            per_key["amount"].tolist(), old):
        if before is None:
            new.append((key, (last, n, amount)))
        else:
            new.append((key, (max(last, before[0]), before[1] + n, before[2] + amount)))
    seen.put_many(new)


def update_ttl(batch: pd.DataFrame, state: Any) -> None:
    _update(batch, state, TTL)


def update_no_ttl(batch: pd.DataFrame, state: Any) -> None:
    _update(batch, state, None)


def _export(state: Any, ttl: StateTtl | None) -> pd.DataFrame:
    rows = [(k.decode(), *v) for k, v in state.value_state("last_seen", SEEN, ttl=ttl).items()]
    return pd.DataFrame(rows, columns=["key", "last_at", "count", "amount"])


def export_ttl(state: Any) -> pd.DataFrame:
    return _export(state, TTL)


def export_no_ttl(state: Any) -> pd.DataFrame:
    return _export(state, None)


WITH_TTL = KeyedOperator("last_seen", key="key", columns=("ts", "amount"), process=update_ttl, export=export_ttl)
WITHOUT_TTL = KeyedOperator("last_seen", key="key", columns=("ts", "amount"), process=update_no_ttl,
                            export=export_no_ttl)
# label -> (operator, changelog checkpoints); the default mode is changelog on
VARIANTS: dict[str, tuple[KeyedOperator, bool]] = {
    "ttl": (WITH_TTL, True), "no-ttl": (WITHOUT_TTL, True),
    "ttl/files": (WITH_TTL, False), "no-ttl/files": (WITHOUT_TTL, False),
}


# --- input -------------------------------------------------------------------------------------


def make_inputs(directory: Path, batches: int, keys: int, seed: int) -> list[int]:
    """Batch files with `keys` distinct keys each (half new, half recent repeats); returns the rows per batch."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True)
    first_seen: list[np.ndarray] = []
    next_id, rows = 0, []
    for i in range(batches):
        fresh = keys if i == 0 else keys - keys // 2
        new = np.arange(next_id, next_id + fresh)
        next_id += fresh
        recent = np.concatenate(first_seen[-RECENT:]) if first_seen else np.array([], dtype=np.int64)
        repeats = rng.choice(recent, size=keys - fresh, replace=False) if i else recent
        first_seen.append(new)
        ids = np.concatenate([new, repeats])
        ids = ids[rng.permutation(len(ids))]
        offsets = rng.integers(0, BATCH_SECONDS * 1_000_000, size=len(ids))
        frame = pd.DataFrame({
            "key": pd.array([f"k{j:09d}" for j in ids], dtype="string"),
            "ts": pd.Series(START + pd.to_timedelta(i * BATCH_SECONDS * 1_000_000 + offsets, unit="us")).astype(
                "datetime64[us, UTC]"),
            "amount": np.round(rng.gamma(2.0, 20.0, size=len(ids)), 2),
        })
        frame.to_parquet(directory / f"batch-{i:05d}.parquet", index=False)
        rows.append(len(frame))
    return rows


# --- a run -------------------------------------------------------------------------------------


def live_breakdown(meta: Any) -> dict[str, int]:
    """The files a restore of this checkpoint reads, by kind, their sum, and the staged slices of
    a materialization in progress (kept by the checkpoint, read by no restore) (bytes)."""
    out = {"sst": 0, "changelog": 0, "other": 0, "changelog_files": 0, "staged": 0}
    for handle in meta.subtask_handles():
        out["staged"] += sum(f.size for f in handle.staged)
        for f in handle.files():
            if f.local_name.endswith(".sst"):
                out["sst"] += f.size
            elif is_changelog_name(f.local_name):
                out["changelog"] += f.size
                out["changelog_files"] += 1
            else:
                out["other"] += f.size
    out["restore"] = out["sst"] + out["changelog"] + out["other"]
    return out


def run_variant(spark: Any, variant: str, inputs: Path, run_dir: Path) -> list[dict[str, Any]]:
    from sparkpoint.pipeline.driver import StatefulPipeline

    operator, changelog = VARIANTS[variant]
    spec = Pipeline(f"ttl-{variant.replace('/', '-')}", [operator], input_url=f"file://{inputs}",
                    checkpoints_url=f"file://{run_dir / 'ckpt'}", local_dir=str(run_dir / "local"),
                    parallelism=PARALLELISM, event_time="ts", allowed_lateness=0, changelog=changelog)
    pipeline = StatefulPipeline(spark, spec.config(), spec.operators)
    store = CompletedCheckpointStore(pipeline.storage)
    out = []
    started = time.perf_counter()
    for index, report in enumerate(pipeline.batches()):
        wall = time.perf_counter() - started
        meta = store.load(report.checkpoint_id)
        facts = state_facts(meta.operators["last_seen"].subtasks)
        state = facts.get("states", {}).get("last_seen", {})
        out.append({
            "batch": index + 1, "rows": report.rows, "wall_s": round(wall, 3),
            "state_size": report.state_size, "checkpointed_size": report.checkpointed_size,
            "live": live_breakdown(meta), "entries": state.get("entries"),
            "expired_removed": facts.get("expired_removed", 0), "watermark": report.watermark,
            "files_new": report.files_new, "files_deleted": report.files_deleted,
        })
        b = out[-1]
        if b["batch"] in SHOWN or b["batch"] % 10 == 0:
            log(f"  {variant} #{b['batch']}: state {b['state_size'] / 1e6:.2f} MB "
                f"(staged {b['live']['staged'] / 1e6:.2f}, sst {b['live']['sst'] / 1e6:.2f}, "
                f"changelog {b['live']['changelog'] / 1e6:.2f} in {b['live']['changelog_files']} files), uploaded "
                f"{b['checkpointed_size'] / 1e3:.0f} kB, entries {b['entries']}, expired {b['expired_removed']}, "
                f"{wall:.2f} s")
        started = time.perf_counter()
    return out


def median_runs(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per batch, the median over runs of each figure."""
    out = []
    for rows in zip(*runs):
        out.append({
            "batch": rows[0]["batch"],
            **{k: statistics.median(r[k] for r in rows)
               for k in ("state_size", "checkpointed_size", "entries", "expired_removed", "wall_s")},
            **{f"live_{k}": statistics.median(r["live"][k] for r in rows) for k in rows[0]["live"]},
        })
    return out


def summary(batches: list[dict[str, Any]]) -> dict[str, Any]:
    by = {b["batch"]: b for b in batches}
    n = len(batches)
    ref = min(STEADY_FROM, n)
    tail = [b for b in batches if b["batch"] >= ref]
    restore = [b["live"]["restore"] for b in tail]
    sizes = [b["state_size"] for b in tail]
    return {
        "batches": n,
        "restore_max_over_steady_mean": max(restore) / statistics.fmean(restore),
        "state_size_max_over_steady_mean": max(sizes) / statistics.fmean(sizes),
        "restore_steady_mean": statistics.fmean(restore),
        "live_last_over_batch20": by[n]["state_size"] / by[ref]["state_size"],
        "restore_last_over_batch20": by[n]["live"]["restore"] / by[ref]["live"]["restore"],
        "restore_max_over_batch20": max(b["live"]["restore"] for b in tail) / by[ref]["live"]["restore"],
        "restore_min_over_batch20": min(b["live"]["restore"] for b in tail) / by[ref]["live"]["restore"],
        "uploaded_last_over_batch20": by[n]["checkpointed_size"] / by[ref]["checkpointed_size"],
        "live_max_over_batch20": max(b["state_size"] for b in tail) / by[ref]["state_size"],
        "uploaded_mean_from_20": statistics.fmean(b["checkpointed_size"] for b in tail),
        "uploaded_max_from_20": max(b["checkpointed_size"] for b in tail),
        "entries_last": by[n]["entries"],
        "wall_s_median": statistics.median(b["wall_s"] for b in batches[1:]) if n > 1 else batches[0]["wall_s"],
    }


# --- report ------------------------------------------------------------------------------------


def table(title: str, header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join([title, fmt.format(*header), "  ".join("-" * w for w in widths),
                      *(fmt.format(*r) for r in rows), ""])


def kb(n: float) -> str:
    return f"{n / 1000:,.0f}"


def report(results: dict[str, Any]) -> str:
    med = results["median"]
    n = results["config"]["batches"]
    shown = [b for b in SHOWN if b <= n] + ([n] if n not in SHOWN else [])
    out = []
    for mode, suffix in (("changelog checkpoints (the default)", ""), ("RocksDB files only", "/files")):
        rows = []
        for b in shown:
            t, f = med["ttl" + suffix][b - 1], med["no-ttl" + suffix][b - 1]
            rows.append([str(b), kb(t["live_restore"]), kb(t["state_size"]), kb(t["checkpointed_size"]),
                         f"{t['entries']:,.0f}", f"{t['expired_removed']:,.0f}", kb(f["live_restore"]),
                         kb(f["state_size"]), kb(f["checkpointed_size"]), f"{f['entries']:,.0f}"])
        out.append(table(f"{mode}: per checkpoint, medians of {results['config']['repeat']} run(s) (kB; entries "
                         "from the checkpoint's facts)",
                         ["batch", "ttl restore", "ttl state_size", "ttl uploaded", "ttl entries", "ttl expired",
                          "no-ttl restore", "no-ttl state_size", "no-ttl uploaded", "no-ttl entries"], rows))
    for variant in ("ttl", "ttl/files"):
        rows = []
        for b in shown:
            t = med[variant][b - 1]
            rows.append([str(b), kb(t["live_sst"]), kb(t["live_changelog"]), f"{t['live_changelog_files']:.0f}",
                         kb(t["live_other"]), kb(t["live_staged"])])
        out.append(table(f"{variant}: what the checkpoint's bytes are (kB)",
                         ["batch", "SSTs", "changelogs", "changelog files", "other", "staged slices"], rows))
    rows = []
    for variant, runs in results["runs"].items():
        for k, run in enumerate(runs):
            s = summary(run)
            rows.append([variant, str(k + 1), f"{s['restore_last_over_batch20']:.2f}",
                         f"{s['restore_min_over_batch20']:.2f}-{s['restore_max_over_batch20']:.2f}",
                         f"{s['live_last_over_batch20']:.2f}", f"{s['uploaded_last_over_batch20']:.2f}",
                         kb(s["uploaded_mean_from_20"]), kb(s["uploaded_max_from_20"]), f"{s['wall_s_median']:.2f}"])
    out.append(table(f"Batch {n} ÷ batch 20 per run (goal for ttl: ≤ 1.2)",
                     ["variant", "run", "restore last/20", "restore min-max/20 (20+)", "state_size last/20",
                      "uploaded last/20", "uploaded mean kB (20+)",
                      "uploaded max kB (20+)", "batch s (median)"], rows))
    flat = []
    for variant, runs in results["runs"].items():
        for k, run in enumerate(runs):
            s = summary(run)
            flat.append([variant, str(k + 1), kb(s["restore_steady_mean"]), f"{s['restore_max_over_steady_mean']:.2f}",
                         f"{s['state_size_max_over_steady_mean']:.2f}"])
    out.append(table(f"Flat? From batch {min(STEADY_FROM, n)} on: the largest ÷ the mean (goal for ttl, every mode: "
                     "≤ 1.3)", ["variant", "run", "restore mean kB", "restore max ÷ mean", "state_size max ÷ mean"],
                     flat))
    ratios = []
    for mode, suffix in (("changelog (default)", ""), ("files only", "/files")):
        for b in sorted({min(30, n), n}):
            t, f = med["ttl" + suffix][b - 1], med["no-ttl" + suffix][b - 1]
            ratios.append([mode, str(b), f"{t['live_restore'] / f['live_restore']:.2f}",
                         f"{t['entries'] / f['entries']:.2f}" if f["entries"] else "-"])
    lo, hi = SPARK_TWS_TTL_OVER_NO_TTL
    ratios.append(["Spark TWS (quoted, issue 48)", "-", f"{lo:.1f}-{hi:.1f}", "-"])
    out.append(table("TTL'd state ÷ the same state without TTL (restore bytes; entries)",
                     ["system", "batch", "ttl ÷ no-ttl bytes", "ttl ÷ no-ttl entries"], ratios))
    return "\n".join(out)


# --- main --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, default=100)
    p.add_argument("--keys", type=int, default=5000, help="distinct keys per batch (default 5000)")
    p.add_argument("--repeat", type=int, default=2, help="runs of each variant, alternating (default 2)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="smoke test: 12 batches of 500 keys, one run each")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.keys, args.repeat = 12, 500, 1
    if args.batches < 2 or args.keys < 2 or args.repeat < 1:
        p.error("--batches and --keys must be at least 2, --repeat at least 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from sparkpoint.spark.session import spark_session

    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="sparkpoint-ttl-"))
    runs: dict[str, list[list[dict[str, Any]]]] = {v: [] for v in VARIANTS}
    spark = spark_session("local[2]", app_name="bench_ttl_bounded")
    try:
        inputs = work / "in"
        rows = make_inputs(inputs, args.batches, args.keys, args.seed)
        log(f"{args.batches} batches of {args.keys:,} keys in {inputs}")
        for k in range(args.repeat):
            order = list(VARIANTS) if k % 2 == 0 else list(reversed(VARIANTS))
            for variant in order:
                log(f"run {k + 1}: {variant}")
                runs[variant].append(run_variant(spark, variant, inputs, work / f"{variant.replace('/', '-')}-{k}"))
    finally:
        spark.stop()
        shutil.rmtree(work, ignore_errors=True)
    import pyspark
    import rocksdict

    results = {
        "config": {"batches": args.batches, "keys_per_batch": args.keys, "repeat": args.repeat,
                   "batch_seconds": BATCH_SECONDS, "ttl_seconds": TTL.seconds, "recent_batches": RECENT,
                   "parallelism": PARALLELISM, "master": "local[2]", "seed": args.seed, "rows": rows,
                   "quick": args.quick},
        "definitions": {
            "state_size": "BatchReport.state_size: bytes of the files a restore of the checkpoint reads",
            "checkpointed_size": "BatchReport.checkpointed_size: bytes the checkpoint uploaded",
            "entries": "entries of state last_seen over the subtasks, from _metadata facts (RocksDB's estimate "
                       "above 100,000 per subtask)",
            "expired_removed": "entries the TTL sweep deleted in that batch",
            "median": "per batch, the median over the runs",
        },
        "runs": runs,
        "median": {v: median_runs(r) for v, r in runs.items()},
        "summary": {v: [summary(run) for run in r] for v, r in runs.items()},
        "spark_tws_ttl_over_no_ttl_quoted": {"range": list(SPARK_TWS_TTL_OVER_NO_TTL), "source": "issue 48: Spark "
                                             "4.3 transformWithStateInPandas, TTL'd value state, measured on this "
                                             "machine; not run by this benchmark"},
        "runtime_s": time.perf_counter() - started,
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "pyspark": pyspark.__version__,
                    "rocksdict": getattr(rocksdict, "__version__", "unknown")},
    }
    print(report(results))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / ("ttl_bounded_quick.json" if args.quick else "ttl_bounded.json")
    path.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {path} ({results['runtime_s']:.0f} s)")


if __name__ == "__main__":
    # Under its module name, so that Spark's workers import the operator's functions from it
    # (a function of `__main__` cannot be shipped).
    from benchmarks.bench_ttl_bounded import main as _main

    _main()
