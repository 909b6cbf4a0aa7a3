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
