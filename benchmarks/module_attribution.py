"""CPU cost of module / phase attribution (COMMPATCH_MODULES) per training step, on the demo's
DDP model (examples/train_ddp.py: hidden 512, 3 hidden layers, batch 64: ~4-5 ms of CPU per step), one gloo process.

Alternating rounds in the same process: commpatch enabled with modules on, then with modules
off (same settings otherwise), each round N steps; CPU time (process_time) and wall time per
step; the median of the paired differences. Target (issue 15): <= 2% of the CPU time per step.
First, the same for forwards alone under no_grad (module calls only: a steadier per-call figure).

    python benchmarks/module_attribution.py [--rounds 40] [--steps 10] [--hidden 512] [--depth 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--depth", type=int, default=3, help="hidden Linear+ReLU blocks")
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import commpatch

    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    h = args.hidden
    layers = [torch.nn.Linear(64, h), torch.nn.ReLU()]
    for _ in range(args.depth - 1):
        layers += [torch.nn.Linear(h, h), torch.nn.ReLU()]
    model = DDP(torch.nn.Sequential(*layers, torch.nn.Linear(h, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch, 64)
    y = x.sum(dim=1, keepdim=True)

    def steps(n):
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(n):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        return (time.process_time() - cpu) / n, (time.perf_counter() - wall) / n

    def forwards(n):  # module calls only: no autograd, no collective
        cpu = time.process_time()
        with torch.no_grad():
            for _ in range(n):
                model.module(x)
        return (time.process_time() - cpu) / n

    per_forward = {True: [], False: []}
    for r in range(args.rounds + 1):
        for modules in (True, False) if r % 2 else (False, True):
            commpatch.enable(output="none", modules=modules)
            measured = forwards(50)
            commpatch.disable()
            if r:
                per_forward[modules].append(measured)
    calls = sum(1 for _ in model.module.modules())
    forward_diff = statistics.median(a - b for a, b in zip(per_forward[True], per_forward[False]))

    results = {True: [], False: []}
    for r in range(args.rounds + 1):
        for modules in (True, False) if r % 2 else (False, True):
            commpatch.enable(output="none", modules=modules)
            steps(3)  # settle after re-enabling
            measured = steps(args.steps)
            commpatch.disable()
            commpatch.reset()
            if r:  # round 0 warms up
                results[modules].append(measured)
    dist.destroy_process_group()
    on_cpu = [c for c, _ in results[True]]
    off_cpu = [c for c, _ in results[False]]
    diffs = [a - b for a, b in zip(on_cpu, off_cpu)]
    base = statistics.median(off_cpu)
    wall = statistics.median(w for _, w in results[False])
    print(
        f"load: {os.getloadavg()[0]:.2f} (1 min); {args.rounds} paired rounds of {args.steps} steps; "
        f"{sum(1 for m in model.modules())} modules"
    )
    print(f"step without attribution: {1e3 * base:.3f} ms CPU, {1e3 * wall:.3f} ms wall")
    print(
        f"forward only ({calls} module calls, no_grad): {1e6 * forward_diff:+.2f} us CPU per forward, "
        f"{1e6 * forward_diff / calls:+.3f} us per module call"
    )
    print(
        f"added by attribution: {1e6 * statistics.median(diffs):+.1f} us CPU per step "
        f"({100 * statistics.median(diffs) / base:+.2f}%; paired differences from {1e6 * min(diffs):+.1f} "
        f"to {1e6 * max(diffs):+.1f} us)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
