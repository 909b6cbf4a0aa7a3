"""What seeing DDP's buckets costs a training step, by the kind of comm hook: one gloo process,
the ground truth's model (hidden 512, 3 buckets of 1 MB, 3 ms steps), the normal step's extra time
over a ``no_sync()`` step (what DDP's synchronisation costs), each way in processes of its own,
alternating, the median over the processes.

- ``plain``: DDP as it comes (the reducer's C++ all-reduce, no hook);
- ``python_hook``: a minimal Python comm hook (the reducer's all-reduce, one ``then()``);
- ``commpatch``: commpatch recording (its C comm hook when the extension is built);
- ``commpatch_python``: commpatch with its Python comm hook (as without the extension);
- ``commpatch_no_packing``: commpatch without its two hooks per parameter that time DDP's packing
  of gradients into buckets (``ddp_pack_us``): what those hooks cost is the difference to
  ``commpatch`` in both step columns (they run in no_sync() steps too);
- ``cpp_hook`` (``--cpp``): a C++ comm hook built now with torch.utils.cpp_extension (~20 s, cached),
  timing each bucket into a C++ vector with no Python in the backward: the floor a hook can reach.

    python benchmarks/ddp_hook_cost.py [--processes 5] [--steps 400] [--cpp] [--layers N] [--ways a,b]

``--layers N``: a model of N Linear(64, 64) layers instead (2N parameters, 1 bucket): the cost per
parameter of what runs per parameter.

``--packing-cost``: the two hooks per parameter alone, in one process (separate processes differ by
more than they cost): two identical DDP models of ``--layers`` layers (default 100) under
commpatch, one without the packing hooks, stepped in alternating rounds; the difference of the
median steps per parameter (``--control``: both models hooked, the A/A control of that difference).

``--phases``: where plain DDP's no_sync() difference sits (one process, the ground truth's model, no
commpatch): per phase the median of synchronized and no_sync() steps, DDP's own forward bookkeeping
(``_pre_forward`` / ``_post_forward``) timed apart.

docs/decisions/ddp-cost.md ("DDP buckets through a C comm hook") has the figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WAYS = ("plain", "python_hook", "commpatch", "commpatch_python", "commpatch_no_packing")

CPP_HOOK = r"""
#include <torch/extension.h>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>
#include <chrono>
#include <mutex>

static int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
      std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Rows { std::mutex mu; std::vector<std::array<int64_t, 4>> rows; };  // start, end, done, numel
static auto ROWS = std::make_shared<Rows>();

struct TimedAllreduce : c10d::CommHookInterface {
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  explicit TimedAllreduce(c10::intrusive_ptr<c10d::ProcessGroup> p) : pg(std::move(p)) {}
  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    int64_t start = now_ns();
    auto t = bucket.getBufferRef();
    if (pg->getSize() != 1) t.mul_(1.0 / pg->getSize());
    std::vector<at::Tensor> ts = {t};
    auto fut = pg->allreduce(ts)->getFuture();
    size_t slot;
    {
      std::lock_guard<std::mutex> g(ROWS->mu);
      slot = ROWS->rows.size();
      ROWS->rows.push_back({start, now_ns(), 0, t.numel()});
    }
    auto rows = ROWS;
    return fut->then([rows, slot](c10::ivalue::Future& f) {
      int64_t done = now_ns();
      { std::lock_guard<std::mutex> g(rows->mu); rows->rows[slot][2] = done; }
      return f.value();
    }, fut->elementType());
  }
  at::Tensor parseHookResult(const c10::IValue& result) override { return result.toTensorVector()[0]; }
};

void register_hook(py::object reducer, py::object pg) {
  reducer.cast<std::shared_ptr<c10d::Reducer>>()->register_comm_hook(
      std::make_unique<TimedAllreduce>(pg.cast<c10::intrusive_ptr<c10d::ProcessGroup>>()));
}

int64_t rows() { std::lock_guard<std::mutex> g(ROWS->mu); return ROWS->rows.size(); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("register_hook", &register_hook);
  m.def("rows", &rows);
}
"""


def cpp_module():
    from torch.utils.cpp_extension import load_inline

    return load_inline(name="commpatch_bench_cpp_hook", cpp_sources=[CPP_HOOK], extra_cflags=["-O2"])


def model_of(layers: int = 0):
    """The ground truth's model (hidden 512, 557k parameters in 8 tensors), or ``layers`` Linear(64, 64)."""
    import torch

    torch.manual_seed(0)
    if layers:
        return torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(layers)], torch.nn.Linear(64, 1))
    h = 512
    return torch.nn.Sequential(
        torch.nn.Linear(64, h),
        torch.nn.ReLU(),
        torch.nn.Linear(h, h),
        torch.nn.ReLU(),
        torch.nn.Linear(h, h),
        torch.nn.ReLU(),
        torch.nn.Linear(h, 1),
    )


def one_process_group():
    """A gloo group of this one process, one intra-op thread; the batch (x, y)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29000 + os.getpid() % 2000))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    x = torch.randn(64, 64)
    return x, x.sum(1, keepdim=True)


def worker(way: str, steps: int, layers: int) -> None:
    """One process, one way: prints the median normal and no_sync step times (us)."""
    sys.path.insert(0, ROOT)
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    if way.startswith("commpatch"):
        import commpatch
        from commpatch.integrations import ddp as cp_ddp

        if way == "commpatch_python":
            cp_ddp.bucket_hook = lambda *args, **kwargs: None
        elif way == "commpatch_no_packing":
            cp_ddp._packing = lambda *args: None
        commpatch.enable(output="none")
    x, y = one_process_group()
    ddp = DDP(model_of(layers), bucket_cap_mb=1.0)
    if way == "python_hook":
        reducer = ddp.reducer
        ddp.register_comm_hook(
            None, lambda state, bucket: reducer._run_allreduce_hook(bucket).then(lambda fut: fut.value()[0])
        )
    elif way == "cpp_hook":
        cpp_module().register_hook(ddp.reducer, ddp.process_group)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)

    def step(sync: bool) -> float:
        t = time.perf_counter()
        opt.zero_grad()
        if sync:
            torch.nn.functional.mse_loss(ddp(x), y).backward()
        else:
            with ddp.no_sync():
                torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        return time.perf_counter() - t

    for _ in range(10):
        step(True)
        step(False)
    times = {True: [], False: []}
    for r in range(steps):
        for sync in (True, False) if r % 2 else (False, True):
            times[sync].append(step(sync))
    print(f"{statistics.median(times[True]) * 1e6:.1f} {statistics.median(times[False]) * 1e6:.1f}")
    dist.destroy_process_group()


def packing_cost(layers: int, rounds: int, steps: int, control: bool = False) -> None:
    sys.path.insert(0, ROOT)
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import commpatch
    from commpatch.integrations import ddp as cp_ddp

    commpatch.enable(output="none")
    x, y = one_process_group()
    models, packing = {}, cp_ddp._packing
    for way in ("hooks", "no_hooks"):
        ddp = DDP(model_of(layers))
        cp_ddp._packing = packing if way == "hooks" or control else (lambda *args: None)
        try:
            ddp(x)  # commpatch installs at the first forward
        finally:
            cp_ddp._packing = packing
        models[way] = (ddp, torch.optim.SGD(ddp.parameters(), lr=1e-3))
    params = sum(1 for p in models["hooks"][0].parameters())

    def step(ddp, opt) -> float:
        t = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        return time.perf_counter() - t

    times: dict = {way: [] for way in models}
    for r in range(rounds):
        for way in ("hooks", "no_hooks") if r % 2 else ("no_hooks", "hooks"):
            for _ in range(steps):
                dt = step(*models[way])
                if r > 0:
                    times[way].append(dt)
    on, off = statistics.median(times["hooks"]) * 1e6, statistics.median(times["no_hooks"]) * 1e6
    packed = commpatch.log()["pack_us"].dropna()
    print(
        f"load {os.getloadavg()[0]:.2f}; {layers} layers ({params} parameters), {rounds} alternating rounds of "
        f"{steps} steps"
    )
    print(
        f"step with the packing hooks {on:.0f} us, without {off:.0f} us: {(on - off) / params:+.3f} us per "
        f"parameter per step; packing measured {packed.median():.0f} us per bucket (median)"
    )
    dist.destroy_process_group()


def phases(steps: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    x, y = one_process_group()
    ddp = DDP(model_of(), bucket_cap_mb=1.0)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    pc, inner = time.perf_counter_ns, {}

    def timed(name):
        orig = getattr(DDP, name)

        def run(*args, **kwargs):
            t = pc()
            try:
                return orig(*args, **kwargs)
            finally:
                inner[name] = pc() - t

        setattr(DDP, name, run)

    timed("_pre_forward")
    timed("_post_forward")
    names = ("forward", "backward", "optimizer", "step", "_pre_forward", "_post_forward")
    out: dict = {True: [], False: []}
    for i in range(2 * steps + 40):
        sync = i % 2 == 0
        opt.zero_grad()
        t0 = pc()
        if sync:
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            t1 = pc()
            loss.backward()
        else:
            with ddp.no_sync():
                loss = torch.nn.functional.mse_loss(ddp(x), y)
                t1 = pc()
                loss.backward()
        t2 = pc()
        opt.step()
        t3 = pc()
        if i >= 40:
            out[sync].append((t1 - t0, t2 - t1, t3 - t2, t3 - t0, inner["_pre_forward"], inner["_post_forward"]))
    print(
        f"load {os.getloadavg()[0]:.2f}; plain DDP, 1 process, {steps} synchronized and {steps} no_sync() steps, "
        "interleaved (us, medians)"
    )
    print("phase            sync   no_sync   difference")
    for k, name in enumerate(names):
        a = statistics.median(v[k] for v in out[True]) / 1e3
        b = statistics.median(v[k] for v in out[False]) / 1e3
        print(f"{name:14s} {a:6.0f}    {b:6.0f}    {a - b:+6.0f}")
    dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker")
    parser.add_argument("--processes", type=int, default=5)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--cpp", action="store_true", help="also a C++ comm hook (torch extension, built now)")
    parser.add_argument("--layers", type=int, default=0, help="a model of N Linear(64, 64) layers instead")
    parser.add_argument("--ways", help=f"comma-separated, of {', '.join(WAYS)} (default: all)")
    parser.add_argument("--packing-cost", action="store_true", help="the packing hooks' cost, in one process")
    parser.add_argument("--control", action="store_true", help="with --packing-cost: both models hooked (A/A)")
    parser.add_argument("--phases", action="store_true", help="plain DDP's no_sync() difference, by phase")
    args = parser.parse_args(argv)
    if args.phases:
        phases(args.steps)
        return 0
    if args.packing_cost:
        packing_cost(args.layers or 100, max(3, args.processes * 4), max(10, args.steps // 20), args.control)
        return 0
    if args.worker:
        worker(args.worker, args.steps, args.layers)
        return 0
    ways = (tuple(args.ways.split(",")) if args.ways else WAYS) + (("cpp_hook",) if args.cpp else ())
    if args.cpp:
        cpp_module()  # build once, before the timed processes
    diffs: dict = {w: [] for w in ways}
    normal: dict = {w: [] for w in ways}
    nosync: dict = {w: [] for w in ways}
    for _ in range(args.processes):
        for way in ways:
            out = subprocess.run(
                [
                    sys.executable,
                    os.path.abspath(__file__),
                    "--worker",
                    way,
                    "--steps",
                    str(args.steps),
                    "--layers",
                    str(args.layers),
                ],
                check=True,
                capture_output=True,
                text=True,
                env=dict(os.environ, OMP_NUM_THREADS="1"),
                timeout=600,
            ).stdout.split()
            n, s = float(out[-2]), float(out[-1])
            diffs[way].append(n - s)
            normal[way].append(n)
            nosync[way].append(s)
    print(
        f"load {os.getloadavg()[0]:.2f}; {args.processes} processes per way, {args.steps} normal + {args.steps} "
        f"no_sync steps each, alternating; model: {f'{args.layers} layers' if args.layers else 'hidden 512'}"
    )
    print("way                   normal step  no_sync step   normal - no_sync (median, range)")
    for way in ways:
        d = diffs[way]
        print(
            f"{way:20s}  {statistics.median(normal[way]):8.0f} us  {statistics.median(nosync[way]):8.0f} us   "
            f"{statistics.median(d):6.0f} us ({min(d):.0f}-{max(d):.0f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
