"""`make demo`: a real 2-process DDP training job (gloo) with one slow rank, instrumented with no
code change; then the report, findings first, with the CSVs (one per rank), a Perfetto trace and
PNG plots (when matplotlib is installed) written under --out."""

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--out", default="commpatch_logs")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--slow-rank", type=int, default=1)
    parser.add_argument("--slow-ms", type=float, default=5.0)
    args = parser.parse_args()
    if os.path.isdir(args.out):
        shutil.rmtree(args.out)
    cmd = [sys.executable, "-m", "commpatch", "run", "--output", os.path.join(args.out, "rank{rank}.csv"), "--",
           sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           os.path.join(HERE, "train_ddp.py"), "--steps", str(args.steps), "--slow-rank", str(args.slow_rank),
           "--slow-ms", str(args.slow_ms)]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    print(f"\nper-rank logs: {sorted(os.listdir(args.out))} in {args.out}/\n", flush=True)
    trace = os.path.join(args.out, "trace.json")
    report = [sys.executable, "-m", "commpatch", "report", args.out, "--trace", trace, "--no-progress"]
    if importlib.util.find_spec("matplotlib") is not None:
        report += ["--plots", os.path.join(args.out, "plots")]
    print("$", " ".join(report[2:]), flush=True)
    subprocess.run(report, check=True)
    print(f"\ntimeline for ui.perfetto.dev / chrome://tracing: {trace}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
