"""`make demo`: a real 2-process DDP training job (gloo) with one slow rank, instrumented with no
code change; then the report, headline and findings first, with the CSVs (one per rank), a Perfetto
trace, the HTML report and PNG plots (when matplotlib is installed) written in a new run directory
of its own under --out (``demo-YYYYmmdd-HHMMSS``). Nothing is ever deleted: earlier demos and your own runs stay."""

import argparse
import importlib.util
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--out", default="commpatch_demo", help="the demo's runs go in a new directory under this one")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--slow-rank", type=int, default=1)
    parser.add_argument("--slow-ms", type=float, default=5.0)
    args = parser.parse_args()
    run_dir = new_run_dir(args.out)
    cmd = [
        sys.executable,
        "-m",
        "commpatch",
        "run",
        "--output",
        os.path.join(run_dir, "rank{rank}.csv"),
        "--",
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={args.nproc}",
        os.path.join(HERE, "train_ddp.py"),
        "--steps",
        str(args.steps),
        "--slow-rank",
        str(args.slow_rank),
        "--slow-ms",
        str(args.slow_ms),
    ]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    print(f"\nper-rank logs: {sorted(os.listdir(run_dir))} in {run_dir}/\n", flush=True)
    trace = os.path.join(run_dir, "trace.json")
    page = os.path.join(run_dir, "report.html")
    report = [sys.executable, "-m", "commpatch", "report", run_dir, "--trace", trace, "--html", page, "--no-progress"]
    if importlib.util.find_spec("matplotlib") is not None:
        report += ["--plots", os.path.join(run_dir, "plots")]
    print("$", " ".join(report[2:]), flush=True)
    subprocess.run(report, check=True)
    print(f"\ntimeline for ui.perfetto.dev / chrome://tracing: {trace}")
    print(f"the report as a web page (works offline): {page}")
    return 0


def new_run_dir(out: str) -> str:
    """A directory this demo creates under ``out`` (never one that exists: it deletes nothing)."""
    stamp = time.strftime("demo-%Y%m%d-%H%M%S")
    for i in range(1000):
        path = os.path.join(out, stamp if i == 0 else f"{stamp}.{i}")
        try:
            os.makedirs(path)
            return path
        except FileExistsError:
            continue
    raise SystemExit(f"demo: no free run directory name under {out}")


if __name__ == "__main__":
    sys.exit(main())
