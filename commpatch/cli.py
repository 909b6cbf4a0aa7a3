"""Command line: ``commpatch run -- CMD``, ``commpatch report FILES``, ``commpatch env``,
``commpatch install-hook``."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import sysconfig

from . import _config

BOOT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_boot")
PTH_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "commpatch.pth")


def hook_path() -> str:
    return os.path.join(sysconfig.get_paths()["purelib"], "commpatch.pth")


def cmd_run(args) -> int:
    if not args.command:
        print("commpatch run: give the command after --, e.g. commpatch run -- torchrun --nproc_per_node=2 train.py",
              file=sys.stderr)
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
            from .export import check_writable

            check_writable(settings["output"])
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


def cmd_report(args) -> int:
    from . import analysis, merge, report

    if args.compare:
        return _report_compare(args)
    if not args.paths:
        print("commpatch report: give log files or directories (or --compare RUN_DIRS...)", file=sys.stderr)
        return 2
    by = [b.strip() for b in args.by.split(",") if b.strip()]
    # the report alone needs a subset of the columns (a large log reads faster); exports need all
    columns = None if args.trace or args.module_tree else set(report.REPORT_COLUMNS) | set(by)
    df = merge.read_logs(args.paths, progress=_progress(args, "reading"), columns=columns)
    steps = _read_steps(args.steps) if args.steps else None
    cross = merge.cross_rank(df) if df["rank"].nunique() > 1 else None
    rep = report.build_report(df, by=by, steps=steps, top=args.top, cross=cross)
    if args.format == "csv":
        frame = rep.sections.get(args.section)
        if frame is None:
            print(f"commpatch report: no '{args.section}' section for this log "
                  f"(available: {', '.join(rep.sections)})", file=sys.stderr)
            return 2
        sys.stdout.write(frame.to_csv(index=False))
    elif args.format == "json":
        sys.stdout.write(report.render_report_json(rep) + "\n")
    elif args.format == "markdown":
        sys.stdout.write(report.render_report_markdown(rep) + "\n")
    else:
        sys.stdout.write(report.render_report_text(rep) + "\n")
    if args.trace:
        from .trace import write_chrome_trace

        print(f"commpatch: trace written to {write_chrome_trace(df, args.trace)} "
              "(open in https://ui.perfetto.dev or chrome://tracing)", file=sys.stderr)
    if args.module_tree:
        from .trace import write_module_tree

        try:
            print(f"commpatch: module tree written to {write_module_tree(df, args.module_tree)}", file=sys.stderr)
        except ValueError as exc:
            print(f"commpatch report: {exc}", file=sys.stderr)
            return 2
    if args.plots:
        from . import plots

        try:
            written = plots.write_plots(args.plots, analysis.summary(df, by=["op", "size_bucket"]),
                                        rep.sections.get("steps"), cross.arrivals if cross is not None else None)
        except ImportError as exc:
            print(f"commpatch report: {exc}", file=sys.stderr)
            return 2
        print("commpatch: plots written: " + ", ".join(written), file=sys.stderr)
    return 1 if args.fail_on_mismatch and rep.errors else 0


def _report_compare(args) -> int:
    from . import analysis, merge, report

    runs = {}
    for i, path in enumerate(args.compare):
        runs[path] = merge.read_logs(path)
        _progress(args, "runs")(i + 1, len(args.compare))
    table, by_op = analysis.scaling(runs), analysis.scaling_by_op(runs)
    if args.format == "csv":
        sys.stdout.write((by_op if args.section == "by_op" else table).to_csv(index=False))
    elif args.format == "json":
        sys.stdout.write(json.dumps({"scaling": json.loads(table.to_json(orient="records")),
                                     "by_op": json.loads(by_op.to_json(orient="records"))}, indent=1) + "\n")
    elif args.format == "markdown":
        sys.stdout.write("## Scaling\n\n" + report.render_markdown(table) + "\n\n## Bus bandwidth per op\n\n"
                         + report.render_markdown(by_op) + "\n")
    else:
        sys.stdout.write(report.render_text(table, title="commpatch scaling: runs by world size") + "\n\n"
                         + report.render_text(by_op, title="bus bandwidth per op and world size") + "\n")
    if args.plots:
        from . import plots

        try:
            path = plots.save(plots.scaling(table, by_op), os.path.join(args.plots, "scaling.png"))
        except ImportError as exc:
            print(f"commpatch report: {exc}", file=sys.stderr)
            return 2
        print(f"commpatch: plots written: {path}", file=sys.stderr)
    return 0


def _read_steps(path):
    import pandas as pd

    steps = pd.read_csv(path)
    if "step" not in steps or not ({"duration_us"} <= set(steps) or {"start_ns", "end_ns"} <= set(steps)):
        raise SystemExit(f"commpatch report: {path}: a steps file needs columns step and duration_us "
                         "(or start_ns and end_ns), optionally rank")
    return steps


def _progress(args, what):
    """A progress callback on stderr (tqdm when installed), or a no-op when not wanted."""
    show = args.progress if args.progress is not None else sys.stderr.isatty()
    state = {}

    def update(done, total):
        if not show or total < 2:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            tqdm = None
        if tqdm is not None:
            bar = state.setdefault("bar", tqdm(total=total, desc=what, file=sys.stderr, leave=False))
            bar.update(done - bar.n)
            if done == total:
                bar.close()
            return
        sys.stderr.write(f"\rcommpatch: {what} {done}/{total}" + ("\n" if done == total else ""))
        sys.stderr.flush()

    return update


def cmd_env(args) -> int:
    rows = _config.describe()
    width = max(len(r[0]) for r in rows)
    for env, value, default, help_text in rows:
        print(f"{env.ljust(width)}  = {value!r:<12} (default {default!r})\n{' ' * width}    {help_text}")
    print(f"\nzero-code hook (.pth): {hook_path()} {'installed' if os.path.exists(hook_path()) else 'not installed'}")
    return 0


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="commpatch", description=__doc__)
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
    p.add_argument("--by", default="op,size_bucket",
                   help="summary grouping: comma-separated columns and/or size_bucket, default op,size_bucket")
    p.add_argument("--format", choices=("text", "markdown", "json", "csv"), default="text")
    p.add_argument("--section", default="summary",
                   help="table written by --format csv: summary, steps, ranks, skew, mismatches, p2p "
                        "(with --compare: scaling or by_op)")
    p.add_argument("--steps", metavar="CSV", help="step times: columns step and duration_us (or start_ns, end_ns), "
                                                  "optionally rank; default: derived from the log's step column")
    p.add_argument("--top", type=int, default=10, help="collectives listed by arrival skew (default 10)")
    p.add_argument("--trace", metavar="FILE", help="also write a Chrome trace / Perfetto JSON timeline (.json or .json.gz)")
    p.add_argument("--plots", metavar="DIR", help="also write PNG plots (needs matplotlib)")
    p.add_argument("--module-tree", metavar="FILE",
                   help="also write the per-module collective tree (CommDebugMode JSON format); needs the module column")
    p.add_argument("--compare", nargs="+", metavar="RUN_DIR",
                   help="compare runs of one job at several world sizes instead (one directory per run)")
    p.add_argument("--fail-on-mismatch", action="store_true", help="exit with status 1 when ranks disagree")
    p.add_argument("--progress", dest="progress", action="store_true", default=None,
                   help="progress on stderr while reading (default: when stderr is a terminal)")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("env", help="show settings and their environment variables")
    p.set_defaults(func=cmd_env)

    p = sub.add_parser("install-hook", help="install the .pth hook that makes COMMPATCH=1 work everywhere")
    p.add_argument("--uninstall", action="store_true")
    p.set_defaults(func=cmd_install_hook)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
