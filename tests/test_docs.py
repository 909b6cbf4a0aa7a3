"""The documentation site stays true: it builds with ``mkdocs build --strict``; its reference pages
are generated from the code (settings, CLI, columns); and every other table in docs/ is either
checked here against the code or, for measured figures, names the benchmark or test that
reproduces them."""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys

import pytest

from commpatch.config import SETTINGS
from commpatch.data.schema import SCHEMA, TIMINGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")


def _hook():
    spec = importlib.util.spec_from_file_location("docs_reference_hook", os.path.join(DOCS, "_hooks", "reference.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


HOOK = _hook()


def page(name: str) -> str:
    """A docs page's markdown as the site shows it (markers replaced by their generated text)."""
    with open(os.path.join(DOCS, name)) as f:
        return HOOK.render(f.read())


def tables(markdown: str) -> list[tuple[tuple[str, ...], list[list[str]]]]:
    """Every pipe table: (header cells, rows of cells)."""
    out, lines = [], markdown.splitlines()
    for i, line in enumerate(lines):
        if i + 1 < len(lines) and line.startswith("|") and re.match(r"^\|(\s*:?-+:?\s*\|)+\s*$", lines[i + 1]):
            rows = []
            for row in lines[i + 2 :]:
                if not row.startswith("|"):
                    break
                rows.append(_cells(row))
            out.append((tuple(_cells(line)), rows))
    return out


def _cells(line: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def _names(cell: str) -> list[str]:
    """The `code` spans of a cell."""
    return re.findall(r"`([^`]+)`", cell)


# ---- the generated reference pages (were README checks) ----------------------------------------


def test_every_column_is_in_the_reference():
    text = page("reference/columns.md")
    for col in SCHEMA:
        assert f"| `{col.name}` | {col.dtype} |" in text, f"column {col.name} missing from the column reference"
    assert "<!-- commpatch:" not in text


def test_every_setting_is_documented():
    for name in ("reference/settings.md", "guide/usage.md"):
        text = page(name)
        for setting in SETTINGS:
            assert f"| `{setting.env}` |" in text, f"{setting.env} missing from {name}"


def test_every_timing_value_is_named_in_the_columns_page_and_explained_in_the_timing_page():
    assert all(f"`{t}`" in page("reference/columns.md") for t in TIMINGS)
    ((header, rows),) = [t for t in tables(page("guide/timing.md")) if t[0][0] == "`timing`"]
    assert {_names(r[0])[0] for r in rows} == set(TIMINGS)


def test_cli_reference_has_every_command_and_option():
    import argparse

    parser = HOOK.parser()
    text = page("reference/cli.md")
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) >= {"run", "report", "convert", "env", "install-hook"}
    for name, p in sub.choices.items():
        assert f"## `commpatch {name}`" in text
        for action in p._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert f"`{option}" in text, f"commpatch {name} {option} missing from the CLI reference"
    assert "`--version`" in text
    for _header, rows in tables(text):
        for row in rows:
            assert row[-1], f"the CLI reference has no meaning for {row[0]} (give it a help= in commpatch/cli.py)"


def test_schema_version_section_is_the_codes():
    from commpatch.data.schema import ADDED_IN, SCHEMA_VERSION

    text = page("reporting.md")
    assert f"- version {SCHEMA_VERSION} (written now):" in text
    for name, version in ADDED_IN.items():
        line = next(line for line in text.splitlines() if line.startswith(f"- version {version}"))
        assert f"`{name}`" in line
    assert "_log." not in text and "(2)" not in text.split("### Schema version")[1].split("###")[0]


# ---- the other tables: each checked against the code -------------------------------------------


def _check_api(rows):
    import commpatch

    documented = {re.match(r"(\w+)", name).group(1) for r in rows for name in _names(r[0])}
    public = {
        n for n in commpatch.__all__ if callable(getattr(commpatch, n)) and not isinstance(getattr(commpatch, n), type)
    }
    public -= {"is_enabled"}  # documented with enable()/disable() in prose
    assert public <= documented, f"public functions missing from the API table: {public - documented}"
    assert documented <= set(commpatch.__all__), (
        f"the API table names non-public functions: {documented - set(commpatch.__all__)}"
    )


def _report_parser():
    import argparse

    sub = next(a for a in HOOK.parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["report"]


def _check_report_flags(rows):
    """Every option of `commpatch report` is in the table, and every default the table states is the parser's."""
    parser = _report_parser()
    by_option = {o: a for a in parser._actions for o in a.option_strings}
    documented = set()
    for r in rows:
        for name in _names(r[0]):
            flag = name.split()[0]
            if flag == "PATHS":
                continue
            assert flag in by_option, f"the report flag table documents {flag}, which `commpatch report` does not have"
            documented.add(flag)
            stated = re.search(r"default `([^`]+)`", r[1])
            if stated and by_option[flag].default not in (None, False):
                assert stated.group(1) == str(by_option[flag].default), (flag, stated.group(1), by_option[flag].default)
    missing = {o for o in by_option if o not in ("-h", "--help")} - documented
    assert not missing, f"report options missing from docs/reporting.md's flag table: {missing}"


def _check_mismatch_kinds(rows):
    """The kinds listed are the enum's (tests/test_mismatch_kinds.py: the kinds both engines
    produce are its members)."""
    from commpatch.analysis import MismatchKind

    kinds = [_names(r[0])[0] for r in rows]
    assert len(kinds) == len(set(kinds)), f"a mismatch kind listed twice: {kinds}"
    assert set(kinds) == {k.value for k in MismatchKind}, "docs/reporting.md's kinds are not MismatchKind's"


def _report_columns(section: str) -> set:
    """The columns of a section of the report (render.text.build_report) on a synthetic 4-rank log."""
    from commpatch.render import text
    from commpatch.testing import make_log

    return set(text.build_report(make_log(4, 6, straggler=1)).sections[section].columns)


def _steps_columns() -> set:
    return _report_columns("steps")


def _column_table(columns):
    def check(rows):
        documented = {n for r in rows for n in _names(r[0])}
        real = columns()
        assert documented <= real | {"step", "rank"}, f"documented columns the table does not have: {documented - real}"

    return check


def _check_step_figures(rows):
    real = _steps_columns()
    for r in rows:
        name = _names(r[0])[0]
        assert name in real, f"docs/guide/reports.md defines {name}, not a column of analysis.per_step"


def _check_watchdog_settings(rows):
    envs = {s.env for s in SETTINGS}
    for r in rows:
        assert _names(r[0])[0] in envs


def _check_gpu_kit_options(rows):
    with open(os.path.join(ROOT, "benchmarks", "gpu", "validate.py")) as f:
        source = f.read()
    options = set(re.findall(r'add_argument\(\s*"(--[\w-]+)"', source))
    documented = {_names(r[0])[0].split()[0] for r in rows}
    assert documented == options, (documented, options)


def _check_matrix_cells(rows):
    with open(os.path.join(ROOT, "ci", "matrix.sh")) as f:
        cells = dict(re.findall(r'\[(\w+)\]="([\d.]+ [\d.]+)"', f.read()))  # name -> "python torch"
    for r in rows:
        name = r[0].split()[0]
        if name in cells:
            python, torch = cells[name].split()
            assert r[1].startswith(python) and r[2].startswith(torch), (r, cells[name])
    assert set(cells) <= {r[0].split()[0] for r in rows}


def _check_advice_keys(rows):
    from commpatch.analysis import advice

    assert {_names(r[0])[0] for r in rows} == set(advice.KEYS)


def _check_headline_keys(rows):
    from commpatch.render import text
    from commpatch.testing import make_log

    headline = text.build_report(make_log(4, 6, straggler=1)).headline
    for r in rows:
        for key in _names(r[1]):
            assert key in headline, f"docs/html-report.md: the headline has no {key}"


def _check_advice_causes(rows):
    from commpatch.analysis import advice

    # "`input` (0)": the cause's name and its index in advice.CAUSES (the evidence's "cause")
    listed = [(_names(r[0])[0], int(re.search(r"\((\d+)\)", r[0]).group(1))) for r in rows]
    assert listed == [(c, i) for i, c in enumerate(advice.CAUSES)], listed


def _check_metric_names(rows):
    from commpatch.metrics import METRICS, PREFIX

    documented = {n for r in rows for n in _names(r[0])}
    served = {PREFIX + name + ("_total" if kind == "counter" else "") for name, (kind, _) in METRICS.items()}
    assert documented == served, documented ^ served
    for r in rows:
        kinds = {METRICS[n.removeprefix(PREFIX).removesuffix("_total")][0] for n in _names(r[0])}
        assert kinds == {r[1]}, (r[0], r[1], kinds)


def _check_run_reference(rows):
    from commpatch.offline import Run

    described = {re.match(r"`run\.(\w+)", r[0]).group(1) for r in rows if r[0].startswith("`run.") and r[1]}
    public = {n for n in dir(Run) if not n.startswith("_")}
    assert public <= described, f"members of Run without a docstring in reference/run.md: {public - described}"
    assert all(r[1] for r in rows), [r[0] for r in rows if not r[1]]


# (page, first header cell) -> check of the rows
CHECKED = {
    ("advice.md", "key"): _check_advice_keys,
    ("advice.md", "cause"): _check_advice_causes,
    ("html-report.md", "label"): _check_headline_keys,
    ("live.md", "metric"): _check_metric_names,
    ("guide/usage.md", "function"): _check_api,
    ("guide/usage.md", "variable"): lambda rows: None,  # generated (commpatch:settings)
    ("reference/settings.md", "variable"): lambda rows: None,  # generated
    ("reference/columns.md", "column"): lambda rows: None,  # generated
    ("reference/cli.md", "option"): lambda rows: None,  # generated
    ("reference/cli.md", "argument"): lambda rows: None,  # generated
    ("reference/run.md", "member"): _check_run_reference,  # generated
    ("guide/timing.md", "`timing`"): lambda rows: None,  # test_every_timing_value_...
    ("guide/reports.md", "figure"): _check_step_figures,
    ("reporting.md", "flag"): _check_report_flags,
    ("reporting.md", "kind"): _check_mismatch_kinds,
    ("reporting.md", "column"): None,  # by section, below
    ("reliability.md", "setting"): _check_watchdog_settings,
    ("gpu-validation.md", "option"): _check_gpu_kit_options,
    ("compatibility.md", "cell"): _check_matrix_cells,
}
REPORT_SECTIONS = {name: (lambda name=name: _report_columns(name)) for name in ("summary", "steps", "ranks")}

# pages whose other tables are measured figures: each names the files that reproduce them
MEASURED = {
    "advice.md": ("benchmarks/advice_loop.py",),
    "reliability.md": ("benchmarks/durable.py", "tests/test_faults.py"),
    "reporting.md": ("tests/test_bad_input.py",),
    "decisions/ddp-cost.md": ("benchmarks/ddp_hook_cost.py", "benchmarks/ddp_step.py"),
    "decisions/c-recorder.md": ("benchmarks/overhead.py",),
    "decisions/module-attribution.md": ("benchmarks/module_attribution.py",),
    "decisions/fsdp.md": ("tests/test_integrations_fsdp.py",),
    "decisions/hidden-collectives.md": ("benchmarks/compiled_collectives.py",),
    "decisions/interception.md": ("benchmarks/dispatch_interception.py",),
    "decisions/real-frameworks.md": ("tests/test_shares.py",),
    "decisions/report-at-scale.md": ("benchmarks/merge_scale.py", "benchmarks/engine_choice.py"),
    "decisions/steps-and-shares.md": ("benchmarks/steps_ground_truth.py",),
    "decisions/straggler-verdict.md": ("benchmarks/verdicts.py",),
    "gpu-validation.md": ("benchmarks/gpu/device_run.sh",),  # and tests/test_gpu_kit.py checks the results table
}


def _pages():
    for path in sorted(glob.glob(os.path.join(DOCS, "**", "*.md"), recursive=True)):
        yield os.path.relpath(path, DOCS)


def test_every_decision_record_names_what_reproduces_it():
    """A decision record's figures and claims name the benchmark or test that measures them."""
    unnamed = []
    for name in _pages():
        if name.startswith("decisions/") and name != "decisions/index.md":
            text = page(name)
            found = re.findall(r"\b(?:benchmarks|tests)/[\w/]+\.py", text)
            if not [f for f in found if os.path.exists(os.path.join(ROOT, f))]:
                unnamed.append(name)
    assert not unnamed, f"decision records naming no benchmark or test that reproduces them: {unnamed}"


def test_every_table_in_the_docs_is_generated_or_checked():
    unchecked = []
    for name in _pages():
        text = page(name)
        section_of = _sections(text)
        for header, rows in tables(text):
            key = (name, header[0])
            if key == ("reporting.md", "column"):
                section = section_of(rows)
                assert section in REPORT_SECTIONS, f"reporting.md: a column table in an unknown section {section}"
                _column_table(REPORT_SECTIONS[section])(rows)
            elif key in CHECKED:
                CHECKED[key](rows)
            elif name in MEASURED:
                for reproducer in MEASURED[name]:
                    assert os.path.exists(os.path.join(ROOT, reproducer)), reproducer
                    assert reproducer in text or os.path.basename(reproducer) in text, (name, reproducer)
            else:
                unchecked.append(key)
    assert not unchecked, f"tables neither generated nor checked by tests/test_docs.py: {unchecked}"


def _sections(text: str):
    """rows -> the `(name)` of the ### heading above their table."""

    def section_of(rows):
        index = next(i for i, line in enumerate(text.splitlines()) if _cells(line) == rows[0] and line.startswith("|"))
        above = [line for line in text.splitlines()[:index] if line.startswith("### ")]
        match = re.search(r"\(`(\w+)`\)", above[-1]) if above else None
        return match.group(1) if match else None

    return section_of


def test_no_reference_to_removed_modules():
    removed = (
        "commpatch.export",
        "commpatch.merge",
        "commpatch.plots",
        "commpatch.report",
        "commpatch.trace",
        "commpatch.synthetic",
        "_log.",
        "design-notes",
    )
    for name in list(_pages()) + ["../README.md"]:
        with open(os.path.join(DOCS, name)) as f:
            text = f.read()
        for old in removed:
            assert not re.search(re.escape(old) + r"\b", text), f"{name} still names {old}"


def test_every_commpatch_name_in_the_docs_exists():
    """`commpatch.x.y` in the README and docs names a module or attribute that exists (the reporting
    page once named modules that did not)."""
    import importlib

    not_code = {"commpatch.schema_version"}  # the Parquet metadata key
    missing = []
    for name in list(_pages()) + ["../README.md"]:
        with open(os.path.join(DOCS, name)) as f:
            text = f.read()
        for dotted in sorted(set(re.findall(r"`(commpatch(?:\.[A-Za-z_]\w*)+)", text)) - not_code):
            parts = dotted.split(".")
            for i in range(len(parts), 0, -1):
                try:
                    obj = importlib.import_module(".".join(parts[:i]))
                except ImportError:
                    continue
                rest = parts[i:]
                break
            try:
                for attr in rest:
                    obj = getattr(obj, attr)
            except AttributeError:
                missing.append((name, dotted))
    assert not missing, f"the docs name what does not exist: {missing}"


def test_no_dated_history_in_readme():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text)
    assert not re.search(r"[Ee]arlier on|[Uu]ntil today|previous release|\bissue \d+", text)


# what dates a sentence: the history belongs in CHANGELOG.md; README and docs say what is true now
DATED = re.compile(
    r"\b20\d\d-[01]\d-[0-3]\d\b"  # a date
    r"|\b(?:earlier|later) (?:today|tonight|on\b)|\buntil today\b|\byesterday\b|\btonight\b"
    r"|\b(?:this|that) (?:morning|afternoon|evening)\b"
    r"|\bissues? #?\d+|\bissue-\d+\b"  # the project's internal issue numbers
    r"|\b(?:the )?(?:previous|last) release\b"
    r"|\b(?:before|after|until) (?:this|that|the) (?:change|fix)\b|\bfinding, fixed\b|\(before\)",
    re.IGNORECASE,
)


def dated_lines(text: str) -> list[str]:
    """The lines of a markdown page that date what they say, outside code (fenced blocks and
    indented sample output)."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced and not line.startswith("    ") and DATED.search(line):
            out.append(line.strip())
    return out


def test_the_dated_history_check_can_fail():
    planted = (
        "Earlier on 2026-11-22 it took 3 s.\n"
        "Measured tonight.\n"
        "Since issue 25 the log says so.\n"
        "The figures below are the previous release's.\n"
        "Before this change a build paid 30 ns.\n"
        "```\nrank 0 at 2026-11-21 20:22:52\n```\n"
        "    sample output at 2026-11-21 20:22:52\n"
        "The reader keeps whole ranks with no step boundary.\n"
    )
    assert len(dated_lines(planted)) == 5


def test_no_dated_history_outside_the_changelog():
    pages = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(DOCS, "**", "*.md"), recursive=True))
    found = []
    for path in pages:
        with open(path, encoding="utf-8") as f:
            found += [f"{os.path.relpath(path, ROOT)}: {line}" for line in dated_lines(f.read())]
    where = "\n".join(found)
    assert not found, f"dated history outside CHANGELOG.md (move it there, or say what is true now):\n{where}"


# ---- the site builds ----------------------------------------------------------------------------


@pytest.mark.slow
def test_site_builds_strict(tmp_path):
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.skip("mkdocs-material is not installed (pip install -e '.[docs]'; CI installs it with the test extra)")
    site = tmp_path / "site"
    res = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert res.returncode == 0, res.stdout + res.stderr
    html = (site / "reference" / "settings" / "index.html").read_text()
    assert all(s.env in html for s in SETTINGS)
    html = (site / "reference" / "columns" / "index.html").read_text()
    assert all(f"<code>{c.name}</code>" in html for c in SCHEMA)
    html = (site / "reference" / "cli" / "index.html").read_text()
    assert "commpatch report" in html and "--fail-on-mismatch" in html
    pages = "".join(p.read_text() for p in site.rglob("*.html"))
    assert "<!-- commpatch:" not in pages and "&lt;!-- commpatch:" not in pages
    # nothing loaded from the web (the theme fetched Google Fonts): an offline reader sees the same site
    loaded = re.findall(r"<(?:link|script|img)\b[^>]*(?:src|href)=\"(https?:)?//[^\"]*", pages)
    assert loaded == [] and "fonts.googleapis" not in pages and "fonts.gstatic" not in pages, loaded[:5]
    shutil.rmtree(site)
