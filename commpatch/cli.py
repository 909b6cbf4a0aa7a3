"""Command line: ``commpatch run -- CMD``, ``commpatch report FILES``, ``commpatch convert FILES``,
``commpatch env``, ``commpatch install-hook``."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
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
        # a bad monitoring setting is each process's warning when it starts: not the launcher's refusal
        settings = _config.resolve(environ=env, warn=lambda message: None)
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
    exe = shutil.which(command[0], path=env.get("PATH")) or command[0]
    started = time.time()
    try:
        child = subprocess.Popen([exe] + command[1:], env=env, preexec_fn=_die_with(os.getpid()))
    except OSError as exc:
        print(f"commpatch run: cannot run {command[0]!r}: {exc.strerror}", file=sys.stderr)
        return 127
    code = _wait_forwarding(child)
    if settings["output"]:
        print(f"commpatch: {_where_written(settings['output'], started)}", file=sys.stderr)
    if code < 0:  # killed by a signal: end the same way, as the shell would have seen the command end
        with contextlib.suppress(OSError, ValueError):  # SIGKILL's cannot be set: it is the default
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        return 128 - code
    return code


# the signals `commpatch run` passes on to the command (SIGINT reaches it from the terminal itself)
FORWARDED = ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")


def _die_with(parent: int):
    """For the command's process, between fork and exec: the kernel sends it SIGTERM when ``parent``
    (`commpatch run`) dies, even by SIGKILL (Linux ``PR_SET_PDEATHSIG``), so that a launcher like
    torchrun stops its workers instead of leaving them to run on, re-parented; None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None

    def preexec() -> None:
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            return
        if os.getppid() != parent:  # the parent died before the call
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def _wait_forwarding(child) -> int:
    """Wait for ``child``, passing on the ``FORWARDED`` signals; its return code (negative: the
    signal that ended it). SIGINT is caught and dropped here: the terminal sends it to the command too."""
    previous = {}
    for name in FORWARDED + ("SIGINT",):
        sig = getattr(signal, name, None)
        if sig is not None:
            previous[sig] = signal.signal(
                sig, (lambda s, f: None) if name == "SIGINT" else (lambda s, f: child.send_signal(s))
            )
    try:
        while True:
            try:
                return child.wait()
            except InterruptedError:  # pragma: no cover - PEP 475 retries; kept for other platforms
                continue
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def runs_root(template: str) -> tuple[str, bool]:
    """(the directory an output template writes into, whether it holds one directory per run):
    ``commpatch_logs/{run}/rank{rank}.csv`` -> (``commpatch_logs``, True)."""
    per_run = "{run}" in template
    head = template.split("{run}")[0] if per_run else template.split("{")[0]
    root = head.rstrip(os.sep) if head.endswith(os.sep) else os.path.dirname(head)
    return root or ".", per_run


def _where_written(template: str, started: float) -> str:
    """One line for the end of `commpatch run`: where this run's logs are and the report command."""
    import shlex

    from . import offline  # lazy: after the command ended; `commpatch run` itself loads no numpy

    root, per_run = runs_root(template)
    found = offline.written_since(root, per_run, started - 1.0)
    if not found:
        return f"no log was written under {root} (`commpatch env` says what is active)"
    more = f" ({len(found)} runs: restarts)" if len(found) > 1 else ""
    return f"the logs are in {found[-1]}{more}; the report: commpatch report {shlex.quote(root)}"


class _InputError(Exception):
    """A bad option of ``commpatch report`` / ``convert``: one line on stderr, exit status 2."""


def cmd_report(args) -> int:
    """``commpatch report``: every bad input ends in one line on stderr and exit status 2 (no
    traceback); what can be read best-effort is, with one ``warning:`` line per problem."""
    from . import offline  # lazy: the CLI's other commands never load numpy / pandas

    try:
        with _plain_warnings(offline):
            return _report_compare(args, offline) if args.compare else _report(args, offline)
    except (_config.ConfigError, offline.LogFileError, offline.EngineError, _InputError) as exc:
        print(f"commpatch report: {offline.terminal_safe(str(exc))}", file=sys.stderr)
        return 2


def _default_logs() -> str:
    """Where `commpatch report` with no path reads: the directory that the output setting
    (COMMPATCH_OUTPUT, else the default) writes into, when it exists."""
    template = _config.resolve(warn=lambda message: None)["output"] or _config.BY_NAME["output"].default
    root, _ = runs_root(template)
    if not os.path.isdir(root):
        raise _InputError(f"give log files or directories (or --compare RUN_DIRS...): there is no {root} here")
    return root


def _report(args, offline) -> int:
    if not args.paths:
        args.paths = [_default_logs()]
    by = offline.check_by(args.by, "--by")
    top = offline.check_top(args.top, "--top")
    ranks = offline.parse_ranks(args.ranks, "--ranks")
    window, step_times = _steps_option(args, offline)
    # outputs and inputs other than the logs are checked before anything is read or computed
    for option, path in (("--trace", args.trace), ("--module-tree", args.module_tree), ("--html", args.html)):
        if path:
            offline.check_output(path, option)
    if args.plots:
        offline.check_plots(args.plots, "--plots")
    if args.tensorboard:
        offline.check_tensorboard(args.tensorboard, "--tensorboard")
    for kind in ("mlflow", "wandb"):
        if getattr(args, kind):
            offline.check_tracker(kind, f"--{kind}")
    steps = offline.read_step_times(*step_times) if step_times else None
    engine = offline.check_engine(args.engine, "--engine")
    progress = _progress(args, "reading")
    with offline.open(
        args.paths,
        ranks=ranks,
        steps=window,
        engine=engine,
        by=by,
        step_times=steps,
        top=top,
        progress=progress,
        spark_master=args.spark_master,
        spark_dir=args.spark_dir,
    ) as run:
        if (args.trace or args.module_tree) and run.engine == "pandas":
            run.rows()  # one read serves the report and the exports (the report alone reads fewer columns)
        _print_report(args, run)
        if args.module_tree and not run.has_modules:
            raise _InputError(f"--module-tree: {offline.NO_MODULES}")
        if args.trace:
            with _writing("--trace", args.trace):
                print(
                    f"commpatch: trace written to {run.write_trace(args.trace)} "
                    "(open in https://ui.perfetto.dev or chrome://tracing)",
                    file=sys.stderr,
                )
        if args.module_tree:
            with _writing("--module-tree", args.module_tree):
                try:
                    path = run.write_module_tree(args.module_tree)
                except ValueError as exc:  # e.g. a log with no module names
                    raise _InputError(str(exc)) from None
            print(f"commpatch: module tree written to {path}", file=sys.stderr)
        if args.tensorboard:
            with _writing("--tensorboard", args.tensorboard):
                written = run.write_tensorboard(args.tensorboard)
            print(
                f"commpatch: TensorBoard scalars written to {args.tensorboard} ({len(written)} rank(s); "
                f"tensorboard --logdir {args.tensorboard})",
                file=sys.stderr,
            )
        if args.mlflow:
            with _logging_to("--mlflow", args.mlflow):
                run_id = run.log_mlflow(args.mlflow, args.mlflow_experiment)
            print(
                f"commpatch: logged to MLflow at {_safe(args.mlflow)}: experiment {_safe(args.mlflow_experiment)}, "
                f"run {run_id} ({_safe(run.name)})",
                file=sys.stderr,
            )
        if args.wandb:
            with _logging_to("--wandb", args.wandb):
                where = run.log_wandb(args.wandb)
            print(f"commpatch: logged to Weights & Biases: {_safe(where)}", file=sys.stderr)
        if args.plots:
            with _writing("--plots", args.plots):
                written = run.plots(args.plots)
            print("commpatch: plots written: " + ", ".join(written), file=sys.stderr)
        if args.html:
            with _writing("--html", args.html):
                path = run.write_html(args.html)
            print(f"commpatch: HTML report written to {path} ({os.path.getsize(path) / 1e6:.2f} MB)", file=sys.stderr)
        return 1 if args.fail_on_mismatch and run.report().errors else 0


def _print_report(args, report) -> None:
    """``report`` (a Run or a Comparison) on stdout in the --format asked (csv: one --section)."""
    if args.format == "csv":
        sys.stdout.write(report.csv(args.section))
    elif args.format == "text":
        sys.stdout.write(report.text(wide=args.wide) + "\n")
    else:
        sys.stdout.write(getattr(report, args.format)() + "\n")


def _steps_option(args, offline):
    """(window of steps (first, stop) or None, (step-times CSV, option name) or None) from --steps
    A:B (a window; either end may be left out) or --step-times CSV (--steps CSV still works)."""
    window, times = None, (args.step_times, "--step-times") if args.step_times else None
    text = args.steps
    if text is not None:
        if offline.is_steps_window(text):
            window = offline.parse_steps(text, "--steps")
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


def _report_compare(args, offline) -> int:
    if args.plots:
        offline.check_plots(args.plots, "--plots")
    if args.html:
        offline.check_output(args.html, "--html")
    for option, does in (("tensorboard", "writes"), ("mlflow", "logs"), ("wandb", "logs")):
        if getattr(args, option):
            raise _InputError(f"--{option} {does} one run's steps: give the run without --compare")
    offline.check_global_batch(args.global_batch, "--global-batch")
    try:
        runs = offline.compare(
            args.compare, scaling=args.scaling, global_batch=args.global_batch, progress=_progress(args, "runs")
        )
    except offline.LogFileError as exc:
        if exc.problem.startswith("no collective calls recorded"):  # a run with no call: name the option
            raise _InputError(f"--compare {exc}") from None
        raise
    for run in runs.unknown_steps():
        print(
            f"commpatch report: warning: --compare {_safe(run)}: no steady-state step (no step boundary in its log, or "
            "fewer than 3 steps): its per-step figures are unknown",
            file=sys.stderr,
        )
    _print_report(args, runs)
    if args.plots:
        with _writing("--plots", args.plots):
            path = runs.plots(args.plots)[0]
        print(f"commpatch: plots written: {path}", file=sys.stderr)
    if args.html:
        with _writing("--html", args.html):
            path = runs.write_html(args.html)
        print(f"commpatch: HTML report written to {path}", file=sys.stderr)
    return 0


@contextlib.contextmanager
def _writing(option: str, path: str):
    """A write that fails is one line (the Run creates the missing parent directories)."""
    try:
        yield
    except ImportError as exc:
        raise _InputError(str(exc)) from None
    except OSError as exc:
        raise _InputError(f"{option} {path}: cannot be written ({exc.strerror or exc})") from None


@contextlib.contextmanager
def _logging_to(option: str, target: str):
    """A tracker that refuses the figures (unreachable, a bad URI, no credentials) is one line
    naming it: the report itself is already printed. What the tracker prints goes to stderr (MLflow
    prints a "View run" line): stdout is the report's (JSON there must stay JSON)."""
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    except Exception as exc:  # noqa: BLE001 - the tracker's own errors, whatever their class
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        raise _InputError(f"{option} {_safe(target)}: could not log ({type(exc).__name__}: {_safe(first)})") from None


def _safe(text) -> str:
    """``text`` (it may name files and hold names from a log) as it may reach a terminal."""
    from .offline import terminal_safe  # lazy: the CLI's other commands never load numpy / pandas

    return terminal_safe(text)


@contextlib.contextmanager
def _plain_warnings(offline, prog: str = "commpatch report"):
    """Warnings about the logs as ``<prog>: warning: ...`` lines (no source location), ``terminal_safe``."""
    import warnings

    plain = (offline.LogFileWarning, offline.StepPatternWarning)
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
    from . import offline  # lazy: the CLI's other commands never load numpy / pandas

    try:
        with _plain_warnings(offline, "commpatch convert"):
            for out, written in offline.convert(args.paths, to=args.to, progress=_progress(args, "converting")):
                print(
                    _safe(out) if written else f"commpatch convert: {_safe(out)} exists: kept as it is",
                    file=sys.stdout if written else sys.stderr,
                )
    except (_config.ConfigError, offline.LogFileError) as exc:
        print(f"commpatch convert: {_safe(exc)}", file=sys.stderr)
        return 2
    return 0


def cmd_diff(args) -> int:
    """``commpatch diff A B``: what changed from run A to run B, each change with its 95% interval
    over the steady steps; one line on stderr and exit status 2 for bad input."""
    from . import offline  # lazy: the CLI's other commands never load numpy / pandas

    try:
        if args.html:
            offline.check_output(args.html, "--html")
        with _plain_warnings(offline, "commpatch diff"):
            d = offline.diff(args.a, args.b, engine="pandas")
    except (_config.ConfigError, offline.LogFileError) as exc:
        print(f"commpatch diff: {_safe(exc)}", file=sys.stderr)
        return 2
    print(offline.diff_json(d) if args.format == "json" else offline.diff_text(d))
    if args.html:
        with _writing("--html", args.html):
            path = offline.write_diff_html(d, args.html)
        print(f"commpatch: diff page written to {_safe(path)}", file=sys.stderr)
    return 0


def cmd_check(args) -> int:
    """``commpatch check RUN --max-...``: exit 0 when the run holds every limit, 1 with one line per
    violated limit (for a CI job to fail on), 2 for bad input."""
    from . import offline  # lazy: the CLI's other commands never load numpy / pandas

    try:
        limits = dict(
            max_exposed=offline.check_share_limit(args.max_exposed, "--max-exposed"),
            max_comm=offline.check_share_limit(args.max_comm, "--max-comm"),
            max_step_ms=args.max_step_ms,
            max_regression=offline.check_share_limit(args.max_regression, "--max-regression"),
        )
        if args.max_step_ms is not None and not args.max_step_ms > 0:
            raise _config.ConfigError(f"--max-step-ms {args.max_step_ms!r}: a number of milliseconds above 0")
        with _plain_warnings(offline, "commpatch check"):
            bad, held = offline.check(args.path, baseline=args.baseline, engine="pandas", **limits)
    except (_config.ConfigError, offline.LogFileError) as exc:
        print(f"commpatch check: {_safe(exc)}", file=sys.stderr)
        return 2
    for line in bad:
        print(f"commpatch check: FAILED: {_safe(line)}")
    for line in held:
        print(f"commpatch check: ok: {_safe(line)}")
    return 1 if bad else 0


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
        choices=("auto", "pandas", "duckdb", "spark"),
        default="auto",
        help="duckdb: the cross-rank report on DuckDB, in bounded memory (pip install 'commpatch[scale]'); "
        "spark: the same queries on Apache Spark (pip install 'commpatch[spark]'); "
        "auto (default): DuckDB from 256 MB of logs on when it is installed, else pandas",
    )
    p.add_argument(
        "--spark-master",
        metavar="URL",
        help="with --engine spark: the Spark master (spark://host:7077, yarn, ...; default local[*])",
    )
    p.add_argument(
        "--spark-dir",
        metavar="DIR",
        help="with --engine spark: where Spark's executors stage the ranks, a directory each of them reads and writes "
        "at the same path (a shared file system; default: the temporary directory)",
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
        "--mlflow",
        metavar="URI",
        help="also log the headline and per-step figures as a new MLflow run at this tracking URI "
        "(needs pip install 'commpatch[mlflow]')",
    )
    p.add_argument(
        "--mlflow-experiment",
        metavar="NAME",
        default="commpatch",
        help="with --mlflow: the experiment (default commpatch)",
    )
    p.add_argument(
        "--wandb",
        metavar="PROJECT",
        help="also log the headline and per-step figures as a new Weights & Biases run in this project "
        "(W&B's own settings apply: WANDB_MODE=offline, WANDB_API_KEY; needs pip install 'commpatch[wandb]')",
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

    p = sub.add_parser("diff", help="compare two runs: what changed, and whether it is more than the steps' spread")
    p.add_argument("a", help="run A (a directory of runs, a run directory or log files): the reference")
    p.add_argument("b", help="run B: compared against A")
    p.add_argument("--format", choices=("text", "json"), default="text", help="text (default) or json")
    p.add_argument("--html", metavar="FILE", help="also write the diff as one self-contained HTML page")
    p.set_defaults(func=cmd_diff)

    p = sub.add_parser("check", help="exit 1 when a run breaks a communication limit (for CI)")
    p.add_argument("path", help="the run (a directory of runs, a run directory or log files)")
    p.add_argument("--max-exposed", help="the largest exposed share of the step, e.g. 30%% (steady-state median)")
    p.add_argument("--max-comm", help="the largest communication share of the step, e.g. 50%%")
    p.add_argument("--max-step-ms", type=float, help="the longest median steady-state step, in ms")
    p.add_argument("--baseline", help="a run to compare with (needs --max-regression)")
    p.add_argument(
        "--max-regression",
        help="the largest significant increase of step time, communication or exposed time over the baseline, e.g. 5%%",
    )
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("env", help="show settings and their environment variables")
    p.set_defaults(func=cmd_env)

    p = sub.add_parser("install-hook", help="install the .pth hook that makes COMMPATCH=1 work everywhere")
    p.add_argument("--uninstall", action="store_true", help="remove the hook this command installed")
    p.set_defaults(func=cmd_install_hook)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
