"""mkdocs hook: the reference pages' tables, generated at build time from the code so they cannot
drift. A page holds a marker line ``<!-- commpatch:NAME -->``; the build replaces it with the table
NAME: ``settings`` (commpatch/config.py's SETTINGS), ``columns`` (commpatch/data/schema.py's
SCHEMA), ``timings`` (the ``timing`` values, data.schema.TIMINGS), ``schema_versions`` (SCHEMA_VERSION,
ADDED_IN), ``cli`` (the argparse parser
of commpatch/cli.py), ``run`` (commpatch.open's Run and the offline API, from their signatures and
docstrings). tests/test_docs.py renders the same markdown and checks it."""

from __future__ import annotations

import argparse
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MARKER = re.compile(r"<!-- commpatch:(\w+) -->")


def _cell(text) -> str:
    """A markdown table cell: pipes escaped, one line."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _code(text) -> str:
    return f"`{text}`" if text not in ("", None) else ""


def settings_table() -> str:
    from commpatch.config import SETTINGS

    lines = ["| variable | setting | default | meaning |", "|---|---|---|---|"]
    for s in SETTINGS:
        default = "all" if s.default is None else (int(s.default) if isinstance(s.default, bool) else s.default)
        if isinstance(default, float) and default.is_integer():
            default = int(default)
        lines.append(f"| `{s.env}` | `{s.name}` | {_code(default)} | {_cell(s.help)} |")
    return "\n".join(lines)


def columns_table() -> str:
    from commpatch.data.schema import SCHEMA

    lines = ["| column | dtype | unit | meaning |", "|---|---|---|---|"]
    lines += [f"| `{c.name}` | {c.dtype} | {c.unit} | {_cell(c.doc)} |" for c in SCHEMA]
    return "\n".join(lines)


def timings_list() -> str:
    from commpatch.data.schema import TIMINGS

    return ", ".join(f"`{t}`" for t in TIMINGS)


def schema_versions() -> str:
    from commpatch.data.schema import ADDED_IN, SCHEMA, SCHEMA_VERSION

    by_version: dict = {}
    for c in SCHEMA:
        by_version.setdefault(ADDED_IN.get(c.name, 1), []).append(f"`{c.name}`")
    lines = [
        f"- version {v}{' (written now)' if v == SCHEMA_VERSION else ''}: {', '.join(by_version[v])}"
        for v in sorted(by_version)
    ]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    """commpatch's argparse parser, as ``commpatch.cli.main`` builds it (taken when it parses)."""
    from commpatch import cli

    class Built(Exception):
        pass

    def grab(self, args=None, namespace=None):
        raise Built(self)

    original = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = grab
    try:
        cli.main([])
    except Built as built:
        return built.args[0]
    finally:
        argparse.ArgumentParser.parse_args = original
    raise RuntimeError("commpatch.cli.main returned without parsing its arguments")


def _usage(p: argparse.ArgumentParser) -> str:
    return " ".join(p.format_usage().replace("usage: ", "", 1).split())


def _option_rows(p: argparse.ArgumentParser) -> list[str]:
    rows = []
    for action in p._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        if action.option_strings:
            name = ", ".join(action.option_strings)
            if action.nargs != 0:  # the option takes a value
                name += " " + (action.metavar or action.dest.upper())
        else:
            name = action.metavar or action.dest
        default = action.default
        if action.nargs == 0 or default in (None, argparse.SUPPRESS):  # a flag: its default is "not given"
            default = ""
        help_text = action.help
        if not help_text and isinstance(action, argparse._StoreFalseAction):
            opposite = [o for a in p._actions if a is not action and a.dest == action.dest for o in a.option_strings]
            help_text = f"the opposite of `{opposite[0]}`" if opposite else ""
        choices = ", ".join(f"`{c}`" for c in action.choices) if action.choices else ""
        rows.append(f"| `{name.strip()}` | {choices} | {_code(default)} | {_cell(help_text or '')} |")
    return rows


def cli_reference() -> str:
    top = parser()
    out = [f"`{_usage(top)}`", "", "| option | choices | default | meaning |", "|---|---|---|---|"]
    out += _option_rows(top)
    subs = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    helps = {c.dest: c.help for c in subs._choices_actions}
    for name, sub in subs.choices.items():
        out += ["", f"## `commpatch {name}`", "", _cell(helps.get(name, "")), "", f"`{_usage(sub)}`", ""]
        rows = _option_rows(sub)
        if rows:
            out += ["| argument | choices | default | meaning |", "|---|---|---|---|"] + rows
    return "\n".join(out)


def _summary_line(obj) -> str:
    """The first paragraph of a docstring, one line."""
    import inspect

    doc = inspect.getdoc(obj) or ""
    return _cell(doc.split("\n\n")[0].replace("``", "`"))


def _signature(f, drop_first: bool = False) -> str:
    """``(a, b=1)``: the parameters without their annotations."""
    import inspect

    params = list(inspect.signature(f).parameters.values())[1 if drop_first else 0 :]
    return "(" + ", ".join(str(p.replace(annotation=inspect.Parameter.empty)) for p in params) + ")"


def _member_rows(owner, prefix: str) -> list[str]:
    import inspect

    rows = []
    for name, member in inspect.getmembers(owner):
        if name.startswith("_"):
            continue
        if isinstance(member, property):
            rows.append(f"| `{prefix}{name}` | {_summary_line(member)} |")
        elif inspect.isfunction(member):
            rows.append(f"| `{prefix}{name}{_signature(member, drop_first=True)}` | {_summary_line(member)} |")
    return rows


def run_reference() -> str:
    """commpatch.open, the Run it returns, compare / Comparison and convert: one row per public member."""
    from commpatch import offline

    def function(f, name) -> str:
        return f"| `{name}{_signature(f)}` | {_summary_line(f)} |"

    lines = ["| member | what it does |", "|---|---|"]
    lines.append(function(offline.open, "commpatch.open"))
    lines.append(
        f"| `commpatch.Run{_signature(offline.Run.__init__, drop_first=True)}` | {_summary_line(offline.Run)} |"
    )
    lines += _member_rows(offline.Run, "run.")
    lines.append(function(offline.compare, "commpatch.compare"))
    lines += _member_rows(offline.Comparison, "comparison.")
    lines.append(function(offline.convert, "commpatch.offline.convert"))
    return "\n".join(lines)


GENERATORS = {
    "settings": settings_table,
    "columns": columns_table,
    "timings": timings_list,
    "cli": cli_reference,
    "schema_versions": schema_versions,
    "run": run_reference,
}


def render(markdown: str) -> str:
    """``markdown`` with every marker replaced by its generated text (an unknown name fails)."""

    def replace(match):
        name = match.group(1)
        if name not in GENERATORS:
            raise KeyError(f"unknown docs marker commpatch:{name}; known: {', '.join(GENERATORS)}")
        return GENERATORS[name]()

    return MARKER.sub(replace, markdown)


def on_config(config, **kwargs):
    if ROOT not in sys.path:  # the checkout's commpatch, as the tests import it
        sys.path.insert(0, ROOT)
    return config


def on_page_markdown(markdown, page, config, files, **kwargs):
    return render(markdown)
