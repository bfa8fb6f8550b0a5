"""Where a checkpoint got to in its input: its source offsets, as `_metadata` records them.

A directory's offsets do not grow with the job's history (version 3): a *floor* in name order
(code point order, S3's) below which every batch name is settled, and the names consumed above
it, at most `RECENT_NAMES` of them beyond those a gap holds up. The rule (docs/life.md):

* A batch takes unconsumed files in name order. After each batch the floor rises, but never to
  or past a batch file the last listing saw unconsumed (a file still being written, a bad file
  refused, the files before one `sparkpoint skip` took), and it trails the newest consumed name
  by `RECENT_NAMES` names.
* A file that lands with a name above the floor is read, once, wherever it sorts among the
  consumed names above it (they are recorded).
* A file that lands late with a name at or below the floor is refused: the floor closed that
  name, and no run reads it (`--rescan` names it in a warning). Land it again under a name above
  the newest consumed one.

Until a job has consumed more than `RECENT_NAMES` files the floor is unset (`null`) and every
consumed name is recorded. A version-1 `_metadata` (every consumed name, in the order read, as
older versions wrote it) of any length is read, and becomes version 3 at the next checkpoint.
A table's offsets (version 2) are the table version reached.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sparkpoint.checkpoint.errors import SparkpointError
from sparkpoint.tables.source import TableOffset

OFFSETS_VERSION = 1  # a directory's offsets, as older versions wrote them: every consumed file name
TABLE_OFFSETS_VERSION = 2  # a table's: the version reached (older readers refuse them, as they must)
FLOOR_OFFSETS_VERSION = 3  # a directory's: a floor and the names consumed above it
RECENT_NAMES = 256  # consumed names kept above the floor: how far behind the newest a late file is still read
MAX_NAME_CHARS = 1024  # S3's longest key


class SourceError(SparkpointError):
    """The input directory cannot be read, or a checkpoint's offsets belong elsewhere."""


class OffsetsError(SourceError):
    """A checkpoint's source offsets are not offsets this version reads."""


@dataclass(frozen=True)
class SourceOffsets:
    """Where a checkpoint got to in its input. A directory's: `floor` (every batch name at or
    below it is settled; None: none yet) and `consumed`, the names consumed above it, in name
    order (version 3, `bounded`); or every consumed name in the order read (version 1, as read
    from an older `_metadata`, until a source advances it). A table's: `table`, the version
    reached (version 2, `consumed` empty)."""

    consumed: tuple[str, ...] = ()
    table: TableOffset | None = None
    floor: str | None = None
    bounded: bool = False  # version 3: written with a floor (the offsets a source advances)

    def includes(self, name: str) -> bool:
        """This checkpoint has consumed input file `name`, or recorded it skipped (skipped files
        are consumed too), or its floor closed `name` (a file landing under it now is refused,
        never read). Always False for a table's offsets, which name no file."""
        if self.table is not None:
            return False
        return (self.floor is not None and name <= self.floor) or name in self._recorded

    def names(self, name: str) -> bool:
        """This checkpoint records `name` itself (consumed or skipped above its floor, or in a
        version-1 list), not only closed it by its floor: a name `includes` only through the floor
        may be a file consumed long ago or one that landed late and was refused, never read."""
        return self.table is None and name in self._recorded

    @property
    def mark(self) -> str | None:
        """The highest name consumed (None: nothing, or a table's offsets)."""
        if self.table is not None:
            return None
        return max(self.consumed, default=self.floor)

    @property
    def _recorded(self) -> frozenset[str]:
        cached = self.__dict__.get("_recorded_set")
        if cached is None:
            cached = frozenset(self.consumed)
            object.__setattr__(self, "_recorded_set", cached)
        return cached

    def to_json(self) -> dict[str, Any]:
        if self.table is not None:
            return {"version": TABLE_OFFSETS_VERSION, "consumed": [], "table": self.table.to_json()}
        if not self.bounded and self.floor is None:  # as read (or nothing consumed yet): as older versions wrote
            return {"version": OFFSETS_VERSION, "consumed": list(self.consumed)}
        return {"version": FLOOR_OFFSETS_VERSION, "floor": self.floor, "consumed": list(self.consumed)}

    @classmethod
    def from_json(cls, raw: Any) -> SourceOffsets:
        if raw is None:
            return cls(())
        version = raw.get("version") if isinstance(raw, dict) else None
        if version == TABLE_OFFSETS_VERSION:
            try:
                return cls((), TableOffset.from_json(raw.get("table")))
            except ValueError as e:
                raise OffsetsError(f"source offsets {_shown(raw)} are not sparkpoint table offsets: {e}") from e
        if version == FLOOR_OFFSETS_VERSION:
            return _floor_offsets(raw)
        if version != OFFSETS_VERSION or not isinstance(raw.get("consumed"), list):
            raise OffsetsError(f"source offsets {_shown(raw)} are not sparkpoint directory offsets (version 1 or 3)")
        where = f"source offsets {_shown(raw)} (version 1): consumed"
        return cls(tuple(check_name(n, where) for n in raw["consumed"]))

    def after(self, files: Iterable[str]) -> SourceOffsets:
        """These offsets with `files` consumed too, the floor where it was."""
        new = tuple(dict.fromkeys(f for f in files if not self.includes(f)))
        if not self.bounded and self.floor is None:
            return SourceOffsets(self.consumed + new)  # in the order read, as version 1 has them
        return SourceOffsets(tuple(sorted({*self.consumed, *new})), floor=self.floor, bounded=True)

    def compacted(self, unconsumed: Iterable[str], keep: int | None = None) -> SourceOffsets:
        """These offsets with the floor raised as far as the rule allows: below the lowest of
        `unconsumed` (batch names a listing saw and no batch took) and below the newest `keep`
        consumed names (default `RECENT_NAMES`). Version-1 offsets become version 3 here."""
        if self.table is not None:
            return self
        keep = RECENT_NAMES if keep is None else keep
        names = sorted(n for n in set(self.consumed) if self.floor is None or n > self.floor)
        held = min((n for n in unconsumed if not self.includes(n)), default=None)
        movable = sum(1 for n in names if held is None or n < held)
        k = min(movable, len(names) - keep)
        if k <= 0:
            return SourceOffsets(tuple(names), floor=self.floor, bounded=True)
        return SourceOffsets(tuple(names[k:]), floor=names[k - 1], bounded=True)


def check_name(name: Any, where: str) -> str:
    """`name` as a recorded input name: a relative name (a file, or `date=.../file`) of at most
    `MAX_NAME_CHARS` characters, without `..`, control characters or a leading `/`."""
    if not isinstance(name, str) or not name:
        raise OffsetsError(f"{where}: {name!r} is not an input file name (a non-empty string)")
    if len(name) > MAX_NAME_CHARS or name.startswith("/") or any(ord(c) < 32 or c == "\x7f" for c in name) \
            or ".." in name.split("/") or "" in name.split("/"):
        raise OffsetsError(f"{where}: {name[:200]!r} is not an input file name relative to the input directory "
                           f"(at most {MAX_NAME_CHARS} characters, no '..', no empty part, no leading '/', no "
                           "control characters)")
    return name


def _floor_offsets(raw: dict[str, Any]) -> SourceOffsets:
    where = f"source offsets {_shown(raw)} (version 3)"
    floor = raw.get("floor")
    consumed = raw.get("consumed")
    if floor is not None:
        check_name(floor, f"{where}: floor")
    if not isinstance(consumed, list):
        raise OffsetsError(f"{where}: 'consumed' must be a list of input file names")
    names = tuple(check_name(n, f"{where}: consumed") for n in consumed)
    if list(names) != sorted(set(names)):
        raise OffsetsError(f"{where}: 'consumed' must be in name order, each name once")
    if floor is not None and names and names[0] <= floor:
        raise OffsetsError(f"{where}: consumed name {names[0]!r} is not above the floor {floor!r}")
    return SourceOffsets(names, floor=floor, bounded=True)


def _shown(raw: Any) -> str:
    return repr(str(raw)[:200])
