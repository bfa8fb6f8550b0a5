"""The generated pages of the documentation site, written by mkdocs-gen-files at every build.

- `reference/*.md`: the API reference, one `::: path` per public name, which mkdocstrings renders
  from the docstrings. The names come from the packages themselves (`sparkpoint.__all__`,
  `sparkpoint.testing.__all__`, `sparkpoint.airflow.__all__`) plus the state handles, so a name
  added to an `__all__` is in the reference without editing a page.
- The command-line reference, appended to `cli.md`, from the parser (`sparkpoint.cli.build_parser`).
- The configuration table, appended to `configuration.md`, from `sparkpoint.pipeline.settings`.

It also keeps the reference honest: every object the reference shows (a public name and the members
shown with it) needs a docstring with a one-line summary, an example, `Args:` naming each
parameter and `Returns:` when it returns something (STYLE.md). Each gap is a warning, which
`mkdocs build --strict` (`make docs`) turns into a failed build.

Imported by the tests too (`tests/test_docs.py`); nothing runs unless mkdocs-gen-files executes it.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

log = logging.getLogger("mkdocs.plugins.sparkpoint_docs")  # under "mkdocs": --strict counts its warnings


@dataclass(frozen=True)
class Page:
    slug: str  # reference/<slug>.md
    title: str
    intro: str


PAGES = [
    Page("pipeline", "Pipelines and operators",
         "Your pipeline, its keyed operators and the states they declare: `from sparkpoint import Pipeline, "
         "KeyedOperator, StateDescriptor, compare_states`."),
    Page("state", "State",
         "What an operator's functions receive (`state`, a `RocksDBStateBackend`), the handles it opens "
         "(`state.value_state(...)` and the others), timers (`state.timers`) and time to live (`StateTtl`). "
         "The guide: [Writing operators](../writing-operators.md)."),
    Page("codecs", "Codecs", "How a state's values are stored: `from sparkpoint import RecordCodec, JsonCodec, "
                             "StructCodec, BytesCodec`."),
    Page("notebook", "Notebook API", "Checkpoints and state as pandas DataFrames, from a notebook or a script."),
    Page("testing", "Testing", "`sparkpoint.testing`: your operator on real RocksDB without Spark, and storage "
                               "faults for any fsspec filesystem."),
    Page("dagster", "Dagster", "Your pipeline as Dagster definitions. The guide: [Dagster](../dagster.md)."),
    Page("airflow", "Airflow", "`sparkpoint.airflow` (`pip install 'sparkpoint[airflow]'`). The guide: "
                               "[Airflow](../airflow.md)."),
]

# The page of each module a public name lives in. A public name from another module stops the build
# with a message saying to add it here.
PAGE_OF_MODULE = {
    "sparkpoint.pipeline.spec": "pipeline",
    "sparkpoint.state.operators": "pipeline",
    "sparkpoint.tables.spec": "pipeline",
    "sparkpoint.state.schema": "pipeline",
    "sparkpoint.state.backend": "state",
    "sparkpoint.state.kinds.value": "state",
    "sparkpoint.state.kinds.map": "state",
    "sparkpoint.state.kinds.list": "state",
    "sparkpoint.state.kinds.reducing": "state",
    "sparkpoint.state.timers": "state",
    "sparkpoint.state.ttl": "state",
    "sparkpoint.state.codecs": "codecs",
    "sparkpoint.state.record": "codecs",
    "sparkpoint.api": "notebook",
    "sparkpoint.testing.harness": "testing",
    "sparkpoint.testing.faultyfs": "testing",
    "sparkpoint.factory": "dagster",
    "sparkpoint.component": "dagster",
    "sparkpoint.airflow": "airflow",
    "sparkpoint.airflow.operators": "airflow",
    "sparkpoint.airflow.dags": "airflow",
}

# Public classes that no `__all__` exports: what `state.value_state(...)` and the others return, and
# the arguments every Airflow operator takes.
EXTRA = {
    "sparkpoint.state.kinds.value.ValueState": "state.value_state(name, codec)",
    "sparkpoint.state.kinds.map.MapState": "state.map_state(name, codec)",
    "sparkpoint.state.kinds.list.ListState": "state.list_state(name, codec)",
    "sparkpoint.state.kinds.reducing.ReducingState": "state.reducing_state(name, codec, reduce)",
    "sparkpoint.state.timers.TimerService": "state.timers",
    "sparkpoint.airflow.operators.SparkpointOperator": "the base of every sparkpoint operator",
}

_CLEAR = "clear"
# The members the reference shows of classes whose other public methods are the machinery's
# (restore, snapshot, the sweep) or a framework's (Airflow's execute, fsspec's file methods).
# Any other class shows its own public methods and properties.
MEMBERS: dict[str, list[str]] = {
    "sparkpoint.state.backend.RocksDBStateBackend": ["value_state", "map_state", "list_state", "reducing_state",
                                                     "declared", "timers", "clock"],
    "sparkpoint.state.kinds.value.ValueState": ["get", "put", "delete", "get_many", "put_many", "update_many",
                                                "update_many_encoded", "get_many_table", "put_many_table", "items",
                                                _CLEAR],
    "sparkpoint.state.kinds.map.MapState": ["get", "contains", "put", "delete", "get_many", "put_many", "put_absent",
                                            "entries", "remove_key", "items", _CLEAR],
    "sparkpoint.state.kinds.list.ListState": ["add", "add_many", "get", "get_many", "put", "delete", "items", _CLEAR],
    "sparkpoint.state.kinds.reducing.ReducingState": ["add", "add_many", "get", "get_many", "delete", "items",
                                                      _CLEAR],
    "sparkpoint.state.timers.TimerService": ["register", "register_many", "delete", "list"],
    "sparkpoint.state.record.RecordCodec": ["schema", "encode", "decode", "decode_table", "encode_table"],
    "sparkpoint.testing.faultyfs.FaultyFileSystem": ["paused", "total_injected"],
    "sparkpoint.component.PipelineComponent": ["resolve_pipeline"],
}
NO_MEMBERS = ("sparkpoint.airflow.operators.",)  # Airflow calls execute/poke; a user passes arguments
# Classes sparkpoint makes and hands to the operator's functions: their constructor is the machinery's,
# so the reference shows no signature and the rule asks for no `Args:` of it.
NOT_CONSTRUCTED = {"sparkpoint.state.backend.RocksDBStateBackend", *(p for p in EXTRA if ".state." in p)}

# --- what the reference shows ----------------------------------------------------------------------------


@dataclass(frozen=True)
class PublicName:
    name: str  # as a user imports it
    package: str  # ... from this package
    path: str  # where it is defined (what mkdocstrings renders)

    @property
    def page(self) -> str:
        module = self.path.rpartition(".")[0]
        try:
            return PAGE_OF_MODULE[module]
        except KeyError:
            raise SystemExit(f"docs/gen_pages.py: {self.package}.{self.name} is defined in {module}, which has no "
                             "reference page: add the module to PAGE_OF_MODULE") from None


def public_names() -> list[PublicName]:
    """Every name the reference documents, from the packages' own `__all__`."""
    import sparkpoint
    import sparkpoint.airflow  # its __init__ imports no Airflow

    names = [PublicName(n, "sparkpoint", f"{sparkpoint._HOMES[n]}.{n}") for n in sparkpoint.__all__]
    names += [PublicName(n, "sparkpoint.airflow",
                         f"{sparkpoint.airflow._HOMES[n]}.{n}" if n in sparkpoint.airflow._HOMES
                         else f"sparkpoint.airflow.{n}")
              for n in sparkpoint.airflow.__all__]
    testing = _griffe()["testing"]
    for n in sorted(testing.exports or ()):
        member = testing.members[str(n)]
        path = member.target_path if member.is_alias else member.path
        names.append(PublicName(str(n), "sparkpoint.testing", path))
    names += [PublicName(path.rpartition(".")[2], "", path) for path in EXTRA]
    return names


_LOADED: dict[str, Any] = {}


def _griffe() -> Any:
    """The package as griffe reads it (statically, as mkdocstrings does: nothing is imported)."""
    if "sparkpoint" not in _LOADED:
        import griffe

        _LOADED["sparkpoint"] = griffe.load("sparkpoint", search_paths=[str(ROOT)], docstring_parser="google",
                                            resolve_aliases=False)
    return _LOADED["sparkpoint"]


def resolve(path: str) -> Any:
    return _griffe()[path.removeprefix("sparkpoint.")]


def shown_members(obj: Any) -> list[Any]:
    """The members the reference shows of `obj` (a class): see MEMBERS, NO_MEMBERS."""
    if not obj.is_class or obj.path.startswith(NO_MEMBERS):
        return []
    if obj.path in MEMBERS:
        return [obj.all_members[m] for m in MEMBERS[obj.path]]
    out = []
    for name, member in obj.members.items():
        if name.startswith("_") or member.is_alias:
            continue
        if member.is_function or (member.is_attribute and "property" in member.labels):
            out.append(member)
    return out


# --- the docstring rule ------------------------------------------------------------------------------------

_SKIP_PARAMS = {"self", "cls"}
_INDENTED_CODE = re.compile(r"(^|\n)\s*\n {4,}\S")


def docstring_problems(obj: Any, shown_as: str) -> list[str]:
    """What `obj`'s docstring lacks under the rule (empty: nothing), each naming `shown_as`."""
    doc = obj.docstring
    if doc is None or not doc.value.strip():
        return [f"{shown_as} has no docstring: give it a one-line summary, an example and Args/Returns (STYLE.md)"]
    problems = []
    summary = doc.value.strip().splitlines()[0]
    if not summary.strip() or summary.startswith((" ", "Args", "Returns", "Example")):
        problems.append(f"{shown_as}: the docstring's first line must be a one-line summary")
    sections = doc.parse("google")
    kinds = {s.kind.value for s in sections}
    is_property = obj.is_attribute and "property" in obj.labels
    if _needs_example(obj, is_property) and not _has_example(doc.value, kinds):
        problems.append(f"{shown_as}: the docstring has no example (an `Example:` section or a code block)")
    if obj.is_function or (obj.is_class and obj.path not in NOT_CONSTRUCTED):
        documented = {p.name.lstrip("*") for s in sections if s.kind.value == "parameters" for p in s.value}
        missing = [p.name for p in _parameters(obj) if p.name.lstrip("*") not in documented]
        if missing:
            problems.append(f"{shown_as}: `Args:` does not name {', '.join(missing)}")
    if obj.is_function and _returns_something(obj) and not kinds & {"returns", "yields"}:
        problems.append(f"{shown_as}: the docstring has no `Returns:` (or `Yields:`) section")
    return problems


def _parameters(obj: Any) -> list[Any]:
    try:
        params = list(obj.parameters)
    except Exception:  # noqa: BLE001  a class whose __init__ griffe cannot see (a framework's)
        return []
    if obj.is_class and obj.path.startswith(NO_MEMBERS) and not obj.members.get("__init__"):
        return []  # the base's arguments, documented there
    return [p for p in params if p.name not in _SKIP_PARAMS and not p.name.lstrip("*").startswith("_")]


def _needs_example(obj: Any, is_property: bool) -> bool:
    if is_property or obj.is_attribute or obj.is_module:
        return False
    # An exception needs none: its summary says when it is raised.
    return not (obj.is_class and any(re.search(r"(Error|Exception|Mismatch)\b", str(b)) for b in obj.bases))


def _has_example(text: str, kinds: set[str]) -> bool:
    return "examples" in kinds or "```" in text or ">>>" in text or bool(_INDENTED_CODE.search(text))


def _returns_something(obj: Any) -> bool:
    if obj.name == "__init__" or "property" in obj.labels:
        return False
    annotation = obj.returns
    return annotation is not None and str(annotation) not in ("None", "NoReturn")


def undocumented() -> list[str]:
    """Every gap in the docstrings of what the reference shows."""
    problems = []
    for public in public_names():
        obj = resolve(public.path)
        shown_as = f"{public.package}.{public.name}" if public.package else public.path
        problems += docstring_problems(obj, shown_as)
        for member in shown_members(obj):
            problems += docstring_problems(member, f"{shown_as}.{member.name}")
    return problems


# --- the pages ---------------------------------------------------------------------------------------------


def reference_pages() -> dict[str, str]:
    """reference/<slug>.md -> its Markdown, and the reference's index."""
    by_page: dict[str, list[PublicName]] = {p.slug: [] for p in PAGES}
    for public in public_names():
        by_page[public.page].append(public)
    pages = {}
    index = ["# Python API", "",
             "Generated from the docstrings at every build (`make docs`): every public name, where it is "
             "imported from, and its first line.", ""]
    for page in PAGES:
        body = [f"# {page.title}", "", page.intro, ""]
        index += [f"## [{page.title}]({page.slug}.md)", "", "| name | what it is |", "|---|---|"]
        for public in by_page[page.slug]:
            obj = resolve(public.path)
            where = f"`from {public.package} import {public.name}`" if public.package else EXTRA[public.path]
            body += [f"::: {public.path}", "    options:"]
            if public.package:
                body.append(f"      heading: '{public.name}'")
            members = shown_members(obj)
            if obj.is_class:
                body.append(f"      members: {[m.name for m in members]!r}" if members else "      members: false")
                if obj.path in MEMBERS:
                    body.append("      inherited_members: true")
                if obj.path in NOT_CONSTRUCTED:
                    body.append("      merge_init_into_class: false")
            body += ["", f"<small>{where}</small>", ""]
            summary = (obj.docstring.value.strip().splitlines()[0] if obj.docstring else "").replace("|", r"\|")
            index.append(f"| [`{public.name}`]({page.slug}.md#{public.path}) | {summary} |")
        index.append("")
        pages[f"reference/{page.slug}.md"] = "\n".join(body)
    pages["reference/index.md"] = "\n".join(index)
    return pages


def cli_reference(parser: argparse.ArgumentParser | None = None) -> str:
    """Every command of the parser with its usage and every option, as Markdown."""
    if parser is None:
        from sparkpoint.cli import build_parser

        parser = build_parser()
    out = ["## Every command and option", "",
           "Generated from the command's own parser (`sparkpoint.cli.build_parser`) at every build: what "
           "`sparkpoint COMMAND --help` prints.", ""]
    out += ["| command | what it does |", "|---|---|"]
    out += [f"| [`{name}`](#sparkpoint-{name}) | {_escape(_help_of(parser, name))} |"
            for name, _ in _subcommands(parser)]
    out += ["", *_options_table(parser, "Options of `sparkpoint` itself (before or after the command):")]
    for name, sub in _subcommands(parser):
        out += [f"### `sparkpoint {name}`", "", _escape(sub.description or _help_of(parser, name)), ""]
        out += ["```", _usage(sub), "```", ""]
        out += _options_table(sub, "")
    return "\n".join(out)


def _subcommands(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices.items()


def _help_of(parser: argparse.ArgumentParser, command: str) -> str:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                if choice.dest == command:
                    return choice.help or ""
    return ""


def _usage(parser: argparse.ArgumentParser) -> str:
    usage = parser.format_usage().removeprefix("usage: ").strip()
    return re.sub(r"\s+", " ", usage)


def _options_table(parser: argparse.ArgumentParser, title: str) -> list[str]:
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) or action.help == argparse.SUPPRESS:
            continue
        names = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.metavar or action.dest}`"
        value = ""
        if action.nargs != 0:
            value = "|".join(action.choices) if action.choices else (action.metavar or action.dest.upper())
        notes = []
        if action.required and action.option_strings:
            notes.append("required")
        if action.default not in (None, False, [], argparse.SUPPRESS) and action.nargs != 0:
            notes.append(f"default `{action.default}`")
        if action.option_strings and isinstance(action, argparse._AppendAction):
            notes.append("may be repeated")
        text = _escape(action.help or "")
        if notes:
            text = f"{text} ({'; '.join(notes)})" if text else "; ".join(notes)
        rows.append(f"| {names} | {f'`{value}`' if value else ''} | {text} |")
    if not rows:
        return []
    return ([title, ""] if title else []) + ["| option | value | what it does |", "|---|---|---|", *rows, ""]


def _escape(text: str) -> str:
    return text.replace("|", r"\|").replace("<", "&lt;").replace(">", "&gt;")


def configuration_table() -> str:
    """Every setting `--conf`, the Pipeline, the Dagster resources and the Airflow overrides take."""
    from sparkpoint.pipeline.settings import SETTINGS

    rows = ["| our name | Flink's key(s) | default | `sparkpoint run` flag | what it does |", "|---|---|---|---|---|"]
    for setting in SETTINGS:
        if not setting.conf:
            continue
        if not setting.description:
            log.warning("setting %r has no description: add one to its Setting in sparkpoint/pipeline/settings.py",
                        setting.name)
        flink = ", ".join(f"`{k}`" for k in setting.flink)
        default = setting.shown_default or setting.default
        shown = "none" if default is None else f"`{str(default).lower() if isinstance(default, bool) else default}`"
        flag = setting.flag.name if setting.flag else None
        rows.append(f"| `{setting.name}` | {flink} | {shown} | {f'`{flag}`' if flag else ''} | "
                    f"{_escape(setting.description)} |")
    return "\n".join(["## Every setting", "",
                      "Generated from `sparkpoint.pipeline.settings` at every build. A `Pipeline` takes each as a "
                      "field (`rocksdb_*` through `rocksdb=RocksDBOptions(...)`, `checkpoints_dir` as "
                      "`checkpoints_url`) and `with_settings({...})` under either name; `sparkpoint run --conf "
                      "KEY=VALUE`, the component's `settings:` and the Airflow `overrides` take either name.", "",
                      *rows, ""])


def write_pages() -> None:
    """What mkdocs-gen-files runs at every build."""
    import mkdocs_gen_files

    for path, text in reference_pages().items():
        with mkdocs_gen_files.open(path, "w") as f:
            f.write(text)
    with mkdocs_gen_files.open("cli.md", "a") as f:
        f.write("\n" + cli_reference())
    with mkdocs_gen_files.open("configuration.md", "a") as f:
        f.write("\n" + configuration_table())
    for problem in undocumented():
        log.warning("undocumented public name: %s", problem)


if __name__ in ("__main__", "<run_path>"):
    write_pages()
