"""Workers of tests/test_steps.py (run in real gloo processes by tests.multiproc.run_ranks)."""

from __future__ import annotations


def step_sources(rank: int, n: int):
    """Steps counted with no commpatch.step(), in one process: by the root forwards of FSDP2
    (fully_shard), FSDP1 and DDP while no optimizer steps; then by the first optimizer (a second
    optimizer does not count again); then by commpatch.step(). Returns, per part, the (step,
    step_source) of its rows in order of first appearance."""
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from tests.torch_compat import fully_shard as _fully_shard

    fully_shard = _fully_shard()
    from torch.nn.parallel import DistributedDataParallel as DDP

    import commpatch

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))

    x = torch.randn(4, 8)

    def steps_of(df):
        seen = {}
        for s, src in zip(df["step"], df["step_source"]):
            seen.setdefault((int(s), str(src)), None)
        return list(seen)

    def by_hand(m, iterations=3):  # an update without an optimizer
        with commpatch.capture() as cap:
            for _ in range(iterations):
                m(x).sum().backward()
                with torch.no_grad():
                    for p in m.parameters():
                        if p.grad is not None:
                            p -= 0.01 * p.grad
                            p.grad = None
        return steps_of(cap.df)

    commpatch.enable(output="none")
    try:
        out = {}
        from tests.torch_compat import fsdp2_cpu_unsupported

        if fsdp2_cpu_unsupported() is None:
            fsdp2 = model()
            for unit in (fsdp2[0], fsdp2[2], fsdp2):
                fully_shard(unit)
            out["fsdp2"] = by_hand(fsdp2)
        out["fsdp1"] = by_hand(
            FullyShardedDataParallel(
                model(), auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}), device_id=torch.device("cpu")
            )
        )
        ddp = DDP(model())
        out["ddp"] = by_hand(ddp)
        first, second = (torch.optim.SGD([p], lr=0.01) for p in (ddp.module[0].weight, ddp.module[2].weight))
        with commpatch.capture() as cap:
            for _ in range(3):
                ddp(x).sum().backward()
                first.step()
                second.step()  # a second optimizer in the same iteration
        out["optimizer"] = steps_of(cap.df[cap.df["op"] == "ddp_bucket_allreduce"])
        commpatch.step(100)
        with commpatch.capture() as cap:
            for _ in range(2):
                ddp(x).sum().backward()
                first.step()
        out["user"] = steps_of(cap.df)
        return out
    finally:
        commpatch.disable()


def hand_written_dp(rank: int, n: int, out: str, iterations: int):
    """A data-parallel loop with no optimizer and no DDP: the parameters are broadcast once
    (set-up), then each iteration all-reduces every gradient by hand and updates in place."""
    import os

    import torch
    import torch.distributed as dist

    import commpatch

    commpatch.enable(output=os.path.join(out, "rank{rank}.csv"))
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        for p in model.parameters():
            dist.broadcast(p.data, 0)
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
        for _ in range(iterations):
            model(x).pow(2).mean().backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= n
            with torch.no_grad():
                for p in model.parameters():
                    p.data -= 0.01 * p.grad
                    p.grad = None
    finally:
        commpatch.disable()
    return float(sum(p.detach().sum() for p in model.parameters()))
