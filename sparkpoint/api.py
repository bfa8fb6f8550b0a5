"""The notebook API: checkpoints, state and the registry as pandas DataFrames.

    import sparkpoint
    sparkpoint.list_checkpoints("s3://bucket/checkpoints", "clicks", storage_options={...})
    sparkpoint.read_state("file:///data/checkpoints", "clicks", "user_totals", checkpoint=7)
    sparkpoint.registry("file:///data/checkpoints", "clicks")
    sparkpoint.diff_state("file:///data/checkpoints", "clicks", user_totals, 5, 9)
    sparkpoint.rollback(clicks, to=7, dry_run=True).message
    sparkpoint.erase_keys(clicks, ["user-42"], report="erase-user-42.json").message
    sparkpoint.history(clicks, plot="history.png")

The same data as `sparkpoint list --json`, `sparkpoint state` and `sparkpoint registry --json`:
each comes from one function of `sparkpoint.checkpoint.catalog` (or `sparkpoint.state.extract.state_table`) that the
command line prints. `rollback` is `sparkpoint rollback` (`sparkpoint.pipeline.rollback`), `erase_keys` is
`sparkpoint erase` (`sparkpoint.pipeline.erase`), `history` is
`sparkpoint history` (`sparkpoint.pipeline.history`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import pandas as pd

from sparkpoint.checkpoint.catalog import LIST_COLUMNS, REGISTRY_COLUMNS, checkpoint_rows, registry_rows
from sparkpoint.checkpoint.errors import MetadataError
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.state.extract import state_table
from sparkpoint.state.operators import KeyedOperator

if TYPE_CHECKING:
    from sparkpoint.pipeline.erasereport import EraseReport
    from sparkpoint.pipeline.rollback import RollbackReport
    from sparkpoint.pipeline.spec import Pipeline

__all__ = ["diff_state", "erase_keys", "history", "list_checkpoints", "read_state", "registry", "rollback",
           "state_table"]


def list_checkpoints(url: str, job_id: str, *, storage_options: dict[str, Any] | None = None) -> pd.DataFrame:
    """The job's retained checkpoints, one row each, newest first: what `sparkpoint list --json` gives.

    Example:
        ```python
        sparkpoint.list_checkpoints("file:///data/checkpoints", "clicks")[["checkpoint_id", "kind", "state_size"]]
        ```

    Args:
        url: the checkpoints directory (any fsspec URL).
        job_id: the job whose checkpoints to list.
        storage_options: fsspec options of `url`.

    Returns:
        A DataFrame with the columns `checkpoint_id`, `kind`, `created_at`, `state_size`,
        `checkpointed_size`, `files`, `restored_from`, `claim_mode`, `operators`.

    Raises:
        MetadataError: a `_metadata` that cannot be read (named; `sparkpoint list` shows it as UNREADABLE).
        CheckpointNotFound: no job directory at `url`/`job_id`.
    """
    rows, unreadable = checkpoint_rows(CheckpointStorage(url, job_id, storage_options))
    if unreadable:
        raise MetadataError("; ".join(f"chk-{cid}/_metadata cannot be read: {why}" for cid, why in unreadable.items()))
    return pd.DataFrame(rows, columns=list(LIST_COLUMNS))


def read_state(
    url: str, job_id: str, operator: str | KeyedOperator, checkpoint: int | None = None, *,
    storage_options: dict[str, Any] | None = None, raw: bool = False,
) -> pd.DataFrame:
    """The state of `operator` at `checkpoint` (default: the latest), every subtask in one table.

        read_state("s3://bucket/checkpoints", "clicks", "totals_op", raw=True)

    Args:
        url: the checkpoints directory (any fsspec URL).
        job_id: the job whose checkpoints to read.
        operator: a `KeyedOperator` (its `export` makes the table), the name of a sample one,
            or, with `raw`, the operator's id in `_metadata` (its code is not needed).
        checkpoint: the checkpoint id; default the latest.
        storage_options: fsspec options of `url`.
        raw: every state of the operator through the codec `_metadata` recorded for it, one row
            per entry: columns state, kind, key, user_key (map), index (list), value (a
            RecordCodec's a dict of fields, a JsonCodec's its JSON value, bytes otherwise).

    Returns:
        A pandas DataFrame.

    Raises:
        OperatorStateMismatch: the checkpoint holds no such operator.
    """
    code = operator if raw else _code_of(operator)
    return state_table(CheckpointStorage(url, job_id, storage_options), code, checkpoint, raw=raw)[1]


def registry(url: str, job_id: str, *, storage_options: dict[str, Any] | None = None) -> pd.DataFrame:
    """The shared-state registry rebuilt from the retained `_metadata`: what `sparkpoint registry --json` gives.

    Example:
        ```python
        files = sparkpoint.registry("s3://bucket/checkpoints", "clicks",
                                    storage_options={"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}})
        files.attrs["totals"]
        ```

    Args:
        url: the checkpoints directory (any fsspec URL).
        job_id: the job whose registry to rebuild.
        storage_options: fsspec options of `url`.

    Returns:
        One row per file it counts (columns `path`, `kind`, `size`, `count`, `created_by`,
        `last_used`, `owned`); the totals in `df.attrs["totals"]`.

    Raises:
        CheckpointNotFound: no job directory at `url`/`job_id`.
    """
    rows, totals = registry_rows(CheckpointStorage(url, job_id, storage_options))
    frame = pd.DataFrame(rows, columns=list(REGISTRY_COLUMNS))
    frame.attrs["totals"] = totals
    return frame


def diff_state(
    url: str, job_id: str, operator: str | KeyedOperator, from_: int | str, to: int | str, *,
    storage_options: dict[str, Any] | None = None, local_dir: str | None = None,
) -> pd.DataFrame:
    """The rows of `operator`'s state that differ between two snapshots, key by key.

        diff = sparkpoint.diff_state("file:///data/checkpoints", "clicks", user_totals, 5, 9)
        diff[diff.change == "changed"][["user", "total_old", "total"]]

    Each snapshot is a checkpoint id of the job, or the URL of a checkpoint or savepoint
    (`<checkpoints-dir>/<job-id>/chk-<N>`): a savepoint against today's checkpoint, across a
    rescale, an upgrade. Each snapshot is read as a restore by `operator`'s code reads it: declared
    states as declared, each in the fields that snapshot recorded (a `RecordCodec` field added
    since reads as its default in the older one). Two checkpoints of the job with the same
    key-group layout are compared by the files one has and the other has not (their shared files
    are not scanned); anything else by exporting both whole (`df.attrs["method"]` says which:
    "changed files" or "full").

    Args:
        url: the checkpoint storage (fsspec URL) of the job named by `job_id`.
        job_id: the job whose checkpoint ids `from_` and `to` may name.
        operator: a `KeyedOperator` (its `export` makes the rows), or the name of a sample one.
        from_: the older snapshot: a checkpoint id or a checkpoint/savepoint URL.
        to: the newer snapshot, likewise.
        storage_options: fsspec options of the storage.
        local_dir: the job's local directory: its verified task-local copies stand in for downloads.

    Returns:
        The export's columns, then `change` ("added", "removed" or "changed"), then `<column>_old`
        for every non-key column. A row is as the snapshot that has it shows it (`to` for added and
        changed rows, `from` for removed ones); `<column>_old` holds the `from` values of changed
        rows (null otherwise). Sorted by key. `df.attrs` holds the summary (method, bytes read).

    Raises:
        CheckpointNotFound: a checkpoint id or URL that names no completed checkpoint.
        OperatorStateMismatch: a snapshot without that operator.
        StateSchemaIncompatible: `operator`'s declared states cannot read a snapshot (an older version
            of the code given for a diff across an upgrade: give the newer one).
    """
    from sparkpoint.state.diff import diff_snapshots, locate

    storage = CheckpointStorage(url, job_id, storage_options)
    result = diff_snapshots(locate(from_, storage, storage_options), locate(to, storage, storage_options),
                            _code_of(operator), local_dir=local_dir)
    table = result.table
    table.attrs.update(result.summary())
    return table


def rollback(pipeline: Pipeline, to: int, *, dry_run: bool = False) -> RollbackReport:
    """Restore the pipeline's job to its retained checkpoint `to` and undo the output of the
    checkpoints after it, which are retired: what `sparkpoint rollback --pipeline M:A --to N` does.
    The next run restores `to` and processes their batches again, as checkpoints with new ids.

    Example:
        ```python
        print(sparkpoint.rollback(clicks, to=7, dry_run=True).message)  # what would be retired and undone
        sparkpoint.rollback(clicks, to=7)
        ```

    Args:
        pipeline: the `Pipeline` whose job (checkpoints and output) to roll back.
        to: the retained checkpoint to go back to (`list_checkpoints` shows them).
        dry_run: change nothing; the report says what would be retired and which output undone.

    Returns:
        A `RollbackReport`: `retired` (checkpoint id, kind), `output` (each one's files undone),
        `replayed` (the input files the next run processes again), `message` and `to_json()`.

    Raises:
        RollbackRefused: `to` is not retained (the retained ids are named), is another job's, or a
            run of the job is between its steps.
    """
    from sparkpoint.pipeline.rollback import rollback as rollback_config

    return rollback_config(pipeline.config(), to, operators=pipeline.operators, dry_run=dry_run)


def erase_keys(pipeline: Pipeline, keys: Sequence[object], *, operators: Sequence[str] | None = None,
               dry_run: bool = False, report: str | None = None) -> EraseReport:
    """Erase `keys` from the pipeline's state everywhere it lives (the right to be forgotten): every
    retained checkpoint and savepoint of its job, this host's task-local copies and the output.
    What `sparkpoint erase --pipeline M:A --key VALUE` does.

    Each checkpoint that holds a key is written again without it as a new checkpoint (a new id
    above every id the job has seen, in the originals' order; only the SST files of its key group,
    in the subtask whose range holds it, are read and rewritten, every other file is shared) and the
    original is retired once the new one verifies. The report proves it: every retained file that can hold a key was
    read and holds no entry of one, and the rest of every rewritten state is identical.

    Example:
        ```python
        print(sparkpoint.erase_keys(clicks, ["user-42"], dry_run=True).message)  # entries per checkpoint
        report = sparkpoint.erase_keys(clicks, ["user-42"], report="erase-user-42.json")
        assert report.verified
        ```

    Args:
        pipeline: the `Pipeline` whose job (checkpoints, savepoints, output) to erase the keys from.
        keys: the key values, as the operators' key column holds them (a `str`, an `int`, ...).
        operators: the uids of the operators to erase them from (None: every operator, which must
            then be keyed by one column).
        dry_run: change nothing; the report counts the entries each checkpoint holds.
        report: a local path the report is written to as JSON.

    Returns:
        An `EraseReport`: per checkpoint and savepoint the new id, entries removed, files read and
        rewritten, bytes read and written; the retired ids; the proof (`verification`, `verified`);
        the output rows removed; `message`, `lines()` and `to_json()`.

    Raises:
        EraseRefused: an unknown operator uid, operators keyed by different columns, a run between
            its steps, another erase holding the job, or a run that committed during the erase.
        EraseNotVerified: a rewritten checkpoint still held a key or lost other state; the rewritten
            ones were withdrawn and the originals kept (`.report` says what was found).
    """
    from sparkpoint.pipeline.erase import erase, write_report

    done = erase(pipeline.config(), pipeline.operators, list(keys), only=operators, dry_run=dry_run)
    if report is not None:
        write_report(done, report)
    return done


def history(
    pipeline: Pipeline | None = None, *, url: str | None = None, job_id: str | None = None,
    storage_options: dict[str, Any] | None = None, plot: str | None = None, last: int | None = None,
) -> pd.DataFrame:
    """The job's checkpoint history, one row per checkpoint, oldest first: what `sparkpoint history
    --json` gives. Kept in `<job>/_history/` by every completed checkpoint (up to the setting
    `history_max_checkpoints`), merged with the retained `_metadata`, so it outlives retention
    and restarts.

    Example:
        ```python
        frame = sparkpoint.history(clicks, plot="history.png")
        frame[["checkpoint_id", "seconds", "checkpointed_size", "restored"]].tail()
        ```

    Args:
        pipeline: the `Pipeline` whose job to read (its checkpoints location, job id and storage options).
        url: the checkpoints directory (any fsspec URL), instead of a pipeline's (with `job_id`).
        job_id: the job, instead of the pipeline's.
        storage_options: fsspec options of `url` (default: the pipeline's).
        plot: a PNG file to draw sizes and durations over the checkpoints into (needs matplotlib).
        last: only the newest `last` checkpoints.

    Returns:
        A DataFrame with the columns `checkpoint_id`, `kind`, `completed_at`, `seconds` (trigger to
        completion), `state_size`, `checkpointed_size`, `files_new`, `files_reused`, `files_deleted`,
        `rows`, `requests` (by operation), `bytes_up`, `bytes_down`, `estimated_cost_usd` (None where
        the checkpoint recorded no request ledger), `restored` (subtasks by where their state came
        from), `restore_seconds`, `materialized`, `retained`, `phase_seconds`; what could not be read
        in `df.attrs["unreadable"]`.

    Raises:
        CheckpointNotFound: no job directory there.
        ValueError: neither a pipeline nor `url` and `job_id`.
    """
    from sparkpoint.pipeline.history import HISTORY_COLUMNS, history_rows, plot_history

    if pipeline is not None:
        url = url or pipeline.location("checkpoints")
        job_id = job_id or pipeline.effective_job_id
        storage_options = storage_options if storage_options is not None else dict(pipeline.storage_options)
    if not url or not job_id:
        raise ValueError("history needs a pipeline, or url= and job_id= naming the job's checkpoints")
    storage = CheckpointStorage(url, job_id, storage_options)
    rows, unreadable = history_rows(storage, limit=last)
    if plot:
        plot_history(rows, plot, title=f"checkpoints of {job_id}")
    frame = pd.DataFrame(rows, columns=list(HISTORY_COLUMNS))
    frame.attrs["unreadable"] = unreadable
    return frame


def _code_of(operator: str | KeyedOperator) -> KeyedOperator:
    """`operator`, or the sample pipeline's operator of that name (the documented shorthand)."""
    if isinstance(operator, KeyedOperator):
        return operator
    from sparkpoint.sample import operator as sample_operator

    return sample_operator(operator)
