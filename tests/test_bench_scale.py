"""The verified copy (one pass: copy, size, CRC32), the quick path check, and smoke runs of the
scale benchmarks (`--quick`: their JSON holds sane figures; timings are never asserted)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from sparkpoint.checkpoint.paths import is_plain_relative, validate_relative, validate_relative_slowly
from sparkpoint.checkpoint.storage import CheckpointStorage, copy_with_crc32, crc32, crc32_of_file, size_and_crc32

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("size", [0, 1, 5000, 4 * 1024 * 1024, 4 * 1024 * 1024 + 7, 9 * 1024 * 1024 + 3])
def test_one_pass_copy_gives_zlib_crc32_and_size_of_the_bytes_written(tmp_path: Path, size: int):
    data = random.Random(size).randbytes(size)
    source = tmp_path / "source"
    source.write_bytes(data)
    expected = (size, zlib.crc32(data))
    assert size_and_crc32(str(source)) == expected
    assert crc32_of_file(str(source)) == expected[1]
    assert copy_with_crc32(str(source), str(tmp_path / "copy"), fsync=True) == expected
    assert (tmp_path / "copy").read_bytes() == data
    assert crc32(data[size // 2 :], crc32(data[: size // 2])) == expected[1], "continues like zlib.crc32"


def test_download_returns_size_and_crc32_of_every_copy(any_storage: CheckpointStorage, tmp_path: Path):
    sources = []
    for i, size in enumerate([0, 10, 300_000, 5 * 1024 * 1024]):
        p = tmp_path / "up" / f"{i:06d}.sst"
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(os.urandom(size))
        sources.append(p)
    handles = any_storage.upload([(str(p), f"shared/op/0/{p.name}") for p in sources], checkpoint_id=2)
    written = any_storage.download([(h.path, str(tmp_path / "down" / h.local_name)) for h in handles])
    assert written == [(h.size, h.crc32) for h in handles]
    assert [(h.size, h.crc32) for h in handles] == [(len(d), zlib.crc32(d)) for d in (p.read_bytes() for p in sources)]
    for p in sources:
        assert (tmp_path / "down" / p.name).read_bytes() == p.read_bytes()
    with pytest.raises(FileNotFoundError):
        any_storage.download([("shared/op/0/gone.sst", str(tmp_path / "down" / "gone.sst"))])


@pytest.mark.parametrize(
    "path",
    ["shared/op/0/0a1b.sst", "chk-7/op/3/abc/MANIFEST-000005", "_pending/x.json", "a", "a/b_c.d-e", "-x/y",
     ".hidden/x", "a..b/c", "x" * 255, "x" * 256, "a/" * 500 + "b", "a//b", "a/./b", "a/../b", "../a", "/a",
     "a/", "", "C:/x", "s3://b/k", "a\\b", "a\x00b", "a\nb", "ü/x", "a b/c", "a:b", "~x", "chk-1/.", "\ud800",
     "a\n", "chk-1/x\n"],
)
def test_quick_path_check_accepts_and_refuses_exactly_what_the_full_checks_do(path: str):
    try:
        expected: str | None = validate_relative_slowly(path)
    except ValueError:
        expected = None
    try:
        got: str | None = validate_relative(path)
    except ValueError:
        got = None
    assert got == expected
    if is_plain_relative(path):
        assert expected == path


def run_benchmark(module: str, out: Path, *args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "-m", module, "--quick", "--out", str(out), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def test_bookkeeping_benchmark_quick_run_writes_sane_figures(tmp_path: Path):
    r = run_benchmark("benchmarks.bench_bookkeeping", tmp_path / "bookkeeping.json")
    assert [x["storage"] for x in r["rebuild"]] == ["file", "memory"]
    for x in r["rebuild"]:
        assert x["checkpoints"] == 10 and x["files_per_checkpoint"] == 1000 + 4 * 3
        assert x["references"] == 10 * (x["files_per_checkpoint"] + 1)
        assert 1000 <= x["distinct_files"] < x["references"]
        assert 0 < x["load_s"] <= x["list_s"] + x["load_s"] + x["count_s"]
    for x in r["complete"]:
        assert x["files"] == 1000 + 20 * 3 and x["files_new"] == x["files_deleted"] > 0
        assert 0 < x["storage_s"] < x["wall_s"] and x["own_s"] > 0
    sweep = r["sweep"]
    assert sweep["files"] == sweep["referenced"] + sweep["orphans"] and sweep["orphans"] > 1000
    assert sweep["files"] >= 10_000 and sweep["wall_s"] > 0
    assert set(r["targets"]) == {"rebuild_s", "complete_own_s", "sweep_s"}


def test_bookkeeping_ladder_measures_rebuild_and_sweep_in_processes_of_their_own(tmp_path: Path):
    out = tmp_path / "ladder.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "benchmarks.bench_bookkeeping", "--ladder", "1000,3000", "--repeat",
                           "1", "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(out.read_text())
    assert [x["files"] for x in r["rows"]] == [1000, 3000]
    for x in r["rows"]:
        assert 0.7 * x["files"] <= x["shared_files"] <= x["files"] and x["references"] > x["shared_files"]
        assert x["rebuild"]["registry_entries"] > x["shared_files"] and x["rebuild"]["checkpoints"] == 10
        assert x["sweep"]["orphans"] == x["orphans"] == round(0.1 * x["files"])
        assert x["rebuild"]["peak_mb"] >= x["rebuild"]["baseline_mb"] > 0
    assert set(r["fits"]) >= {"rebuild.wall_s", "sweep.peak_over_baseline_mb"}


@pytest.mark.s3
def test_state_backend_benchmark_quick_run_writes_sane_figures(tmp_path: Path):
    r = run_benchmark("benchmarks.bench_state_backend", tmp_path / "state_backend.json", "--repeat", "1")
    assert r["load"]["live_sst_bytes"] > 30 * 1024 * 1024
    assert [p["fraction"] for p in r["phases"]] == [0.01, 0.1]
    assert all(p["amplification"] > 0 and p["full"]["uploaded_bytes"] > p["mean_uploaded_bytes"] for p in r["phases"])
    assert {name: x["source"] for name, x in r["restore"].items()} == {
        "working": "working", "local": "local", "primary": "primary", "primary on s3 (moto)": "primary"
    }
    assert r["restore"]["primary on s3 (moto)"]["downloaded_bytes"] == r["restore"]["primary"]["downloaded_bytes"]
    assert len(r["restore"]["primary"]["runs_s"]) == 1  # --repeat is taken (one run each: the count does not matter)
    assert r["restore"]["local"]["verify_s"] > 0 and r["restore"]["local"]["verify_deep_s"] > 0
    assert all(x["first_reads_s"] > 0 for x in r["restore"].values())
    s3 = r["restore"]["primary on s3 (moto)"]
    assert s3["requests"]["GetObject"] >= s3["files"] and s3["probe"]["stream_mb_per_s"] > 0
    assert set(r["transfer"]) == {"file", "s3 (moto)"}
    for x in r["transfer"].values():
        assert x["bytes"] == r["restore"]["primary"]["downloaded_bytes"] and len(x["runs_s"]["get"]) == 1
        assert min(x["upload_s"], x["put_s"], x["download_s"], x["get_s"]) > 0
    assert len(r["targets"]) == 8 and r["machine"]["crc32"] in ("isal", "zlib")


# The default layout in make test; the index loaded at open (the other layout) in make soak.
@pytest.mark.parametrize("layout", [[], pytest.param(["--load-index-at-open"], marks=pytest.mark.soak)])
def test_damage_benchmark_quick_run_finds_no_silent_damage(tmp_path: Path, layout: list[str]):
    r = run_benchmark("benchmarks.bench_damage", tmp_path / "damage.json", *layout)
    assert r["keys"] == 2000 and r["load_index_at_open"] == bool(layout)
    for kind in ("bit flip", "zeroed 4 KB page"):
        x = r[kind]
        assert x["open"] + x["read"] + x["harmless"] + x["SILENT"] == x["trials"] > 50
        assert x["SILENT"] == 0 and x["silent_offsets"] == [], x
        assert x["open"] + x["read"] > 0  # the damage is seen, not just survived


def test_bench_scale_tells_a_tasks_peak_memory_from_building_the_state(tmp_path: Path):
    done = subprocess.run([sys.executable, "-m", "benchmarks.bench_scale", "--sizes", "10", "--out", str(tmp_path)],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = json.loads((tmp_path / "scale.json").read_text())["rows"]
    phases = row["peak_rss_mb_by_phase"]
    assert {"build the state", "incremental checkpoints", "restores"} <= set(phases), phases
    assert 0 < row["task_peak_rss_mb"] <= row["peak_rss_mb"]
    assert row["peak_rss_mb"] == max(phases.values())
    # A task in a process of its own: a primary restore into an empty directory, then a new
    # process restoring what the first left locally; each read and wrote its batch and committed.
    first, second = row["tasks"]
    assert first["restored_from"] == "primary" and second["restored_from"] in ("local", "working")
    for t in (first, second):
        assert t["baseline_mb"] < t["peak_after_restore_mb"] <= t["peak_mb"], t
        assert t["uploaded_bytes"] > 0 and t["rocksdb_at_end_mb"]["block-cache-usage"] > 0
