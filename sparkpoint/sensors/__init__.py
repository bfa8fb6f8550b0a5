"""One pipeline's sensors (`build`): recovery after its failed runs (`recovery`), retention when
something is to prune (`retention`), a run when new input lands (`input`, deciding by `landing`)."""

from sparkpoint.sensors.build import build_sensors
from sparkpoint.sensors.input import report_observation
from sparkpoint.sensors.recovery import (
    CONFIG_ERRORS,
    FOLLOWS_AFTER_TAG,
    NOT_RECOVERED_TAG,
    WILL_RETRY_TAG,
    not_recovered_note,
    recovery_decision,
    resources_config,
)
from sparkpoint.sensors.retention import retention_decision

__all__ = ["CONFIG_ERRORS", "FOLLOWS_AFTER_TAG", "NOT_RECOVERED_TAG", "WILL_RETRY_TAG", "build_sensors",
           "not_recovered_note", "recovery_decision", "report_observation", "resources_config", "retention_decision"]
