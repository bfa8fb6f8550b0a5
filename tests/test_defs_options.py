"""The factory's options are declared once (`PipelineDefsOptions`): `build_pipeline_defs`'s keywords
and the component's attributes of the same names are its fields, with its defaults."""

from __future__ import annotations

import dataclasses
import inspect

import dagster as dg

from sparkpoint.component import PipelineComponent
from sparkpoint.factory import build_pipeline_defs, pipeline_defs
from sparkpoint.resources.options import PipelineDefsOptions
from sparkpoint.sample import pipeline as sample

FIELDS = {f.name: f for f in dataclasses.fields(PipelineDefsOptions)}


def test_the_factorys_keywords_are_the_options_fields_with_their_defaults():
    keywords = {n: p for n, p in inspect.signature(build_pipeline_defs).parameters.items() if n != "pipeline"}
    assert set(keywords) == set(FIELDS) - {"land_batch"}
    defaults = PipelineDefsOptions()
    for name, parameter in keywords.items():
        assert parameter.default == getattr(defaults, name), name


def test_the_components_attributes_of_the_options_names_default_as_the_options_do():
    component = PipelineComponent(pipeline="sparkpoint.sample:pipeline")
    given = {n for n in PipelineComponent.model_fields if n in FIELDS}
    assert given == {"key_prefix", "group_name", "owners", "tags", "schedule", "landing_sensor",
                     "landing_settle_seconds", "landing_retry_seconds", "tick"}
    defaults = PipelineDefsOptions()
    options = component.defs_options()
    for name in given:
        assert getattr(options, name) == (getattr(defaults, name) or type(getattr(options, name))()), name


def test_pipeline_defs_takes_the_options_and_keywords_on_top(tmp_path):
    pipeline = sample.with_(name="opts", job_id="opts", checkpoints_url=str(tmp_path / "c"),
                            input_url=str(tmp_path / "in"))
    parts = pipeline_defs(pipeline, PipelineDefsOptions(group_name="g", landing_sensor=False),
                          schedule="*/5 * * * *", schedule_status=dg.DefaultScheduleStatus.STOPPED)
    assert parts.scope.group_name == "g" and parts.jobs.schedule is not None
    assert parts.jobs.schedule.default_status == dg.DefaultScheduleStatus.STOPPED
    assert parts.sensor("input_sensor").default_status == dg.DefaultSensorStatus.STOPPED
