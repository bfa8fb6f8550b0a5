"""`PipelineComponent`: a sparkpoint pipeline declared in a Dagster project's `defs.yaml`.

    dg scaffold defs sparkpoint.PipelineComponent clicks

    # defs/clicks/defs.yaml
    type: sparkpoint.PipelineComponent
    attributes:
      pipeline: my_project.pipelines:clicks      # a sparkpoint.Pipeline ...
      # ... or inline:
      # name: clicks
      # operators: [my_project.operators:clicks_per_user]
      # input_url: landing/clicks
      settings:                                  # our names or Flink's keys
        state.checkpoints.num-retained: 3

It builds what `build_pipeline_defs` builds, and is refused as it is when another pipeline of the
process writes the same job directory; `dg check defs` and `dg dev` load it.

`dg scaffold defs sparkpoint.PipelineComponent <name>` writes a `defs.yaml` that names every field
a user fills in, each with a comment saying what it does: `pipeline` set to where a project keeps
it (`<project>.pipelines:<name>`, or what `--pipeline MODULE:ATTR` says), every other field
commented out with an example (`PipelineScaffolder`).
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

import dagster as dg
from pydantic import BaseModel

from sparkpoint.factory import pipeline_defs
from sparkpoint.pipeline.runtime import PipelineError
from sparkpoint.pipeline.settings import BY_NAME
from sparkpoint.pipeline.spec import Pipeline, load_operator, load_pipeline
from sparkpoint.resources.options import PipelineDefsOptions

_DEFAULTS = PipelineDefsOptions()

_LOCATIONS = ("input_url", "checkpoints_url", "output_url", "local_dir", "job_id")


class PipelineScaffoldParams(BaseModel):
    pipeline: str | None = None  # MODULE:ATTR of a sparkpoint.Pipeline (default: <project>.pipelines:<name>)


DEFS_YAML = """\
type: {type_name}

# A sparkpoint pipeline (keyed RocksDB state, incremental checkpoints) as Dagster assets, checks,
# jobs and sensors. Name your pipeline one of the two ways below, uncomment what you need, then
# run `dg check defs`.
attributes:
  # Either your sparkpoint.Pipeline defined in Python, as MODULE:ATTR ...
  pipeline: {pipeline}
  #
  # ... or, instead of `pipeline`, the pipeline declared here: its name (the default job id and the prefix of every
  # Dagster name it makes) and its operators (MODULE:ATTR of each sparkpoint.KeyedOperator).
  # name: {name}
  # operators:
  #   - {module}.operators:{name}_per_user
  #
  # Where it reads, writes and keeps its local state (any fsspec URL; default: the pipeline's own).
  # input_url: s3://landing/{name}
  # checkpoints_url: s3://checkpoints
  # output_url: s3://output/{name}
  # local_dir: /var/lib/sparkpoint/{name}
  # job_id: {name}
  # storage_options: {{endpoint_url: "http://127.0.0.1:9000"}}
  #
  # Settings: sparkpoint's names or Flink's keys, as `sparkpoint run --conf`.
  # settings:
  #   state.checkpoints.num-retained: 3
  #   parallelism.default: 2
  #
  # Its assets: key prefix and group (default: the pipeline's name), owners and tags.
  # key_prefix: [{name}]
  # group_name: {name}
  # owners: ["team:data"]
  # tags: {{domain: {name}}}
  #
  # When it runs. schedule: a cron for the checkpoint job. landing_sensor: the input sensor runs
  # it when a batch file lands, once the file is unchanged for landing_settle_seconds; a file a
  # run did not consume is offered again after landing_retry_seconds (doubling). tick: a
  # scheduled run that finds no batch makes a checkpoint of no input (timers fire, TTL expires).
  # schedule: "*/15 * * * *"
  # landing_sensor: true
  # landing_settle_seconds: {settle:g}
  # landing_retry_seconds: {retry:g}
  # tick: false
"""


def defs_yaml(type_name: str, name: str, module: str, pipeline: str | None = None) -> str:
    """The `defs.yaml` `dg scaffold defs` writes for a pipeline named `name` in project `module`."""
    return DEFS_YAML.format(type_name=type_name, name=name, module=module,
                            pipeline=pipeline or f"{module}.pipelines:{name}",
                            settle=BY_NAME["settle_seconds"].default, retry=_DEFAULTS.landing_retry_seconds)


def _project_module(request: dg.ScaffoldRequest[Any]) -> str:
    """The project's root module, for the examples: the first folder of the target under the project."""
    try:
        parts = request.target_path.resolve().relative_to(Path(request.project_root or "").resolve()).parts
    except ValueError:
        return "my_project"
    parts = parts[1:] if parts[:1] == ("src",) else parts
    return parts[0] if len(parts) > 1 else "my_project"


class PipelineScaffolder(dg.Scaffolder[PipelineScaffoldParams]):
    """`dg scaffold defs sparkpoint.PipelineComponent NAME [--pipeline MODULE:ATTR]`."""

    @classmethod
    def get_scaffold_params(cls) -> type[PipelineScaffoldParams]:
        return PipelineScaffoldParams

    def scaffold(self, request: dg.ScaffoldRequest[PipelineScaffoldParams]) -> None:
        if request.scaffold_format != "yaml":  # a component.py: Dagster's own
            dg.scaffold_component(request, {})
            return
        text = defs_yaml(request.type_name, request.target_path.name, _project_module(request),
                         request.params.pipeline if request.params else None)
        if request.append:
            with open(request.target_path, "a") as f:
                f.write("---\n" + text)
        else:
            (request.target_path / "defs.yaml").write_text(text)


@dg.scaffold_with(PipelineScaffolder)
class PipelineComponent(dg.Component, dg.Model, dg.Resolvable):
    """A sparkpoint pipeline declared in a `dg` project's `defs.yaml`: what `build_pipeline_defs` builds.

    SSTable assets per operator, the checkpoint asset, input and output, recovery, retention and the
    input-landing sensor. `dg scaffold defs sparkpoint.PipelineComponent NAME` makes one; `dg list
    components` lists it; `dg check defs` and `dg dev` load it.

    Example:
        ```yaml
        # my_project/defs/pages/defs.yaml
        type: sparkpoint.PipelineComponent
        attributes:
          pipeline: my_project.pipelines:pages           # a sparkpoint.Pipeline; or inline:
          # name: pages
          # operators: [my_project.operators:pages_per_user]
          # input_url: s3://landing/pages
          settings:                                      # our names or Flink's keys, as `run --conf`
            state.checkpoints.num-retained: 3
          owners: ["team:web"]
        ```

    Attributes:
        pipeline: `MODULE:ATTR` of a `sparkpoint.Pipeline` (what is set below goes on top of it).
        name: inline: the pipeline's name (default job id, prefix of every name).
        operators: inline: `MODULE:ATTR` of each `sparkpoint.KeyedOperator`.
        input_url: where batch files land.
        checkpoints_url: the checkpoint storage.
        output_url: the exactly-once sink's output.
        local_dir: the working RocksDB instances.
        job_id: the job's directory under `checkpoints_url`.
        storage_options: fsspec options of the storage.
        settings: retention, parallelism, ...: our names or Flink's keys.
        key_prefix: prefix of the asset keys.
        group_name: the assets' group.
        owners: owners of every asset.
        tags: tags of every asset.
        schedule: a cron for the checkpoint job.
        landing_sensor: run the checkpoint job when a batch file lands.
        landing_settle_seconds: ... once it has been unchanged this long.
        landing_retry_seconds: a file a run did not consume: offered again after this (doubling).
        tick: a scheduled run with no batch to read makes a checkpoint of no input (timers, TTL).
    """

    pipeline: str | None = None  # MODULE:ATTR of a sparkpoint.Pipeline
    name: str | None = None  # inline: the pipeline's name (default job id, prefix of every name)
    operators: list[str] = []  # inline: MODULE:ATTR of each sparkpoint.KeyedOperator
    input_url: str | None = None
    checkpoints_url: str | None = None
    output_url: str | None = None
    local_dir: str | None = None
    job_id: str | None = None
    storage_options: dict[str, Any] | None = None
    settings: dict[str, Any] = {}  # retention, parallelism, ...: our names or Flink's keys
    key_prefix: list[str] | None = None
    group_name: str | None = None
    owners: list[str] = []
    tags: dict[str, str] = {}
    schedule: str | None = None  # cron for the checkpoint job
    landing_sensor: bool = _DEFAULTS.landing_sensor  # run the checkpoint job when a batch file lands
    landing_settle_seconds: float | None = None  # ... unchanged this long (None: the pipeline's settle_seconds)
    landing_retry_seconds: float = _DEFAULTS.landing_retry_seconds  # a file a run did not consume: again after this
    tick: bool = _DEFAULTS.tick  # a scheduled run with no batch to read makes a checkpoint of no input (timers, TTL)

    def build_defs(self, context: dg.ComponentLoadContext) -> dg.Definitions:
        return pipeline_defs(self.resolve_pipeline(), self.defs_options()).definitions()

    def defs_options(self) -> PipelineDefsOptions:
        """The factory's options this component sets: its attributes named as the options' fields."""
        names = {f.name for f in fields(PipelineDefsOptions)} & set(type(self).model_fields)
        return PipelineDefsOptions(**{name: getattr(self, name) for name in names})

    def resolve_pipeline(self) -> Pipeline:
        """The Pipeline this component declares: the referenced one with what is set here on top,
        or one built inline.

        Example:
            ```python
            component = PipelineComponent(pipeline="my_project.pipelines:pages", settings={"parallelism.default": 4})
            component.resolve_pipeline().parallelism          # 4
            ```

        Returns:
            The `sparkpoint.Pipeline`.

        Raises:
            PipelineError: both `pipeline` and inline `operators`, or neither with a name; a setting it refuses.
        """
        given = {k: getattr(self, k) for k in _LOCATIONS if getattr(self, k) is not None}
        if self.storage_options is not None:
            given["storage_options"] = self.storage_options
        if self.pipeline:
            if self.operators:
                raise PipelineError("PipelineComponent: give either `pipeline` or inline `operators`, not both")
            base = load_pipeline(self.pipeline)
            if self.name:
                given["name"] = self.name
            base = base.with_(**given) if given else base
        else:
            if not self.name or not self.operators:
                raise PipelineError("PipelineComponent: give `pipeline: MODULE:ATTR`, or `name` and `operators` "
                                    "(a list of MODULE:ATTR of KeyedOperator)")
            base = Pipeline(self.name, [load_operator(ref) for ref in self.operators], **given)
        return base.with_settings(self.settings) if self.settings else base
