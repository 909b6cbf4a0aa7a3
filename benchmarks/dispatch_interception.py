"""Per-call cost of four ways to see a collective (fake backend, world 8, 1-element all_reduce).

    python benchmarks/dispatch_interception.py [--calls 20000]

1. plain torch; 2. commpatch's Python wrapper; 3. a Python kernel registered with torch.library
for c10d::allreduce_ at AutogradCPU that records a tuple and redispatches below autograd (the
targeted dispatcher interception of issue 4); 4. CommDebugMode (a global TorchDispatchMode).
Prints microseconds per call, median of alternating rounds. Numbers go to docs/decisions/hidden-collectives.md.
"""

from __future__ import annotations

import argparse
import time

from _util import alternating


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import commpatch

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    t = torch.ones(1)
    rows = []
    lib = None

    def loop():
        t0 = time.perf_counter_ns()
        for _ in range(args.calls):
            dist.all_reduce(t)
        return (time.perf_counter_ns() - t0) / args.calls / 1e3

    op = torch.ops.c10d.allreduce_.default
    after_autograd = torch._C._after_autograd_keyset

    def kernel(keyset, tensors, *rest):
        start = time.perf_counter_ns()
        out = op.redispatch(keyset & after_autograd, tensors, *rest)
        rows.append((start, time.perf_counter_ns(), tensors[0].numel()))
        return out

    def plain():
        return loop()

    def wrapper():
        commpatch.enable(output="none", modules=False)
        try:
            return loop()
        finally:
            commpatch.disable()
            commpatch.reset()

    def dispatcher():
        nonlocal lib
        lib = torch.library.Library("c10d", "IMPL")
        lib.impl("allreduce_", kernel, "AutogradCPU", with_keyset=True)
        try:
            return loop()
        finally:
            lib._destroy()  # unregister: a registered Python kernel at exit can abort
            rows.clear()

    def comm_debug():
        with CommDebugMode():
            return loop()

    ways = {
        "plain": plain,
        "commpatch wrapper": wrapper,
        "dispatcher (AutogradCPU)": dispatcher,
        "CommDebugMode": comm_debug,
    }
    medians = alternating(ways, args.rounds)
    base = medians["plain"]
    print(f"{'way':28s} {'us/call':>8s} {'added us':>9s}")
    for name, med in medians.items():
        print(f"{name:28s} {med:8.2f} {med - base:9.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
