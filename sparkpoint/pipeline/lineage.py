"""OpenLineage run events of a checkpoint (`lineage_transport`; off by default, and then nothing of
`openlineage` is imported): one run per checkpoint, a START at the time it was triggered and a
COMPLETE once it stands, sent together by its completer. Inputs: the batch's files (a directory
input) or the input table at the version the checkpoint consumed up to; output: the sink (a table
with the version the checkpoint made, its rows, files and columns); the job is the pipeline's job
id in `lineage_namespace`, with its type, and the run carries the checkpoint's facts.
"""

from __future__ import annotations

import functools
import posixpath
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from sparkpoint.checkpoint.metadata import CheckpointMetadata
from sparkpoint.pipeline.history import RunFacts
from sparkpoint.spark.offsets import SourceOffsets
from sparkpoint.tables.sinks import output_facts, table_version
from sparkpoint.tables.spec import DELTA_SCHEME

if TYPE_CHECKING:
    from sparkpoint.pipeline.runtime import BatchReport, PipelineConfig
    from sparkpoint.tables.sink import Sink

FACET_SCHEMA = "urn:sparkpoint:facet:CheckpointRunFacet:1"  # a custom facet names its schema


def dataset_name(url: str) -> tuple[str, str]:
    """(namespace, name) of a location, as OpenLineage names datasets: `file` and the absolute path
    for a local file, `<scheme>://<authority>` and the path for anything else (`s3://bucket`,
    `key/…`); a Delta table by its location, an Iceberg table as `iceberg://<catalog>` and its name."""
    url = url.removeprefix(DELTA_SCHEME)
    parts = urlsplit(url)
    if parts.scheme in ("", "file", "local"):
        return "file", parts.path if parts.scheme else url
    return f"{parts.scheme}://{parts.netloc}", parts.path.lstrip("/") or "/"


@functools.cache
def _client(transport: str) -> Any:
    """One client per transport and process (the file transport appends to one file)."""
    from openlineage.client import OpenLineageClient
    from openlineage.client.transport.console import ConsoleConfig, ConsoleTransport
    from openlineage.client.transport.file import FileConfig, FileTransport
    from openlineage.client.transport.http import HttpConfig, HttpTransport

    if transport == "console":
        return OpenLineageClient(transport=ConsoleTransport(ConsoleConfig()))
    if transport.startswith("file://"):
        path = urlsplit(transport).path
        return OpenLineageClient(transport=FileTransport(FileConfig(log_file_path=path, append=True)))
    return OpenLineageClient(transport=HttpTransport(HttpConfig(url=transport, timeout=5.0)))


@functools.cache
def _facet_class() -> Any:
    """The run facet of a checkpoint's facts (made once: `openlineage` is imported only when on)."""
    import attr
    from openlineage.client.generated.base import RunFacet

    @attr.define
    class CheckpointRunFacet(RunFacet):
        checkpointId: int  # noqa: N815
        kind: str
        statePath: str  # noqa: N815
        stateSize: int  # noqa: N815
        checkpointedSize: int  # noqa: N815
        filesNew: int  # noqa: N815
        filesReused: int  # noqa: N815
        rows: int
        seconds: float

        @staticmethod
        def _get_schema() -> str:
            return FACET_SCHEMA

    return CheckpointRunFacet


def _checkpoint_facet(meta: CheckpointMetadata, report: BatchReport) -> Any:
    return _facet_class()(
        checkpointId=meta.checkpoint_id, kind=meta.kind, statePath=meta.metadata_path,
        stateSize=meta.stats.state_size, checkpointedSize=meta.stats.checkpointed_size,
        filesNew=meta.stats.files_new, filesReused=meta.stats.files_reused, rows=report.rows,
        seconds=round(report.seconds, 3))


def _inputs(config: PipelineConfig, attempt: RunFacts) -> list[Any]:
    from openlineage.client.event_v2 import InputDataset
    from openlineage.client.facet_v2 import dataset_version_dataset

    table = SourceOffsets.from_json(attempt.source_offsets).table
    if table is not None:
        namespace, name = dataset_name(table.table or config.input_url)
        return [InputDataset(namespace, name, facets={
            "version": dataset_version_dataset.DatasetVersionDatasetFacet(datasetVersion=str(table.version))})]
    base = config.input_url.rstrip("/")
    return [InputDataset(*dataset_name(posixpath.join(base, f))) for f in attempt.files]


def _outputs(config: PipelineConfig, sink: Sink | None, meta: CheckpointMetadata) -> list[Any]:
    from openlineage.client.event_v2 import OutputDataset
    from openlineage.client.facet_v2 import dataset_version_dataset, output_statistics_output_dataset, schema_dataset

    if sink is None or not config.output_url:
        return []
    staged = list((meta.source_offsets or {}).get("sink") or [])
    facts = output_facts(sink, meta.checkpoint_id, staged)
    facets: dict[str, Any] = {}
    version = table_version(facts)
    if version is not None and version[1] is not None:
        facets["version"] = dataset_version_dataset.DatasetVersionDatasetFacet(datasetVersion=str(version[1]))
    if facts.get("columns"):
        pairs: Iterable[tuple[str, Any]] = (facts["columns"].items() if isinstance(facts["columns"], dict)
                                           else facts["columns"])
        facets["schema"] = schema_dataset.SchemaDatasetFacet(
            fields=[schema_dataset.SchemaDatasetFacetFields(name=n, type=str(t)) for n, t in pairs])
    stats = output_statistics_output_dataset.OutputStatisticsOutputDatasetFacet(
        rowCount=facts.get("rows"), fileCount=facts.get("files"))
    return [OutputDataset(*dataset_name(config.output_url), facets=facets, outputFacets={"outputStatistics": stats})]


def emit_lineage(config: PipelineConfig, sink: Sink | None, attempt: RunFacts, meta: CheckpointMetadata,
                 report: BatchReport) -> None:
    """Send the checkpoint's START and COMPLETE events through `config.lineage_transport`."""
    from openlineage.client.event_v2 import Job, Run, RunEvent, RunState
    from openlineage.client.facet_v2 import job_type_job, processing_engine_run
    from openlineage.client.uuid import generate_new_uuid

    import sparkpoint

    client = _client(config.lineage_transport)
    job = Job(namespace=config.lineage_namespace, name=config.job_id, facets={
        "jobType": job_type_job.JobTypeJobFacet(processingType="BATCH", integration="SPARKPOINT",
                                                jobType="CHECKPOINT")})
    run_id = str(generate_new_uuid())
    facets = {"processing_engine": processing_engine_run.ProcessingEngineRunFacet(
        version=sparkpoint.__version__, name="sparkpoint"), "sparkpoint_checkpoint": _checkpoint_facet(meta, report)}
    inputs, outputs = _inputs(config, attempt), _outputs(config, sink, meta)
    started = datetime.fromtimestamp(attempt.started_at, UTC).isoformat()
    for state, when in ((RunState.START, started), (RunState.COMPLETE, datetime.now(UTC).isoformat())):
        client.emit(RunEvent(eventType=state, eventTime=when, run=Run(runId=run_id, facets=facets), job=job,
                             inputs=inputs, outputs=outputs))
