"""`list`, `inspect`, `registry` and `metrics`: read-only views of a job's checkpoints, as tables or JSON
(`sparkpoint.checkpoint.catalog` gathers what they show)."""

from __future__ import annotations

import argparse
from typing import Any

from sparkpoint.checkpoint.metadata import iso_micros
from sparkpoint.cli.common import job_storage, storage_options
from sparkpoint.cli.output import key_range, printed_json, size, table


def cmd_list(args: argparse.Namespace) -> int:
    from sparkpoint.checkpoint.catalog import checkpoint_rows

    storage = job_storage(args)
    rows, unreadable = checkpoint_rows(storage)
    if printed_json(args, {"checkpoints": rows, "unreadable": unreadable}):
        return 0
    table(
        f"{len(rows)} retained checkpoint(s) of {storage.job_id}",
        ["id", "kind", "created", "restored from", "skipped input", "state size", "checkpointed size", "files"],
        [[f"chk-{r['checkpoint_id']}", r["kind"], r["created_at"],
          f"{r['restored_from']} ({r['claim_mode']})" if r["restored_from"] else "",
          ", ".join(s["file"] for s in r["skipped_files"]),
          size(r["state_size"]), size(r["checkpointed_size"]), r["files"]] for r in rows],
        right=3,
    )
    for r in rows:
        for s in r["skipped_files"]:
            print(f"chk-{r['checkpoint_id']} skipped {s['file']}: {s['check']}: {s['reason']}")
    for cid, why in unreadable.items():
        print(f"chk-{cid} UNREADABLE: {why}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from sparkpoint.checkpoint.catalog import describe_checkpoint, load_checkpoint_at

    info = describe_checkpoint(load_checkpoint_at(args.path, storage_options(args.storage_options)))
    if printed_json(args, info):
        return 0
    _print_checkpoint(info)
    if info["skipped_files"]:
        table(f"{len(info['skipped_files'])} input file(s) consumed without being processed (skipped)",
              ["file", "skipped by", "check", "reason"],
              [[s["file"], f"chk-{s['checkpoint_id']}", s["check"], s["reason"]] for s in info["skipped_files"]])
    for uid, op in info["operators"].items():
        _print_operator(uid, op)
    return 0


def _print_checkpoint(info: dict[str, Any]) -> None:
    """The lines of `inspect` about the checkpoint as a whole."""
    lineage = f", restored from {info['restored_from']} ({info['claim_mode']})" if info["restored_from"] else ""
    print(f"{info['path']}\n  chk-{info['checkpoint_id']} {info['kind']} of job {info['job_id']}, created "
          f"{info['created_at']}{lineage}\n  state {size(info['state_size'])}, checkpointed "
          f"{size(info['checkpointed_size'])}, {info['files']} files ({info['files_new']} new, "
          f"{info['files_reused']} reused)")
    if info["watermark"] is not None:
        print(f"  watermark {info['watermark']}")
    if "requests" in info:
        counts = ", ".join(f"{op} {n}" for op, n in info["requests"].items() if n) or "none"
        inputs = ", ".join(f"{op} {n}" for op, n in info["input"]["requests"].items() if n) or "none"
        print(f"  requests {counts}; {size(info['bytes_up'])} up, {size(info['bytes_down'])} down; input reads "
              f"{inputs}, {size(info['input']['bytes'])}; estimated cost ${info['estimated_cost_usd']:.6f}")
    if info["read"] is not None:
        read = info["read"]
        times = f" ({read['bytes_read'] / read['batch_bytes']:.2f}x)" if read["batch_bytes"] else ""
        print(f"  batch routed by {read['routing']}: read {size(read['bytes_read'])} of "
              f"{size(read['batch_bytes'])}{times}")


def _print_operator(uid: str, op: dict[str, Any]) -> None:
    """The tables of `inspect` about one operator: its subtasks, its states, its files."""
    name = uid if op["name"] == uid else f"{op['name']} (uid {uid})"
    table(
        f"operator {name}: parallelism {op['parallelism']}, max parallelism {op['max_parallelism']}",
        ["subtask", "key groups", "files", "size"],
        [[s["subtask"], key_range(s["key_group_range"]), len(s["shared"]) + len(s["private"]),
          size(s["state_size"])] for s in op["subtasks"]],
        right=2,
    )
    if "states" in op:
        earliest = f", earliest {iso_micros(op['timers_earliest'])}" if op["timers_earliest"] is not None else ""
        table(
            f"operator {name}: {op['entries']} entries; timers pending {op['timers_pending']}{earliest}, fired "
            f"{op['timers_fired']}; expired entries removed {op['expired_removed']} (this checkpoint's batch)",
            ["state", "kind", "TTL", "entries"],
            [[state, fact["kind"], _ttl(fact["ttl"]), fact["entries"]] for state, fact in op["states"].items()],
            right=1,
        )
    table(
        None, ["subtask", "file", "path", "shared", "created by", "size"],
        [[s["subtask"], f["local_name"], f["path"], "yes" if group == "shared" else "no",
          f"chk-{f['created_by']}", size(f["size"])]
         for s in op["subtasks"] for group in ("shared", "private") for f in s[group]],
        right=1,
    )


def _ttl(ttl: dict[str, Any] | None) -> str:
    return "-" if ttl is None else f"{ttl['seconds']:g}s {ttl['clock']} time, {ttl['update']}"


def cmd_registry(args: argparse.Namespace) -> int:
    from sparkpoint.checkpoint.catalog import registry_rows

    rows, totals = registry_rows(job_storage(args))
    if printed_json(args, {"files": rows, "totals": totals}):
        return 0
    table(
        f"shared-state registry of {args.job_id}, rebuilt from checkpoints {totals['checkpoints']}",
        ["path", "kind", "owned", "created by", "last used", "references", "size"],
        [[r["path"], r["kind"], "yes" if r["owned"] else "no (NO_CLAIM)", f"chk-{r['created_by']}",
          f"chk-{r['last_used']}", r["count"], size(r["size"])] for r in rows],
        right=2,
    )
    print(f"{totals['files']} files ({totals['shared_files']} shared), {size(totals['bytes'])}, "
          f"{totals['references']} references; owned: {totals['owned_files']} files, {size(totals['owned_bytes'])}")
    for reason in totals["deletion_blocked"]:
        print(f"deletion blocked: {reason}")
    return 0


def cmd_metrics(args: argparse.Namespace) -> int:
    """The metrics of `sparkpoint.checkpoint.metrics` from the retained checkpoints (gauges: the
    newest; counters: summed over them), in Prometheus' text format."""
    from sparkpoint.checkpoint.catalog import existing_store
    from sparkpoint.checkpoint.metrics import metrics_of_checkpoints

    storage = job_storage(args)
    listing = existing_store(storage).load_all()
    for cid, why in sorted(listing.unreadable.items()):
        print(f"# chk-{cid} UNREADABLE: {why}")
    print(metrics_of_checkpoints(storage.job_id, listing.checkpoints).text(), end="")
    return 0


def cmd_history(args: argparse.Namespace) -> int:
    from sparkpoint.pipeline.history import history_rows, plot_history, total_requests

    storage = job_storage(args)
    rows, unreadable = history_rows(storage, limit=args.last)
    if args.plot:
        plot_history(rows, args.plot, title=f"checkpoints of {storage.job_id}")
    if printed_json(args, {"checkpoints": rows, "unreadable": unreadable, "plot": args.plot}):
        return 0
    table(
        f"{len(rows)} checkpoint(s) of {storage.job_id} in its history (+ retained; * materialization)",
        ["id", "kind", "completed", "restored", "duration", "state size", "uploaded", "files new", "rows",
         "requests", "up", "down", "cost"],
        [[f"chk-{r['checkpoint_id']}{'*' if r['materialized'] else ''}{'+' if r['retained'] else ''}", r["kind"],
          r["completed_at"], _restored(r["restored"]), _or_dash(r["seconds"], "{:.2f} s"), size(r["state_size"]),
          size(r["checkpointed_size"]), _or_dash(r["files_new"]), _or_dash(r["rows"]),
          _or_dash(total_requests(r)), size(r["bytes_up"]) or "-", size(r["bytes_down"]) or "-",
          _or_dash(r["estimated_cost_usd"], "${:.6f}")] for r in rows],
        right=9,
    )
    if args.plot:
        print(f"plot: {args.plot}")
    for why in unreadable:
        print(f"UNREADABLE: {why}")
    return 0


def _or_dash(value: Any, fmt: str = "{}") -> str:
    """A value as `fmt` shows it; "-" when it was not recorded."""
    return "-" if value is None else fmt.format(value)


def _restored(restored: dict[str, int]) -> str:
    """`primary×2`: how many subtasks restored state, from where."""
    return ", ".join(f"{source}×{n}" for source, n in sorted(restored.items())) or "-"
