"""DDP training step with and without commpatch, in one run, alternating rounds.

    python benchmarks/ddp_step.py [--nproc 2] [--steps 50] [--rounds 6]

Two identical DDP models on a gloo group: one is only ever stepped while commpatch is disabled
(no hook is ever installed on it), the other while enabled (bucket hook + module attribution).
Prints the median step time of each and the ratio (target: <= 1.02).

--compare adds, in the same alternating rounds: torch.profiler (CPU, record_shapes=True) and
CommDebugMode around the plain model, torch's own Python ``allreduce_hook`` on a model of its own
(what any Python comm hook costs: commpatch sees DDP's buckets through one), torch's own C++
``ALLREDUCE`` comm hook on another (what any comm hook costs: the reducer then copies each gradient
into its bucket unscaled and the hook divides the bucket, a second pass over the gradients that
the hook-less path fuses into the copy), and the hand-written
recipe on another model (a comm hook
that times each bucket's all_reduce and waits for it: DDP's reducer bypasses dist.*, so a
wrapper of dist.all_reduce would see nothing). DeepSpeed's comms logger only sees calls made
through deepspeed.comm, so a DDP job gives it nothing to record: not in this table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def demo_model():
    import torch

    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(512, 512), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(512, 10))


def sync_recipe_hook(records):
    """The common recipe as a DDP comm hook: time the bucket's all_reduce, wait for it, log it."""
    import torch
    import torch.distributed as dist

    def hook(state, bucket):
        buf = bucket.buffer()
        t0 = time.perf_counter()
        dist.all_reduce(buf.div_(dist.get_world_size()))
        if buf.is_cuda:
            torch.cuda.synchronize()
        records.append(
            {"op": "all_reduce", "bytes": buf.numel() * buf.element_size(), "duration_s": time.perf_counter() - t0}
        )
        fut = torch.futures.Future()
        fut.set_result(buf)
        return fut

    return hook


def worker(rank, nproc, steps, rounds, port, compare=False):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import commpatch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=nproc)
    models = {"plain": DDP(demo_model(), bucket_cap_mb=1), "commpatch": DDP(demo_model(), bucket_cap_mb=1)}
    kinds = ["plain", "commpatch"]
    records = []
    if compare:
        models["sync recipe"] = DDP(demo_model(), bucket_cap_mb=1)
        models["sync recipe"].register_comm_hook(None, sync_recipe_hook(records))
        models["torch.profiler"] = models["plain"]
        models["CommDebugMode"] = DDP(demo_model(), bucket_cap_mb=1)  # its own: it may break it
        # torch's own Python all-reduce hook, no commpatch: what any Python comm hook costs here
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        models["torch allreduce_hook"] = DDP(demo_model(), bucket_cap_mb=1)
        models["torch allreduce_hook"].register_comm_hook(None, default_hooks.allreduce_hook)
        # torch's own C++ hook (no Python at all): with any hook the reducer copies each gradient
        # into its bucket unscaled and the hook divides it, a second pass the default path fuses
        models["torch C++ ALLREDUCE hook"] = DDP(demo_model(), bucket_cap_mb=1)
        models["torch C++ ALLREDUCE hook"]._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
        kinds += ["torch.profiler", "CommDebugMode", "sync recipe", "torch allreduce_hook", "torch C++ ALLREDUCE hook"]
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.01) for k, m in models.items()}
    x, y = torch.randn(64, 512), torch.randint(0, 10, (64,))
    times = {k: [] for k in kinds}
    failed = {}

    def context(kind):
        import contextlib

        if kind == "torch.profiler":
            from torch.profiler import ProfilerActivity, profile

            return profile(activities=[ProfilerActivity.CPU], record_shapes=True)
        if kind == "CommDebugMode":
            from torch.distributed.tensor.debug import CommDebugMode

            return CommDebugMode()
        return contextlib.nullcontext()

    def run(kind):
        model, opt = models[kind], opts[kind]
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        return (time.perf_counter() - t0) / steps

    for r in range(rounds + 1):
        order = kinds[r % len(kinds) :] + kinds[: r % len(kinds)]  # rotate who goes first
        for kind in order:
            if kind in failed:
                continue
            if kind == "commpatch":
                commpatch.enable(output="none")
            else:
                commpatch.disable()
            try:
                with context(kind):
                    t = run(kind)
            except Exception as exc:  # noqa: BLE001 - a tool that cannot run this job is reported
                failed[kind] = f"{type(exc).__name__}: {exc}"
                continue
            if r:  # round 0 warms up all
                times[kind].append(t)
    commpatch.disable()
    rows = len(commpatch.log())
    dist.destroy_process_group()
    if rank == 0:
        plain, patched = statistics.median(times["plain"]), statistics.median(times["commpatch"])
        print(
            f"step plain {plain * 1e3:.3f} ms, commpatch {patched * 1e3:.3f} ms, "
            f"ratio {patched / plain:.4f} (added {(patched - plain) * 1e6:.1f} us/step; {rows} rows)"
        )
        if compare:
            print("\n| tool | DDP step (ms, median) | ratio to no instrumentation |\n|---|---:|---:|")
            for kind in kinds:
                if kind in failed:
                    print(f"| {kind} | fails on DDP here: {failed[kind][:90]} | - |")
                    continue
                step = statistics.median(times[kind])
                print(f"| {kind} | {step * 1e3:.2f} | {step / plain:.3f} |")


def main() -> None:
    import torch.multiprocessing as mp

    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--port", type=int, default=29561)
    ap.add_argument("--compare", action="store_true", help="also torch.profiler, CommDebugMode, the sync recipe")
    a = ap.parse_args()
    mp.spawn(worker, args=(a.nproc, a.steps, a.rounds, a.port, a.compare), nprocs=a.nproc)


if __name__ == "__main__":
    main()
