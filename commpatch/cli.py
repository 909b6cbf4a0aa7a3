"""Command line: ``commpatch run -- CMD``, ``commpatch report FILES``, ``commpatch env``,
``commpatch install-hook``."""

from __future__ import annotations

import argparse
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
    from . import analysis, export, report

    df = export.read(args.paths)
    by = [b.strip() for b in args.by.split(",") if b.strip()]
    summ = analysis.summary(df, by=by)
    if args.format == "csv":
        sys.stdout.write(summ.to_csv(index=False))
    elif args.format == "json":
        sys.stdout.write(summ.to_json(orient="records", indent=1) + "\n")
    elif args.format == "markdown":
        sys.stdout.write(report.render_markdown(summ) + "\n")
    else:
        ranks = sorted(df["rank"].unique().tolist())
        title = f"commpatch summary: {len(df)} calls, ranks {ranks}"
        sys.stdout.write(report.render_text(summ, title=title) + "\n")
    return 0


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

    p = sub.add_parser("report", help="summarise per-rank log files")
    p.add_argument("paths", nargs="+", help="files, directories or globs")
    p.add_argument("--by", default="op", help="comma-separated columns (and/or size_bucket), default op")
    p.add_argument("--format", choices=("text", "markdown", "json", "csv"), default="text")
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
