"""What every command reads from its arguments: the exit statuses, the usage error, `--pipeline
MODULE:ATTR` loaded once, `--storage-options`, and the job's storage and checkpoints."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from sparkpoint.checkpoint.catalog import existing_store
from sparkpoint.checkpoint.errors import SparkpointError
from sparkpoint.checkpoint.metadata import CheckpointMetadata
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore

if TYPE_CHECKING:
    from sparkpoint.pipeline.spec import Pipeline

EXIT_BAD_FILES = 1
EXIT_REFUSED = 1  # check-upgrade: the restore would be refused
EXIT_BAD_INPUT = 2
EXIT_FAILED = 3
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a Ctrl-C
EXIT_TERMINATED = 143  # 128 + SIGTERM: `run --follow` stopped by SIGTERM


class UsageError(Exception):
    """Bad input on the command line; its message says what to fix (exit status 2)."""


def storage_options(text: str | None) -> dict[str, Any]:
    """The `--storage-options` JSON object ({} without one)."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"--storage-options must be a JSON object: {e}") from e
    if not isinstance(value, dict):
        raise UsageError("--storage-options must be a JSON object, e.g. '{\"anon\": false}'")
    return value


def key_value(text: str) -> tuple[str, str]:
    """One `--conf KEY=VALUE`."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise UsageError(f"--conf takes KEY=VALUE, got {text!r}")
    return key.strip(), value.strip()


def pipeline_of(args: argparse.Namespace) -> Pipeline | None:
    """The `--pipeline` given (None without one), loaded once."""
    if not getattr(args, "pipeline", None):
        return None
    if not hasattr(args, "_loaded_pipeline"):
        from sparkpoint.pipeline.spec import load_pipeline

        args._loaded_pipeline = load_pipeline(args.pipeline)
    loaded: Pipeline = args._loaded_pipeline
    return loaded


def given_pipeline(args: argparse.Namespace) -> Pipeline:
    """The `--pipeline` of a command that requires one."""
    pipeline = pipeline_of(args)
    if pipeline is None:
        raise UsageError("--pipeline MODULE:ATTR is required")
    return pipeline


def job_storage(args: argparse.Namespace) -> CheckpointStorage:
    """The job's storage from `--checkpoints`, `--job-id` and `--storage-options`, each defaulting
    to the `--pipeline`'s."""
    pipeline = pipeline_of(args)
    if pipeline is None:
        if not (args.checkpoints and args.job_id):
            raise UsageError("--checkpoints and --job-id are required (or --pipeline MODULE:ATTR, which names them)")
        return CheckpointStorage(args.checkpoints, args.job_id, storage_options(args.storage_options))
    checkpoints = args.checkpoints or pipeline.location("checkpoints")
    job_id = args.job_id or pipeline.effective_job_id
    options = storage_options(args.storage_options) if args.storage_options else dict(pipeline.storage_options)
    return CheckpointStorage(checkpoints, job_id, options)


def job_store(args: argparse.Namespace) -> CompletedCheckpointStore:
    """The completed-checkpoint store of a job directory that must exist."""
    return existing_store(job_storage(args))


def checkpoints_of(store: CompletedCheckpointStore, wanted: int | None) -> list[CheckpointMetadata]:
    """Checkpoint `wanted`, or (None) every retained one; an unreadable `_metadata` is an error."""
    if wanted is not None:
        return [store.load(wanted)]
    listing = store.load_all()
    if listing.unreadable:
        raise SparkpointError(
            "; ".join(f"chk-{c}/_metadata cannot be read: {why}" for c, why in sorted(listing.unreadable.items()))
        )
    if not listing.checkpoints:
        raise UsageError(f"{store.storage.job_url} holds no completed checkpoint")
    return listing.checkpoints
