"""Real jobs for the advice tests (spawned by tests/multiproc.py run_ranks)."""


def many_small_calls(rank: int, n: int, steps: int = 14, small: int = 64, coalesced: bool = False, big: int = 3):
    """Per step (commpatch.step()): ``small`` all_reduce calls of 16 floats, or one of them all flattened
    (``coalesced``), then ``big`` all_reduce calls of 1M floats; the log, as a DataFrame."""
    import torch
    import torch.distributed as dist

    import commpatch

    torch.set_num_threads(1)
    tiny = [torch.ones(16) for _ in range(small)]
    large = torch.ones(1 << 20)
    commpatch.enable(output="none")
    try:
        for _ in range(steps):
            commpatch.step()
            if coalesced:
                dist.all_reduce(torch.cat(tiny))
            else:
                for t in tiny:
                    dist.all_reduce(t)
            for _ in range(big):
                dist.all_reduce(large)
        return commpatch.log()
    finally:
        commpatch.disable()


def ddp_job(rank: int, n: int, steps: int = 8, bucket_cap_mb: float = 25.0, as_view: bool = False, slow=None):
    """A DDP job (an embedding of 2 MiB first, then two Linear layers) under ``commpatch.enable``;
    ``slow``: (rank, "input" or "work", ms): that rank sleeps before its forward (a slow data loader) or
    burns that much thread CPU time inside its step (more work). The log and its job notes (attrs)."""
    import time

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import commpatch

    torch.set_num_threads(1)
    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(1024, 512)  # 2 MiB of float32: one parameter
            self.hidden = torch.nn.Linear(512, 256)
            self.out = torch.nn.Linear(256, 1)

        def forward(self, idx):
            return self.out(torch.relu(self.hidden(self.embed(idx).mean(dim=1))))

    commpatch.enable(output="none")
    try:
        ddp = DistributedDataParallel(Net(), bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=as_view)
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(steps):
            opt.zero_grad()
            if slow is not None and slow[0] == rank and slow[1] == "input":
                time.sleep(slow[2] / 1e3)
            idx = torch.randint(0, 1024, (8, 4), generator=gen)
            loss = ddp(idx).sum()
            if slow is not None and slow[0] == rank and slow[1] == "work":
                end = time.thread_time() + slow[2] / 1e3
                while time.thread_time() < end:
                    pass
            loss.backward()
            opt.step()
        dist.barrier()
        df = commpatch.log()
        return df, df.attrs.get("job_notes")
    finally:
        commpatch.disable()


def fsdp2_job(rank: int, n: int, steps: int = 4):
    """FSDP2: two Linear units (the first with reshard_after_forward=False) and the root; the job notes
    of the log, or None where FSDP2 cannot run on CPU."""
    import torch

    import commpatch
    from tests.integration_workers import _fsdp_train
    from tests.torch_compat import fsdp2_cpu_unsupported
    from tests.torch_compat import fully_shard as _fully_shard

    if fsdp2_cpu_unsupported() is not None:
        return None
    fully_shard = _fully_shard()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    commpatch.enable(output="none")
    try:
        fully_shard(model[0], reshard_after_forward=False)
        fully_shard(model[2])
        fully_shard(model)
        _fsdp_train(model, steps)
        return commpatch.log().attrs.get("job_notes")
    finally:
        commpatch.disable()


def _train_square(model, rank: int, width: int, steps: int) -> None:
    """``steps`` SGD steps of the FSDP jobs below on a batch of 16 (the rank's own data)."""
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(16, width, generator=torch.Generator().manual_seed(rank))
    for _ in range(steps):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def fsdp2_reshard_job(rank: int, n: int, out: str, reshard, keep=(), steps: int = 12, width: int = 512):
    """FSDP2 over 4 blocks (Linear + ReLU, ``width`` wide), each its own unit with
    ``reshard_after_forward=reshard`` (a bool, or an int: resharded over that many ranks; False for the
    blocks whose index is in ``keep``), and the root; its log written to ``out`` (rank{rank}.csv and
    .cplog). False where FSDP2 cannot run on CPU with this torch, else True."""
    import os

    import torch

    import commpatch
    from tests.torch_compat import fsdp2_cpu_unsupported
    from tests.torch_compat import fully_shard as _fully_shard

    if fsdp2_cpu_unsupported() is not None:
        return False
    fully_shard = _fully_shard()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU()) for _ in range(4)]
    model = torch.nn.Sequential(*blocks)
    commpatch.enable(output=os.path.join(out, "rank{rank}.csv"))
    try:
        for i, block in enumerate(blocks):
            fully_shard(block, reshard_after_forward=False if i in keep else reshard)
        fully_shard(model)
        _train_square(model, rank, width, steps)
        return True
    finally:
        commpatch.disable()


def fsdp1_reshard_job(rank: int, n: int, out: str, strategy: str, steps: int = 12, width: int = 512, record=True):
    """FSDP1 (``FullyShardedDataParallel`` on CPU) over 4 blocks (Linear + ReLU, ``width`` wide),
    auto-wrapped one unit each, and a last Linear in the root unit, with ``sharding_strategy``
    ``strategy``; its log written to ``out`` (``record`` False: commpatch stays off). The digest of the
    rank's parameters after the steps; False where FSDP1 cannot run on CPU with this torch."""
    import hashlib
    import os

    import torch

    import commpatch

    try:
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    except ImportError:
        return False
    torch.set_num_threads(1)
    torch.manual_seed(0)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(width, width)

        def forward(self, x):
            return torch.relu(self.linear(x))

    model = torch.nn.Sequential(*[Block() for _ in range(4)], torch.nn.Linear(width, 1))
    if record:
        commpatch.enable(output=os.path.join(out, "rank{rank}.csv"))
    try:
        try:
            model = FullyShardedDataParallel(
                model,
                auto_wrap_policy=ModuleWrapPolicy({Block}),
                sharding_strategy=getattr(ShardingStrategy, strategy),
                device_id=torch.device("cpu"),
            )
        except (RuntimeError, ValueError, TypeError):  # an older torch: FSDP1 on accelerators only
            return False
        _train_square(model, rank, width, steps)
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        return hashlib.sha256(flat.numpy().tobytes()).hexdigest()
    finally:
        commpatch.disable()
