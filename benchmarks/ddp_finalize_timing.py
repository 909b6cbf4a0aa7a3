"""Cost of timing DDP's finalize (``sync_end_us``: two autograd-engine callbacks and one timestamp
per backward, integrations/ddp.py ``_time_finalize``) per training step, on the ground truth's DDP
model (hidden 512, 3 Linear layers, batch 64, 3 buckets of 1 MB), one gloo process.

Alternating rounds in the same process, commpatch recording throughout: the finalize timed, then
not (``_time_finalize`` replaced by a no-op), each round N steps; CPU time (process_time) and wall
time per step; the median of the paired differences. Step times vary by more than the cost, so it
is also measured alone: a tiny backward (one multiply) whose tensor hook calls ``_time_finalize``
or not, alternating blocks of 2,000 backwards, median of the paired block differences.

    python benchmarks/ddp_finalize_timing.py [--rounds 40] [--steps 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import commpatch
    from commpatch.integrations import ddp as ddp_integration

    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    commpatch.enable(output="none")
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    h = 512
    model = DDP(
        torch.nn.Sequential(
            torch.nn.Linear(64, h),
            torch.nn.ReLU(),
            torch.nn.Linear(h, h),
            torch.nn.ReLU(),
            torch.nn.Linear(h, h),
            torch.nn.ReLU(),
            torch.nn.Linear(h, 1),
        ),
        bucket_cap_mb=1.0,
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(64, 64)
    y = x.sum(dim=1, keepdim=True)
    timed = ddp_integration._time_finalize

    def steps(n):
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(n):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        return (time.process_time() - cpu) / n, (time.perf_counter() - wall) / n

    results = {True: [], False: []}
    noted = {True: 0, False: 0}
    for r in range(args.rounds + 1):
        for on in (True, False) if r % 2 else (False, True):
            ddp_integration._time_finalize = timed if on else (lambda *a: None)
            steps(2)
            measured = steps(args.steps)
            noted[on] += int(commpatch.log()["sync_end_us"].notna().sum())
            commpatch.reset()
            if r:  # round 0 warms up
                results[on].append(measured)
    ddp_integration._time_finalize = timed
    dist.destroy_process_group()

    syncs = []
    engine = torch.autograd.Variable._execution_engine
    w = torch.ones(1, requires_grad=True)

    def block(on, n=2000):
        hook = (lambda g: timed(engine, syncs, 0, 0)) if on else (lambda g: None)
        handle = w.register_hook(hook)
        t = time.perf_counter()
        for _ in range(n):
            (w * 2.0).backward()
        handle.remove()
        return (time.perf_counter() - t) / n

    alone = {True: [], False: []}
    for r in range(21):
        for on in (True, False) if r % 2 else (False, True):
            measured = block(on)
            if r:
                alone[on].append(measured)
    assert len(syncs) == 21 * 2000
    per_call = statistics.median(a - b for a, b in zip(alone[True], alone[False]))
    base_cpu = statistics.median(c for c, _ in results[False])
    base_wall = statistics.median(w for _, w in results[False])
    cpu = [a[0] - b[0] for a, b in zip(results[True], results[False])]
    wall = [a[1] - b[1] for a, b in zip(results[True], results[False])]
    print(
        f"load: {os.getloadavg()[0]:.2f} (1 min); {args.rounds} paired rounds of {args.steps} steps "
        f"(finalize ends noted: {noted[True]} timed, {noted[False]} not)"
    )
    print(f"step without the finalize timed: {1e3 * base_cpu:.3f} ms CPU, {1e3 * base_wall:.3f} ms wall")
    print(
        f"added: {1e6 * statistics.median(cpu):+.1f} us CPU per step ({100 * statistics.median(cpu) / base_cpu:+.2f}%; "
        f"paired differences {1e6 * min(cpu):+.1f} to {1e6 * max(cpu):+.1f}), "
        f"{1e6 * statistics.median(wall):+.1f} us wall per step ({100 * statistics.median(wall) / base_wall:+.2f}%)"
    )
    print(
        f"alone: {1e6 * per_call:+.2f} us per backward (a tiny backward: {1e6 * statistics.median(alone[False]):.2f} us)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
