"""The table of settings (`sparkpoint.pipeline.settings.SETTINGS`) is the single source of every
surface: the `sparkpoint run` flags, `--conf` and Flink's keys, the `Pipeline` and `PipelineConfig`
fields, the Dagster resources' fields, the Airflow `overrides`, the component's `settings:` and the
docs' configuration table each take every setting its roles say, with the table's default."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

from sparkpoint.cli import main
from sparkpoint.pipeline import settings
from sparkpoint.pipeline.runtime import PipelineConfig
from sparkpoint.pipeline.settings import SETTINGS, Setting, of_role, resolve_settings
from sparkpoint.pipeline.spec import Pipeline
from sparkpoint.resources import ResourceConfigError, StateBackendResource
from sparkpoint.sample import pipeline as sample
from tests.support.dagster_setup import init_resource

ROOT = Path(__file__).resolve().parents[1]
CONF = [s for s in SETTINGS if s.conf]


def _as_text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _value_on(obj: Any, setting: Setting) -> Any:
    for part in (setting.target or setting.name).split("."):
        obj = getattr(obj, part)
    return obj


def test_each_setting_is_declared_once_with_a_description():
    names = [s.name for s in SETTINGS]
    assert len(names) == len(set(names))
    aliases = [key for s in SETTINGS for key in s.flink]
    assert len(aliases) == len(set(aliases)) and not set(aliases) & set(names)
    assert all(s.description.strip() for s in SETTINGS)
    assert all(s.resource is None or s.resource.role in settings.ROLES for s in SETTINGS)


def test_pipeline_and_its_config_have_a_field_per_setting_with_the_tables_default():
    pipeline = Pipeline("p", sample.operators)
    config = pipeline.config()
    for setting in SETTINGS:
        if setting.shown_default:  # a location: its default is where the pipeline's name puts it
            continue
        assert _value_on(pipeline, setting) == setting.default, setting.name
        assert _value_on(config, setting) == setting.default, setting.name
        assert _value_on(pipeline.settings, setting) == setting.default if setting.field == setting.name else True
    fields = {f.name for f in dataclasses.fields(PipelineConfig)}
    assert {s.field for s in SETTINGS} - {"checkpoints_url"} <= fields


@pytest.mark.parametrize("setting", [s for s in CONF if s.default is not None], ids=lambda s: s.name)
def test_conf_takes_each_setting_by_our_name_and_flinks_keys(setting: Setting):
    """(A setting whose default is None, such as `event_time`, has no default to give as text:
    the test of its own feature gives it a value.)"""
    for key in (setting.name, setting.name.replace("_", "-"), *setting.flink):
        resolved = resolve_settings({key: _as_text(setting.default)})
        field, _, part = (setting.target or setting.name).partition(".")
        assert (getattr(resolved[field], part) if part else resolved[field]) == setting.default, key


def test_conf_refuses_a_setting_the_table_says_it_does_not_take():
    for setting in SETTINGS:
        if not setting.conf:
            with pytest.raises(ValueError, match="unknown setting"):
                resolve_settings({setting.name: _as_text(setting.default)})


def test_run_has_each_settings_flag_unset_by_default_so_the_pipelines_own_setting_stays():
    from sparkpoint.cli import build_parser

    run = next(a for a in build_parser()._subparsers._actions if a.choices and "run" in a.choices).choices["run"]
    actions = {option: action for action in run._actions for option in action.option_strings}
    for setting in SETTINGS:
        if setting.flag is None:
            continue
        action = actions[setting.flag.name]
        assert action.default is None, setting.name
        assert action.dest == setting.flag.dest
        if setting.flag.choices:
            assert list(action.choices) == list(setting.flag.choices)


def test_a_run_flag_and_conf_set_the_setting_on_the_runs_config(tmp_path: Path):
    from sparkpoint.cli import build_parser
    from sparkpoint.cli.run import run_config

    base = ["run", "--input", str(tmp_path / "in"), "--checkpoints", str(tmp_path / "c"), "--job-id", "j"]
    args = build_parser().parse_args([*base, "--max-future-event-time", "60", "--conf", "routing=shuffle"])
    _, config, _ = run_config(args)
    assert (config.max_future_event_time, config.routing) == (60.0, "shuffle")
    args = build_parser().parse_args([*base, "--conf", "max_future_event_time=none"])
    assert run_config(args)[1].max_future_event_time is None


def test_each_resource_has_a_field_per_setting_of_its_role_with_the_tables_default():
    from sparkpoint import resources

    classes = {"storage": resources.CheckpointStorageResource, "registry": resources.CheckpointRegistryResource,
               "state_backend": resources.StateBackendResource, "source": resources.InputResource}
    for role, cls in classes.items():
        for setting in of_role(role):
            assert setting.resource is not None
            default = setting.resource.none_as if setting.default is None and setting.resource.none_as is not None \
                else setting.default
            assert cls.model_fields[setting.resource_field].default == default, (role, setting.name)


def test_the_resources_carry_a_pipelines_settings_and_give_them_back():
    from sparkpoint.resources import PipelineResources, resources_for

    pipeline = sample.with_(max_future_event_time=None, on_bad_file="skip", parallelism=3, from_checkpoint=None,
                            routing="shuffle", num_retained=4)
    made = resources_for(pipeline)
    assert made["source"].max_future_event_time is None and made["registry"].from_checkpoint == ""
    config = PipelineResources(made["storage"], made["registry"], made["state_backend"], made["source"]).config(
        pipeline)
    for setting in SETTINGS:
        if setting.resource is not None:
            assert _value_on(config, setting) == _value_on(pipeline, setting), setting.name


def test_airflow_overrides_and_the_components_settings_take_every_conf_key():
    from sparkpoint.airflow.operators import resolve_pipeline
    from sparkpoint.component import PipelineComponent

    given = {s.flink[0] if s.flink else s.name: _as_text(s.default) for s in CONF if s.default is not None}
    given["max_future_event_time"] = "none"
    by_airflow = resolve_pipeline(sample, given)
    by_component = PipelineComponent(pipeline="sparkpoint.sample:pipeline", settings=given).resolve_pipeline()
    for pipeline in (by_airflow, by_component):
        assert pipeline.max_future_event_time is None
        assert pipeline.settings == dataclasses.replace(sample.settings, max_future_event_time=None)


def test_the_docs_table_lists_each_conf_setting_with_its_default_and_flag(monkeypatch: pytest.MonkeyPatch):
    spec = importlib.util.spec_from_file_location("gen_pages_for_settings", ROOT / "docs" / "gen_pages.py")
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, gen)
    spec.loader.exec_module(gen)
    rows = {line.split("|")[1].strip(): line for line in gen.configuration_table().splitlines()
            if line.startswith("| `")}
    for setting in CONF:
        row = rows[f"`{setting.name}`"]
        assert all(f"`{key}`" in row for key in setting.flink)
        if setting.flag is not None:
            assert f"`{setting.flag.name}`" in row
    assert "| `max_future_event_time` |  | `86400.0` | `--max-future-event-time` |" in rows["`max_future_event_time`"]


def test_the_values_the_table_repeats_are_those_of_the_modules_that_act_on_them():
    from sparkpoint.pipeline.badfiles import ON_BAD_FILE
    from sparkpoint.spark.routing import ROUTINGS
    from sparkpoint.spark.settling import SETTLE_SECONDS
    from sparkpoint.state.eventtime import MAX_FUTURE_EVENT_TIME

    assert (settings.ON_BAD_FILE, settings.ROUTINGS, settings.MAX_FUTURE_EVENT_TIME, settings.SETTLE_SECONDS) == (
        ON_BAD_FILE, ROUTINGS, MAX_FUTURE_EVENT_TIME, SETTLE_SECONDS)


@pytest.mark.parametrize("value", [32769, 0])
def test_max_parallelism_outside_key_group_bounds_is_refused_at_resource_setup(value: int):
    with pytest.raises(ResourceConfigError, match=r"max_parallelism must be between 1 and 32768"):
        init_resource(StateBackendResource(max_parallelism=value, parallelism=1))


@pytest.mark.parametrize("conf", ["parallelism.default=0", "parallelism=3", "pipeline.max-parallelism=40000"])
def test_parallelism_through_conf_is_checked_like_the_flag(tmp_path: Path, capsys, conf: str):
    (tmp_path / "in").mkdir()
    args = ["run", "--input", str(tmp_path / "in"), "--checkpoints", f"file://{tmp_path}/ckpt", "--job-id", "job"]
    with pytest.raises(SystemExit):  # the flag: refused by the parser
        main([*args, "--parallelism", "0"])
    capsys.readouterr()
    extra = ["--max-parallelism", "2"] if conf == "parallelism=3" else []  # 3 subtasks over 2 key groups
    code = main([*args, *extra, "--conf", conf])
    err = capsys.readouterr().err
    assert code == 2 and "parallelism must be between 1 and" in err, err
    assert not (tmp_path / "ckpt").exists(), "refused before anything was written"
