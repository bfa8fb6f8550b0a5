"""A user's own pipeline for the erase tests on Spark: club members, keyed by `member`.

`memberships` keeps per member a value state with a TTL (the plan last seen), a map state (visits
per club), a list state (every visit's minutes, in order) and a processing-time "renewal" timer a
year ahead (it never fires in a test); it emits one row per member and batch. `members` is what
the CLI loads (`--pipeline tests.support.members_pipeline:members`), its directories under `MEMBERS_ROOT`
(its output a Delta table with `MEMBERS_OUTPUT=delta`).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pandas as pd

from sparkpoint import JsonCodec, KeyedOperator, Pipeline, StateTtl
from sparkpoint.state.backend import RocksDBStateBackend

PLAN_TTL = StateTtl(10 * 365 * 24 * 3600)
YEAR_US = 365 * 24 * 3600 * 1_000_000


def process(batch: pd.DataFrame, state: RocksDBStateBackend) -> pd.DataFrame:
    last = batch.groupby("member", sort=True).last()
    members = last.index.tolist()
    state.value_state("plan", JsonCodec(), ttl=PLAN_TTL).put_many(zip(members, last["plan"]))
    clubs = state.map_state("clubs", JsonCodec())
    per_club = batch.groupby(["member", "club"]).size()
    old = clubs.get_many(list(per_club.index))
    clubs.put_many((m, c, (o or 0) + int(n)) for (m, c), n, o in zip(per_club.index, per_club, old))
    state.list_state("visits", JsonCodec()).add_many(zip(batch["member"], batch["minutes"].astype(int)))
    now = state.clock("processing") or 0
    state.timers.register_many((m, pd.Timestamp(now + YEAR_US, unit="us", tz="UTC")) for m in members)
    return pd.DataFrame({"member": members, "plan": last["plan"].tolist(),
                         "visits": batch.groupby("member", sort=True).size().tolist()})


def renew(fired: pd.DataFrame, state: RocksDBStateBackend) -> None:
    return None


def export(state: RocksDBStateBackend) -> pd.DataFrame:
    plans = dict(state.value_state("plan", JsonCodec(), ttl=PLAN_TTL).items())
    visits = dict(state.list_state("visits", JsonCodec()).items())
    clubs: dict[bytes, dict[str, int]] = {}
    for member, club, n in state.map_state("clubs", JsonCodec()).items():
        clubs.setdefault(member, {})[club.decode()] = n
    keys = sorted(set(plans) | set(visits) | set(clubs))
    rows = [(k.decode(), plans.get(k), visits.get(k, []), clubs.get(k, {}), len(state.timers.list(k))) for k in keys]
    return pd.DataFrame(rows, columns=["member", "plan", "visits", "clubs", "renewals"])


memberships = KeyedOperator("memberships", key="member", columns=("plan", "club", "minutes"), process=process,
                            export=export, emits=True, on_timer=renew, key_type="string")


def members_pipeline(root: Path, **changes: object) -> Pipeline:
    return Pipeline("members", [memberships], input_url=str(root / "in"), checkpoints_url=str(root / "ckpt"),
                    output_url=str(root / "out"), local_dir=str(root / "local"), parallelism=2,
                    max_parallelism=16, num_retained=3).with_(**changes)


def land(directory: Path, batch: int, members: list[str]) -> pd.DataFrame:
    """One input file: every member visits two clubs."""
    directory.mkdir(parents=True, exist_ok=True)
    rows = pd.DataFrame({"member": [m for m in members for _ in (0, 1)],
                         "plan": [f"plan-{batch}" for _ in members for _ in (0, 1)],
                         "club": [f"club-{(i + batch + j) % 3}" for i, _ in enumerate(members) for j in (0, 1)],
                         "minutes": [10 * batch + j for _ in members for j in (0, 1)]})
    rows.to_parquet(directory / f"visits-{batch:03d}.parquet", index=False)
    return rows


_ROOT = Path(os.environ.get("MEMBERS_ROOT") or Path(tempfile.gettempdir()) / "sparkpoint-members")
members = members_pipeline(_ROOT, **({"output_url": f"delta+file://{_ROOT}/out"}
                                     if os.environ.get("MEMBERS_OUTPUT") == "delta" else {}))
