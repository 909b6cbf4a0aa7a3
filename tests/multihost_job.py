"""A torchrun worker for tests/test_multihost.py: ``--steps`` steps of two all_reduce calls after a
little compute; rank ``--delay-rank`` sleeps ``--delay-ms`` before its first call of every step
(a real straggler); with ``--jitter-ms`` every rank sleeps a random 0 to that many ms first (ranks
that are symmetric but noisy, as on a real cluster: the operating system of this 2-core machine
otherwise keeps one of the two nodes' ranks consistently ~0.1-0.4 ms later in some runs, a real
hold-up the verdict names). Activated by ``commpatch run`` (nothing of commpatch is imported here except
``step``); checks its own results."""

import argparse
import random
import time

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--delay-rank", type=int, default=-1)
    p.add_argument("--delay-ms", type=float, default=0.0)
    p.add_argument("--jitter-ms", type=float, default=0.0)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    import commpatch

    a = torch.randn(64, 64, generator=torch.Generator().manual_seed(rank))
    noise = random.Random(1000 + rank)
    for step in range(args.steps):
        commpatch.step(step)
        for _ in range(4):
            a = torch.tanh(a @ a.T / 64)
        if args.jitter_ms:
            time.sleep(noise.uniform(0, args.jitter_ms) / 1e3)
        if rank == args.delay_rank:
            time.sleep(args.delay_ms / 1e3)
        x = torch.full((4096,), float(rank + step))
        dist.all_reduce(x)
        assert float(x[0]) == sum(r + step for r in range(world)), float(x[0])
        y = torch.ones(1024)
        dist.all_reduce(y)
        assert float(y[0]) == world
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
