"""The job's checkpoint history: one compact record per completed checkpoint, kept beside the
checkpoints in `<job>/_history/`, so that durations, sizes, requests and restores outlive
retention (which deletes old `_metadata`) and restarts.

    _history/chk-<N>.json     one record, written by the completer of checkpoint N
    _history/seg-<K>.jsonl    the records of ids K*SEGMENT .. (K+1)*SEGMENT-1, one per line

An actor of the protocol that can neither corrupt nor block it (DESIGN rule 14):

* Only the completer of checkpoint N writes `chk-<N>.json`, after `_metadata` stood its re-checks
  and the sink committed, by an exclusive create: a second completer of the same attempt (or a
  retry) finds it there and writes nothing. Nothing of the protocol reads `_history/`, and nothing
  here touches a path outside it; a failure is logged and never raised into the checkpoint.
* Compaction folds the records of a finished segment into `seg-<K>.jsonl` (exclusive create, so
  two compactors racing write one segment) and only then deletes the single records the
  segment holds: a record is in a segment or single at every moment, never in neither. It runs
  when a checkpoint crosses into a new segment (no listing otherwise: a checkpoint costs one
  create). The bound: segments and records older than the newest `keep` ids are deleted.
* Readers take a record from a single file or a segment, whichever holds it; a file that does not
  parse (a torn write on a store without atomic creates) is skipped and named, never fatal.
"""

from __future__ import annotations

import json
import logging
import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sparkpoint.checkpoint.errors import CheckpointAlreadyExists
from sparkpoint.checkpoint.storage import CheckpointStorage

log = logging.getLogger(__name__)

HISTORY_DIR = "_history"
SEGMENT = 1000  # records per segment file
DEFAULT_KEEP = 10_000  # checkpoints the history keeps by default (`history_max_checkpoints`)
RECORD_VERSION = 1

_SINGLE = re.compile(r"chk-([1-9][0-9]*)\.json")
_SEGMENT = re.compile(r"seg-(0|[1-9][0-9]*)\.jsonl")


def record_path(checkpoint_id: int) -> str:
    return f"{HISTORY_DIR}/chk-{checkpoint_id}.json"


def segment_path(index: int) -> str:
    return f"{HISTORY_DIR}/seg-{index}.jsonl"


def encode(record: Mapping[str, Any]) -> bytes:
    """One record as one line of compact JSON (no newline inside)."""
    return json.dumps({"v": RECORD_VERSION, **record}, separators=(",", ":"), sort_keys=True,
                      allow_nan=False).encode("utf-8")


def decode(line: bytes | str) -> dict[str, Any]:
    """A record from its line; ValueError when it is not one (a torn or foreign line)."""
    raw = json.loads(line)
    if not isinstance(raw, dict) or not isinstance(raw.get("checkpoint_id"), int) or raw["checkpoint_id"] < 1:
        raise ValueError(f"not a history record: {str(raw)[:120]!r}")
    return raw


def write_record(storage: CheckpointStorage, record: Mapping[str, Any], *, previous: int | None,
                 keep: int = DEFAULT_KEEP) -> bool:
    """Record checkpoint `record["checkpoint_id"]` once (False: a record was there already), then
    compact when this checkpoint entered a new segment since `previous` (the job's checkpoint
    before it; None: unknown, e.g. the first of a run). Never raises: the history must not fail
    a checkpoint that stands."""
    cid = int(record["checkpoint_id"])
    try:
        storage.commit_exclusive(record_path(cid), encode(record) + b"\n")
    except CheckpointAlreadyExists:
        return False
    except Exception as e:  # noqa: BLE001  a history that cannot be written never fails a checkpoint
        log.warning("checkpoint %s: its history record could not be written (%s)", cid, e)
        return False
    if previous is None or previous // SEGMENT != cid // SEGMENT:
        try:
            compact(storage, newest=cid, keep=keep)
        except Exception as e:  # noqa: BLE001  left for the next compaction
            log.warning("the checkpoint history could not be compacted (%s); the next segment's first checkpoint "
                        "tries again", e)
    return True


def _listing(storage: CheckpointStorage) -> tuple[dict[int, str], dict[int, str]]:
    """(single records by checkpoint id, segments by index): relative paths."""
    singles, segments = {}, {}
    for f in storage.walk(HISTORY_DIR):
        name = posixpath.basename(f.path)
        if posixpath.dirname(f.path) != HISTORY_DIR:
            continue
        if m := _SINGLE.fullmatch(name):
            singles[int(m.group(1))] = f.path
        elif m := _SEGMENT.fullmatch(name):
            segments[int(m.group(1))] = f.path
    return singles, segments


def compact(storage: CheckpointStorage, *, newest: int, keep: int = DEFAULT_KEEP) -> None:
    """Fold every finished segment's single records into its segment file, then drop what is
    older than the newest `keep` ids. Safe beside other compactors and writers (see above)."""
    singles, segments = _listing(storage)
    current = newest // SEGMENT
    for index in sorted({cid // SEGMENT for cid in singles if cid // SEGMENT < current}):
        mine = {cid: path for cid, path in singles.items() if cid // SEGMENT == index}
        held = _fold(storage, index, mine, exists=index in segments)
        storage.delete([path for cid, path in mine.items() if cid in held])
    oldest = newest - keep
    doomed = [path for index, path in segments.items() if (index + 1) * SEGMENT - 1 < oldest]
    doomed += [path for cid, path in singles.items() if cid < oldest]
    if doomed:
        storage.delete(doomed)


def _fold(storage: CheckpointStorage, index: int, singles: dict[int, str], *, exists: bool) -> set[int]:
    """The ids segment `index` holds once it is written (by us or by a compactor before us)."""
    if not exists:
        records = []
        for cid in sorted(singles):
            try:
                records.append(encode(decode(storage.read_bytes(singles[cid]))))
            except FileNotFoundError:
                continue  # another compactor folded and deleted it
            except ValueError as e:  # a torn record: left where it is, skipped by readers
                log.warning("history record %s cannot be read (%s); left out of its segment", singles[cid], e)
        try:
            storage.commit_exclusive(segment_path(index), b"".join(r + b"\n" for r in records))
        except CheckpointAlreadyExists:
            pass
    held, _ = _read_lines(storage.read_bytes(segment_path(index)))
    return set(held)


def _read_lines(data: bytes) -> tuple[dict[int, dict[str, Any]], int]:
    """(records by id, lines that are not records) of a segment's text."""
    records, bad = {}, 0
    for line in data.splitlines():
        if not line.strip():
            continue
        try:
            record = decode(line)
        except ValueError:
            bad += 1
            continue
        records[record["checkpoint_id"]] = record
    return records, bad


@dataclass(frozen=True)
class History:
    """Every record found, by checkpoint id (ascending), and what could not be read."""

    records: dict[int, dict[str, Any]]
    unreadable: list[str] = field(default_factory=list)


def read_history(storage: CheckpointStorage) -> History:
    """Every record of the job's history, segments and single records together (a record found in
    both is the same record). Unreadable files and lines are named in `unreadable`."""
    singles, segments = _listing(storage)
    records: dict[int, dict[str, Any]] = {}
    unreadable = []
    for index in sorted(segments):
        try:
            found, bad = _read_lines(storage.read_bytes(segments[index]))
        except FileNotFoundError:  # dropped by a compaction since we listed
            continue
        records.update(found)
        if bad:
            unreadable.append(f"{segments[index]}: {bad} line(s) are not records")
    for cid in sorted(set(singles) - set(records)):
        try:
            records[cid] = decode(storage.read_bytes(singles[cid]))
        except FileNotFoundError:  # folded into a segment since we listed it: read that once more
            records.update(_segment_again(storage, cid))
        except ValueError as e:
            unreadable.append(f"{singles[cid]}: {e}")
    return History(dict(sorted(records.items())), unreadable)


def _segment_again(storage: CheckpointStorage, checkpoint_id: int) -> dict[int, dict[str, Any]]:
    try:
        return _read_lines(storage.read_bytes(segment_path(checkpoint_id // SEGMENT)))[0]
    except (FileNotFoundError, ValueError):
        return {}
