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
   ``torch.ops._c10d_functional.all_reduce_`` / ``wait_tensor`` replaced by Python objects whose
   ``.default`` records and calls the real op. dynamo guards on those objects, so the swap makes a
   compiled graph recompile, and tracing the object fails under fullgraph=True: its cost is
   measured on the op calls themselves (wrapped minus direct) and added to the plain graph;
4. post-grad pass estimate (not shipped): the graph as compiled, plus two calls of a Python custom
   op per collective from the same generated code (each copies its 16 floats), about what a pass
   bracketing each collective with recording calls would add (the pass itself needs a custom inductor pass, its
   cache key, and sees only graphs compiled while enabled).
Prints µs per graph call, added µs per collective and the ratio to plain. Numbers go to
docs/decisions/hidden-collectives.md.
"""

from __future__ import annotations

import argparse
import time

from _util import alternating, fake_world


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--collectives", type=int, default=8)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()

    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    import commpatch

    fake_world(8)
    group = dist.group.WORLD
    k = args.collectives

    def graph(x):
        acc = x
        for i in range(k):
            acc = acc + funcol.wait_tensor(funcol.all_reduce(x + i, "sum", group))
        return acc

    marks = []

    @torch.library.custom_op("commpatch_bench::mark", mutates_args=(), schema="(Tensor x) -> Tensor")
    def mark(x):
        marks.append(time.perf_counter_ns())
        return x.clone()  # a custom op may not return its input

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

    op, wait = torch.ops._c10d_functional.all_reduce_.default, torch.ops._c10d_functional.wait_tensor.default
    name = dist.group.WORLD.group_name
    buf = torch.ones(16)

    def op_loop(reduce, wait_):
        t0 = time.perf_counter_ns()
        for _ in range(args.calls):
            wait_(reduce(buf, "sum", name))
        return (time.perf_counter_ns() - t0) / args.calls / 1e3 * k  # per graph's worth of collectives

    def namespace_wrap():
        """What generated code would call through a Python object put in place of
        ``torch.ops._c10d_functional.all_reduce_`` / ``wait_tensor``: measured on the op calls
        themselves (dynamo guards on those objects: a graph compiled before the swap recompiles
        and, tracing the object, fails under fullgraph=True)."""
        rows = []

        def recorded(real):
            def default(*a, **kw):
                start = time.perf_counter_ns()
                out = real(*a, **kw)
                rows.append((start, time.perf_counter_ns(), a[0].numel()))
                return out

            return default

        return op_loop(recorded(op), recorded(wait)) - op_loop(op, wait) + loop(compiled)

    def post_grad_estimate():
        t = loop(compiled_bracketed)
        marks.clear()
        return t

    ways = {
        "plain": plain,
        "commpatch (dispatcher kernels)": instrumented,
        "namespace wrap (not shipped)": namespace_wrap,
        "post-grad pass estimate (not shipped)": post_grad_estimate,
    }
    medians = alternating(ways, args.rounds)
    base = medians["plain"]
    print(f"{k} all_reduce + wait_tensor per graph, {args.calls} calls x {args.rounds} rounds, fake backend (world 8)")
    print(f"{'way':40s} {'us/graph':>9s} {'added us/collective':>20s} {'ratio':>6s}")
    for name, med in medians.items():
        print(f"{name:40s} {med:9.2f} {(med - base) / k:20.2f} {med / base:6.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
