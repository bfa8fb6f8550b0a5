"""What the `visits` pipeline of `examples/sessions` must produce, recomputed with pandas from its
input batches, one batch (one input file) per checkpoint.

The watermark replays batch by batch: before batch j it is W(j-1) (none before the first), after
it W(j) = max(W(j-1), latest click of the batch - lateness). A click below the watermark its
batch starts with is late and dropped. Sessions are then cut from all kept clicks at once (each
event_id once, cut where two clicks are GAP or more apart): a session is emitted with the first
batch whose watermark reaches its last click + GAP (no click kept later can join it: it would be
late), and one the last watermark has not reached is still open. Deduplication walks the batches:
a click is emitted unless its id was emitted at a batch whose watermark is at least W(j) - TTL.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

US = pd.Timedelta(microseconds=1)


@dataclass(frozen=True)
class Expected:
    watermarks: list[int]  # W(j) after each batch, µs since the epoch
    late_rows: list[int]  # per batch
    sessions: pd.DataFrame  # emitted: user, session_start, session_end, clicks, pages, batch
    open_sessions: pd.DataFrame  # the state after the last batch: user, first_click, last_click, clicks, closes_at
    first_clicks: pd.DataFrame  # emitted: event_id, user, page, clicked_at, batch
    seen: pd.DataFrame  # the state after the last batch: event_id, clicked_at
    reemitted: int  # ids emitted a second time because their first emission had expired
    duplicates_dropped: int  # copies not emitted (within a batch or across batches)


def read_batches(input_dir: str | Path) -> list[pd.DataFrame]:
    return [pd.read_parquet(p) for p in sorted(Path(input_dir).glob("clicks-*.parquet"))]


def _micros(ts: pd.Series) -> pd.Series:
    return pd.to_datetime(ts, utc=True).astype("datetime64[us, UTC]").astype("int64")


def _ts(values: pd.Series | list[int]) -> pd.Series:
    return pd.to_datetime(pd.Series(list(values), dtype="int64"), unit="us", utc=True).astype("datetime64[us, UTC]")


def expected(batches: list[pd.DataFrame], *, lateness_s: float, gap: pd.Timedelta, ttl_s: float) -> Expected:
    lateness, gap_us, ttl = round(lateness_s * 1e6), gap // US, round(ttl_s * 1e6)
    watermark: int | None = None
    watermarks, late_rows, kept = [], [], []
    for j, batch in enumerate(batches):
        at = _micros(batch["clicked_at"])
        late = at < watermark if watermark is not None else pd.Series(False, index=batch.index)
        late_rows.append(int(late.sum()))
        kept.append(batch.loc[~late].assign(at=at[~late], batch=j))
        top = int(at.max()) - lateness
        watermark = top if watermark is None else max(watermark, top)
        watermarks.append(watermark)
    clicks = pd.concat(kept, ignore_index=True)

    sessions, still_open = [], []
    distinct = clicks.sort_values(["at", "event_id", "batch"]).drop_duplicates("event_id")
    for user, rows in distinct.groupby("user"):
        cut = (rows["at"].diff() >= gap_us).cumsum()
        for _, s in rows.groupby(cut):
            end = int(s["at"].iloc[-1]) + gap_us
            closing = next((j for j, w in enumerate(watermarks) if w >= end), None)
            facts = (user, int(s["at"].iloc[0]), int(s["at"].iloc[-1]), len(s), " ".join(s["page"]), end)
            (sessions if closing is not None else still_open).append((*facts, closing))
    emitted = pd.DataFrame(sessions, columns=["user", "start", "end", "clicks", "pages", "closes", "batch"])
    open_rows = pd.DataFrame(still_open, columns=["user", "start", "end", "clicks", "pages", "closes", "batch"])
    per_user = open_rows.groupby("user").agg(first_click=("start", "min"), last_click=("end", "max"),
                                             clicks=("clicks", "sum"), closes_at=("closes", "min")).reset_index()

    seen: dict[str, tuple[int, int]] = {}  # id -> (watermark of the batch that emitted it, click time)
    firsts, reemitted, dropped = [], 0, 0
    for j, rows in enumerate(kept):
        unique = rows.sort_values(["at", "event_id"]).drop_duplicates("event_id")
        dropped += len(rows) - len(unique)
        for r in unique.itertuples():
            if r.event_id in seen and seen[r.event_id][0] >= watermarks[j] - ttl:
                dropped += 1
                continue
            reemitted += r.event_id in seen
            seen[r.event_id] = (watermarks[j], r.at)
            firsts.append((r.event_id, r.user, r.page, r.at, j))
    live = sorted((i, at) for i, (stamp, at) in seen.items() if stamp >= watermarks[-1] - ttl)

    return Expected(
        watermarks=watermarks, late_rows=late_rows,
        sessions=pd.DataFrame({
            "user": emitted["user"], "session_start": _ts(emitted["start"]), "session_end": _ts(emitted["end"]),
            "clicks": emitted["clicks"].astype("int64"), "pages": emitted["pages"],
            "batch": emitted["batch"].astype("int64"),
        }).sort_values(["user", "session_start"]).reset_index(drop=True),
        open_sessions=pd.DataFrame({
            "user": per_user["user"], "first_click": _ts(per_user["first_click"]),
            "last_click": _ts(per_user["last_click"]), "clicks": per_user["clicks"].astype("int64"),
            "closes_at": _ts(per_user["closes_at"]),
        }).sort_values("user").reset_index(drop=True),
        first_clicks=pd.DataFrame({
            "event_id": [f[0] for f in firsts], "user": [f[1] for f in firsts], "page": [f[2] for f in firsts],
            "clicked_at": _ts([f[3] for f in firsts]), "batch": pd.Series([f[4] for f in firsts], dtype="int64"),
        }).sort_values(["event_id", "batch"]).reset_index(drop=True),
        seen=pd.DataFrame({"event_id": [i for i, _ in live], "clicked_at": _ts([a for _, a in live])}),
        reemitted=reemitted, duplicates_dropped=dropped,
    )
