"""Real training jobs for the analysis tests (spawned by tests/multiproc.py run_ranks)."""


def _ddp_train(
    rank: int,
    steps: int = 12,
    slow_rank: int = -1,
    slow_ms: float = 0.0,
    accumulate: int = 1,
    hidden: int = 64,
    seed: int = 0,
    user_steps: bool = False,
) -> None:
    """A small DDP job: ``slow_rank`` sleeps ``slow_ms`` before each step's forward (a straggler);
    ``accumulate`` forwards / backwards per optimizer step (the first ``accumulate - 1`` under
    no_sync(), as gradient accumulation does); ``user_steps``: commpatch.step() before each step (a
    process's later optimizers are not counted: its first one is)."""
    import contextlib
    import time

    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, 1),
    )
    ddp = DDP(model, bucket_cap_mb=hidden * hidden * 4 / 2**20 * 0.6)  # a few buckets
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        if user_steps:
            import commpatch

            commpatch.step()
        if rank == slow_rank:
            time.sleep(slow_ms / 1e3)
        for micro in range(accumulate):
            with contextlib.nullcontext() if micro == accumulate - 1 else ddp.no_sync():
                ddp(torch.randn(8, 16, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def ddp_job(rank: int, n: int, out: str, **job):
    """One DDP job (``_ddp_train``'s options) writing its rank log under ``out``; returns commpatch's
    internal errors in this rank (none expected)."""
    import os

    import torch

    import commpatch

    torch.set_num_threads(1)
    commpatch.enable(output=os.path.join(out, "rank{rank}.csv"))
    try:
        _ddp_train(rank, **job)
    finally:
        commpatch.disable()
    return dict(commpatch.internal_errors())


def ddp_jobs(rank: int, n: int, jobs: list):
    """Several DDP jobs in turn (each a new model and DDP, its own log, steps counted by
    commpatch.step()): their logs, as DataFrames."""
    import torch

    import commpatch

    torch.set_num_threads(1)
    frames = []
    commpatch.enable(output="none")
    try:
        for job in jobs:
            commpatch.reset()
            _ddp_train(rank, user_steps=True, **job)
            frames.append(commpatch.log())
    finally:
        commpatch.disable()
    return frames


def pipeline_job(rank: int, n: int, steps: int = 8):
    """A two-stage GPipe pipeline trained with SGD (gloo's isend / irecv: no duration): its log."""
    import torch
    from torch.distributed.pipelining import ScheduleGPipe

    import commpatch
    from tests.torch_compat import pipeline_stage

    torch.set_num_threads(1)
    torch.manual_seed(rank)
    stage_mod = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    opt = torch.optim.SGD(stage_mod.parameters(), lr=0.01)
    commpatch.enable(output="none")
    try:
        stage = pipeline_stage(stage_mod, rank, n, (2, 8))  # torch 2.4 needs a microbatch's shape
        schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=lambda out, target: out.pow(2).mean())
        for _ in range(steps):
            if rank == 0:
                schedule.step(torch.randn(4, 8))
            else:
                schedule.step(target=torch.zeros(4, 8))
            opt.step()
            opt.zero_grad()
        return commpatch.log()
    finally:
        commpatch.disable()
