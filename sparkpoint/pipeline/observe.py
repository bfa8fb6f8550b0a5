"""What a completer tells about a checkpoint that stands (its `_metadata` committed, re-checked and
its sink committed): the history record, the traces and the lineage events, each as its setting
says. None of them can fail or undo the checkpoint: an error is logged, and each costs nothing
when it is off."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from sparkpoint.checkpoint.history import write_record
from sparkpoint.checkpoint.metadata import CheckpointMetadata
from sparkpoint.checkpoint.phases import Phase
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.pipeline.history import RunFacts, history_record

if TYPE_CHECKING:
    from sparkpoint.pipeline.runtime import BatchReport, PipelineConfig
    from sparkpoint.tables.sink import Sink

log = logging.getLogger(__name__)


def observe_checkpoint(config: PipelineConfig, storage: CheckpointStorage, sink: Sink | None,
                       attempt: RunFacts, meta: CheckpointMetadata, report: BatchReport, *,
                       driver_phases: Sequence[Phase] = ()) -> None:
    """Record checkpoint `meta` in the job's history, and trace it and send its lineage when configured."""
    ended = time.time()
    if config.history_max_checkpoints:
        try:
            record = history_record(attempt, meta, report)
        except Exception as e:  # noqa: BLE001  the history never fails a checkpoint
            log.warning("checkpoint %s: no history record (%s)", meta.checkpoint_id, e)
        else:
            write_record(storage, record, previous=attempt.base, keep=config.history_max_checkpoints)
    if config.traces_endpoint:
        try:
            from sparkpoint.pipeline.traces import emit_traces

            emit_traces(config.traces_endpoint, attempt, meta, ended, driver_phases)
        except Exception as e:  # noqa: BLE001  a trace never fails a checkpoint
            log.warning("checkpoint %s: its trace could not be sent to %s (%s)", meta.checkpoint_id,
                        config.traces_endpoint, e)
    if config.lineage_transport:
        try:
            from sparkpoint.pipeline.lineage import emit_lineage

            emit_lineage(config, sink, attempt, meta, report)
        except Exception as e:  # noqa: BLE001  a lineage event never fails a checkpoint
            log.warning("checkpoint %s: its lineage events could not be sent to %s (%s)", meta.checkpoint_id,
                        config.lineage_transport, e)
