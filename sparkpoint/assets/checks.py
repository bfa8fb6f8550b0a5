"""The pipeline's asset checks: the checkpoint verifies and its registry matches a recount of
`_metadata` (after each checkpoint, and on their own from the UI), and on the input the upgrade
pre-flight (blocking: a restore that would be refused stops the run before Spark starts) and the
files the latest checkpoint skipped. Each check's result is a plain function of storage, which
the recovery and skip ops report too."""

import dagster as dg

from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.pipeline.maintenance import recount, registry_counts, verify_latest
from sparkpoint.pipeline.runtime import restore_plan
from sparkpoint.pipeline.upgrade import RestorePlan
from sparkpoint.resources.scope import PipelineScope

UPGRADE_CHECK = "upgrade_preflight"
SKIPPED_CHECK = "skipped_files"  # on the input: a WARN when the latest checkpoint skipped bad input files
CODE_VERSION_TAG = "dagster/code_version"  # what Dagster tags a materialization of an asset with a code version


def build_checks(scope: PipelineScope) -> list[dg.AssetChecksDefinition]:
    """The checkpoint's checks, run after each checkpoint (the first blocks what depends on it)
    and on their own from the UI; the recovery run reports them for the checkpoint it makes. And
    the upgrade pre-flight on the input, which the checkpoint job runs before its SSTable step
    (blocking: a restore that would be refused stops the run before Spark starts)."""
    keys = scope.resource_keys("storage")

    @dg.asset_check(asset=scope.input_key, name=UPGRADE_CHECK, blocking=True,
                    required_resource_keys=scope.resource_keys("storage", "registry", "state_backend", "source"),
                    description="Whether the latest checkpoint's state maps onto this code's operators (by uid): "
                                "what `sparkpoint check-upgrade` reports, from _metadata alone")
    def upgrade_preflight(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        config = scope.resources(context).config(scope.pipeline)
        return preflight(scope, restore_plan(config, scope.pipeline.operators),
                         last_code_version(context.instance, scope.checkpoint_key))

    @dg.asset_check(asset=scope.checkpoint_key, name="checkpoint_verifies", blocking=True,
                    required_resource_keys=keys, description="Every file of the latest checkpoint: size, CRC32")
    def checkpoint_verifies(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        return verifies(scope, scope.storage(context).open())

    @dg.asset_check(asset=scope.checkpoint_key, name="registry_matches_metadata", required_resource_keys=keys,
                    description="Registry counts equal a recount of the retained _metadata")
    def registry_matches_metadata(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        return registry_matches(scope, scope.storage(context).open())

    @dg.asset_check(asset=scope.input_key, name=SKIPPED_CHECK, additional_deps=[scope.checkpoint_key],
                    required_resource_keys=keys,
                    description="Whether the latest checkpoint consumed input files without processing them "
                                "(on_bad_file=\"skip\", or the skip_file job): a warning naming each file and why")
    def skipped_input_files(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        return skipped_files(scope, scope.storage(context).open())

    return [upgrade_preflight, checkpoint_verifies, registry_matches_metadata, skipped_input_files]


def skipped_files(scope: PipelineScope, storage: CheckpointStorage) -> dg.AssetCheckResult:
    """The input check after a checkpoint: passes unless the latest checkpoint skipped input
    files; then a WARN-severity failure naming them, the check each failed and why."""
    latest = CompletedCheckpointStore(storage).latest()
    skipped = latest.newly_skipped() if latest is not None else ()
    description = ("; ".join(f"skipped {s.line()}" for s in skipped) if skipped
                   else "no input file skipped" if latest is not None else "no completed checkpoint")
    return dg.AssetCheckResult(
        asset_key=scope.input_key, check_name=SKIPPED_CHECK, passed=not skipped,
        severity=dg.AssetCheckSeverity.WARN, description=description[:2000],
        metadata={"checkpoint_id": latest.checkpoint_id if latest else 0,
                  "skipped_files": dg.MetadataValue.json([s.to_json() for s in skipped]),
                  "skipped_before": len(latest.skipped_files) - len(skipped) if latest else 0},
    )


def last_code_version(instance: dg.DagsterInstance, key: dg.AssetKey) -> str | None:
    """The code version of `key`'s latest materialization (None: none, or none recorded)."""
    event = instance.get_latest_materialization_event(key)
    materialization = event.asset_materialization if event is not None else None
    return materialization.tags.get(CODE_VERSION_TAG) if materialization and materialization.tags else None


def preflight(scope: PipelineScope, plan: RestorePlan | None, before: str | None) -> dg.AssetCheckResult:
    """The upgrade pre-flight's result: passes when the next start's restore would go ahead.
    It runs before every checkpoint (it reads one `_metadata`); it matters on the first after the
    operators' code version changed, which its metadata says."""
    now = scope.pipeline.code_version()
    changed = before is not None and before != now
    if plan is None:
        description = "no checkpoint to restore: the job starts empty"
    else:
        description = plan.decision() + (f" (code version {before} -> {now})" if changed else "")
    return dg.AssetCheckResult(
        asset_key=scope.input_key, check_name=UPGRADE_CHECK, passed=plan is None or plan.ok,
        description=description[:2000],
        metadata={"code_version": now, "checkpointed_code_version": before or "", "code_changed": changed,
                  "plan": dg.MetadataValue.json(plan.to_json() if plan is not None else {})},
    )


def verifies(scope: PipelineScope, storage: CheckpointStorage) -> dg.AssetCheckResult:
    meta, problems = verify_latest(storage)
    return dg.AssetCheckResult(
        asset_key=scope.checkpoint_key, check_name="checkpoint_verifies",
        passed=meta is not None and not problems,
        metadata={
            "checkpoint_id": meta.checkpoint_id if meta else 0,
            "files": len(meta.paths()) if meta else 0,
            "problems": dg.MetadataValue.json([str(p) for p in problems]),
        },
        description=None if meta else "no completed checkpoint",
    )


def registry_matches(scope: PipelineScope, storage: CheckpointStorage) -> dg.AssetCheckResult:
    built, counted = registry_counts(storage), recount(storage)
    return dg.AssetCheckResult(
        asset_key=scope.checkpoint_key, check_name="registry_matches_metadata",
        passed=(built.checkpoints, built.files, built.references)
        == (counted.checkpoints, counted.files, counted.references),
        metadata={
            "registry_files": built.files, "recount_files": counted.files,
            "registry_references": built.references, "recount_references": counted.references,
            "retained": dg.MetadataValue.json(list(built.checkpoints)),
        },
    )


def check_event(result: dg.AssetCheckResult) -> dg.AssetCheckEvaluation:
    """A check's result as an event an op logs (an op may report a check of an asset)."""
    assert result.asset_key is not None
    return dg.AssetCheckEvaluation(
        asset_key=result.asset_key, check_name=result.check_name or "", passed=result.passed,
        severity=result.severity, metadata=result.metadata, description=result.description,
    )
