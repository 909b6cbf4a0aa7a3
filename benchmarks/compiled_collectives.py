"""Added time per collective inside a torch.compile'd graph (inductor, fullgraph=True), and the
ratio of the instrumented graph to the same graph uninstrumented.

    python benchmarks/compiled_collectives.py [--collectives 8] [--calls 2000] [--rounds 7]

Fake backend (``FakeStore``, world 8: the collective itself costs almost nothing, so the added
time is what stands out), one compiled function issuing ``--collectives`` functional all-reduces
of 16 floats (inductor emits ``all_reduce_`` + ``wait_tensor`` for each). Ways, in alternating
rounds of ``--calls`` graph calls, median per way:

1. plain: commpatch not enabled;
2. commpatch: ``enable()``: the dispatcher kernels of ``integrations/compiled.py`` (ADInplaceOrView
   key, redispatch below; one row per collective, timed to its wait);
3. namespace wrap (the option measured, not shipped): the generated code's
   ``torch.ops._c10d_functional.all_reduce_`` / ``wait_tensor`` replaced, after compilation, by
   Python objects whose ``.default`` records and calls the real op;
4. post-grad pass estimate (not shipped): the graph as compiled, plus two calls of a Python custom
   op per collective from the same generated code, which is what a pass bracketing each
   collective with recording calls would add (the pass itself needs a custom inductor pass, its
   cache key, and sees only graphs compiled while enabled).
Prints µs per graph call, added µs per collective and the ratio to plain. Numbers go to
docs/design-notes.md (issue 16).
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--collectives", type=int, default=8)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()

    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import commpatch

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    group = dist.group.WORLD
    k = args.collectives

    def graph(x):
        acc = x
        for i in range(k):
            acc = acc + funcol.wait_tensor(funcol.all_reduce(x + i, "sum", group))
        return acc

    marks = []

    @torch.library.custom_op("commpatch_bench::mark", mutates_args=())
    def mark(x: torch.Tensor) -> torch.Tensor:
        marks.append(time.perf_counter_ns())
        return x

    @mark.register_fake
    def _(x):
        return torch.empty_like(x)

    def bracketed(x):
        acc = x
        for i in range(k):
            y = mark(x + i)
            acc = acc + mark(funcol.wait_tensor(funcol.all_reduce(y, "sum", group)))
        return acc

    x = torch.ones(16)
    compiled = torch.compile(graph, fullgraph=True)
    compiled_bracketed = torch.compile(bracketed, fullgraph=True)
    expected = compiled(x)
    assert torch.equal(compiled_bracketed(x), expected)

    def loop(fn):
        t0 = time.perf_counter_ns()
        for _ in range(args.calls):
            fn(x)
        return (time.perf_counter_ns() - t0) / args.calls / 1e3

    def plain():
        return loop(compiled)

    def instrumented():
        commpatch.enable(output="none", modules=False)
        try:
            t = loop(compiled)
            rows = len(commpatch.log())
            assert rows == k * args.calls, rows
            return t
        finally:
            commpatch.disable()
            commpatch.reset()

    def namespace_wrap():
        ns = torch.ops._c10d_functional
        saved = {name: getattr(ns, name) for name in ("all_reduce_", "wait_tensor")}
        rows = []

        class Packet:
            def __init__(self, packet):
                real = packet.default

                def default(*a, **kw):
                    start = time.perf_counter_ns()
                    out = real(*a, **kw)
                    rows.append((start, time.perf_counter_ns(), a[0].numel()))
                    return out

                self.default = default

        try:
            for name, packet in saved.items():
                setattr(ns, name, Packet(packet))
            return loop(compiled)
        finally:
            for name, packet in saved.items():
                setattr(ns, name, packet)

    def post_grad_estimate():
        t = loop(compiled_bracketed)
        marks.clear()
        return t

    ways = {"plain": plain, "commpatch (dispatcher kernels)": instrumented,
            "namespace wrap (not shipped)": namespace_wrap, "post-grad pass estimate (not shipped)": post_grad_estimate}
    for fn in ways.values():
        fn()                      # warm up (and check the row count once)
    results = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, fn in ways.items():
            results[name].append(fn())
    base = statistics.median(results["plain"])
    print(f"{k} all_reduce + wait_tensor per graph, {args.calls} calls x {args.rounds} rounds, fake backend (world 8)")
    print(f"{'way':40s} {'us/graph':>9s} {'added us/collective':>20s} {'ratio':>6s}")
    for name, values in results.items():
        med = statistics.median(values)
        print(f"{name:40s} {med:9.2f} {(med - base) / k:20.2f} {med / base:6.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
