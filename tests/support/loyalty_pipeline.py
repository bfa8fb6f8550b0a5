"""A user's own operator whose state schema changes between versions (issue 33: declared states,
RecordCodec evolution, state without the code).

`loyalty` keeps per customer a `totals` record (RecordCodec, read and written as Arrow tables)
with a TTL, a `profile` (JsonCodec: its shape changes freely between versions) and a `days` map
state (JsonCodec) of clicks per day. Version 1's totals are narrow; version 2 adds a field with a
default and a nullable one, removes one, widens two, reorders them and makes one nullable.
`recompute` is the pandas recomputation of what the state must hold.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from sparkpoint import JsonCodec, KeyedOperator, Pipeline, RecordCodec, StateDescriptor, StateTtl
from sparkpoint.state.backend import RocksDBStateBackend

TTL = StateTtl(10 * 365 * 24 * 3600)  # never expires in a test, but every entry carries its stamp
V1 = RecordCodec({"clicks": "int32", "spend": "float32", "visits": "int64 not null", "legacy": "string"},
                 defaults={"visits": 0})
V2 = RecordCodec({"visits": "int64", "spend": "float64", "clicks": "int64", "tier": "string", "bonus": "float64"},
                 defaults={"bonus": 1.5})
V2_RULES = ["added field tier (null)", "added field bonus (default 1.5)", "widened spend float32→float64",
            "widened clicks int32→int64", "made visits nullable", "removed field legacy", "reordered fields"]


def loyalty_operator(totals: RecordCodec, version: int = 1) -> KeyedOperator:
    def process(batch: pd.DataFrame, state: RocksDBStateBackend) -> None:
        agg = batch.groupby("customer", sort=True).agg(clicks=("clicks", "sum"), spend=("spend", "sum"),
                                                       visits=("clicks", "size"), tier=("tier", "last"))
        keys = agg.index.tolist()
        store = state.declared("totals")
        old = store.get_many_table(keys)
        new = {"clicks": pc.add(pc.fill_null(old["clicks"], 0), pa.array(agg["clicks"], pa.int64())),
               "spend": pc.add(pc.fill_null(old["spend"], 0.0), pa.array(agg["spend"], pa.float64())),
               "visits": pc.add(pc.fill_null(old["visits"], 0), pa.array(agg["visits"], pa.int64()))}
        if "tier" in totals.names:
            new["tier"] = pa.array(agg["tier"])
        if "legacy" in totals.names:
            new["legacy"] = pa.array(["v1"] * len(keys))
        store.put_many_table(keys, new)
        profile = state.value_state("profile", JsonCodec())
        profile.put_many((k, {"tier": t} if version == 1 else {"tiers": [t], "version": 2})
                         for k, t in zip(keys, agg["tier"]))
        days = state.declared("days")
        per_day = batch.groupby(["customer", "day"]).size()
        old_days = days.get_many([(c, d) for c, d in per_day.index])
        days.put_many((c, d, (o or 0) + int(n)) for (c, d), n, o in zip(per_day.index, per_day, old_days))

    def export(state: RocksDBStateBackend) -> pd.DataFrame:
        rows = [{"customer": k.decode(), **v} for k, v in state.declared("totals").items()]
        return pd.DataFrame(rows, columns=["customer", *totals.names])

    return KeyedOperator(
        "loyalty", key="customer", columns=("clicks", "spend", "tier", "day"), process=process, export=export,
        key_type="string",
        states={"totals": StateDescriptor("value", totals, ttl=TTL), "profile": JsonCodec(),
                "days": StateDescriptor("map", JsonCodec())},
    )


loyalty_v1 = loyalty_operator(V1, 1)
loyalty_v2 = loyalty_operator(V2, 2)


def batch(b: int, customers: int = 24) -> pd.DataFrame:
    """Batch `b`: clicks and spends (halves: exact in float32) of some customers, a tier, a day."""
    n = 40
    return pd.DataFrame({
        "customer": [f"c{(7 * b + 5 * i) % customers:02d}" for i in range(n)],
        "clicks": [(b + i) % 5 + 1 for i in range(n)],
        "spend": [((b * 3 + i) % 9) / 2 for i in range(n)],
        "tier": [["bronze", "silver", "gold"][(b + i) % 3] for i in range(n)],
        "day": [f"d{(b + i) % 3}" for i in range(n)],
    })


def recompute(v1_batches: list[pd.DataFrame], v2_batches: list[pd.DataFrame], fields: tuple[str, ...]) -> pd.DataFrame:
    """What `totals` holds after version 1 ran `v1_batches` and version 2 `v2_batches`."""
    every = pd.concat([*v1_batches, *v2_batches], ignore_index=True)
    g = every.groupby("customer", sort=True)
    out = pd.DataFrame({"customer": g.size().index, "clicks": g["clicks"].sum().values,
                        "spend": g["spend"].sum().astype(float).values, "visits": g.size().values})
    if "tier" in fields:
        later = pd.concat(v2_batches, ignore_index=True) if v2_batches else every.iloc[:0]
        last = later.groupby("customer")["tier"].last()
        out["tier"] = out["customer"].map(last).astype(object).where(out["customer"].isin(last.index), None)
    if "bonus" in fields:
        out["bonus"] = 1.5
    if "legacy" in fields:
        out["legacy"] = "v1"
    return out[["customer", *fields]]


def loyalty_pipeline(root: Path, operator: KeyedOperator = loyalty_v1, **changes: object) -> Pipeline:
    return Pipeline("loyalty", [operator], input_url=str(root / "in"), checkpoints_url=str(root / "ckpt"),
                    local_dir=str(root / "local"), parallelism=2, max_parallelism=32).with_(**changes)
