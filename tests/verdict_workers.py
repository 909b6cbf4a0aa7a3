"""Real training jobs for the straggler truth table (benchmarks/verdicts.py, tests/test_verdicts.py):
DDP, FSDP2, tensor parallel (DTensor), an n-stage GPipe pipeline and a ZeRO-style sharded optimizer
(ZeroRedundancyOptimizer over DDP), on gloo, with one rank delayed at a spot that one collective
absorbs (before the step, inside one block's forward, before the optimizer) by a share of the step.

``truth_jobs`` runs several jobs in turn in one set of processes (each a new model and wrapper, its own
log); the delay is a share of the kind's step time measured first in the same processes (a calibration
job, not recorded), so that 5% and 20% mean the same on a quiet machine and beside a CPU hog."""

from __future__ import annotations

KINDS = ("ddp", "fsdp2", "tp", "pipeline", "zero")
SPOTS = ("before_step", "in_forward", "before_optimizer")
HIDDEN = 192
BLOCKS = 4
BATCH = 32


def _blocks():
    import torch

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = torch.nn.Linear(HIDDEN, 2 * HIDDEN)
            self.down = torch.nn.Linear(2 * HIDDEN, HIDDEN)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(x)))

    return [Block() for _ in range(BLOCKS)]


def _sleep_hook(seconds):
    import time

    def hook(module, args):
        time.sleep(seconds)

    return hook


class _Job:
    """One job: build the model for ``kind``, then ``step(delay)`` trains one step (the delay, seconds,
    at ``spot``: 0 on the ranks that are not slow)."""

    def __init__(self, kind, rank, n, seed):
        import torch

        self.kind, self.rank, self.n = kind, rank, n
        torch.manual_seed(seed)
        self.gen = torch.Generator().manual_seed(1000 * seed + (0 if kind == "tp" else rank))
        blocks = _blocks()
        self.hooked = None  # the module whose forward the in_forward delay goes in
        self.schedule = None
        if kind == "pipeline":
            from tests.torch_compat import pipeline_stage

            per = max(1, BLOCKS // n)
            mod = torch.nn.Sequential(*blocks[rank * per : (rank + 1) * per] if rank < BLOCKS else blocks[:1])
            from torch.distributed.pipelining import ScheduleGPipe

            stage = pipeline_stage(mod, rank, n, (BATCH // 2, HIDDEN))
            self.schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=lambda out, target: out.pow(2).mean())
            self.model = mod
            self.hooked = mod[0]
            self.opt = torch.optim.SGD(mod.parameters(), lr=1e-3)
            return
        model = torch.nn.Sequential(*blocks)
        self.hooked = model[1]
        if kind == "ddp" or kind == "zero":
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.model = DDP(model, bucket_cap_mb=HIDDEN * 2 * HIDDEN * 4 * 1.5 / 2**20)  # a few buckets
            if kind == "zero":
                from torch.distributed.optim import ZeroRedundancyOptimizer

                self.opt = ZeroRedundancyOptimizer(self.model.parameters(), optimizer_class=torch.optim.SGD, lr=1e-3)
            else:
                self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        elif kind == "fsdp2":
            from tests.torch_compat import fully_shard

            shard = fully_shard()
            for block in model:
                shard(block)
            shard(model)
            self.model = model
            self.opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        elif kind == "tp":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            mesh = init_device_mesh("cpu", (n,))
            for block in model:
                parallelize_module(block, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
            self.model = model
            self.opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        else:
            raise ValueError(f"kind {kind!r}: one of {KINDS}")

    def step(self, spot=None, delay=0.0):
        import time

        import torch

        import commpatch

        commpatch.step()
        handle = None
        if delay and spot == "before_step":
            time.sleep(delay)
        elif delay and spot == "in_forward":
            # once per step: the pipeline's stage runs its forward once per microbatch
            handle = self.hooked.register_forward_pre_hook(_sleep_hook(delay / (2 if self.schedule else 1)))
        try:
            x = torch.randn(BATCH, HIDDEN, generator=self.gen)
            if self.schedule is not None:
                if self.rank == 0:
                    self.schedule.step(x)
                elif self.rank == self.n - 1:
                    self.schedule.step(target=torch.zeros(BATCH, HIDDEN))
                else:
                    self.schedule.step()
            else:
                self.model(x).pow(2).mean().backward()
        finally:
            if handle is not None:
                handle.remove()
        if delay and spot == "before_optimizer":
            time.sleep(delay)
        self.opt.step()
        self.opt.zero_grad()


def truth_jobs(rank: int, n: int, jobs: list, calibrate_steps: int = 12):
    """Run ``jobs`` in turn (dicts: kind, spot (None: no delay), share (of the kind's step time) or
    delay_ms, slow_rank, steps, seed); return per job (its log as a DataFrame, the delay in ms, the calibrated
    step time in ms, the training thread's CPU time per step in ns: the job's own measure of its work). Each kind is calibrated once, the first time it comes: the median step time of
    ``calibrate_steps`` undelayed steps (not recorded), agreed across ranks (rank 0's)."""
    import statistics
    import time

    import torch
    import torch.distributed as dist

    import commpatch

    torch.set_num_threads(1)
    step_ms: dict = {}
    out = []
    commpatch.enable(output="none")
    try:
        for job in jobs:
            kind = job["kind"]
            if kind not in step_ms:
                cal = _Job(kind, rank, n, seed=999)
                times = []
                for _ in range(calibrate_steps):
                    t = time.perf_counter()
                    cal.step()
                    times.append(time.perf_counter() - t)
                agreed = torch.tensor([statistics.median(times[2:]) * 1e3])
                dist.broadcast(agreed, 0)
                step_ms[kind] = float(agreed)
                del cal
            commpatch.reset()
            delay = job.get("delay_ms", job.get("share", 0.0) * step_ms[kind]) if job.get("spot") else 0.0
            j = _Job(kind, rank, n, seed=job.get("seed", 0))
            cpu = []  # the job's own measure of its work: the thread's CPU time per step (ns)
            for _ in range(job.get("steps", 30)):
                c = time.thread_time_ns()
                j.step(job.get("spot"), delay / 1e3 if rank == job.get("slow_rank") else 0.0)
                cpu.append(time.thread_time_ns() - c)
            dist.barrier()
            out.append((commpatch.log(), delay, step_ms[kind], cpu))
            del j
    finally:
        commpatch.disable()
    return out


def works_longer(rank, cpu, late_us) -> bool:
    """Does the job's own measure agree that ``rank`` works longer than the others: its training
    thread's median CPU time per step (set-up's two steps left out; ``cpu``: per rank, ns per step,
    as ``truth_jobs`` returns it) above every other rank's by at least half the verdict's figure
    ``late_us``? A rank named in a symmetric run that does so is no false verdict: the run was not
    symmetric (a 2-stage pipeline's last stage computes the loss and merges the microbatches'
    outputs: 0.15-1.3 ms more CPU per step, docs/decisions/straggler-verdict.md)."""
    import statistics

    med = [statistics.median(c[2:]) / 1e3 for c in cpu]
    return all(med[rank] - m >= 0.5 * late_us for r, m in enumerate(med) if r != rank)


def reduce_to_root(rank: int, n: int, steps: int = 40, late_ms: float = 0.0, late_rank: int = 1, op: str = "reduce"):
    """A step of a small all-reduce and then a rooted collective to rank 0, ``steps`` times.
    ``op="reduce"``: 64 MB of statistics reduced; the root receives and adds while the others only
    send, which makes it leave last in some steps (gloo on a 2-core machine: by 0.2-0.35 ms) and first
    in others (by as much): the median over 40 steps is 0 to 0.15 ms from run to run. ``op="gather"``:
    2 MB gathered; the others write into their socket's buffer and return while the root receives and
    copies out, so it leaves last in nearly every step (0.15-0.65 ms in 9 steps of 10). ``late_ms``:
    ``late_rank`` sleeps that long before each step. Returns the rank's log."""
    import time

    import torch
    import torch.distributed as dist

    import commpatch

    torch.set_num_threads(1)
    commpatch.enable(output="none")
    try:
        x = torch.ones(1024)
        stats = torch.ones(16 << 20 if op == "reduce" else 1 << 19)  # 64 MB, 2 MB
        into = [torch.empty_like(stats) for _ in range(n)] if op == "gather" and rank == 0 else None
        for _ in range(steps):
            if late_ms and rank == late_rank:
                time.sleep(late_ms / 1e3)
            dist.all_reduce(x)
            if op == "reduce":
                dist.reduce(stats, dst=0)
            else:
                dist.gather(stats, into, dst=0)
            commpatch.step()
        return commpatch.log()
    finally:
        commpatch.disable()
