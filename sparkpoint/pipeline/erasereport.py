"""What `sparkpoint erase` did, per checkpoint and savepoint, and its proof (`EraseReport`).

The report never holds an erased key: it names the keys by count and by a SHA-256 over them
(`keys_digest`), so it can be kept and shown to an auditor without repeating what was erased. (A
key that can be guessed, a user id, can be confirmed against that hash: keep the report as the
request it answers is kept. No `_metadata` holds it: a copy names its erase by a random id.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sparkpoint.state.erasure import FileFinding, SubtaskErasure


@dataclass(frozen=True)
class Verification:
    """The proof for one retained checkpoint: every SST and changelog file of its subtasks whose
    key-group range holds an erased key's group was read (but the SSTs their MANIFEST places
    outside every key group of the keys: `files_ruled_out`), and `findings` lists the files that
    still hold an entry of one (empty: none does); for a rewritten one, the rest of each rewritten
    subtask's state hashed before and after (`rest_equal`; for a subtask erased by its key groups'
    files, `sparkpoint.state.erasure.PartialProof` says what that covers)."""

    checkpoint_id: int
    files_checked: int
    bytes_checked: int
    findings: tuple[FileFinding, ...] = ()
    rest_equal: bool | None = None  # None: nothing was rewritten in it
    problems: tuple[str, ...] = ()
    files_ruled_out: int = 0  # SSTs whose recorded key range lies outside every key group of the keys: not read

    @property
    def ok(self) -> bool:
        return not self.findings and self.rest_equal is not False and not self.problems

    def to_json(self) -> dict[str, Any]:
        return {"checkpoint_id": self.checkpoint_id, "ok": self.ok, "files_checked": self.files_checked,
                "bytes_checked": self.bytes_checked, "findings": [f.to_json() for f in self.findings],
                "rest_equal": self.rest_equal, "problems": list(self.problems),
                "files_ruled_out": self.files_ruled_out}


@dataclass(frozen=True)
class CheckpointErasure:
    """One retained checkpoint or savepoint: erased into `new_id` (None: it held none of the keys
    and nothing older was rewritten, so it stays as it is)."""

    original_id: int
    kind: str
    new_id: int | None
    subtasks: tuple[SubtaskErasure, ...] = ()
    entries_found: int = 0  # a dry run: the entries it would remove

    @property
    def entries_removed(self) -> int:
        return sum(s.entries_removed for s in self.subtasks)

    @property
    def files_read(self) -> int:
        return sum(s.files_read for s in self.subtasks)

    @property
    def bytes_read(self) -> int:
        return sum(s.bytes_read for s in self.subtasks)

    @property
    def files_rewritten(self) -> int:
        return sum(len(s.files_rewritten) for s in self.subtasks)

    @property
    def bytes_written(self) -> int:
        return sum(s.bytes_written for s in self.subtasks)

    def line(self, dry_run: bool) -> str:
        name = f"chk-{self.original_id}" + (" (savepoint)" if self.kind == "savepoint" else "")
        if dry_run:
            return f"  {name}: {self.entries_found} entries of the keys" + (" would be removed" if self.entries_found
                                                                            else ", nothing to remove")
        if self.new_id is None:
            return f"  {name}: holds none of the keys, kept as it is"
        return (f"  {name} -> chk-{self.new_id}: {self.entries_removed} entries removed; {self.files_read} files "
                f"read ({self.bytes_read} bytes), {self.files_rewritten} rewritten, {self.bytes_written} bytes written")

    def to_json(self) -> dict[str, Any]:
        return {"original": self.original_id, "kind": self.kind, "new": self.new_id,
                "entries_removed": self.entries_removed, "entries_found": self.entries_found,
                "files_read": self.files_read, "bytes_read": self.bytes_read,
                "files_rewritten": self.files_rewritten, "bytes_written": self.bytes_written,
                "subtasks": [s.to_json() for s in self.subtasks]}


@dataclass(frozen=True)
class EraseReport:
    """What `sparkpoint erase` / `sparkpoint.erase_keys` did (with `dry_run`: would do)."""

    job_url: str
    keys: int
    keys_digest: str
    operators: tuple[str, ...]
    checkpoints: tuple[CheckpointErasure, ...]
    dry_run: bool = False
    retired: tuple[int, ...] = ()
    files_deleted: int = 0
    verification: tuple[Verification, ...] = ()
    local_dropped: tuple[str, ...] = ()
    output: tuple[dict[str, Any], ...] = ()
    output_url: str | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def verified(self) -> bool:
        """Every retained checkpoint was checked, and none holds an entry of the keys."""
        return not self.dry_run and all(v.ok for v in self.verification)

    @property
    def message(self) -> str:
        """One paragraph: what was (would be) erased where, and whether the proof holds."""
        ops = ", ".join(self.operators)
        if self.dry_run:
            found = sum(c.entries_found for c in self.checkpoints)
            holding = [c.original_id for c in self.checkpoints if c.entries_found]
            return (f"erase of {self.keys} key(s) from {ops} of {self.job_url} (dry run): {found} entries in "
                    f"checkpoints {holding or 'none'} would be removed, as new checkpoints; nothing was changed")
        rewritten = [c for c in self.checkpoints if c.new_id is not None]
        pairs = ", ".join(f"chk-{c.original_id} -> chk-{c.new_id}" for c in rewritten) or "none"
        parts = [f"erased {self.keys} key(s) from {ops} of {self.job_url}: "
                 f"{sum(c.entries_removed for c in rewritten)} entries removed; rewritten {pairs}; "
                 f"retired {list(self.retired) or 'none'} ({self.files_deleted} files deleted)"]
        if self.local_dropped:
            parts.append(f"dropped {len(self.local_dropped)} task-local directories")
        for out in self.output:
            parts.append(f"output {out.get('column')}: {out.get('rows_removed')} rows removed")
        checked = sum(v.files_checked for v in self.verification)
        parts.append(f"VERIFIED: {checked} files of {len(self.verification)} retained checkpoints read, no entry "
                     "of the keys; the rest of every rewritten state is identical" if self.verified else
                     "NOT VERIFIED: " + "; ".join(self._failures()))
        return "; ".join(parts + list(self.notes))

    def _failures(self) -> list[str]:
        out = []
        for v in self.verification:
            out += [f"chk-{v.checkpoint_id}: {f.path} still holds {f.entries} entries" for f in v.findings]
            if v.rest_equal is False:
                out.append(f"chk-{v.checkpoint_id}: the rest of its state differs from the original's")
            out += [f"chk-{v.checkpoint_id}: {p}" for p in v.problems]
        return out or ["no retained checkpoint was checked"]

    def lines(self) -> list[str]:
        """The message, then a line per checkpoint and savepoint, then the proof per checkpoint."""
        out = [self.message, *(c.line(self.dry_run) for c in self.checkpoints)]
        for v in self.verification:
            verdict = "no entry of the keys" if v.ok else "FAILED"
            rest = "" if v.rest_equal is None else (", rest of the state identical" if v.rest_equal
                                                    else ", REST OF THE STATE DIFFERS")
            out.append(f"  proof chk-{v.checkpoint_id}: {v.files_checked} files read ({v.bytes_checked} bytes), "
                       f"{verdict}{rest}")
        return out

    def to_json(self) -> dict[str, Any]:
        return {"job": self.job_url, "keys": self.keys, "keys_sha256": self.keys_digest,
                "operators": list(self.operators), "dry_run": self.dry_run, "verified": self.verified,
                "checkpoints": [c.to_json() for c in self.checkpoints], "retired": list(self.retired),
                "files_deleted": self.files_deleted, "verification": [v.to_json() for v in self.verification],
                "local_dropped": list(self.local_dropped), "output_url": self.output_url,
                "output": list(self.output), "notes": list(self.notes), "summary": self.message}
