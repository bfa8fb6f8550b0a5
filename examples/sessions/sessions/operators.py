"""Two event-time operators over clicks (`event_id`, `user`, `page`, `clicked_at`) delivered at
least once, written against sparkpoint's public API only.

- `sessions`: a user's clicks go to a ListState (one append each) until an event-time timer at
  the session's last click + `GAP` fires; `on_timer` emits the closed session and clears it.
- `first_clicks`: the first copy of each `event_id` goes to the sink; a ValueState with an
  event-time TTL remembers the ids seen, so the state forgets them and stays bounded.
"""

from __future__ import annotations

from collections.abc import Iterable

import pandas as pd

from sparkpoint import JsonCodec, KeyedOperator, RocksDBStateBackend, StateTtl, StructCodec

GAP = pd.Timedelta(minutes=10)  # a session ends after 10 minutes without a click
GAP_US = GAP // pd.Timedelta(microseconds=1)
SEEN_FOR = StateTtl(20 * 60, clock="event")  # an id is forgotten 20 minutes of event time after it was seen

CLICK = JsonCodec()  # one click of an open session: [clicked_at in µs since the epoch, event_id, page]
FIRST_SEEN = StructCodec[tuple[int]]("<q")  # the id's click time, µs since the epoch

Click = tuple[int, str, str]


def micros(timestamps: pd.Series) -> list[int]:
    """Timestamps as int microseconds since the epoch, UTC (naive ones taken as UTC)."""
    return pd.to_datetime(timestamps, utc=True).astype("datetime64[us, UTC]").astype("int64").tolist()


def split_sessions(clicks: Iterable[Click]) -> list[list[Click]]:
    """Clicks in time order, cut where two follow `GAP` or more apart; a click delivered twice
    (the same event_id, time and page) counts once."""
    sessions: list[list[Click]] = []
    for click in sorted(set(clicks)):
        if sessions and click[0] - sessions[-1][-1][0] < GAP_US:
            sessions[-1].append(click)
        else:
            sessions.append([click])
    return sessions


def first_end(clicks: Iterable[Click]) -> int | None:
    """When the earliest open session ends (its last click + GAP): the user's one timer."""
    sessions = split_sessions(clicks)
    return sessions[0][-1][0] + GAP_US if sessions else None


def open_sessions(batch: pd.DataFrame, state: RocksDBStateBackend) -> None:
    """Append each user's clicks to their open clicks; move the user's timer when the earliest
    session's end moved (a click extended it, or an earlier session appeared)."""
    clicks = state.list_state("clicks", CLICK)
    timers = state.timers  # event time: they fire once the watermark reaches them
    batch = batch.assign(at=micros(batch["clicked_at"])).sort_values(["user", "at", "event_id"])
    for user, rows in batch.groupby("user", sort=False):
        old: list[Click] = [tuple(c) for c in clicks.get(user)]  # type: ignore[misc]
        new: list[Click] = list(zip(rows["at"].tolist(), rows["event_id"].tolist(), rows["page"].tolist()))
        clicks.add_many((user, list(c)) for c in new)
        before, after = first_end(old), first_end(old + new)
        if after != before:
            if before is not None:
                timers.delete(user, before)
            timers.register(user, after)


def close_sessions(fired: pd.DataFrame, state: RocksDBStateBackend) -> pd.DataFrame:
    """A user's timer fired (the watermark passed a session's end): emit every session that
    ended by then, keep the others and set the timer to the next one's end."""
    clicks = state.list_state("clicks", CLICK)
    closed = []
    for user, due in zip(fired["key"], micros(fired["timestamp"])):
        sessions = split_sessions(tuple(c) for c in clicks.get(user))
        still_open = [s for s in sessions if s[-1][0] + GAP_US > due]
        closed += [(user, s) for s in sessions if s[-1][0] + GAP_US <= due]
        clicks.put(user, [list(c) for s in still_open for c in s])
        if still_open:  # fires in this batch too when the watermark is past it already
            state.timers.register(user, still_open[0][-1][0] + GAP_US)
    return _sessions_frame(closed)


def _sessions_frame(sessions: list[tuple[str, list[Click]]]) -> pd.DataFrame:
    return pd.DataFrame({
        "user": pd.Series([u for u, _ in sessions], dtype="string"),
        "session_start": _timestamps([s[0][0] for _, s in sessions]),
        "session_end": _timestamps([s[-1][0] for _, s in sessions]),  # the last click
        "clicks": pd.Series([len(s) for _, s in sessions], dtype="int64"),
        "pages": pd.Series([" ".join(c[2] for c in s) for _, s in sessions], dtype="string"),
    })


def export_sessions(state: RocksDBStateBackend) -> pd.DataFrame:
    """The open clicks per user and when the user's timer fires."""
    timers = state.timers
    rows = []
    for user, stored in state.list_state("clicks", CLICK).items():
        clicks = sorted({tuple(c) for c in stored})
        closes = min(timers.list(user, clock="event"), default=None)
        rows.append((user.decode(), clicks[0][0], clicks[-1][0], len(clicks), closes))
    return pd.DataFrame({
        "user": pd.Series([r[0] for r in rows], dtype="string"),
        "first_click": _timestamps([r[1] for r in rows]),
        "last_click": _timestamps([r[2] for r in rows]),
        "clicks": pd.Series([r[3] for r in rows], dtype="int64"),
        "closes_at": _timestamps([r[4] for r in rows]),
    })


def keep_first(batch: pd.DataFrame, state: RocksDBStateBackend) -> pd.DataFrame:
    """The clicks whose event_id this state has not seen (within its TTL): the sink's rows."""
    seen = state.value_state("seen", FIRST_SEEN, ttl=SEEN_FOR)
    batch = batch.sort_values(["clicked_at", "event_id"]).drop_duplicates("event_id")
    known = seen.get_many(batch["event_id"].tolist())
    first = batch[[k is None for k in known]].reset_index(drop=True)
    seen.put_many(zip(first["event_id"].tolist(), [(t,) for t in micros(first["clicked_at"])]))
    return pd.DataFrame({
        "event_id": first["event_id"].astype("string"), "user": first["user"].astype("string"),
        "page": first["page"].astype("string"), "clicked_at": _timestamps(micros(first["clicked_at"])),
    })


def export_seen(state: RocksDBStateBackend) -> pd.DataFrame:
    rows = [(k.decode(), v[0]) for k, v in state.value_state("seen", FIRST_SEEN, ttl=SEEN_FOR).items()]
    return pd.DataFrame({"event_id": pd.Series([r[0] for r in rows], dtype="string"),
                         "clicked_at": _timestamps([r[1] for r in rows])})


def _timestamps(values: list[int] | list[int | None]) -> pd.Series:
    """Microseconds since the epoch (None: no time) as timestamps, UTC."""
    return pd.to_datetime(pd.Series(values, dtype="Int64"), unit="us", utc=True).astype("datetime64[us, UTC]")


sessions = KeyedOperator(
    "sessions", key="user", columns=("clicked_at", "event_id", "page"), process=open_sessions,
    on_timer=close_sessions, export=export_sessions, emits=True,
    schema={"user": "string", "first_click": "timestamp[us, UTC]", "last_click": "timestamp[us, UTC]",
            "clicks": "int64", "closes_at": "timestamp[us, UTC]"},
)
first_clicks = KeyedOperator(
    "first_clicks", key="event_id", columns=("user", "page", "clicked_at"), process=keep_first,
    export=export_seen, emits=True, schema={"event_id": "string", "clicked_at": "timestamp[us, UTC]"},
)
