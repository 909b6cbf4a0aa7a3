"""A small DistributedDataParallel training job, with no commpatch code at all (what `make demo` runs).

Run it under torchrun; instrument it with no code change:
    commpatch run -- torchrun --standalone --nproc_per_node=2 examples/train_ddp.py --slow-rank 1
    COMMPATCH=1 torchrun --standalone --nproc_per_node=2 examples/train_ddp.py     # with the .pth hook

DDP reduces the gradients in buckets during backward (``--bucket-mb`` small enough for several);
``--slow-rank`` makes one rank late by ``--slow-ms`` before each step's forward (a straggler: the
others wait for it in the gradient all-reduce). Steps are found by commpatch from optimizer.step().
"""

import argparse
import gc
import hashlib
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64, help="samples per rank and step")
    parser.add_argument("--bucket-mb", type=float, default=1.0, help="DDP bucket_cap_mb")
    parser.add_argument("--slow-rank", type=int, default=-1, help="this rank is late before each step")
    parser.add_argument("--slow-ms", type=float, default=5.0)
    args = parser.parse_args()

    torch.set_num_threads(1)  # one core per rank: ranks do not fight over threads
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    h = args.hidden
    model = torch.nn.Sequential(
        torch.nn.Linear(64, h),
        torch.nn.ReLU(),
        torch.nn.Linear(h, h),
        torch.nn.ReLU(),
        torch.nn.Linear(h, h),
        torch.nn.ReLU(),
        torch.nn.Linear(h, 1),
    )
    ddp = DDP(model, bucket_cap_mb=args.bucket_mb)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(args.steps):
        if rank == args.slow_rank:
            time.sleep(args.slow_ms / 1e3)
        x = torch.randn(args.batch, 64, generator=gen)
        loss = torch.nn.functional.mse_loss(ddp(x), x.sum(dim=1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        opt.step()
    if rank == 0:
        # the parameters' exact bytes: enabling commpatch must not change a single bit of them
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
        print(f"trained {args.steps} DDP steps on {world} ranks; last loss {float(loss.detach()):.4f}")
        print(f"parameters sha256 {digest[:16]}")
    # DDP's reducer holds the process group from inside a reference cycle: collected at interpreter
    # exit, gloo's worker threads would meet a finalizing Python there and abort the process
    # (torch's, with or without commpatch: 3 of 15 plain runs on torch 2.13); free both first
    del ddp, opt, loss
    gc.collect()
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 5):
        # torch < 2.5's gloo can deadlock in destroy_process_group while a worker frees the last
        # work (docs/compatibility.md): give the workers the GIL for a moment first
        time.sleep(0.2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
