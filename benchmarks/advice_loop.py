"""Tuning advice, checked by running it: a DDP job with a poor setting, its report's advice, the job again
with the advice applied.

    python benchmarks/advice_loop.py [--rounds 3] [--start-mb 1000] [--steps 40] [--port 35100]

Each round: the job (2 ranks, gloo, CPU, under ``commpatch run``) with ``bucket_cap_mb=--start-mb``
(by default one bucket holding every gradient: its all-reduce starts only when the backward is over);
``commpatch report --format json``; the advice item of rule ``ddp_bucket_size`` read from the JSON
(its ``setting``, never a value written here); the job again with that setting; its report. Prints,
per round and run, the bucket size, the steady-state step time (median) and exposed share, and the
ratios (advised / poor) with their median over the rounds. A run with no bucket advice says so.

``--worker`` is the training job itself (run by torchrun).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def mlp(args):
    """The job's model: ``--layers`` square layers of ``--hidden`` between a 64-input layer and one output."""
    import torch

    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, args.hidden), torch.nn.ReLU()]
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(args.hidden, 1))


def worker(args) -> None:
    """One rank of the DDP job (no commpatch code: ``commpatch run`` activates it)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    ddp = DistributedDataParallel(mlp(args), bucket_cap_mb=args.bucket_mb)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(args.steps):
        x = torch.randn(args.batch, 64, generator=gen)
        loss = torch.nn.functional.mse_loss(ddp(x), x.sum(dim=1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        opt.step()
    dist.destroy_process_group()


def run_job(args, bucket_mb: float, out: str) -> dict:
    """The job under commpatch with ``bucket_cap_mb=bucket_mb``; its report as parsed JSON."""
    os.makedirs(out)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    cmd = [sys.executable, "-m", "commpatch", "run", "--output", os.path.join(out, "rank{rank}.csv"), "--",
           sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
           f"--master_port={args.port}", os.path.abspath(__file__), "--worker", "--bucket-mb", str(bucket_mb),
           "--steps", str(args.steps), "--layers", str(args.layers), "--hidden", str(args.hidden),
           "--batch", str(args.batch)]
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rep = subprocess.run([sys.executable, "-m", "commpatch", "report", out, "--format", "json", "--no-progress"],
                         check=True, env=env, capture_output=True, text=True)
    return json.loads(rep.stdout)


def steady(report: dict) -> tuple:
    """(median step time in ms, median exposed share) over the report's steady-state steps."""
    rows = [r for r in report["sections"]["steps"] if r["stage"] == "steady"]
    return (statistics.median(r["step_us"] for r in rows) / 1e3,
            statistics.median(r["exposed_share"] for r in rows))


def bucket_advice(report: dict):
    return next((a for a in report.get("advice", []) if a["rule"] == "ddp_bucket_size"), None)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--start-mb", type=float, default=1000.0, help="the poor bucket_cap_mb of the first run")
    parser.add_argument("--bucket-mb", type=float, default=25.0, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--port", type=int, default=35100)
    parser.add_argument("--out", default=None, help="keep the runs' logs here (default: a temporary directory)")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    ratios = {"step": [], "exposed": []}
    with tempfile.TemporaryDirectory() as tmp:
        base = args.out or tmp
        print(f"{'round':>5}  {'run':<8}  {'bucket_cap_mb':>13}  {'step p50 ms':>11}  {'exposed':>7}  advice")
        for i in range(args.rounds):
            poor = run_job(args, args.start_mb, os.path.join(base, f"round{i}-poor"))
            step0, exp0 = steady(poor)
            advice = bucket_advice(poor)
            print(f"{i:>5}  {'poor':<8}  {args.start_mb:>13g}  {step0:>11.2f}  {exp0:>7.1%}  "
                  + (advice["change"] if advice else "none"), flush=True)
            if advice is None:
                continue
            mb = advice["setting"]["bucket_cap_mb"]
            advised = run_job(args, mb, os.path.join(base, f"round{i}-advised"))
            step1, exp1 = steady(advised)
            again = bucket_advice(advised)
            print(f"{i:>5}  {'advised':<8}  {mb:>13g}  {step1:>11.2f}  {exp1:>7.1%}  "
                  + (again["change"] if again else "none"), flush=True)
            ratios["step"].append(step1 / step0)
            ratios["exposed"].append(exp1 / exp0 if exp0 > 0 else float("nan"))
    if ratios["step"]:
        print(f"advised / poor, median of {len(ratios['step'])} round(s): step time "
              f"{statistics.median(ratios['step']):.2f} (per round {', '.join(f'{r:.2f}' for r in ratios['step'])}), "
              f"exposed share {statistics.median(ratios['exposed']):.2f} "
              f"(per round {', '.join(f'{r:.2f}' for r in ratios['exposed'])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
