"""Shared by the reliability tests: writing a round of counts into RocksDB subtasks against a dict
model, and the figures (a small table on stdout, JSON in build/soak/<name>.json)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from sparkpoint.state.backend import RocksDBStateBackend
from sparkpoint.state.codecs import StructCodec
from tests.support.backends import owned

ROOT = Path(__file__).resolve().parents[2]
COUNT = StructCodec[tuple[int]]("<q")


def count_round(subtasks: list[RocksDBStateBackend], model: dict[str, int], keys: list[str]) -> None:
    """Add 1 to each key's count, in the model and in the subtask that owns the key."""
    for k in keys:
        model[k] = model.get(k, 0) + 1
    for b in subtasks:
        b.value_state("count", COUNT).put_many(
            (k, (model[k],)) for k in owned(b, keys)
        )


def counts(subtasks: list[RocksDBStateBackend]) -> dict[str, int]:
    return {k.decode(): v[0] for b in subtasks for k, v in b.value_state("count", COUNT).items()}


def scale(name: str, default: int) -> int:
    """A scale knob from the environment (`SPARKPOINT_SOAK_<NAME>`), else the soak default."""
    return int(os.environ.get(f"SPARKPOINT_SOAK_{name.upper()}", default))


def report(name: str, rows: list[dict[str, Any]]) -> Path:
    """Print `rows` as a table and write them (and their totals) to build/soak/<name>.json."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    widths = {k: max(len(k), *(len(str(r.get(k, ""))) for r in rows)) for k in keys}
    print(f"\n{name}")
    print("  ".join(k.rjust(widths[k]) for k in keys))
    for r in rows:
        print("  ".join(str(r.get(k, "")).rjust(widths[k]) for k in keys))
    totals = {k: sum(r[k] for r in rows) for k in keys if all(isinstance(r.get(k), int) for r in rows)}
    out = ROOT / "build" / "soak" / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "totals": totals}, indent=1, default=str))
    return out
