"""One pipeline's jobs and schedule (`jobs`), what their ops do (`steps`), what they say of the
maintenance results (`results`), and the Dagster instance settings sparkpoint relies on (`instance`)."""

from sparkpoint.ops.jobs import FollowConfig, PipelineJobs, RecoverConfig, SavepointConfig, SkipFileConfig, build_jobs
from sparkpoint.ops.steps import RECOVERY_RUN, link_to_recovery
from sparkpoint.resources.scope import FAILED_RUN_TAG

__all__ = ["FAILED_RUN_TAG", "RECOVERY_RUN", "FollowConfig", "PipelineJobs", "RecoverConfig", "SavepointConfig",
           "SkipFileConfig", "build_jobs", "link_to_recovery"]
