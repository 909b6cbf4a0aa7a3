"""The offline entry point: ``commpatch.open(paths, ranks=..., steps=...)`` gives a ``Run``, which
owns reading a run's rank logs, picks the backend (pandas in memory, or DuckDB in bounded memory
for large logs: ``analysis.engine``) and gives the run's analyses and every output ``commpatch
report`` writes (text, Markdown, JSON, CSV, Chrome trace, module tree, plots, HTML, TensorBoard).
``compare`` does the same for runs of one job at several world sizes; ``convert`` turns binary
rank logs into CSV or Parquet. The CLI parses options, prints and exits: what it reports comes
from here.

Bad input raises one-line errors: ``ConfigError`` for an argument (each validator takes the name
its caller gives the argument: ``ranks`` here, ``--ranks`` in the CLI), ``LogFileError`` for the
logs, ``EngineError`` when DuckDB fails (out of memory or disk space)."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import math
import os
import re
import reprlib
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from . import analysis, io
from .analysis import diff as _diff
from .analysis import engine as _engine
from .analysis import spark
from .analysis.engine import EngineError
from .analysis.pattern import StepPatternWarning
from .config import ConfigError
from .data.logfile import SUFFIX
from .data.schema import COLUMNS
from .io import discovery
from .io.reader import LogFileError, LogFileWarning, chosen_run
from .render import diffs as _diffs
from .render import html, plots, trace, trackers
from .render import tensorboard as tensorboard_writer
from .render import text as _text
from .render.people import terminal_safe

__all__ = [
    "DEFAULT_BY",
    "ENGINES",
    "Comparison",
    "ConfigError",
    "EngineError",
    "LogFileError",
    "LogFileWarning",
    "NO_MODULES",
    "Run",
    "StepPatternWarning",
    "check_by",
    "check_engine",
    "check_global_batch",
    "check_output",
    "check_plots",
    "check_tensorboard",
    "check_tracker",
    "check_top",
    "compare",
    "convert",
    "is_steps_window",
    "open",
    "parse_ranks",
    "parse_steps",
    "read_step_times",
    "terminal_safe",
]

DEFAULT_BY = ("collective", "size_bucket")
ENGINES = ("auto", "pandas", "duckdb", "spark")
SQL_ENGINES = ("duckdb", "spark")  # the report from staged Parquet files (analysis.engine)
PLOT_BINS = 200  # arrival-matrix columns of the plots and the HTML page (DuckDB engine)
SCALING = {
    "weak": "weak scaling, the same batch per rank: efficiency = T(N0) / T(N), speedup = efficiency x N / N0; "
    "step times are steady-state medians",
    "strong": "strong scaling, the same global batch: speedup = T(N0) / T(N), efficiency = speedup / (N / N0); "
    "step times are steady-state medians",
}
NO_MODULES = "the log has no module column (written by an older commpatch): no module tree"
_WINDOW = re.compile(r"\s*(-?\d*)\s*:\s*(-?\d*)\s*")


# ---- arguments: each validator names the argument as its caller does ---------------------------
def parse_ranks(value, name: str = "ranks") -> set | None:
    """``"0-7,12"``, an int or an iterable of ints -> a set of ranks (None: every rank)."""
    if value is None:
        return None
    if isinstance(value, str):
        out: set = set()
        for part in value.split(","):
            part = part.strip()
            first, dash, last = part.partition("-")
            try:
                lo = int(first)
                hi = int(last) if dash else lo
            except ValueError:
                raise ConfigError(
                    f"{name} {value!r}: {part!r} is not a rank or a range of ranks (e.g. 0-7,12)"
                ) from None
            if lo < 0 or hi < lo:
                raise ConfigError(
                    f"{name} {value!r}: {part!r} is not a range of ranks (give first-last with "
                    "0 <= first <= last, e.g. 0-7,12)"
                )
            out.update(range(lo, hi + 1))
        return out
    items = [value] if isinstance(value, int) else value
    try:
        ranks = list(items)
    except TypeError:
        raise ConfigError(f"{name} {value!r}: give ranks as 0-7,12 or a list of ranks") from None
    bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, int) or r < 0]
    if bad:
        raise ConfigError(f"{name} {value!r}: {bad[0]!r} is not a rank (an integer, 0 or more)")
    if not ranks:
        raise ConfigError(f"{name} {value!r}: give one or more ranks (None: every rank)")
    return set(ranks)


def is_steps_window(text) -> bool:
    """``text`` has the shape of a window of steps, ``A:B`` (either end may be left out)."""
    return isinstance(text, str) and _WINDOW.fullmatch(text) is not None


def parse_steps(value, name: str = "steps") -> tuple | None:
    """A window of steps ``"A:B"`` (steps A to B-1; ``"100:"``, ``":50"``), ``(A, B)``, ``range``
    or ``slice`` -> ``(first, stop)`` with None for an open end (None: every step)."""
    if value is None:
        return None
    if isinstance(value, str):
        m = _WINDOW.fullmatch(value)
        if m is None:
            raise ConfigError(f"{name} {value}: give a window of steps A:B (e.g. 100:200, 100:, :50)")
        lo, hi = (int(g) if g else None for g in m.groups())
    elif isinstance(value, (range, slice)) and value.step in (None, 1):
        lo, hi = value.start, value.stop
    elif isinstance(value, tuple) and len(value) == 2:
        lo, hi = value
    else:
        raise ConfigError(f"{name} {value!r}: give a window of steps A:B, (A, B) or range(A, B)")
    for end in (lo, hi):
        if end is not None and (isinstance(end, bool) or not isinstance(end, int)):
            raise ConfigError(f"{name} {value}: the ends of a window of steps are integers (or None: open)")
    if (lo is not None and lo < 0) or (hi is not None and hi < 0):
        raise ConfigError(f"{name} {value}: steps are 0 or more (A:B keeps steps A to B-1)")
    if lo is not None and hi is not None and hi <= lo:
        raise ConfigError(f"{name} {value}: no step in this window (A:B keeps steps A to B-1: give B > A)")
    return None if lo is None and hi is None else (lo, hi)


def check_by(value, name: str = "by") -> list:
    """The summary's grouping: ``"collective,size_bucket"`` or a list of log columns and size_bucket."""
    try:
        by = [b.strip() for b in value.split(",") if b.strip()] if isinstance(value, str) else [str(b) for b in value]
    except TypeError:  # not iterable
        by = []
    if not by:
        raise ConfigError(f"{name} {value!r}: give one or more columns (e.g. op,size_bucket)")
    unknown = [b for b in by if b not in COLUMNS and b != "size_bucket"]
    if unknown:
        raise ConfigError(
            f"{name}: unknown column(s) {', '.join(map(repr, unknown))} (choose from size_bucket, {', '.join(COLUMNS)})"
        )
    return by


def check_top(value, name: str = "top") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{name} {value}: give 0 or more")
    return value


def check_progress(value, name: str = "progress"):
    """None, or a callable ``progress(done, total)``."""
    if value is not None and not callable(value):
        raise ConfigError(f"{name} {value!r}: give a function progress(done, total) or None")
    return value


def check_engine(value, name: str = "engine") -> str:
    """``auto`` (DuckDB from ``analysis.engine.AUTO_BYTES`` of logs on, when installed), ``pandas``
    ``duckdb`` (refused when DuckDB is not installed) or ``spark`` (when PySpark is not)."""
    if value not in ENGINES:
        raise ConfigError(f"{name} {value!r}: choose from {', '.join(ENGINES)}")
    if value == "duckdb" and not _engine.available():
        raise ConfigError(f"{name} duckdb: DuckDB is not installed: pip install 'commpatch[scale]'")
    if value == "spark":
        if not spark.available():
            raise ConfigError(f"{name} spark: PySpark is not installed: {spark.INSTALL}")
        if not spark.java():
            raise ConfigError(
                f"{name} spark: no Java found (PySpark runs on Java 17 or newer): install it or set JAVA_HOME"
            )
    return value


def check_output(path, name: str, directory: bool = False) -> None:
    """Raise when ``path`` (a file, or with ``directory`` a directory) cannot be written: checked
    before anything is read. Missing parent directories are fine (they are created)."""
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ConfigError(f"{name} {path!r}: give the path of a {'directory' if directory else 'file'} to write")
    target = os.path.abspath(path)
    if os.path.exists(target):
        if directory and not os.path.isdir(target):
            raise ConfigError(f"{name} {path}: exists and is not a directory")
        if not directory and os.path.isdir(target):
            raise ConfigError(f"{name} {path}: is a directory (give a file name)")
        if not os.access(target, os.W_OK | (os.X_OK if directory else 0)):
            raise ConfigError(f"{name} {path}: not writable")
        return
    parent = os.path.dirname(target)
    while not os.path.exists(parent):  # the nearest existing ancestor must take a directory
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ConfigError(f"{name} {path}: cannot be written ({parent} is a file, not a directory)")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{name} {path}: cannot be written ({parent} is not writable)")


def check_plots(directory, name: str = "plots") -> None:
    check_output(directory, name, directory=True)
    if importlib.util.find_spec("matplotlib") is None:
        raise ConfigError(f"{name} needs matplotlib: pip install 'commpatch[plots]' (or pip install matplotlib)")


def check_tensorboard(directory, name: str = "tensorboard") -> None:
    check_output(directory, name, directory=True)
    try:
        import tensorboard  # type: ignore[import-untyped]  # noqa: F401 - torch.utils.tensorboard writes with it
    except ImportError:
        raise ConfigError(f"{name} needs the tensorboard package: pip install 'commpatch[tensorboard]'") from None
    earlier = tensorboard_writer.taken(directory)
    if earlier:
        raise ConfigError(
            f"{name} {directory}: {earlier[0]} already holds TensorBoard events (an earlier "
            "report?): give a new directory (TensorBoard would show both as one run)"
        )


TRACKERS = {"mlflow": "mlflow", "wandb": "wandb"}  # extra -> the package it installs (imported by that name)


def check_tracker(kind: str, name: str) -> None:
    """An experiment tracker's package is installed (``render.trackers``), else one line naming the extra."""
    if importlib.util.find_spec(TRACKERS[kind]) is None:
        raise ConfigError(f"{name} needs the {TRACKERS[kind]} package: pip install 'commpatch[{kind}]'")


def read_step_times(path, name: str = "step_times"):
    """A step-times CSV (columns step and duration_us, or start_ns and end_ns; optionally rank),
    checked: one-line ``ConfigError`` for what is wrong; impossible times left out with a warning."""
    if not os.path.exists(path):
        raise ConfigError(f"{name} {path}: no such file")
    if os.path.isdir(path):
        raise ConfigError(f"{name} {path}: is a directory (give the CSV file)")
    try:
        steps = pd.read_csv(path)
    except pd.errors.EmptyDataError:
        raise ConfigError(f"{name} {path}: empty file (a steps file needs a header: step,duration_us)") from None
    except (pd.errors.ParserError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"{name} {path}: not a readable CSV ({' '.join(str(exc).split())[:120]})") from None
    except OSError as exc:
        raise ConfigError(f"{name} {path}: cannot be read ({exc.strerror or exc})") from None
    return _checked_step_times(steps, f"{name} {path}", "a steps file", "in the file")


def check_step_times(value, name: str = "step_times"):
    """``step_times``: None, a step-times CSV's path (``read_step_times``) or a DataFrame of the same
    columns, checked as the file is; anything else is a one-line ``ConfigError``."""
    if value is None:
        return None
    if isinstance(value, (str, os.PathLike)):
        return read_step_times(os.fspath(value), name)
    if isinstance(value, pd.DataFrame):
        return _checked_step_times(value.copy(), name, "a DataFrame of step times", "given")
    raise ConfigError(
        f"{name} {reprlib.repr(value)}: give a CSV file or a DataFrame with columns step and duration_us "
        "(or start_ns and end_ns), optionally rank"
    )


def _checked_step_times(steps, where: str, what: str, held: str):
    """The step times of ``steps`` (a DataFrame, changed in place) checked: ``where`` names them in
    the errors (``what`` needs these columns, no step times ``held``)."""
    steps.columns = [str(c).strip() for c in steps.columns]
    if "step" not in steps or not ({"duration_us"} <= set(steps) or {"start_ns", "end_ns"} <= set(steps)):
        raise ConfigError(
            f"{where}: {what} needs columns step and duration_us (or start_ns and end_ns), optionally rank"
        )
    for col in ("step", "rank", "duration_us", "start_ns", "end_ns"):
        if col not in steps:
            continue
        values = pd.to_numeric(steps[col], errors="coerce")
        bad = values.isna() & steps[col].notna()
        integral = col in ("step", "rank")
        if integral:
            bad |= values.isna() | (values % 1 != 0)
        if bad.any():
            i = int(np.flatnonzero(bad.to_numpy())[0])
            raise ConfigError(
                f"{where}: column {col!r} holds {str(steps[col].iloc[i])[:40]!r} "
                f"{f'on line {i + 2}' if held == 'in the file' else f'in row {i}'}, "
                f"not {'an integer' if integral else 'a number'}"
            )
        steps[col] = values.astype(np.int64) if integral else values.astype(np.float64)
    if "duration_us" not in steps:
        steps["duration_us"] = (steps["end_ns"] - steps["start_ns"]) / 1e3
    d = steps["duration_us"].to_numpy(np.float64)
    impossible = ~np.isfinite(d) | (d < 0)
    if impossible.any():
        warnings.warn(
            f"{where}: {int(impossible.sum())} step time(s) missing, infinite or negative: left out",
            LogFileWarning,
            stacklevel=2,
        )
        steps = steps[~impossible]
    if len(steps) == 0:
        raise ConfigError(f"{where}: no step times {held}")
    return steps


def _paths(paths) -> list:
    """A path, a glob or a list of them -> a list of str (several directories: one run across hosts)."""
    out = io.path_list(paths)
    if not out:
        raise ConfigError("paths: give log files or directories")
    return out


def _shown(paths) -> str:
    return paths[0] if len(paths) == 1 else f"{paths[0]} (and {len(paths) - 1} more)"


def _parent(path, name: str, directory: bool = False) -> str:
    """Check an output (``check_output``: one-line ``ConfigError`` naming ``name``), then create its
    missing directories (with ``directory``: the output itself)."""
    check_output(path, name, directory=directory)
    target = os.path.abspath(path)
    os.makedirs(target if directory else os.path.dirname(target), exist_ok=True)
    return os.fspath(path)


# ---- one run ---------------------------------------------------------------------------------
class Run:
    """One run's rank logs: a file, a directory (of rank logs, or of runs: the latest), a glob, a
    list of them, or one directory of runs per host (one run across hosts). Nothing is read until
    asked; each result is computed once and kept.

    ``ranks``: only these ranks (``"0-7,12"``, an int or an iterable; the other ranks' files are
    not read). ``steps``: only steps A to B-1 (``"100:200"``, ``(100, None)``, ``range(100, 200)``).
    ``engine``: ``"pandas"`` (every row in one DataFrame), ``"duckdb"`` (the report's tables in
    bounded memory: ``pip install 'commpatch[scale]'``) or ``"auto"`` (DuckDB from 256 MB of logs
    on when installed), or ``"spark"`` (the DuckDB engine's queries on Apache Spark, ``spark_master``: a
    master URL, default ``local[*]``; ``spark_dir``: where the ranks are staged, a directory every
    executor reads: ``pip install 'commpatch[spark]'``). ``by``: the summary's grouping. ``step_times``: a step-times CSV (or a
    DataFrame: step, duration_us, optionally rank) instead of the steps the log holds. ``top``:
    collectives listed by arrival skew. ``progress(done, total)``: called as files are read.

    With the DuckDB engine the staged tables live in a temporary directory until ``close()`` (or
    the end of a ``with`` block, or the Run's collection)."""

    def __init__(
        self,
        paths,
        ranks=None,
        steps=None,
        engine: str = "auto",
        by=DEFAULT_BY,
        step_times=None,
        top: int = 10,
        progress=None,
        spark_master: str | None = None,
        spark_dir: str | None = None,
    ) -> None:
        self.paths = _paths(paths)
        self.ranks = parse_ranks(ranks)
        self.window = parse_steps(steps)
        self.by = check_by(by)
        self.top = check_top(top)
        self._engine_choice = check_engine(engine)
        if (spark_master or spark_dir) and self._engine_choice != "spark":
            raise ConfigError(
                f"spark_master / spark_dir (--spark-master / --spark-dir) are for the spark engine, not {self._engine_choice!r}"
            )
        if self._engine_choice == "spark":
            try:
                spark.check_master(spark_master)
            except ValueError as exc:
                raise ConfigError(f"spark_master (--spark-master) {exc}") from None
        if spark_dir is not None and not os.path.isdir(spark_dir):
            raise ConfigError(f"spark_dir {spark_dir}: not a directory")
        self.spark_master, self.spark_dir = spark_master, spark_dir
        self.step_times = check_step_times(step_times)
        self.progress = check_progress(progress)
        self._engine_name: str | None = None
        self._frame: Any = None  # the rows read, steps numbered (every column, or the report's: _full)
        self._full = False
        self._cross: dict = {}  # key "cross" -> analysis.CrossRank or None (one rank)
        self._report: _text.Report | None = None
        self._pre: Any = None  # analysis.engine.Results (DuckDB)
        self._engine: Any = None  # the open analysis.engine.Engine (DuckDB), until close()
        self._closer: Any = None
        self._plot_data: tuple | None = None

    def __repr__(self) -> str:
        return f"<commpatch.Run {_shown(self.paths)}{' (open)' if self._engine is not None else ''}>"

    # ---- life ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Remove the DuckDB engine's staged tables (nothing to do with pandas)."""
        if self._closer is not None:
            self._closer()
        self._engine = self._closer = None

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- reading ------------------------------------------------------------------------------
    @property
    def engine(self) -> str:
        """The backend of the report: ``"pandas"`` or ``"duckdb"`` (``auto`` resolved by the
        logs' size: ``analysis.engine.AUTO_BYTES``)."""
        if self._engine_name is None:
            choice = self._engine_choice
            if choice == "auto":
                choice = "pandas"
                if _engine.available():
                    total = 0
                    for path in io.expand(self.paths):
                        with contextlib.suppress(OSError):
                            total += os.path.getsize(path)
                    choice = "duckdb" if total >= _engine.AUTO_BYTES else "pandas"
            self._engine_name = choice
        return self._engine_name

    def rows(self):
        """Every row of the ranks and steps asked, one per collective call, as a pandas DataFrame
        with the steps numbered (those found from the calls' pattern too: ``with_pattern_steps``)."""
        return self._read(full=True)

    @property
    def df(self):
        """``rows()``."""
        return self.rows()

    def _read(self, full: bool):
        if self._frame is not None and (self._full or not full):
            return self._frame
        # the report alone needs a subset of the columns (a large log reads faster); exports need all
        columns = None if full else set(analysis.REPORT_COLUMNS) | set(self.by)
        df = io.read(self.paths, progress=self.progress, columns=columns, ranks=self.ranks, steps=self.window)
        self._check_rows(len(df))
        # before cross_rank (its mismatches name the step); the window of steps again: the reader
        # kept whole the ranks with no step boundary, whose steps are found now. Warned once: a
        # second read (every column, after the report's), or after the engine's, says nothing new
        warn = self._frame is None and self._pre is None
        df = analysis.with_pattern_steps(df, warn=warn, window=self.window)
        self._check_rows(len(df))
        self._frame, self._full = df, full
        self._cross.clear()
        return df

    def _check_rows(self, n: int) -> None:
        if n == 0:
            sliced = self.ranks is not None or self.window is not None
            raise LogFileError(
                _shown(self.paths),
                "no collective calls recorded in the log file(s)"
                + (" for the ranks / steps asked" if sliced else "")
                + ": nothing to report",
            )

    # ---- analyses -----------------------------------------------------------------------------
    def cross_rank(self):
        """The same collective matched across ranks (``analysis.CrossRank``: collectives, skew,
        stragglers, mismatches, point-to-point pairs), from the rows in memory; None for one rank."""
        if "cross" not in self._cross:
            df = self._read(full=False)
            self._cross["cross"] = analysis.cross_rank(df) if df["rank"].nunique() > 1 else None
        return self._cross["cross"]

    def report(self) -> _text.Report:
        """The report ``commpatch report`` prints (``render.text.Report``: title, findings, advice,
        headline, errors, notes and its tables in ``sections``), from the engine chosen."""
        if self._report is None:
            self._report = self._engine_report() if self.engine in SQL_ENGINES else self._pandas_report()
        return self._report

    def _pandas_report(self) -> _text.Report:
        df = self._read(full=False)
        return _text.build_report(df, by=self.by, steps=self.step_times, top=self.top, cross=self.cross_rank())

    def _engine_report(self) -> _text.Report:
        """Each rank read, reduced and staged in turn by two processes (reading and reducing a rank
        is single-threaded Python / numpy), then queried with DuckDB."""
        if self.engine == "spark":
            eng: _engine.Engine = spark.SparkEngine(by=self.by, master=self.spark_master, temp_dir=self.spark_dir)
        else:
            eng = _engine.Engine(by=self.by)
        self._engine, self._closer = eng, weakref.finalize(self, eng.close)
        try:
            transform = functools.partial(
                _engine.stage, directory=eng.directory, by=self.by, steps=self.step_times, window=self.window
            )
            columns = set(analysis.REPORT_COLUMNS) | set(self.by) - {"size_bucket"}
            in_flight = 0
            try:
                for staged in io.read_ranks(
                    self.paths,
                    transform,
                    columns=columns,
                    ranks=self.ranks,
                    steps=self.window,
                    progress=self.progress,
                    workers=min(2, os.cpu_count() or 1),
                    batch_bytes=_engine.STAGE_BATCH_BYTES,
                    run_tasks=getattr(eng, "run_tasks", None),  # Spark: on its executors
                ):
                    eng.add(staged)
                    in_flight += staged.in_flight
            except EngineError as exc:  # Spark's executors read and stage the ranks: it failed there
                raise self._engine_failed(exc) from None
            self._check_rows(eng.counts["calls"])
            pre = self._engine_call(eng.results, self.top)
        except BaseException:
            self.close()
            raise
        pre.in_flight = in_flight
        self._pre = pre
        return _text.build_report(
            None, by=self.by, steps=self.step_times, top=self.top, precomputed=pre, run=chosen_run(self.paths)
        )

    def _engine_call(self, function, *args):
        try:
            return function(*args)
        except EngineError as exc:  # out of memory or disk space: say so on one line
            raise self._engine_failed(exc) from None

    def _engine_failed(self, exc: EngineError) -> EngineError:
        name = "Spark" if self.engine == "spark" else "DuckDB"
        return EngineError(
            f"the {name} engine failed ({' '.join(str(exc).split())[:300]}); "
            'engine="pandas" (--engine pandas) computes the same report in memory'
        )

    def summary(self, by=None):
        """Calls, time, bytes and bandwidth per ``by`` (default the Run's ``by``: the report's
        summary table, with ``per_rank``)."""
        if by is None:
            return self.report().sections["summary"]
        by = check_by(by)
        if self.engine in SQL_ENGINES:
            self.report()
            try:
                return self._engine_call(self._engine.summary, by)
            except ValueError as exc:  # a column the engine does not stage (e.g. api)
                raise ConfigError(f"by {by}: {exc}") from None
        df = self._read(full=False)
        if not set(by) - {"size_bucket"} <= set(df.columns):  # a column the report does not read
            df = self._read(full=True)
        cross = self.cross_rank()
        return analysis.summary(analysis.with_transfer(df, cross) if cross is not None else df, by=by)

    def steps(self):
        """One row per step (averaged over ranks): step time, communication and exposed shares,
        set-up against steady state (the report's steps table; None when the log has no steps)."""
        return self.report().sections.get("steps")

    def steady_state(self) -> dict:
        """The median and p95 steady-state step and its median shares (``analysis.steady_state``)."""
        steps = self.steps()
        return analysis.steady_state(steps) if steps is not None else {}

    def findings(self) -> list:
        """The report's findings (``analysis.findings.Finding``: kind, text, section), first first."""
        return self.report().findings

    # ---- renderings ---------------------------------------------------------------------------
    def text(self, wide: bool = False) -> str:
        """The report as ``commpatch report`` prints it (``wide``: every column, no wrapping)."""
        return _text.render_report_text(self.report(), wide=wide)

    def markdown(self) -> str:
        """The report in Markdown (``commpatch report --format markdown``)."""
        return _text.render_report_markdown(self.report())

    def json(self) -> str:
        """Every section in full, as ``commpatch report --format json`` writes it."""
        return _text.render_report_json(self.report())

    def to_dict(self) -> dict:
        """``json()`` as a dict."""
        return json.loads(self.json())

    def csv(self, section: str = "summary") -> str:
        """One section of the report as CSV (``summary``, ``steps``, ``ranks``, ``skew``, ...)."""
        frame = self.report().sections.get(section)
        if frame is None:
            raise ConfigError(f"no '{section}' section for this log (available: {', '.join(self.report().sections)})")
        return _text.render_csv(frame)

    # ---- files --------------------------------------------------------------------------------
    def write_trace(self, path) -> str:
        """A Chrome trace / Perfetto timeline (``.json`` or ``.json.gz``); returns its path."""
        return trace.write_chrome_trace(self.rows(), _parent(path, "path"))

    def write_module_tree(self, path) -> str:
        """The per-module collective tree (CommDebugMode's JSON format); needs the module column."""
        if not self.has_modules:
            raise LogFileError(None, NO_MODULES)
        return trace.write_module_tree(self.rows(), _parent(path, "path"))

    @property
    def has_modules(self) -> bool:
        """The log has the module column (an older commpatch did not write it: no module tree)."""
        return "module" not in self.rows().attrs.get("filled_columns", ())

    def write_tensorboard(self, directory) -> list:
        """TensorBoard scalars per step and rank (``directory/rank{r}``); returns the files written."""
        df = self._frame if self._frame is not None else self.rows()
        cross = self._cross.get("cross") if self._pre is None else None
        return tensorboard_writer.write_tensorboard(
            analysis.with_transfer(df, cross) if df["rank"].nunique() > 1 else df,
            _parent(directory, "directory", directory=True),
            steps=self.step_times,
        )

    @property
    def name(self) -> str:
        """The run's name: its run directory's (the latest run of a directory of runs), else the
        directory or file given."""
        chosen = chosen_run(self.paths)
        first = chosen[0] if chosen else (self.paths[0] if isinstance(self.paths, (list, tuple)) else self.paths)
        return os.path.basename(os.path.normpath(os.path.abspath(os.fspath(first))))

    def log_mlflow(self, uri: str, experiment: str = "commpatch") -> str:
        """The report's headline and per-step figures as a new MLflow run (named ``name``) in
        ``experiment`` at the tracking server ``uri``; returns the run id (``render.trackers``)."""
        return trackers.log_mlflow(self.report(), uri, experiment, self.name)

    def log_wandb(self, project: str) -> str:
        """The report's headline and per-step figures as a new Weights & Biases run in ``project``
        (online or offline as W&B's own settings say); returns its URL or directory."""
        return trackers.log_wandb(self.report(), project, self.name)

    def _plots_data(self) -> tuple:
        """(summary by op and size_bucket, arrival matrix or None): what the plots and the page show."""
        if self._plot_data is None:
            self.report()
            if self._pre is not None:
                by_op = self._engine_call(self._engine.summary, ["op", "size_bucket"])
                many = len(self._pre.rank_list) > 1
                arrivals = self._engine_call(self._engine.arrivals, PLOT_BINS) if many else None
            else:
                cross = self.cross_rank()
                df = self._read(full=False)
                by_op = analysis.summary(
                    analysis.with_transfer(df, cross) if cross is not None else df, by=["op", "size_bucket"]
                )
                arrivals = cross.arrivals if cross is not None else None
            self._plot_data = (by_op, arrivals)
        return self._plot_data

    def plots(self, directory) -> list:
        """PNG plots (bandwidth per size, communication per step, arrival skew; needs matplotlib)."""
        by_op, arrivals = self._plots_data()
        return plots.write_plots(_parent(directory, "directory", directory=True), by_op, self.steps(), arrivals)

    def write_html(self, path) -> str:
        """The report as one self-contained HTML page, with a timeline excerpt of one step (with
        the DuckDB engine, only that step of a few ranks is read)."""
        rep = self.report()
        by_op, arrivals = self._plots_data()
        steps, straggler = rep.sections.get("steps"), (rep.headline.get("straggler") or {}).get("rank")
        step = html.pick_step(steps)
        df = self._frame
        if df is None and step is not None:  # the engine's report: read the excerpt's rows only
            known = (
                sorted(self.ranks)
                if self.ranks
                else sorted(rep.sections["ranks"]["rank"].tolist())
                if "ranks" in rep.sections
                else []
            )
            chosen = html.excerpt_ranks(known, straggler)
            df = io.read(self.paths, ranks=set(chosen), steps=(step, step + 1)) if chosen else None
        excerpt = (
            html.timeline_excerpt(df, steps, straggler, of_ranks=rep.headline.get("ranks")) if df is not None else None
        )
        return html.write(html.page(rep, by_op, arrivals, excerpt), _parent(path, "path"))


def open(paths, **options) -> Run:  # noqa: A001 - commpatch.open(path), as tarfile.open / gzip.open
    """A run's rank logs, as a ``Run`` (nothing is read until asked); ``options`` are ``Run``'s:
    ``ranks``, ``steps``, ``engine``, ``by``, ``step_times``, ``top``, ``progress``, ``spark_master``,
    ``spark_dir``."""
    return Run(paths, **options)


# ---- runs at several world sizes -------------------------------------------------------------
@dataclass
class Comparison:
    """Runs of one job at several world sizes: ``table`` (per run: world size, steady-state step,
    steps/s, speed-up, efficiency) and ``by_op`` (bus bandwidth per op and size per world size)."""

    table: Any
    by_op: Any
    scaling: str = "weak"
    runs: list = field(default_factory=list)

    def unknown_steps(self) -> list:
        """The runs with no steady-state step (their per-step figures are unknown)."""
        return self.table.loc[self.table["steps"] == 0, "run"].tolist()

    def text(self, wide: bool = False) -> str:
        """Both tables (shown whole: ``wide`` changes nothing, as for a Run's report)."""
        return (
            _text.render_text(self.table, title=f"commpatch scaling: runs by world size ({SCALING[self.scaling]})")
            + "\n\n"
            + _text.render_text(self.by_op, title="steady-state collectives per message size and world size")
        )

    def markdown(self) -> str:
        """Both tables in Markdown."""
        return (
            "## Scaling\n\n"
            + _text.render_markdown(self.table)
            + "\n\n## Bus bandwidth per op\n\n"
            + _text.render_markdown(self.by_op)
        )

    def json(self) -> str:
        """Both tables in full, as ``commpatch report --compare --format json`` writes them."""
        return json.dumps(
            {
                "scaling": json.loads(self.table.to_json(orient="records")),
                "by_op": json.loads(self.by_op.to_json(orient="records")),
            },
            indent=1,
        )

    def csv(self, section: str = "scaling") -> str:
        """``by_op``, or the scaling table."""
        return _text.render_csv(self.by_op if section == "by_op" else self.table)

    def plots(self, directory) -> list:
        """The scaling plot (``directory/scaling.png``; needs matplotlib); returns the files written."""
        target = os.path.join(_parent(directory, "directory", directory=True), "scaling.png")
        return [plots.save(plots.scaling(self.table, self.by_op), target)]

    def write_html(self, path) -> str:
        """Both tables as one self-contained HTML page; returns its path."""
        title = f"commpatch scaling: {len(self.runs)} runs ({SCALING[self.scaling]})"
        return html.write(html.compare_page(self.table, self.by_op, title), _parent(path, "path"))


def check_global_batch(value, name: str = "global_batch"):
    """Samples per step of the smallest run (``compare``): a positive number, or None."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
        raise ConfigError(f"{name} {value}: give a positive number of samples")
    return value


def compare(paths, scaling: str = "weak", global_batch=None, progress=None) -> Comparison:
    """Runs of one job at several world sizes (one directory per run): ``scaling`` ``weak`` (the
    same batch per rank) or ``strong`` (the same global batch); ``global_batch``: samples per
    step of the smallest run, for a samples/s column. A run with no call raises ``LogFileError``
    naming its directory."""
    paths = _paths(paths)
    if scaling not in SCALING:
        raise ConfigError(f"scaling {scaling!r}: choose from {', '.join(SCALING)}")
    check_global_batch(global_batch)
    check_progress(progress)
    runs = {}
    for i, path in enumerate(paths):
        runs[path] = analysis.with_pattern_steps(io.read(path))
        if len(runs[path]) == 0:
            raise LogFileError(path, "no collective calls recorded in this run's file(s)")
        if progress is not None:
            progress(i + 1, len(paths))
    table = analysis.scaling(runs, mode=scaling, global_batch=global_batch)
    return Comparison(table, analysis.scaling_by_op(runs), scaling, list(runs))


# ---- two runs of one job: diff and check ------------------------------------------------------
def diff(a, b, **options) -> dict:
    """Run ``b`` against run ``a`` (paths as ``open`` takes them; ``options`` for both):
    ``analysis.diff.diff``'s dict (per-step figures and per collective and size, each change with
    its 95% interval over the steady steps)."""
    sides = []
    for paths in (a, b):
        with open(paths, **options) as run:
            steps = run.steps()
            rows = run.rows() if steps is not None else None
            sides.append(dict(name=_run_name(paths), steps=steps, rows=rows))
    return _diff.diff(*sides)


def written_since(root: str, per_run: bool, since: float) -> list:
    """What a job wrote under ``root`` from the Unix time ``since`` on: its run directories
    (``per_run``: one per run, oldest first), else ``[root]`` when a log file there changed since;
    [] when nothing (or ``root`` cannot be read)."""
    try:
        if not os.path.isdir(root):
            return []
        if per_run:
            return [r for r in discovery.runs(root) if discovery.run_started(r) >= since]
        return [root] if any(os.path.getmtime(f) >= since for f in discovery.log_files(root)) else []
    except OSError:
        return []


def diff_text(d: dict) -> str:
    """``diff``'s result as ``commpatch diff`` prints it."""
    return "\n".join(_diffs.diff_lines(d))


def write_diff_html(d: dict, path) -> str:
    """``commpatch diff --html``: the diff as one self-contained HTML page at ``path``; returns it."""
    return html.write(html.diff_page(d), _parent(path, "path"))


def diff_json(d: dict) -> str:
    """``diff``'s result as ``commpatch diff --format json`` prints it (unknown: null)."""
    return _diffs.diff_json(d)


def _run_name(paths) -> str:
    """The run read from ``paths``: its run directory when they name a directory of runs."""
    chosen = chosen_run(paths)
    return chosen[0] if chosen else _shown(_paths(paths))


def check_share_limit(value, name: str) -> float | None:
    """A limit given in percent ('30%' or '30'): the fraction; None when not given."""
    if value is None:
        return None
    text = str(value).strip().rstrip("%").strip()
    try:
        limit = float(text) / 100
    except ValueError:
        limit = math.nan
    if not 0 <= limit <= 10:  # NaN too
        raise ConfigError(f"{name} {value!r}: a percentage from 0 to 1000, e.g. 30%")
    return limit


def check(path, baseline=None, max_exposed=None, max_comm=None, max_step_ms=None, max_regression=None, **options):
    """``commpatch check``: (violations, held): one line each for the limits the run ``path``
    breaks (steady-state medians; a regression against ``baseline``: a significant change above
    ``max_regression`` of the baseline's step time, communication or exposed time) and for those
    it holds. A limit whose figure is unknown (not measured) is a violation: a gate cannot pass
    on what it could not see."""
    if (baseline is None) != (max_regression is None):
        raise ConfigError(
            "a regression is checked with a baseline run and a limit: give both --baseline and --max-regression"
        )
    if all(x is None for x in (max_exposed, max_comm, max_step_ms, max_regression)):
        raise ConfigError(
            "no limit given: --max-exposed, --max-comm, --max-step-ms or --baseline with --max-regression"
        )
    with open(path, **options) as run:
        steps = run.steps()
        state = run.steady_state()
    bad, held = [], []

    def limit(name, value, most, unit):
        shown, bound = _diffs.fmt(value, unit), _diffs.fmt(most, unit)
        if value is None or value != value:
            bad.append(f"{name}: unknown (not measured), the limit is {bound}")
        elif value > most:
            bad.append(f"{name}: {shown} > {bound}")
        else:
            held.append(f"{name}: {shown} <= {bound}")

    if max_exposed is not None:
        limit("exposed share of the step", state.get("exposed_share"), max_exposed, "share")
    if max_comm is not None:
        limit("communication share of the step", state.get("comm_share"), max_comm, "share")
    if max_step_ms is not None:
        limit("step time", state.get("step_p50_us"), max_step_ms * 1e3, "us")
    if baseline is not None and max_regression is not None:
        with open(baseline, **options) as base:
            before = dict(name=_run_name(baseline), steps=base.steps(), rows=None)
        d = _diff.diff(before, dict(name=_run_name(path), steps=steps, rows=None))
        for s in d["steps"]:
            if s["key"] not in ("step_us", "comm_us", "exposed_us"):
                continue
            name = f"{s['name']} against the baseline"
            if s["relative"] != s["relative"]:
                bad.append(f"{name}: unknown (not measured in both runs)")
            elif s["significant"] and s["relative"] > max_regression:
                bad.append(f"{name}: {_diffs.verdict(s, s['unit'])}, above the {100 * max_regression:g}% allowed")
            else:
                held.append(f"{name}: {_diffs.verdict(s, s['unit'])}")
    return bad, held


# ---- binary logs to CSV / Parquet --------------------------------------------------------------
def convert(paths, to: str = "csv", progress=None):
    """Binary rank logs (``.cplog``: a directory, its latest run, or files) to CSV beside them, or
    to one rank-partitioned Parquet dataset per run (``parquet/rank=R/``). Yields ``(path,
    written)`` per log: an existing file is never replaced (``written`` False)."""
    if to not in ("csv", "parquet"):
        raise ConfigError(f"to {to!r}: choose from csv, parquet")
    check_progress(progress)
    paths = _paths(paths)
    files = [f for f in io.expand(paths) if f.endswith(SUFFIX)]
    if not files:
        raise LogFileError(None, f"no binary rank log (*{SUFFIX}) in {', '.join(paths)}")
    for i, path in enumerate(files):
        if to == "parquet":  # one rank-partitioned dataset per run directory
            out = os.path.join(
                os.path.dirname(path),
                "parquet",
                f"rank={io.file_rank(path)}",
                os.path.basename(io.export_path(path, ".parquet")),
            )
        else:
            out = io.export_path(path, "." + to)
        if os.path.lexists(out):
            yield out, False
            continue
        try:
            out = (
                io.convert_to_dataset(path, os.path.dirname(os.path.dirname(out)))
                if to == "parquet"
                else io.convert(path, out)
            )
        except LogFileError:
            raise
        except ValueError as exc:
            raise LogFileError(None, str(exc)) from None
        except OSError as exc:  # a full disk, a read-only directory: one line, not a traceback
            raise LogFileError(out, f"cannot be written ({exc.strerror or exc})") from None
        yield out, True
        if progress is not None:
            progress(i + 1, len(files))
