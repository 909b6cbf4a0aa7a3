"""`make demo`: a real 2-process gloo training job, instrumented with no code change, then a
summary of what it communicated. Writes one CSV per rank under --out."""

import argparse
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--out", default="commpatch_logs")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    if os.path.isdir(args.out):
        shutil.rmtree(args.out)
    cmd = [sys.executable, "-m", "commpatch", "run", "--output", os.path.join(args.out, "rank{rank}.csv"), "--",
           sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           os.path.join(HERE, "train.py"), "--steps", str(args.steps)]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    print(f"\nper-rank logs: {sorted(os.listdir(args.out))} in {args.out}/\n", flush=True)
    trace = os.path.join(args.out, "trace.json")
    subprocess.run([sys.executable, "-m", "commpatch", "report", args.out, "--trace", trace], check=True)
    print(f"\ntimeline for ui.perfetto.dev / chrome://tracing: {trace}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
