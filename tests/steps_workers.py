"""Workers of tests/test_steps.py (run in real gloo processes by tests.multiproc.run_ranks)."""

from __future__ import annotations


def counted_steps(rank: int, n: int):
    """Steps counted with no commpatch.step(): by DDP's forward while no optimizer steps, then by
    the first optimizer (a second optimizer does not count again), then by commpatch.step()."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import commpatch

    commpatch.enable(output="none")
    try:
        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)))
        x = torch.randn(4, 8)
        for _ in range(3):                        # an update by hand: no optimizer step
            model(x).sum().backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.01 * p.grad
                    p.grad = None
        first, second = (torch.optim.SGD([p], lr=0.01) for p in (model.module[0].weight, model.module[1].weight))
        for _ in range(3):
            model(x).sum().backward()
            first.step()
            second.step()                         # a second optimizer in the same iteration
        after_auto = commpatch.session.integrations.steps._runtime.STATE.step
        commpatch.step(100)
        for _ in range(2):
            model(x).sum().backward()
            first.step()
        df = commpatch.log()
        rows = df[df["op"] == "ddp_bucket_allreduce"]
        return dict(after_auto=after_auto, buckets=rows[["step", "step_source"]].astype({"step_source": str})
                    .values.tolist())
    finally:
        commpatch.disable()


def fsdp_forward_steps(rank: int, n: int):
    """No optimizer: each root forward of FSDP2 (fully_shard) and FSDP1 opens one step, nested units
    do not count again. Returns, per framework, the steps its rows carry."""
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    import commpatch

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))

    def train(m):
        with commpatch.capture() as cap:
            for _ in range(3):
                m(torch.randn(4, 8)).sum().backward()
        df = cap.df
        return sorted({(int(s), str(src)) for s, src in zip(df["step"], df["step_source"])})

    commpatch.enable(output="none")
    try:
        m2 = model()
        for unit in (m2[0], m2[2], m2):
            fully_shard(unit)
        out = {"fsdp2": train(m2)}
        m1 = FullyShardedDataParallel(model(), auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}),
                                      device_id=torch.device("cpu"))
        out["fsdp1"] = train(m1)
        return out
    finally:
        commpatch.disable()
