"""The offline entry point, ``commpatch.open(path)`` -> ``Run``: its report is the one `commpatch
report` prints (the same JSON and text, with pandas and with DuckDB), its selections of ranks and
steps are the CLI's, bad input raises the CLI's one-line errors as exceptions, and the CLI reaches
the offline side only through it (cli.py's imports, parsed)."""

from __future__ import annotations

import ast
import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

import commpatch
from commpatch import offline
from commpatch.analysis import engine
from commpatch.testing import write_binary_run, write_rank_files

from .test_report import run_cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINES = ["pandas", pytest.param("duckdb", marks=pytest.mark.skipif(not engine.available(), reason="needs duckdb"))]


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    out = tmp_path_factory.mktemp("logs")
    write_rank_files(str(out), 4, 8, p2p=True, straggler=3, mismatch=(1, 9))
    return str(out)


# ---- the same report as the CLI --------------------------------------------------------------
@pytest.mark.parametrize("engine_name", ENGINES)
def test_the_run_reports_what_the_cli_prints(logs, capsys, engine_name):
    code, out, _ = run_cli(capsys, logs, "--format", "json", "--engine", engine_name)
    assert code == 0
    with commpatch.open(logs, engine=engine_name) as run:
        assert run.engine == engine_name
        assert run.json() + "\n" == out  # the same text with either engine (DuckDB sums in a fixed order)
        rep = run.report()
        assert rep.errors and "bytes mismatch in group 0 at collective #10" in rep.errors[0]
        assert run.findings() == rep.findings and run.findings()
        assert run.summary() is rep.sections["summary"]
        assert run.steps() is rep.sections["steps"] and len(run.steps()) == 8
        assert run.steady_state()["steps"] > 0
    _, text, _ = run_cli(capsys, logs, "--engine", engine_name)
    _, markdown, _ = run_cli(capsys, logs, "--engine", engine_name, "--format", "markdown")
    _, csv, _ = run_cli(capsys, logs, "--engine", engine_name, "--format", "csv", "--section", "ranks")
    run = commpatch.open(logs, engine=engine_name)
    assert (run.text() + "\n", run.markdown() + "\n", run.csv("ranks")) == (text, markdown, csv)
    run.close()


def test_the_engines_agree_through_the_run(logs):
    if not engine.available():
        pytest.skip("needs duckdb (commpatch[scale])")
    with commpatch.open(logs, engine="pandas") as a, commpatch.open(logs, engine="duckdb") as b:
        # every finding, the set-up one included (the DuckDB report adds an 'engine' finding only where it
        # leaves the small-message advice out: more steady-state rows than engine.ADVICE_ROWS)
        assert [f.text for f in a.findings()] == [f.text for f in b.findings()]
        assert "engine" not in [f.kind for f in b.findings()]
        assert a.report().errors == b.report().errors
        sa, sb = a.summary(by=["op"]), b.summary(by=["op"])
        assert sa["count"].tolist() == sb["count"].tolist()
        # the same sums in another order (tests/test_engine_parity.py)
        assert sa["total_us"].tolist() == pytest.approx(sb["total_us"].tolist(), rel=1e-12, abs=0)
        with pytest.raises(commpatch.ConfigError, match="the engine's summary is by"):
            b.summary(by=["api"])  # a column the engine does not stage: one line
        assert a.summary(by=["api"])["count"].sum() == sa["count"].sum()
        assert b._engine is not None  # the staged tables stay until close()
        directory = b._engine.directory
    assert not os.path.exists(directory)


@pytest.mark.parametrize("engine_name", ENGINES)
@pytest.mark.parametrize(
    "ranks, steps",
    [("1-2", None), (None, "2:5"), ("0,3", ":4"), ([0, 3], (None, 4)), ({1, 2}, range(2, 5)), (3, slice(1, None))],
)
def test_ranks_and_steps_select_as_the_cli_does(logs, capsys, engine_name, ranks, steps):
    def text(value, sep):
        if isinstance(value, (range, slice)):
            return f"{value.start if value.start is not None else ''}:{value.stop if value.stop is not None else ''}"
        if isinstance(value, tuple):
            return ":".join("" if v is None else str(v) for v in value)
        if isinstance(value, (set, list)):
            return sep.join(map(str, sorted(value)))
        return str(value)

    argv = [logs, "--format", "json", "--engine", engine_name]
    argv += ["--ranks", text(ranks, ",")] if ranks is not None else []
    argv += ["--steps", text(steps, ":")] if steps is not None else []
    code, out, _ = run_cli(capsys, *argv)
    assert code == 0
    with commpatch.open(logs, ranks=ranks, steps=steps, engine=engine_name) as run:
        assert run.json() + "\n" == out
        df = run.rows()
    want = offline.parse_ranks(ranks) if ranks is not None else {0, 1, 2, 3}
    assert set(df["rank"].unique().tolist()) == want
    lo, hi = offline.parse_steps(steps) or (None, None)
    assert (lo is None or df["step"].min() >= lo) and (hi is None or df["step"].max() < hi)


def test_several_directories_are_one_run_across_hosts(tmp_path, capsys):
    a, b = tmp_path / "host_a", tmp_path / "host_b"
    files = write_rank_files(str(tmp_path / "all"), 4, 5, straggler=1)
    for host, ranks in ((a, (0, 1)), (b, (2, 3))):
        host.mkdir()
        for r in ranks:
            os.replace(files[r], host / f"rank{r}.csv")
    code, out, _ = run_cli(capsys, a, b, "--format", "json")
    assert code == 0
    run = commpatch.open([a, b])
    assert run.to_dict() == json.loads(out)
    assert sorted(run.rows()["rank"].unique().tolist()) == [0, 1, 2, 3]


# ---- bad input: the CLI's one-line errors, as exceptions -----------------------------------------
BAD = {
    # case -> (Run keyword arguments, the CLI options with the same values)
    "ranks not a number": (dict(ranks="0-x"), ["--ranks", "0-x"]),
    "ranks backwards": (dict(ranks="5-2"), ["--ranks", "5-2"]),
    "steps backwards": (dict(steps="5:2"), ["--steps", "5:2"]),
    "by unknown column": (dict(by="op,nope"), ["--by", "op,nope"]),
    "by nothing": (dict(by=","), ["--by", ","]),
    "top negative": (dict(top=-1), ["--top", "-1"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_arguments_raise_the_clis_one_line_error(logs, capsys, case):
    kwargs, argv = BAD[case]
    code, _, err = run_cli(capsys, logs, *argv)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    with pytest.raises(commpatch.ConfigError) as raised:
        commpatch.open(logs, **kwargs)
    (name,) = kwargs
    # the same sentence; the argument named as the caller names it (ranks=..., --ranks ...)
    assert err == f"commpatch report: {raised.value}\n".replace(f"{name}", argv[0], 1)


def test_a_missing_path_raises_the_clis_error(tmp_path, capsys):
    missing = tmp_path / "nope"
    code, _, err = run_cli(capsys, missing)
    assert code == 2
    run = commpatch.open(missing)  # nothing is read until asked
    with pytest.raises(commpatch.LogFileError) as raised:
        run.report()
    assert isinstance(raised.value, FileNotFoundError)
    assert err == f"commpatch report: {raised.value}\n" and str(missing) in err


def test_nothing_in_the_selection_is_one_line(logs, capsys):
    code, _, err = run_cli(capsys, logs, "--ranks", "100-200")
    with pytest.raises(commpatch.LogFileError) as raised:
        commpatch.open(logs, ranks="100-200").report()
    assert code == 2 and err == f"commpatch report: {raised.value}\n"
    assert "no collective calls recorded in the log file(s) for the ranks / steps asked" in err


def test_other_bad_arguments_are_config_errors(logs, tmp_path):
    for kwargs in (
        dict(engine="polars"),
        dict(ranks=[-1]),
        dict(ranks=[]),
        dict(steps=(1, 2, 3)),
        dict(steps="-1:4"),
        dict(paths=[]),
        dict(progress=False),  # a flag where a function progress(done, total) goes: a TypeError inside before
        # before: TypeError 'int' object is not iterable, KeyError 'end_ns'
        dict(paths=5),
        dict(paths=None),
        dict(paths=[logs, 3]),
        dict(by=5),
        dict(step_times=[1, 2]),
        dict(step_times=pd.DataFrame({"step": [1], "end_ns": [5]})),
        dict(step_times=pd.DataFrame({"step": ["x"], "duration_us": [5.0]})),
    ):
        paths = kwargs.pop("paths", logs)
        with pytest.raises(commpatch.ConfigError) as raised:
            commpatch.open(paths, **kwargs)
        assert "\n" not in str(raised.value)
    with pytest.raises(commpatch.ConfigError, match=r"by 3: give one or more columns"):
        commpatch.open(logs).summary(by=3)
    with pytest.raises(commpatch.ConfigError, match=r"paths 5: give a log file, a directory, a glob or a list of them"):
        commpatch.read_csv(5)
    with pytest.raises(commpatch.ConfigError, match="no 'nope' section for this log"):
        commpatch.open(logs).csv("nope")
    with pytest.raises(commpatch.ConfigError, match="steps file needs columns step and duration_us"):
        bad = tmp_path / "steps.csv"
        bad.write_text("a,b\n1,2\n")
        commpatch.open(logs, step_times=bad)


def test_step_times_and_paths_are_taken_in_every_form(logs):
    """A DataFrame of step times is checked as the CSV is and used as it is; ``Path.glob(...)`` (an
    iterator of paths) reads what the list of the same paths reads."""
    import pathlib

    times = pd.DataFrame({"step": np.arange(8), "duration_us": np.full(8, 12_345.0)})
    steps = commpatch.open(logs, step_times=times).steps()
    steady = steps[steps["stage"] == "steady"]
    assert len(steady) and (steady["step_us"] == 12_345.0).all() and (steady["step_time_from"] == "user").all()
    files = sorted(pathlib.Path(logs).glob("rank*"))
    a = commpatch.open(iter(files)).report().headline
    assert a == commpatch.open([str(f) for f in files]).report().headline


def test_outputs_are_checked_and_written_beside_never_through_links(logs, tmp_path):
    """Every output of a Run: a path that is not one, a directory for a file (or a file for a
    directory) is a one-line ConfigError naming it, and nothing is left behind (before: TypeError,
    IsADirectoryError with the HTML page's temporary file left beside the directory, FileExistsError).
    A link at the output's name is replaced by the file, its target untouched (before: the trace,
    the module tree and the plots were written through it)."""
    run = commpatch.open(logs)
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("mine")
    for call, arg, said in (
        (run.write_html, tmp_path / "adir", "is a directory (give a file name)"),
        (run.write_html, None, "give the path of a file to write"),
        (run.write_trace, 5, "give the path of a file to write"),
        (run.plots, tmp_path / "afile", "exists and is not a directory"),
    ):
        with pytest.raises(commpatch.ConfigError) as raised:
            call(arg)
        assert said in str(raised.value) and "\n" not in str(raised.value), raised.value
    assert sorted(os.listdir(tmp_path)) == ["adir", "afile"] and os.listdir(tmp_path / "adir") == []
    target = tmp_path / "target.txt"
    target.write_text("keep me")
    for name, write in (
        ("t.json", run.write_trace),
        ("t.json.gz", run.write_trace),
        ("p.html", run.write_html),
    ):
        link = tmp_path / name
        link.symlink_to(target)
        if name == "p.html":  # the page refuses a link at its name, as before
            with pytest.raises(OSError, match="symbolic link"):
                write(link)
            continue
        assert write(link) == str(link)
        assert not link.is_symlink() and target.read_text() == "keep me"
    with gzip.open(tmp_path / "t.json.gz", "rt") as f:
        assert json.load(f)["traceEvents"] == json.loads((tmp_path / "t.json").read_text())["traceEvents"]


# ---- files --------------------------------------------------------------------------------------
def test_the_runs_files_are_the_clis(logs, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    cli_dir, run_dir = tmp_path / "cli", tmp_path / "run"
    code, _, err = run_cli(
        capsys, logs, "--trace", cli_dir / "t.json", "--plots", cli_dir / "plots", "--html", cli_dir / "r.html"
    )
    assert code == 0, err
    with commpatch.open(logs) as run:
        assert run.write_trace(run_dir / "deep" / "t.json") == str(run_dir / "deep" / "t.json")
        written = run.plots(run_dir / "plots")
        page = run.write_html(run_dir / "r.html")
    assert json.loads((run_dir / "deep" / "t.json").read_text()) == json.loads((cli_dir / "t.json").read_text())
    assert sorted(os.path.basename(p) for p in written) == sorted(os.listdir(cli_dir / "plots"))
    assert os.path.getsize(page) > 10_000 and (cli_dir / "r.html").exists()


def test_compare_is_the_clis(tmp_path, capsys):
    runs = []
    for world in (2, 4):
        d = tmp_path / f"w{world}"
        write_rank_files(str(d), world, 6)
        runs.append(str(d))
    code, out, _ = run_cli(capsys, "--compare", *runs, "--format", "json", "--global-batch", "32")
    assert code == 0
    cmp = commpatch.compare(runs, global_batch=32)
    assert json.loads(cmp.json()) == json.loads(out)
    assert cmp.unknown_steps() == []
    with pytest.raises(commpatch.ConfigError, match="give a positive number of samples"):
        commpatch.compare(runs, global_batch=0)
    with pytest.raises(commpatch.ConfigError, match=r"progress True: give a function progress\(done, total\) or None"):
        commpatch.compare(runs, progress=True)


def test_convert_yields_each_log_once_and_never_replaces(tmp_path):
    files = write_binary_run(str(tmp_path / "run"), 8, 200, straggler=None, mismatch=None)
    first = list(offline.convert(str(tmp_path / "run")))
    assert [w for _, w in first] == [True] * len(files) and all(os.path.exists(p) for p, _ in first)
    again = list(offline.convert(str(tmp_path / "run")))
    assert again == [(p, False) for p, _ in first]
    with pytest.raises(commpatch.LogFileError, match="no binary rank log"):
        list(offline.convert(str(tmp_path / "run" / os.path.basename(first[0][0]))))


# ---- the package: commpatch.open costs nothing until used, and hides no builtin --------------------
def test_open_is_lazy_and_not_star_exported():
    code = (
        "import sys, commpatch; assert 'pandas' not in sys.modules and 'commpatch.offline' not in sys.modules; "
        "import builtins; from commpatch import *; assert open is builtins.open; "
        "assert commpatch.open is __import__('commpatch.offline').offline.open; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr
    assert "open" not in commpatch.__all__ and {"Run", "compare"} <= set(commpatch.__all__)


# ---- the rule: the CLI calls the offline side only through commpatch.offline ----------------------
# what cli.py may import of commpatch: the settings, the version, the live view, the offline entry
# point, and (for `commpatch run`, the recorder side) io.paths.check_writable
CLI_MAY_IMPORT = {
    "commpatch.config": None,
    "commpatch._version": None,
    "commpatch.watch": None,
    "commpatch.offline": None,
    "commpatch.io.paths": {"check_writable"},
}


def cli_rule_violations(source: str) -> list[str]:
    """What cli.py (``source``) imports of commpatch beyond CLI_MAY_IMPORT, and the private names
    of ``offline`` it uses."""
    bad = []
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = "commpatch" + ("." + node.module if node.module else "") if node.level else node.module or ""
            if not base.startswith("commpatch"):
                continue
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in CLI_MAY_IMPORT and CLI_MAY_IMPORT[full] is None:  # `from . import offline`
                    continue
                allowed = CLI_MAY_IMPORT.get(base, set())
                if base not in CLI_MAY_IMPORT or (allowed is not None and alias.name not in allowed):
                    bad.append(f"line {node.lineno}: from {base} import {alias.name}")
                elif base == "commpatch.offline" and alias.name.startswith("_"):
                    bad.append(f"line {node.lineno}: {base}.{alias.name} is private")
        elif isinstance(node, ast.Import):
            bad += [f"line {node.lineno}: import {a.name}" for a in node.names if a.name.startswith("commpatch")]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "offline":
            if node.attr.startswith("_"):
                bad.append(f"line {node.lineno}: offline.{node.attr} is private")
    return bad


def test_the_cli_reaches_the_offline_side_only_through_run():
    with open(os.path.join(ROOT, "commpatch", "cli.py"), encoding="utf-8") as f:
        assert cli_rule_violations(f.read()) == []


@pytest.mark.parametrize(
    "line",
    [
        "from . import analysis, io",
        "from .render import text as report",
        "from .io.reader import LogFileError",
        "from .analysis import engine",
        "from .data.schema import COLUMNS",
        "from .io.paths import export_path",
        "import commpatch.render.html",
        "from .offline import _paths",
        "x = offline._engine",
    ],
)
def test_the_cli_rule_can_fail(line):
    assert cli_rule_violations(f"def f():\n    {line}\n"), line
    assert not cli_rule_violations("def f():\n    from . import offline\n    from .io.paths import check_writable\n")


def test_a_duckdb_failure_is_one_line_and_cleans_up(logs, capsys, monkeypatch):
    if not engine.available():
        pytest.skip("needs duckdb (commpatch[scale])")
    made = []

    def out_of_memory(self, *args):
        made.append(self.directory)
        raise engine.EngineError("Out of Memory Error: failed to allocate data of size 2.0 GiB\n(2.0 GiB/2.0 GiB used)")

    monkeypatch.setattr(engine.Engine, "results", out_of_memory)
    code, out, err = run_cli(capsys, logs, "--engine", "duckdb")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert (
        err.startswith("commpatch report: the DuckDB engine failed (Out of Memory Error") and "--engine pandas" in err
    )
    run = commpatch.open(logs, engine="duckdb")
    with pytest.raises(engine.EngineError, match="computes the same report in memory") as raised:
        run.report()
    assert "\n" not in str(raised.value)
    assert made and not any(os.path.exists(d) for d in made)  # the staged tables are removed
