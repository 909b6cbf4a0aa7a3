"""Real training jobs for the analysis tests (spawned by tests/multiproc.py run_ranks)."""


def ddp_job(rank: int, n: int, out: str, steps: int = 12, slow_rank: int = -1, slow_ms: float = 0.0,
            accumulate: int = 1, hidden: int = 64, seed: int = 0):
    """A small DDP job writing its rank log under ``out``: ``slow_rank`` sleeps ``slow_ms`` before
    each step's forward (a straggler); ``accumulate`` forwards / backwards per optimizer step (the
    first ``accumulate - 1`` under no_sync(), as gradient accumulation does)."""
    import contextlib
    import os
    import time

    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import commpatch

    torch.set_num_threads(1)
    commpatch.enable(output=os.path.join(out, "rank{rank}.csv"))
    try:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(16, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
                                    torch.nn.ReLU(), torch.nn.Linear(hidden, 1))
        ddp = DDP(model, bucket_cap_mb=hidden * hidden * 4 / 2**20 * 0.6)     # a few buckets
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(steps):
            if rank == slow_rank:
                time.sleep(slow_ms / 1e3)
            for micro in range(accumulate):
                sync = micro == accumulate - 1
                with contextlib.nullcontext() if sync else ddp.no_sync():
                    x = torch.randn(8, 16, generator=gen)
                    ddp(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    finally:
        commpatch.disable()
    return 0
