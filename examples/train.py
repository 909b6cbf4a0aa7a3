"""A small data-parallel training loop with hand-written collectives (no commpatch code).

Run it under torchrun; instrument it with no code change:
    commpatch run -- torchrun --standalone --nproc_per_node=2 examples/train.py
    COMMPATCH=1 torchrun --standalone --nproc_per_node=2 examples/train.py   # with the .pth hook
"""

import argparse
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed import all_reduce  # bound at import: still caught (post-import hook)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--sleep-rank", type=int, default=-1, help="this rank sleeps before each step (a straggler)")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, args.hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(args.hidden, args.hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(args.hidden, 1),
    )
    for p in model.parameters():  # every rank starts from rank 0's weights
        dist.broadcast(p.data, src=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    # commpatch is importable only when it was activated (COMMPATCH=1 / commpatch run)
    mark_step = getattr(sys.modules.get("commpatch"), "step", lambda: None)

    for step in range(args.steps):
        mark_step()
        if rank == args.sleep_rank:
            time.sleep(0.02)
        x = torch.randn(32, 64, generator=gen)
        y = x.sum(dim=1, keepdim=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        works = [dist.all_reduce(p.grad, async_op=True) for p in model.parameters()]  # overlapped
        for w in works:
            w.wait()
        for p in model.parameters():
            p.grad /= world
        opt.step()
        losses = [torch.zeros(1) for _ in range(world)]
        dist.all_gather(losses, loss.detach().reshape(1))
        if step % 10 == 0:
            all_reduce(torch.ones(1))  # the name imported at the top
    stats = [None] * world
    dist.all_gather_object(stats, {"rank": rank, "final_loss": float(loss.detach())})
    dist.barrier()
    if rank == 0:
        print(f"trained {args.steps} steps on {world} ranks; final losses {[round(s['final_loss'], 4) for s in stats]}")
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 5):
        # torch < 2.5's gloo can deadlock in destroy_process_group while a worker frees the last
        # work (docs/compatibility.md): give the workers the GIL for a moment first
        time.sleep(0.2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
