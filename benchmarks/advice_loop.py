"""Tuning advice, checked by running it: a DDP job with a poor setting, its report's advice, the job again
with the advice applied.

    python benchmarks/advice_loop.py [--rounds 3] [--start-mb 1000] [--steps 40] [--port 35100]

Each round: the job (2 ranks, gloo, CPU, under ``commpatch run``) with ``bucket_cap_mb=--start-mb``
(by default one bucket holding every gradient: its all-reduce starts only when the backward is over);
``commpatch report --format json``; the advice item of rule ``ddp_bucket_size`` read from the JSON
(its ``setting``, never a value written here); the job twice with that setting, then once more with
the poor one (poor, advised, advised, poor: a load on the machine that drifts during the round
cancels out). Prints, per run, the bucket size, the steady-state step time (median) and exposed
share, and the advice of its own report; per round the ratios advised / poor (the means of two runs
each), and their median over the rounds. A poor run with no bucket advice ends its round.

The model's layers are followed by compute that leaves the CPU free (``--device-ms``: a sleep), as an
accelerator's kernels do; with ``--device-ms 0`` the backward is CPU work only and, on a machine of
few cores, the all-reduce competes with it for the CPU.

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
    """The job's model: ``--layers`` square layers of ``--hidden`` between a 64-input layer and one output,
    each followed by ``--device-ms`` of compute that leaves the CPU free (a sleep: forward, twice that in
    the backward), as an accelerator's kernels do: on 2 shared cores the gloo threads have a CPU for the
    all-reduce while the backward runs."""
    import time

    import torch

    class Device(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            time.sleep(args.device_ms / 1e3)
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            time.sleep(2 * args.device_ms / 1e3)
            return grad

    class OnDevice(torch.nn.Module):
        def forward(self, x):
            return Device.apply(x) if args.device_ms > 0 else x

    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, args.hidden), OnDevice(), torch.nn.ReLU()]
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.hidden, args.hidden), OnDevice(), torch.nn.ReLU()]
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
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
    )
    cmd = [
        sys.executable,
        "-m",
        "commpatch",
        "run",
        "--output",
        os.path.join(out, "rank{rank}.csv"),
        "--",
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--nproc_per_node=2",
        f"--master_port={args.port}",
        os.path.abspath(__file__),
        "--worker",
        "--bucket-mb",
        str(bucket_mb),
        "--steps",
        str(args.steps),
        "--layers",
        str(args.layers),
        "--hidden",
        str(args.hidden),
        "--batch",
        str(args.batch),
        "--device-ms",
        str(args.device_ms),
    ]
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rep = subprocess.run(
        [sys.executable, "-m", "commpatch", "report", out, "--format", "json", "--no-progress"],
        check=True,
        env=env,
        capture_output=True,
        text=True,
    )
    return json.loads(rep.stdout)


def steady(report: dict) -> tuple:
    """(median step time in ms, median exposed share) over the report's steady-state steps."""
    rows = [r for r in report["sections"]["steps"] if r["stage"] == "steady"]
    return (statistics.median(r["step_us"] for r in rows) / 1e3, statistics.median(r["exposed_share"] for r in rows))


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
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument(
        "--device-ms", type=float, default=3.0, help="per layer: forward sleep (backward: twice); 0: CPU compute only"
    )
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

        def one(i, name, mb):
            rep = run_job(args, mb, os.path.join(base, f"round{i}-{name}"))
            step, exposed = steady(rep)
            advice = bucket_advice(rep)
            print(
                f"{i:>5}  {name:<8}  {mb:>13g}  {step:>11.2f}  {exposed:>7.1%}  "
                + (advice["change"] if advice else "none"),
                flush=True,
            )
            return step, exposed, advice

        for i in range(args.rounds):
            # poor, advised, advised, poor: the machine's drift during a round cancels out of the ratios
            poor = [one(i, "poor", args.start_mb)]
            advice = poor[0][2]
            if advice is None:
                continue
            mb = advice["setting"]["bucket_cap_mb"]  # the advice, as the report's JSON gives it
            advised = [one(i, "advised", mb), one(i, "advised2", mb)]
            poor.append(one(i, "poor2", args.start_mb))
            for key, k in (("step", 0), ("exposed", 1)):
                ratios[key].append(sum(r[k] for r in advised) / sum(r[k] for r in poor))
    if ratios["step"]:
        print(
            f"advised / poor (means of the round's two runs each), median of {len(ratios['step'])} round(s): "
            f"step time {statistics.median(ratios['step']):.2f} (per round "
            f"{', '.join(f'{r:.2f}' for r in ratios['step'])}), exposed share "
            f"{statistics.median(ratios['exposed']):.2f} (per round {', '.join(f'{r:.2f}' for r in ratios['exposed'])})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
