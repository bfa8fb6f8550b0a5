"""Two keyed operators over clicks (`user`, `page`, `clicked_at`), written against sparkpoint's
public API only: one keeps a ValueState per user, the other a MapState of pages per user."""

from __future__ import annotations

import pandas as pd

from sparkpoint import BytesCodec, KeyedOperator, RocksDBStateBackend, StructCodec

CLICKS = StructCodec[tuple[int, int]]("<qq")  # (clicks, latest click in µs since the epoch)
SEEN = BytesCodec()
PAGES = StructCodec[tuple[int]]("<q")  # distinct pages


def count_clicks(batch: pd.DataFrame, state: RocksDBStateBackend) -> pd.DataFrame:
    """Clicks and the latest click per user; returns the users it changed (the sink's rows)."""
    micros = pd.to_datetime(batch["clicked_at"], utc=True).astype("datetime64[us, UTC]").astype("int64")
    per_user = (batch.assign(at=micros).groupby("user", sort=True)
                .agg(clicks=("at", "size"), latest=("at", "max")))
    users = per_user.index.tolist()
    totals = state.value_state("clicks", CLICKS)
    old = totals.get_many(users)
    new = [(int(n) + (o[0] if o else 0), max(int(t), o[1] if o else int(t)))
           for n, t, o in zip(per_user["clicks"], per_user["latest"], old)]
    totals.put_many(zip(users, new))
    return _clicks_frame(users, new)


def export_clicks(state: RocksDBStateBackend) -> pd.DataFrame:
    rows = [(k.decode(), v) for k, v in state.value_state("clicks", CLICKS).items()]
    return _clicks_frame([u for u, _ in rows], [v for _, v in rows])


def _clicks_frame(users: list[str], values: list[tuple[int, int]]) -> pd.DataFrame:
    return pd.DataFrame({
        "user": pd.Series(users, dtype="string"),
        "clicks": pd.Series([v[0] for v in values], dtype="int64"),
        "last_click": pd.to_datetime(pd.Series([v[1] for v in values], dtype="int64"), unit="us", utc=True),
    })


def note_pages(batch: pd.DataFrame, state: RocksDBStateBackend) -> None:
    """The set of pages each user has visited (a MapState user -> page), and its size."""
    pairs = batch[["user", "page"]].drop_duplicates()
    added = state.map_state("pages", SEEN).put_absent(
        (u, p, b"") for u, p in zip(pairs["user"], pairs["page"]))
    new = pd.Series(added, index=pairs["user"].to_numpy()).groupby(level=0).sum()
    users = new.index.tolist()
    counts = state.value_state("distinct_pages", PAGES)
    old = counts.get_many(users)
    counts.put_many((u, (int(n) + (o[0] if o else 0),)) for u, n, o in zip(users, new, old))


def export_pages(state: RocksDBStateBackend) -> pd.DataFrame:
    rows = [(k.decode(), v[0]) for k, v in state.value_state("distinct_pages", PAGES).items()]
    return pd.DataFrame({"user": pd.Series([u for u, _ in rows], dtype="string"),
                         "distinct_pages": pd.Series([n for _, n in rows], dtype="int64")})


clicks_per_user = KeyedOperator(
    "clicks_per_user", key="user", columns=("clicked_at",), process=count_clicks, export=export_clicks,
    emits=True, schema={"user": "string", "clicks": "int64", "last_click": "timestamp[us, UTC]"},
)
pages_per_user = KeyedOperator(
    "pages_per_user", key="user", columns=("page",), process=note_pages, export=export_pages,
    schema={"user": "string", "distinct_pages": "int64"},
)
