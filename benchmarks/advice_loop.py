"""Tuning advice, checked by running it: for every rule, a job that should get it, its report's advice,
and the job again with the advice applied; the gain the advice predicted against the gain measured.

    python benchmarks/advice_loop.py [--pairs 5] [--rules all] [--steps 24] [--port 35100]

Per rule (``RULES``): a job with a poor setting (2 ranks, gloo, CPU, under ``commpatch run``), then
``commpatch report --format json``; the rule's item read from the JSON (its ``setting`` or ``change``,
never a value written here: ``apply`` turns it into the job's arguments), then the job with it applied.
Each pair: poor, advised, in alternating order from pair to pair (the machine's drift cancels out of
the median). The measured gain of a pair: the poor run's median steady-state step minus the advised
run's; the predicted gain: the poor run's ``gain_us``. Printed per rule: the medians over the pairs,
their ratio (predicted / measured: within 2x is the goal), and for a rule whose gain is unknown (its
text says why it cannot predict it) the measured gain alone.

The jobs (``--worker``, run by torchrun):
- ``mlp`` (``ddp_bucket_size``, ``ddp_grad_copy``): DDP over an MLP of 64-1024-1024x6-1, batch 32; each
  layer followed by ``--device-ms`` of compute that leaves the CPU free (a sleep, as an accelerator's
  kernels do; twice that in the backward). Poor: ``bucket_cap_mb=1000`` (one bucket, all exposed),
  and ``bucket_cap_mb=6, gradient_as_bucket_view=False`` for the copy rule.
- ``small`` (``small_messages``): per step 20 ms of compute (a sleep), then the per-gradient loop: 64
  all-reduces of 16 floats and 2 of 1M floats, one call each; advised: the 64 flattened into one call.
- ``tail`` (``ddp_tail_parameter``): DDP at ``bucket_cap_mb=1`` over a model whose first parameter is a
  4 MiB embedding: the last bucket is that one parameter. The rule names it and predicts nothing;
  applied: DDP's fp16 compression hook (its ``change``).
- ``fsdp`` (``fsdp_reshard``): FSDP2 over ``--layers`` blocks of Linear(``--hidden``) + ReLU, each its own
  unit, batch ``--batch`` x 2; CPU compute only. Poor: every unit ``reshard_after_forward=True``
  (FSDP's default: their parameters gathered again in the backward); advised: the units the item
  names with the value it gives. ``fsdp_reshard/fsdp1``: the same blocks under FSDP1, auto-wrapped one
  unit each, at ``FULL_SHARD``; advised: the sharding strategy the item gives.
- ``slow`` (``straggler``): the ``mlp`` job at 6 MiB buckets with rank 1 sleeping ``--slow-ms`` before
  each forward (a slow data loader); advised: no sleep (the input made ready in time).
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
    """``--layers`` square layers of ``--hidden`` between a 64-input layer and one output, each followed
    by ``--device-ms`` of compute that leaves the CPU free (a sleep: forward, twice that in the backward)."""
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


def tail_model():
    """A 4 MiB embedding first (its gradient is ready last: DDP's last bucket, alone), then an MLP."""
    import torch

    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(2048, 512)
            self.body = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 64))

        def forward(self, x):
            return self.body(self.embed(x).mean(dim=1))

    return Net()


def worker(args) -> None:
    """One rank of the job (no commpatch code: ``commpatch run`` activates it)."""
    import time

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(rank)
    if args.job == "small":
        tiny = [torch.ones(16) for _ in range(64)]
        large = [torch.ones(1 << 20) for _ in range(2)]
        boundary = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)  # its step() ends a step
        for _ in range(args.steps):
            time.sleep(0.02)
            if args.coalesce:
                flat = torch.cat(tiny)
                dist.all_reduce(flat)
                for t, r in zip(tiny, flat.split(16)):
                    t.copy_(r)
            else:
                for t in tiny:
                    dist.all_reduce(t)
            for t in large:
                dist.all_reduce(t)
            boundary.step()
        dist.destroy_process_group()
        return
    if args.job == "fsdp":
        fsdp_job(args)
        dist.destroy_process_group()
        return
    model = tail_model() if args.job == "tail" else mlp(args)
    ddp = DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb, gradient_as_bucket_view=args.as_view)
    if args.fp16_hook:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    for _ in range(args.steps):
        opt.zero_grad()
        if rank == 1 and args.slow_ms > 0:
            time.sleep(args.slow_ms / 1e3)
        if args.job == "tail":
            x = torch.randint(0, 2048, (32, 8), generator=gen)
            loss = ddp(x).square().mean()
        else:
            x = torch.randn(args.batch, 64, generator=gen)
            loss = torch.nn.functional.mse_loss(ddp(x), x.sum(dim=1, keepdim=True))
        loss.backward()
        opt.step()
    dist.destroy_process_group()


def fsdp_job(args) -> None:
    """The ``fsdp`` job's steps: FSDP2 units named by their index in the model, as FSDP names them;
    with ``--fsdp1 STRATEGY``, FSDP1 auto-wrapping each block with that sharding strategy instead."""
    import torch

    torch.manual_seed(0)
    width = args.hidden
    model = torch.nn.Sequential(
        *[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU()) for _ in range(args.layers)]
    )
    if args.fsdp1:
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        blocks = {type(model[0])}  # each block is a Sequential: the root's type too, which is always wrapped
        model = FullyShardedDataParallel(
            model,
            auto_wrap_policy=ModuleWrapPolicy(blocks),
            sharding_strategy=getattr(ShardingStrategy, args.fsdp1),
            device_id=torch.device("cpu"),
        )
    else:
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:  # torch < 2.6
            from torch.distributed._composable.fsdp import fully_shard

        kept = set(args.keep_units.split(",")) if args.keep_units else set()
        for name, block in model.named_children():
            fully_shard(block, reshard_after_forward=name not in kept)
        fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(2 * args.batch, width, generator=torch.Generator().manual_seed(0))
    for _ in range(args.steps):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def run_job(args, job_args: list, out: str) -> dict:
    """The job under commpatch with ``job_args``; its report as parsed JSON (``--reuse``: the report of
    the logs an earlier run left in ``out``, by this checkout's commpatch)."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
    )
    common = ["--steps", str(args.steps), "--layers", str(args.layers), "--hidden", str(args.hidden)]
    common += ["--batch", str(args.batch), "--device-ms", str(args.device_ms)]
    cmd = [sys.executable, "-m", "commpatch", "run", "--output", os.path.join(out, "rank{rank}.csv"), "--"]
    cmd += [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2"]
    cmd += [f"--master_port={args.port}", os.path.abspath(__file__), "--worker", *common, *job_args]
    if not args.reuse:
        os.makedirs(out)
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rep = subprocess.run(
        [sys.executable, "-m", "commpatch", "report", out, "--format", "json", "--no-progress"],
        check=True,
        env=env,
        capture_output=True,
        text=True,
    )
    return json.loads(rep.stdout)


def step_ms(report: dict) -> float:
    """The median steady-state step time of a report, ms."""
    rows = [r for r in report["sections"]["steps"] if r["stage"] == "steady" and r["step_us"] is not None]
    return statistics.median(r["step_us"] for r in rows) / 1e3


def _cap(item) -> list:
    return ["--bucket-mb", str(item["setting"]["bucket_cap_mb"])]


def _view(item) -> list:
    assert item["setting"] == {"gradient_as_bucket_view": True}, item
    return ["--as-view"]


def _coalesce(item) -> list:
    assert "_coalescing_manager" in item["change"] or "flatten" in item["change"], item
    return ["--coalesce"]


def _fp16(item) -> list:
    assert "fp16_compress_hook" in item["change"], item
    return ["--fp16-hook"]


def _keep(item) -> list:
    assert item["setting"]["reshard_after_forward"] is False, item
    return ["--keep-units", ",".join(item["setting"]["units"])]


def _strategy(item) -> str:
    assert sorted(item["setting"]["units"]) == [f"_fsdp_wrapped_module.{i}" for i in range(6)], item
    return item["setting"]["sharding_strategy"]


def _even(item) -> list:
    assert item["evidence"]["rank"] == 1, item
    return []  # the input ready in time: no sleep


# rule -> (the job's poor arguments, the advised run's arguments from the item, what it fixes)
RULES = {
    "ddp_bucket_size": (["--job", "mlp", "--bucket-mb", "1000"], lambda item: ["--job", "mlp", *_cap(item)]),
    "ddp_grad_copy": (
        ["--job", "mlp", "--bucket-mb", "6"],
        lambda item: ["--job", "mlp", "--bucket-mb", "6", *_view(item)],
    ),
    "small_messages": (["--job", "small"], lambda item: ["--job", "small", *_coalesce(item)]),
    "ddp_tail_parameter": (
        ["--job", "tail", "--bucket-mb", "1"],
        lambda item: ["--job", "tail", "--bucket-mb", "1", *_fp16(item)],
    ),
    "fsdp_reshard": (["--job", "fsdp"], lambda item: ["--job", "fsdp", *_keep(item)]),
    "fsdp_reshard/fsdp1": (
        ["--job", "fsdp", "--fsdp1", "FULL_SHARD"],
        lambda item: ["--job", "fsdp", "--fsdp1", _strategy(item)],
    ),
    "straggler": (
        ["--job", "mlp", "--bucket-mb", "6", "--slow-ms", "30"],
        lambda item: ["--job", "mlp", "--bucket-mb", "6", *_even(item)],
    ),
}


def check_rule(args, rule: str, base: str) -> dict:
    """``--pairs`` pairs of poor / advised runs of the rule's job; medians of the predicted and
    measured gains (ms), or why not (the poor run got no such advice)."""
    poor_args, advised = RULES[rule]
    predicted, measured, missing, item = [], [], 0, None
    for i in range(args.pairs):
        # poor first in even pairs; in odd ones the advised run (the previous pair's advice) first
        first = i % 2 == 1 and item is not None
        if args.reuse and not os.path.isdir(os.path.join(base, f"{rule}-{i}-advised")):
            missing += 1
            print(f"  {rule} pair {i}: no advised run in {base}", flush=True)
            continue
        if first:
            good = run_job(args, advised(item), os.path.join(base, f"{rule}-{i}-advised"))
        poor = run_job(args, poor_args, os.path.join(base, f"{rule}-{i}-poor"))
        item = next((a for a in poor.get("advice", []) if a["rule"] == rule.split("/")[0]), None)
        if item is None:
            missing += 1
            print(f"  {rule} pair {i}: the poor run got no {rule} advice", flush=True)
            continue
        if not first:
            good = run_job(args, advised(item), os.path.join(base, f"{rule}-{i}-advised"))
        gain = step_ms(poor) - step_ms(good)
        predicted.append(item["gain_us"] / 1e3 if item["gain_us"] is not None else float("nan"))
        measured.append(gain)
        print(
            f"  {rule} pair {i}: step {step_ms(poor):.1f} -> {step_ms(good):.1f} ms, measured {gain:.2f} ms, "
            f"predicted {predicted[-1]:.2f} ms ({item['change'][:70]})",
            flush=True,
        )
    out = dict(rule=rule, pairs=len(measured), missing=missing)
    if measured:
        out.update(predicted_ms=statistics.median(predicted), measured_ms=statistics.median(measured))
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--job", default="mlp", help=argparse.SUPPRESS)
    parser.add_argument("--bucket-mb", type=float, default=25.0, help=argparse.SUPPRESS)
    parser.add_argument("--as-view", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--coalesce", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--fp16-hook", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--slow-ms", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--keep-units", default="", help=argparse.SUPPRESS)
    parser.add_argument("--fsdp1", default="", help=argparse.SUPPRESS)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--rules", default="all", help="comma-separated rule names (default: all of RULES)")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument(
        "--device-ms", type=float, default=3.0, help="per layer: forward sleep (backward: twice); 0: CPU compute only"
    )
    parser.add_argument("--port", type=int, default=35100)
    parser.add_argument("--out", default=None, help="keep the runs' logs here (default: a temporary directory)")
    parser.add_argument(
        "--reuse", action="store_true", help="report the logs an earlier run left in --out again (no job is run)"
    )
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    rules = list(RULES) if args.rules == "all" else args.rules.split(",")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for rule in rules:
            results.append(check_rule(args, rule, args.out or tmp))
    print("\n| rule | pairs | predicted gain (ms, median) | measured gain (ms, median) | predicted / measured |")
    print("|---|---:|---:|---:|---:|")
    for r in results:
        if not r["pairs"]:
            print(f"| {r['rule']} | 0 | no advice in {r['missing']} poor run(s) | | |")
            continue
        p, m = r["predicted_ms"], r["measured_ms"]
        ratio = "cannot predict (its text says why)" if p != p else (f"{p / m:.2f}" if m > 0 else "measured <= 0")
        print(f"| {r['rule']} | {r['pairs']} | {p:.2f} | {m:.2f} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
