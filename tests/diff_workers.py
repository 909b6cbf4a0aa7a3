"""Workers of tests/test_diff.py (spawned by tests/multiproc.py run_ranks)."""


def ddp_jobs(rank: int, n: int, jobs: list) -> list:
    """Several small DDP jobs in turn, each into its own directory (dicts: out, bucket_cap_mb,
    slow_ms: rank 1 sleeps that long before the step's loss all_reduce, a 4-byte call; steps).
    Returns each job's parameter sum on this rank (the job ran)."""
    import os
    import time

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import commpatch

    torch.set_num_threads(1)
    sums = []
    for job in jobs:
        torch.manual_seed(0)
        commpatch.enable(output=os.path.join(job["out"], "rank{rank}.csv"))
        model = DDP(
            torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)]), bucket_cap_mb=job["bucket_cap_mb"]
        )
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(job.get("steps", 25)):
            commpatch.step()
            model(torch.randn(32, 256, generator=gen)).pow(2).mean().backward()
            loss = torch.ones(1)
            if job.get("slow_ms") and rank == 1:
                time.sleep(job["slow_ms"] / 1e3)
            dist.all_reduce(loss)
            opt.step()
            opt.zero_grad()
        dist.barrier()
        commpatch.disable()
        sums.append(float(sum(p.sum() for p in model.parameters())))
    return sums
