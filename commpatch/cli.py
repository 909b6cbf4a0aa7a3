"""Command line: ``commpatch run -- CMD``, ``commpatch report FILES``, ``commpatch convert FILES``,
``commpatch env``, ``commpatch install-hook``."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time

from . import config as _config
from ._version import __version__

BOOT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_boot")
PTH_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "commpatch.pth")


def hook_path() -> str:
    return os.path.join(sysconfig.get_paths()["purelib"], "commpatch.pth")


def cmd_run(args) -> int:
    if not args.command:
        print(
            "commpatch run: give the command after --, e.g. commpatch run -- torchrun --nproc_per_node=2 train.py",
            file=sys.stderr,
        )
        return 2
    env = dict(os.environ)
    env["COMMPATCH"] = "1"
    for name in ("output", "ops", "timing"):
        value = getattr(args, name)
        if value is not None:
            env[_config.BY_NAME[name].env] = value
    if args.summary:
        env["COMMPATCH_SUMMARY"] = "1"
    try:
        settings = _config.resolve(environ=env)
        if settings["output"]:
            from .io.paths import check_writable  # lazy: the CLI's other commands never load numpy / pandas

            problem = check_writable(settings["output"], strict=settings["strict"])
            if problem:  # the job runs: each rank keeps its rows in memory and retries the file
                print(
                    f"commpatch run: warning: {problem}: the job runs, its rows are kept in memory (bounded) "
                    "and the file is retried (COMMPATCH_STRICT=1 refuses instead)",
                    file=sys.stderr,
                )
    except _config.ConfigError as exc:
        print(f"commpatch: {exc}", file=sys.stderr)
        return 2
    env["PYTHONPATH"] = os.pathsep.join([BOOT_DIR] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    command = args.command[1:] if args.command[0] == "--" else args.command
    exe = shutil.which(command[0]) or command[0]
    try:
        os.execvpe(exe, command, env)
    except OSError as exc:
        print(f"commpatch run: cannot run {command[0]!r}: {exc.strerror}", file=sys.stderr)
        return 127
    return 0  # pragma: no cover - exec does not return


class _InputError(Exception):
    """A bad option or input of ``commpatch report``: one line on stderr, exit status 2."""


def cmd_report(args) -> int:
    """``commpatch report``: every bad input ends in one line on stderr and exit status 2 (no
    traceback); what can be read best-effort is, with one ``warning:`` line per problem."""
    from .io.reader import LogFileError  # lazy: the CLI's other commands never load numpy / pandas

    try:
        with _plain_warnings():
            return _report_compare(args) if args.compare else _report(args)
    except (LogFileError, _InputError) as exc:
        print(f"commpatch report: {_safe(exc)}", file=sys.stderr)
        return 2


def _report(args) -> int:
    from . import analysis, io  # lazy: the CLI's other commands never load numpy / pandas
    from .render import text as report  # lazy: the CLI's other commands never load numpy / pandas

    if not args.paths:
        raise _InputError("give log files or directories (or --compare RUN_DIRS...)")
    by = _check_by(args.by)
    if args.top < 0:
        raise _InputError(f"--top {args.top}: give 0 or more")
    ranks = _parse_ranks(args.ranks) if args.ranks is not None else None
    window, step_times = _steps_option(args)
    # outputs and inputs other than the logs are checked before anything is read or computed
    for option, path in (("--trace", args.trace), ("--module-tree", args.module_tree), ("--html", args.html)):
        if path:
            _check_output(option, path, directory=False)
    if args.plots:
        _check_plots(args.plots)
    if args.tensorboard:
        _check_tensorboard(args.tensorboard)
    steps = _read_steps(step_times[0], step_times[1]) if step_times else None
    cross = None
    if _use_engine(args):
        df, rep, pre = None, *_engine_report(args, by, steps, ranks, window)
    else:
        # the report alone needs a subset of the columns (a large log reads faster); exports need all
        columns = None if args.trace or args.module_tree else set(report.REPORT_COLUMNS) | set(by)
        df = io.read(args.paths, progress=_progress(args, "reading"), columns=columns, ranks=ranks, steps=window)
        _check_rows(args, len(df), ranks, window)
        # before cross_rank (its mismatches name the step); the window of steps again: the reader
        # kept whole the ranks with no step boundary, whose steps are found now
        df = analysis.with_pattern_steps(df, window=window)
        _check_rows(args, len(df), ranks, window)
        cross = analysis.cross_rank(df) if df["rank"].nunique() > 1 else None
        rep, pre = report.build_report(df, by=by, steps=steps, top=args.top, cross=cross), None
    if args.format == "csv":
        frame = rep.sections.get(args.section)
        if frame is None:
            raise _InputError(f"no '{args.section}' section for this log (available: {', '.join(rep.sections)})")
        sys.stdout.write(report.render_csv(frame))
    elif args.format == "json":
        sys.stdout.write(report.render_report_json(rep) + "\n")
    elif args.format == "markdown":
        sys.stdout.write(report.render_report_markdown(rep) + "\n")
    else:
        sys.stdout.write(report.render_report_text(rep, wide=args.wide) + "\n")
    if (args.trace or args.module_tree) and df is None:  # the engine read the report's columns only
        df = analysis.with_pattern_steps(io.read(args.paths, ranks=ranks, steps=window), warn=False, window=window)
    if args.module_tree and "module" in df.attrs.get("filled_columns", ()):
        raise _InputError("--module-tree: the log has no module column (written by an older commpatch): no module tree")
    if args.trace:
        from .render.trace import write_chrome_trace  # lazy: the CLI's other commands never load numpy / pandas

        with _writing("--trace", args.trace):
            print(
                f"commpatch: trace written to {write_chrome_trace(df, args.trace)} "
                "(open in https://ui.perfetto.dev or chrome://tracing)",
                file=sys.stderr,
            )
    if args.module_tree:
        from .render.trace import write_module_tree  # lazy: the CLI's other commands never load numpy / pandas

        with _writing("--module-tree", args.module_tree):
            try:
                print(f"commpatch: module tree written to {write_module_tree(df, args.module_tree)}", file=sys.stderr)
            except ValueError as exc:
                raise _InputError(str(exc)) from None
    if args.tensorboard:
        from .render.tensorboard import write_tensorboard  # lazy: the CLI's other commands never load torch's writer

        if df is None:
            df = analysis.with_pattern_steps(io.read(args.paths, ranks=ranks, steps=window), warn=False, window=window)
        with _writing("--tensorboard", args.tensorboard):
            written = write_tensorboard(
                analysis.with_transfer(df, cross) if df["rank"].nunique() > 1 else df, args.tensorboard, steps=steps
            )
        print(
            f"commpatch: TensorBoard scalars written to {args.tensorboard} ({len(written)} rank(s); "
            f"tensorboard --logdir {args.tensorboard})",
            file=sys.stderr,
        )
    if args.plots or args.html:
        if pre is not None:
            by_op, arrivals = pre.by_op_size, pre.arrivals
        else:
            by_op = analysis.summary(
                analysis.with_transfer(df, cross) if cross is not None else df, by=["op", "size_bucket"]
            )
            arrivals = cross.arrivals if cross is not None else None
    if args.plots:
        from .render import plots  # lazy: the CLI's other commands never load numpy / pandas

        with _writing("--plots", args.plots):
            written = plots.write_plots(args.plots, by_op, rep.sections.get("steps"), arrivals)
        print("commpatch: plots written: " + ", ".join(written), file=sys.stderr)
    if args.html:
        _write_html(args, rep, df, by_op, arrivals, ranks)
    return 1 if args.fail_on_mismatch and rep.errors else 0


def _write_html(args, rep, df, by_op, arrivals, ranks) -> None:
    """--html: the page, with a timeline excerpt of one step (at scale, only that step of a few
    ranks is read)."""
    from . import io  # lazy: the CLI's other commands never load numpy / pandas
    from .render import html  # lazy: the CLI's other commands never load numpy / pandas

    steps, straggler = rep.sections.get("steps"), (rep.headline.get("straggler") or {}).get("rank")
    step = html.pick_step(steps)
    if df is None and step is not None:  # the engine's report: read the excerpt's rows only
        known = (
            sorted(ranks)
            if ranks
            else sorted(rep.sections["ranks"]["rank"].tolist())
            if "ranks" in rep.sections
            else []
        )
        chosen = html.excerpt_ranks(known, straggler)
        df = io.read(args.paths, ranks=set(chosen), steps=(step, step + 1)) if chosen else None
    excerpt = (
        html.timeline_excerpt(df, steps, straggler, of_ranks=rep.headline.get("ranks")) if df is not None else None
    )
    with _writing("--html", args.html):
        path = html.write(html.page(rep, by_op, arrivals, excerpt), args.html)
    print(f"commpatch: HTML report written to {path} ({os.path.getsize(path) / 1e6:.2f} MB)", file=sys.stderr)


def _check_rows(args, n, ranks, window) -> None:
    if n == 0:
        sliced = ranks is not None or window is not None
        raise _InputError(
            f"{_shown(args.paths)}: no collective calls recorded in the log file(s)"
            + (" for the ranks / steps asked (--ranks, --steps)" if sliced else "")
            + ": nothing to report"
        )


def _use_engine(args) -> bool:
    """--engine duckdb, or auto with DuckDB installed and at least AUTO_BYTES of input."""
    from .analysis import engine  # lazy: the CLI's other commands never load numpy / pandas

    if args.engine == "pandas":
        return False
    if args.engine == "duckdb":
        if not engine.available():
            raise _InputError("--engine duckdb: DuckDB is not installed: pip install 'commpatch[scale]'")
        return True
    if not engine.available():
        return False
    from . import io  # lazy: the CLI's other commands never load numpy / pandas

    total = 0
    for path in io.expand(args.paths):
        with contextlib.suppress(OSError):
            total += os.path.getsize(path)
    return total >= engine.AUTO_BYTES


def _engine_report(args, by, steps, ranks, window):
    """The report's tables from the engine: each rank read, reduced and staged in turn by two
    processes (reading and reducing a rank is single-threaded Python / numpy), then queried."""
    import functools

    from . import io  # lazy: the CLI's other commands never load numpy / pandas
    from .analysis import engine  # lazy: the CLI's other commands never load numpy / pandas
    from .render import text as report  # lazy: the CLI's other commands never load numpy / pandas

    eng = engine.Engine(by=by)
    try:
        transform = functools.partial(engine.stage, directory=eng.directory, by=by, steps=steps, window=window)
        columns = set(report.REPORT_COLUMNS) | set(by) - {"size_bucket"}
        in_flight = 0
        for staged in io.read_ranks(
            args.paths,
            transform,
            columns=columns,
            ranks=ranks,
            steps=window,
            progress=_progress(args, "reading"),
            workers=min(2, os.cpu_count() or 1),
        ):
            eng.add(staged)
            in_flight += staged.in_flight
        _check_rows(args, eng.counts["calls"], ranks, window)
        try:
            pre = eng.results(top=args.top, arrivals_bins=200 if args.plots or args.html else None)
            pre.by_op_size = eng.summary(["op", "size_bucket"]) if args.plots or args.html else None
        except engine.EngineError as exc:  # out of memory or disk space: say so on one line
            raise _InputError(
                f"the DuckDB engine failed ({' '.join(str(exc).split())[:200]}); "
                "--engine pandas computes the same report in memory"
            ) from None
    finally:
        eng.close()
    from .io.reader import chosen_run  # lazy: the CLI's other commands never load numpy / pandas

    pre.in_flight = in_flight
    return report.build_report(None, by=by, steps=steps, top=args.top, precomputed=pre, run=chosen_run(args.paths)), pre


def _parse_ranks(text: str) -> set:
    """``--ranks 0-7,12`` -> {0, ..., 7, 12}; a one-line error for anything else."""
    out: set = set()
    for part in text.split(","):
        part = part.strip()
        first, dash, last = part.partition("-")
        try:
            lo = int(first)
            hi = int(last) if dash else lo
        except ValueError:
            raise _InputError(f"--ranks {text!r}: {part!r} is not a rank or a range of ranks (e.g. 0-7,12)") from None
        if lo < 0 or hi < lo:
            raise _InputError(
                f"--ranks {text!r}: {part!r} is not a range of ranks (give first-last with "
                "0 <= first <= last, e.g. 0-7,12)"
            )
        out.update(range(lo, hi + 1))
    return out


def _steps_option(args):
    """(window of steps (first, stop) or None, (step-times CSV, option name) or None) from --steps
    A:B (a window; either end may be left out) or --step-times CSV (--steps CSV still works)."""
    import re

    window, times = None, (args.step_times, "--step-times") if args.step_times else None
    text = args.steps
    if text is not None:
        m = re.fullmatch(r"\s*(-?\d*)\s*:\s*(-?\d*)\s*", text)
        if m is not None:
            lo, hi = (int(g) if g else None for g in m.groups())
            if (lo is not None and lo < 0) or (hi is not None and hi < 0):
                raise _InputError(f"--steps {text}: steps are 0 or more (A:B keeps steps A to B-1)")
            if lo is not None and hi is not None and hi <= lo:
                raise _InputError(f"--steps {text}: no step in this window (A:B keeps steps A to B-1: give B > A)")
            window = (lo, hi)
        elif os.path.exists(text) or text.lower().endswith(".csv"):
            if times is not None:
                raise _InputError("--steps CSV and --step-times CSV: give the step times once (--step-times)")
            times = (text, "--steps")
        else:
            raise _InputError(
                f"--steps {text}: give a window of steps A:B (e.g. 100:200, 100:, :50) "
                "(step times from a CSV file: --step-times FILE)"
            )
    return window, times


def _report_compare(args) -> int:
    from . import analysis, io  # lazy: the CLI's other commands never load numpy / pandas
    from .render import text as report  # lazy: the CLI's other commands never load numpy / pandas

    if args.plots:
        _check_plots(args.plots)
    if args.html:
        _check_output("--html", args.html, directory=False)
    if args.tensorboard:
        raise _InputError("--tensorboard writes one run's steps: give the run without --compare")
    runs = {}
    for i, path in enumerate(args.compare):
        runs[path] = analysis.with_pattern_steps(io.read(path))
        if len(runs[path]) == 0:
            raise _InputError(f"--compare {path}: no collective calls recorded in this run's file(s)")
        _progress(args, "runs")(i + 1, len(args.compare))
    if args.global_batch is not None and not args.global_batch > 0:
        raise _InputError(f"--global-batch {args.global_batch}: give a positive number of samples")
    table, by_op = (
        analysis.scaling(runs, mode=args.scaling, global_batch=args.global_batch),
        analysis.scaling_by_op(runs),
    )
    for run in table.loc[table["steps"] == 0, "run"]:
        print(
            f"commpatch report: warning: --compare {_safe(run)}: no steady-state step (no step boundary in its log, or "
            "fewer than 3 steps): its per-step figures are unknown",
            file=sys.stderr,
        )
    if args.format == "csv":
        sys.stdout.write(report.render_csv(by_op if args.section == "by_op" else table))
    elif args.format == "json":
        sys.stdout.write(
            json.dumps(
                {
                    "scaling": json.loads(table.to_json(orient="records")),
                    "by_op": json.loads(by_op.to_json(orient="records")),
                },
                indent=1,
            )
            + "\n"
        )
    elif args.format == "markdown":
        sys.stdout.write(
            "## Scaling\n\n"
            + report.render_markdown(table)
            + "\n\n## Bus bandwidth per op\n\n"
            + report.render_markdown(by_op)
            + "\n"
        )
    else:
        sys.stdout.write(
            report.render_text(table, title=f"commpatch scaling: runs by world size ({_SCALING[args.scaling]})")
            + "\n\n"
            + report.render_text(by_op, title="steady-state collectives per message size and world size")
            + "\n"
        )
    if args.plots:
        from .render import plots  # lazy: the CLI's other commands never load numpy / pandas

        with _writing("--plots", args.plots):
            path = plots.save(plots.scaling(table, by_op), os.path.join(args.plots, "scaling.png"))
        print(f"commpatch: plots written: {path}", file=sys.stderr)
    if args.html:
        from .render import html  # lazy: the CLI's other commands never load numpy / pandas

        with _writing("--html", args.html):
            path = html.write(
                html.compare_page(table, by_op, f"commpatch scaling: {len(runs)} runs ({_SCALING[args.scaling]})"),
                args.html,
            )
        print(f"commpatch: HTML report written to {path}", file=sys.stderr)
    return 0


_SCALING = {
    "weak": "weak scaling, the same batch per rank: efficiency = T(N0) / T(N), speedup = efficiency x N / N0; "
    "step times are steady-state medians",
    "strong": "strong scaling, the same global batch: speedup = T(N0) / T(N), efficiency = speedup / (N / N0); "
    "step times are steady-state medians",
}


def _shown(paths) -> str:
    return paths[0] if len(paths) == 1 else f"{paths[0]} (and {len(paths) - 1} more)"


def _check_by(text: str) -> list:
    from .data.schema import COLUMNS  # lazy: the CLI's other commands never load numpy / pandas

    by = [b.strip() for b in text.split(",") if b.strip()]
    if not by:
        raise _InputError(f"--by {text!r}: give one or more columns (e.g. op,size_bucket)")
    unknown = [b for b in by if b not in COLUMNS and b != "size_bucket"]
    if unknown:
        raise _InputError(
            f"--by: unknown column(s) {', '.join(map(repr, unknown))} (choose from size_bucket, {', '.join(COLUMNS)})"
        )
    return by


def _check_output(option: str, path: str, directory: bool) -> None:
    """Raise when ``path`` (a file, or with ``directory`` a directory) cannot be written: checked
    before the report is computed. Missing parent directories are fine (they are created)."""
    target = os.path.abspath(path)
    if os.path.exists(target):
        if directory and not os.path.isdir(target):
            raise _InputError(f"{option} {path}: exists and is not a directory")
        if not directory and os.path.isdir(target):
            raise _InputError(f"{option} {path}: is a directory (give a file name)")
        if not os.access(target, os.W_OK | (os.X_OK if directory else 0)):
            raise _InputError(f"{option} {path}: not writable")
        return
    parent = os.path.dirname(target)
    while not os.path.exists(parent):  # the nearest existing ancestor must take a directory
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise _InputError(f"{option} {path}: cannot be written ({parent} is a file, not a directory)")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise _InputError(f"{option} {path}: cannot be written ({parent} is not writable)")


def _check_plots(directory: str) -> None:
    import importlib.util

    _check_output("--plots", directory, directory=True)
    if importlib.util.find_spec("matplotlib") is None:
        raise _InputError("--plots needs matplotlib: pip install 'commpatch[plots]' (or pip install matplotlib)")


def _check_tensorboard(directory: str) -> None:
    _check_output("--tensorboard", directory, directory=True)
    try:
        import tensorboard  # noqa: F401 - torch.utils.tensorboard writes with it
    except ImportError:
        raise _InputError("--tensorboard needs the tensorboard package: pip install 'commpatch[tensorboard]'") from None
    from .render.tensorboard import taken  # lazy: the CLI's other commands never load numpy / pandas

    earlier = taken(directory)
    if earlier:
        raise _InputError(
            f"--tensorboard {directory}: {earlier[0]} already holds TensorBoard events (an earlier "
            "report?): give a new directory (TensorBoard would show both as one run)"
        )


@contextlib.contextmanager
def _writing(option: str, path: str):
    """Create the missing parent directories of an output; a write that fails is one line."""
    try:
        target = os.path.abspath(path)
        os.makedirs(target if option == "--plots" else os.path.dirname(target), exist_ok=True)
        yield
    except ImportError as exc:
        raise _InputError(str(exc)) from None
    except OSError as exc:
        raise _InputError(f"{option} {path}: cannot be written ({exc.strerror or exc})") from None


def _safe(text) -> str:
    """``text`` (it may name files and hold names from a log) as it may reach a terminal."""
    from .render.text import terminal_safe  # lazy: the CLI's other commands never load numpy / pandas

    return terminal_safe(text)


@contextlib.contextmanager
def _plain_warnings(prog: str = "commpatch report"):
    """Warnings about the logs as ``<prog>: warning: ...`` lines (no source location), ``terminal_safe``."""
    import warnings

    from .analysis import StepPatternWarning  # lazy: the CLI's other commands never load numpy / pandas
    from .io.reader import LogFileWarning  # lazy: the CLI's other commands never load numpy / pandas

    plain = (LogFileWarning, StepPatternWarning)
    with warnings.catch_warnings():
        for category in plain:
            warnings.simplefilter("always", category)
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if issubclass(category, plain):
                print(f"{prog}: warning: {_safe(message)}", file=sys.stderr)
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        yield


def _read_steps(path, option="--steps"):
    """The step-times file, checked (read before the logs): one-line errors for what is wrong."""
    import numpy as np
    import pandas as pd

    if not os.path.exists(path):
        raise _InputError(f"{option} {path}: no such file")
    if os.path.isdir(path):
        raise _InputError(f"{option} {path}: is a directory (give the CSV file)")
    try:
        steps = pd.read_csv(path)
    except pd.errors.EmptyDataError:
        raise _InputError(f"{option} {path}: empty file (a steps file needs a header: step,duration_us)") from None
    except (pd.errors.ParserError, UnicodeDecodeError, ValueError) as exc:
        raise _InputError(f"{option} {path}: not a readable CSV ({' '.join(str(exc).split())[:120]})") from None
    except OSError as exc:
        raise _InputError(f"{option} {path}: cannot be read ({exc.strerror or exc})") from None
    steps.columns = [str(c).strip() for c in steps.columns]
    if "step" not in steps or not ({"duration_us"} <= set(steps) or {"start_ns", "end_ns"} <= set(steps)):
        raise _InputError(
            f"{option} {path}: a steps file needs columns step and duration_us "
            "(or start_ns and end_ns), optionally rank"
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
            raise _InputError(
                f"{option} {path}: column {col!r} holds {str(steps[col].iloc[i])[:40]!r} on line {i + 2}, "
                f"not {'an integer' if integral else 'a number'}"
            )
        steps[col] = values.astype(np.int64) if integral else values.astype(np.float64)
    if "duration_us" not in steps:
        steps["duration_us"] = (steps["end_ns"] - steps["start_ns"]) / 1e3
    d = steps["duration_us"].to_numpy(np.float64)
    impossible = ~np.isfinite(d) | (d < 0)
    if impossible.any():
        import warnings

        from .io.reader import LogFileWarning  # lazy: the CLI's other commands never load numpy / pandas

        warnings.warn(
            f"{option} {path}: {int(impossible.sum())} step time(s) missing, infinite or negative: left out",
            LogFileWarning,
            stacklevel=2,
        )
        steps = steps[~impossible]
    if len(steps) == 0:
        raise _InputError(f"{option} {path}: no step times in the file")
    return steps


PROGRESS_AFTER_S = 2.0  # a read that ends sooner shows no progress bar


def _progress(args, what):
    """A progress callback on stderr (tqdm when installed), or a no-op when not wanted."""
    import time

    show = args.progress if args.progress is not None else sys.stderr.isatty()
    delay = 0.0 if args.progress else PROGRESS_AFTER_S  # asked for: at once; else only for long reads
    state = {"t0": time.monotonic()}

    def update(done, total):
        if not show or total < 2:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            tqdm = None
        if tqdm is not None:
            bar = state.setdefault("bar", tqdm(total=total, desc=what, file=sys.stderr, leave=False, delay=delay))
            bar.update(done - bar.n)
            if done == total:
                bar.close()
            return
        if time.monotonic() - state["t0"] < delay:
            return
        sys.stderr.write(f"\rcommpatch: {what} {done}/{total}" + ("\n" if done == total else ""))
        sys.stderr.flush()

    return update


def cmd_convert(args) -> int:
    """Binary rank logs (.cplog: a directory, its latest run, or files) to CSV or Parquet beside
    them; an existing file is never replaced."""
    from . import io  # lazy: the CLI's other commands never load numpy / pandas
    from .data.logfile import SUFFIX  # lazy: the CLI's other commands never load numpy / pandas

    try:
        with _plain_warnings("commpatch convert"):
            return _convert(args, io, SUFFIX)
    except _InputError as exc:
        print(f"commpatch convert: {_safe(exc)}", file=sys.stderr)
        return 2


def _convert(args, io, suffix) -> int:
    files = [f for f in io.expand(args.paths) if f.endswith(suffix)]
    if not files:
        raise _InputError(f"no binary rank log (*{suffix}) in {', '.join(args.paths)}")
    progress = _progress(args, "converting")
    for i, path in enumerate(files):
        if args.to == "parquet":  # one rank-partitioned dataset per run directory
            out = os.path.join(
                os.path.dirname(path),
                "parquet",
                f"rank={io.file_rank(path)}",
                os.path.basename(io.export_path(path, ".parquet")),
            )
        else:
            out = io.export_path(path, "." + args.to)
        if os.path.lexists(out):
            print(f"commpatch convert: {_safe(out)} exists: kept as it is", file=sys.stderr)
            continue
        try:
            out = (
                io.convert_to_dataset(path, os.path.dirname(os.path.dirname(out)))
                if args.to == "parquet"
                else io.convert(path, out)
            )
        except ValueError as exc:
            raise _InputError(str(exc)) from None
        except OSError as exc:  # a full disk, a read-only directory: one line, not a traceback
            raise _InputError(f"{out}: cannot be written ({exc.strerror or exc})") from None
        print(_safe(out))
        progress(i + 1, len(files))
    return 0


def cmd_env(args) -> int:
    rows = _config.describe()
    width = max(len(r[0]) for r in rows)
    for env, value, default, help_text in rows:
        problem = _config.check(env)
        shown = "(unset)" if value is None else repr(value)
        print(f"{env.ljust(width)}  = {shown:<12} (default {default})\n{' ' * width}    {help_text}")
        if problem:
            print(f"{' ' * width}    !! {problem}")
    print(f"\nzero-code hook (.pth): {hook_path()} {'installed' if os.path.exists(hook_path()) else 'not installed'}")
    print(f"hot path: {_recorder_status()}")
    _integrations_status()
    return 0


def _integrations_status() -> None:
    """Each integration active / partial / unavailable on this torch (``python -m
    commpatch.integrations``, in a child process: cli is on the offline side, and a torch that
    fails to import must not take this command down)."""
    env = {k: v for k, v in os.environ.items() if k != "COMMPATCH"}
    try:
        out = subprocess.run(
            [sys.executable, "-m", "commpatch.integrations"], env=env, capture_output=True, text=True, timeout=120
        )
    except (OSError, subprocess.SubprocessError) as exc:
        print(f"integrations: not checked ({exc})")
        return
    if out.returncode == 0:
        print(out.stdout, end="")
    else:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        print(f"integrations: not checked (torch failed to import: {last})")


def _recorder_status() -> str:
    """Which tail the fast path uses: the C recorder (record/_hot.c) or pure Python, and why (the
    same test as record.rows.C_ROWS, without loading the runtime: cli is on the offline side)."""
    import importlib.util

    clock = time.get_clock_info("perf_counter").implementation
    if importlib.util.find_spec("commpatch.record._hot") is None:
        return (
            "pure Python (the optional C recorder was not built: reinstall with a C compiler for ~0.2 us less per call)"
        )
    if clock != "clock_gettime(CLOCK_MONOTONIC)":
        return f"pure Python (perf_counter here is {clock}; the C recorder reads CLOCK_MONOTONIC)"
    return "C recorder (commpatch.record._hot)"


def cmd_install_hook(args) -> int:
    target = hook_path()
    if args.uninstall:
        if os.path.exists(target):
            os.unlink(target)
        print(f"removed {target}")
        return 0
    shutil.copyfile(PTH_SOURCE, target)
    print(f"installed {target}: COMMPATCH=1 now instruments every Python process of this environment")
    return 0


def cmd_watch(args) -> int:
    """``commpatch watch RUN_DIR``: the live view of a running job (needs rich)."""
    import importlib.util

    if importlib.util.find_spec("rich") is None:
        print("commpatch watch: needs the rich package: pip install 'commpatch[live]'", file=sys.stderr)
        return 2
    for option, value in (("--interval", args.interval), ("--idle", args.idle), ("--stuck", args.stuck)):
        if not value > 0:
            print(f"commpatch watch: {option} {value:g}: give a number of seconds > 0", file=sys.stderr)
            return 2
    if os.path.lexists(args.run_dir) and not os.path.isdir(args.run_dir):
        print(
            f"commpatch watch: {args.run_dir}: not a directory (give the run's directory of rank logs)", file=sys.stderr
        )
        return 2
    from .watch import watch  # lazy: the CLI's other commands never load rich, numpy or pandas

    return watch(args.run_dir, interval=args.interval, idle=args.idle, stuck_s=args.stuck)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="commpatch", description=__doc__)
    parser.add_argument("--version", action="version", version=f"commpatch {__version__}")
    sub = parser.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("run", help="run a command with every Python process instrumented")
    p.add_argument("--output", help=_config.BY_NAME["output"].help)
    p.add_argument("--ops", help=_config.BY_NAME["ops"].help)
    p.add_argument("--timing", help=_config.BY_NAME["timing"].help)
    p.add_argument("--summary", action="store_true", help=_config.BY_NAME["summary"].help)
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("report", help="summarise per-rank log files (cross-rank checks, trace, plots)")
    p.add_argument("paths", nargs="*", help="files, directories or globs (every rank's file for cross-rank checks)")
    p.add_argument(
        "--by",
        default="collective,size_bucket",
        help="summary grouping: comma-separated columns and/or size_bucket, default collective,size_bucket "
        "(op, api, source: the other names of a call)",
    )
    p.add_argument(
        "--format",
        choices=("text", "markdown", "json", "csv"),
        default="text",
        help="text and markdown show every section (long tables cut); json holds every section in full; "
        "csv writes one section (--section)",
    )
    p.add_argument(
        "--section",
        default="summary",
        help="table written by --format csv: summary, steps, ranks, skew, mismatches, p2p "
        "(with --compare: scaling or by_op)",
    )
    p.add_argument("--steps", metavar="A:B", help="only steps A to B-1 (100:200; 100: or :50 leave an end open)")
    p.add_argument(
        "--ranks", metavar="LIST", help="only these ranks, e.g. 0-7,12 (the other ranks' files are not read)"
    )
    p.add_argument(
        "--step-times",
        metavar="CSV",
        help="step times: columns step and duration_us (or start_ns, end_ns), optionally rank; default: "
        "derived from the log's step column (--steps CSV is still read as this)",
    )
    p.add_argument(
        "--engine",
        choices=("auto", "pandas", "duckdb"),
        default="auto",
        help="duckdb: the cross-rank report on DuckDB, in bounded memory (pip install 'commpatch[scale]'); "
        "auto (default): DuckDB from 256 MB of logs on when it is installed, else pandas",
    )
    p.add_argument("--top", type=int, default=10, help="collectives listed by arrival skew (default 10)")
    p.add_argument(
        "--trace", metavar="FILE", help="also write a Chrome trace / Perfetto JSON timeline (.json or .json.gz)"
    )
    p.add_argument("--plots", metavar="DIR", help="also write PNG plots (needs matplotlib)")
    p.add_argument(
        "--html", metavar="FILE", help="also write the report as one self-contained HTML page (works offline)"
    )
    p.add_argument(
        "--wide",
        action="store_true",
        help="text: every column of every table, sentences unwrapped (default: fits 120 columns)",
    )
    p.add_argument(
        "--tensorboard",
        metavar="OUTDIR",
        help="also write TensorBoard scalars per step and rank (OUTDIR/rank{r}: step time, communication and "
        "exposed share, busbw per collective; needs pip install 'commpatch[tensorboard]')",
    )
    p.add_argument(
        "--module-tree",
        metavar="FILE",
        help="also write the per-module collective tree (CommDebugMode JSON format); needs the module column",
    )
    p.add_argument(
        "--compare",
        nargs="+",
        metavar="RUN_DIR",
        help="compare runs of one job at several world sizes instead (one directory per run)",
    )
    p.add_argument(
        "--scaling",
        choices=("weak", "strong"),
        default="weak",
        help="with --compare: weak (the same batch per rank, default) or strong (the same global batch)",
    )
    p.add_argument(
        "--global-batch",
        type=float,
        metavar="SAMPLES",
        help="with --compare: samples per step of the smallest run (weak scaling: it grows with the world "
        "size), for a samples/s column",
    )
    p.add_argument("--fail-on-mismatch", action="store_true", help="exit with status 1 when ranks disagree")
    p.add_argument(
        "--progress",
        dest="progress",
        action="store_true",
        default=None,
        help="progress on stderr while reading (default: when stderr is a terminal)",
    )
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser(
        "convert",
        help="write the CSV of binary rank logs (e.g. of a job that died), or a "
        "rank-partitioned Parquet dataset of them",
    )
    p.add_argument("paths", nargs="+", help=".cplog files, or directories (a run, or a directory of runs: the latest)")
    p.add_argument(
        "--to",
        choices=("csv", "parquet"),
        default="csv",
        help="csv: rank{r}.csv beside each log; parquet: one dataset per run, parquet/rank=R/rank{r}.parquet "
        "(hive layout: DuckDB, Spark, Trino, pyarrow and commpatch report read it as is)",
    )
    p.add_argument(
        "--progress",
        dest="progress",
        action="store_true",
        default=None,
        help="progress on stderr (default: when stderr is a terminal and it takes more than 2 s)",
    )
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser(
        "watch",
        help="the live view of a running job: per rank its step, step time and shares "
        "(reads its growing rank logs; needs rich)",
    )
    p.add_argument("run_dir", help="the run's directory of rank logs (or a directory of runs: the latest)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    p.add_argument(
        "--idle", type=float, default=60.0, help="stop when no rank log grew for this many seconds (default 60)"
    )
    p.add_argument(
        "--stuck", type=float, default=30.0, help="list a call in flight for longer than this many seconds (default 30)"
    )
    p.set_defaults(func=cmd_watch)

    p = sub.add_parser("env", help="show settings and their environment variables")
    p.set_defaults(func=cmd_env)

    p = sub.add_parser("install-hook", help="install the .pth hook that makes COMMPATCH=1 work everywhere")
    p.add_argument("--uninstall", action="store_true", help="remove the hook this command installed")
    p.set_defaults(func=cmd_install_hook)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
