"""Where commpatch's cost goes in a DDP step on a GPU: a bf16 transformer and the kit's Linear model
under DDP (1 rank, NCCL), each configuration in alternating rounds (median per-step time, host issue
time before the synchronize and total), and whether the plain job is deterministic at all.

    python benchmarks/gpu/ddp_cost.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import commpatch  # noqa: E402

CONFIGS = {
    "plain": None,
    "torch allreduce_hook": "hook",
    "default": {},
    "modules=0": {"modules": False},
    "timing=host": {"timing": "host"},
    "modules=0,timing=host": {"modules": False, "timing": "host"},
}


def _stepper(torch, net, ddp, lr, loss_of, context=None):
    """One training step of ``ddp`` (SGD), returning the loss; ``context()``: around forward + backward."""
    import contextlib

    opt = torch.optim.SGD(ddp.parameters(), lr=lr)

    def step():
        with context() if context is not None else contextlib.nullcontext():
            loss = loss_of()
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    step.net, step.ddp = net, ddp
    return step


def transformer(torch, seed=0, math_sdpa=False):
    from torch.nn.parallel import DistributedDataParallel as DDP

    d, layers, batch, seq = 1024, 4, 8, 512
    torch.manual_seed(seed)
    layer = torch.nn.TransformerEncoderLayer(d, nhead=8, dim_feedforward=4 * d, batch_first=True)
    net = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False).to("cuda", dtype=torch.bfloat16)
    ddp = DDP(net, device_ids=[0], bucket_cap_mb=25)
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    x = torch.randn(batch, seq, d, generator=g).to("cuda", dtype=torch.bfloat16)
    context = None
    if math_sdpa:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        context = lambda: sdpa_kernel(SDPBackend.MATH)  # noqa: E731
    return _stepper(torch, net, ddp, 1e-3, lambda: ddp(x).float().pow(2).mean(), context)


def linear(torch, seed=0):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(seed)
    mods = []
    for _ in range(8):
        mods += [torch.nn.Linear(4096, 4096), torch.nn.ReLU()]
    net = torch.nn.Sequential(*mods).cuda()
    ddp = DDP(net, device_ids=[0])
    x, y = torch.randn(256, 4096, device="cuda"), torch.randn(256, 4096, device="cuda")
    return _stepper(torch, net, ddp, 1e-4, lambda: torch.nn.functional.mse_loss(ddp(x), y))


def rounds(torch, make, n=10, rounds=8):
    steps = {name: make(torch) for name in CONFIGS}
    # the floor of any Python comm hook: torch's own allreduce hook, without commpatch
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    steps["torch allreduce_hook"].ddp.register_comm_hook(None, allreduce_hook)
    host = {name: [] for name in CONFIGS}
    total = {name: [] for name in CONFIGS}
    names = list(CONFIGS)
    for r in range(rounds + 1):
        order = names if r % 2 else names[::-1]
        for name in order:
            cfg = CONFIGS[name]
            commpatch.disable()
            if isinstance(cfg, dict):
                commpatch.enable(output="none", **cfg)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                steps[name]()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            if r:
                host[name].append((t1 - t0) * 1e3 / n)
                total[name].append((t2 - t0) * 1e3 / n)
    commpatch.disable()
    out = {}
    for name in names:
        out[name] = {
            "host_ms": statistics.median(host[name]),
            "total_ms": statistics.median(total[name]),
            "ratio_total": statistics.median([a / b for a, b in zip(total[name], total["plain"])]),
        }
    return out


def determinism(torch, math_sdpa):
    res = []
    for _ in range(2):
        step = transformer(torch, math_sdpa=math_sdpa)
        losses = torch.stack([step() for _ in range(4)])
        torch.cuda.synchronize()
        res.append((losses.cpu(), [p.detach().cpu() for p in step.net.parameters()]))
    same = torch.equal(res[0][0], res[1][0]) and all(torch.equal(a, b) for a, b in zip(res[0][1], res[1][1]))
    return same


def where(torch, make, steps=20):
    """Where the host time of a step goes, plain and with commpatch: the CUDA runtime / driver calls
    per step (torch.profiler's CPU trace: its event names and counts, within the steps) and, with
    commpatch, the Python functions that cost most (cProfile, own time per step)."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    out = {}
    step = make(torch)
    for name in ("plain", "commpatch"):
        commpatch.disable()
        if name == "commpatch":
            commpatch.enable(output="none")
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
        counts = {}
        for e in prof.events():
            if e.name.startswith(("cuda", "cu")) and not e.name.startswith("cudnn"):
                counts[e.name] = counts.get(e.name, 0) + 1
        out[name] = {"runtime_calls_per_step": {k: v / steps for k, v in sorted(counts.items())}}
        if name == "commpatch":
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
            pr.disable()
            text = io.StringIO()
            pstats.Stats(pr, stream=text).sort_stats("tottime").print_stats(25)
            out[name]["cprofile"] = text.getvalue()
    commpatch.disable()
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--where", action="store_true", help="also: runtime calls and a cProfile per step")
    args = p.parse_args()
    import tempfile

    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    store = tempfile.mkdtemp()
    dist.init_process_group(
        "nccl", init_method=f"file://{store}/s", rank=0, world_size=1, device_id=torch.device("cuda", 0)
    )
    result = {
        "plain run twice equal, default SDPA": determinism(torch, False),
        "plain run twice equal, math SDPA": determinism(torch, True),
    }
    print(result, flush=True)
    for label, make in (("bf16 transformer", transformer), ("fp32 linear (kit)", linear)):
        result[label] = rounds(torch, make)
        for name, v in result[label].items():
            print(
                f"{label:18s} {name:22s} host {v['host_ms']:7.3f} ms  total {v['total_ms']:7.3f} ms  x{v['ratio_total']:.4f}",
                flush=True,
            )
    if args.where:
        result["where (bf16 transformer)"] = where(torch, transformer)
        w = result["where (bf16 transformer)"]
        for k in sorted(set(w["plain"]["runtime_calls_per_step"]) | set(w["commpatch"]["runtime_calls_per_step"])):
            a = w["plain"]["runtime_calls_per_step"].get(k, 0)
            b = w["commpatch"]["runtime_calls_per_step"].get(k, 0)
            if a != b:
                print(f"per step {k:40s} plain {a:8.1f} commpatch {b:8.1f}", flush=True)
        print(w["commpatch"]["cprofile"][:4000], flush=True)
    dist.destroy_process_group()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
