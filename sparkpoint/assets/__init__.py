"""One pipeline's assets and checks (`build`, `checks`), what its steps do (`steps`), and a
committed checkpoint as materializations (`committed`), with their metadata (`metadata`)."""

from sparkpoint.assets.build import build_assets, step_driver
from sparkpoint.assets.checks import (
    SKIPPED_CHECK,
    UPGRADE_CHECK,
    build_checks,
    check_event,
    preflight,
    registry_matches,
    skipped_files,
    verifies,
)
from sparkpoint.assets.committed import (
    Materialized,
    checkpoint_version,
    committed_checkpoint_metadata,
    committed_materializations,
    committed_output_metadata,
    has_output,
)
from sparkpoint.assets.steps import run_lineage, skip_job_how

__all__ = ["SKIPPED_CHECK", "UPGRADE_CHECK", "Materialized", "build_assets", "build_checks", "check_event",
           "checkpoint_version", "committed_checkpoint_metadata", "committed_materializations",
           "committed_output_metadata", "has_output", "preflight", "registry_matches", "run_lineage",
           "skip_job_how", "skipped_files", "step_driver", "verifies"]
