"""DDP training step with and without commpatch, in one run, alternating rounds.

    python benchmarks/ddp_step.py [--nproc 2] [--steps 50] [--rounds 6]

Two identical DDP models on a gloo group: one is only ever stepped while commpatch is disabled
(no hook is ever installed on it), the other while enabled (bucket hook + module attribution).
Prints the median step time of each and the ratio (target: <= 1.02).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def demo_model():
    import torch

    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(512, 512), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(512, 10))


def worker(rank, nproc, steps, rounds, port):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import commpatch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=nproc)
    models = {"plain": DDP(demo_model(), bucket_cap_mb=1), "commpatch": DDP(demo_model(), bucket_cap_mb=1)}
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.01) for k, m in models.items()}
    x, y = torch.randn(64, 512), torch.randint(0, 10, (64,))
    times = {k: [] for k in models}

    def run(kind):
        model, opt = models[kind], opts[kind]
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        return (time.perf_counter() - t0) / steps

    for r in range(rounds + 1):
        for kind in ("plain", "commpatch") if r % 2 else ("commpatch", "plain"):
            if kind == "commpatch":
                commpatch.enable(output="none")
            else:
                commpatch.disable()
            t = run(kind)
            if r:                                   # round 0 warms up both
                times[kind].append(t)
    commpatch.disable()
    rows = len(commpatch.log())
    dist.destroy_process_group()
    if rank == 0:
        plain, patched = statistics.median(times["plain"]), statistics.median(times["commpatch"])
        print(f"step plain {plain * 1e3:.3f} ms, commpatch {patched * 1e3:.3f} ms, "
              f"ratio {patched / plain:.4f} (added {(patched - plain) * 1e6:.1f} us/step; {rows} rows)")


def main() -> None:
    import torch.multiprocessing as mp

    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--port", type=int, default=29561)
    a = ap.parse_args()
    mp.spawn(worker, args=(a.nproc, a.steps, a.rounds, a.port), nprocs=a.nproc)


if __name__ == "__main__":
    main()
