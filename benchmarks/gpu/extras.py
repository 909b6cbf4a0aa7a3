"""GPU checks beyond the kit: what real jobs do with CUDA, each with commpatch on and off, results bit for bit.

    python benchmarks/gpu/extras.py [--quick] [--json extras.json]     # 1 GPU (NCCL 1 rank; gloo 2 ranks)
    python benchmarks/gpu/extras.py --dry-run-cpu                      # the code path on CPU (validates nothing)

Checks (one pass / fail / skip row each, with what was measured and the bound):
  graph_capture    a step holding an NCCL all_reduce and all_gather captured in a CUDA graph with
                   commpatch enabled, then replayed: capture works, outputs equal to the run without
                   commpatch bit for bit; the captured calls are recorded once each with timing=none,
                   replays add no row (docs/reliability.md, "CUDA graph capture");
  compile_graphs   torch.compile(mode="reduce-overhead") of a model with a functional all_reduce:
                   outputs equal bit for bit with / without commpatch;
  ddp_bf16         a small bf16 transformer under DDP (1 rank, NCCL): step time with / without
                   commpatch in alternating rounds (median ratio <= 1.01), and the CPU-side profile
                   of the training thread: no added cudaStreamSynchronize / cudaDeviceSynchronize /
                   cudaEventSynchronize;
  fsdp2_dtensor    fully_shard (1 rank) training steps and a DTensor redistribute + matmul on CUDA:
                   losses and outputs equal bit for bit; FSDP2's all-gathers / reduce-scatters recorded;
  gloo_cuda        2 processes on the one GPU through gloo with CUDA tensors, rank 1 delayed 20 ms
                   per step: rows timed by device events, the skew seen, rank 1 named the straggler;
                   the symmetric job names none; results equal with / without commpatch;
  call_overhead    host time a sync all_gather gains per call with commpatch, and with torch.profiler
                   (CPU + CUDA activities): commpatch at most half of the profiler's;
  many_calls       100,000 timed calls: events created, host RSS and device memory flat.
Exit status 0 when every check that ran passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, REPO)
_spec = importlib.util.spec_from_file_location("gpu_validate", os.path.join(HERE, "validate.py"))
kit = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kit)  # shares the row format, the verdict and the sync counters
import commpatch  # noqa: E402
import commpatch.session  # noqa: E402

row, failed_row, render_table, verdict, clean = kit.row, kit.failed_row, kit.render_table, kit.verdict, kit.clean
STEP_RATIO_MAX = 1.01
DELAY_MS = 20.0
EVENTS_MAX = 1024  # many_calls: events for what is in flight
RSS_GROWTH_MAX_MB = 32.0  # host memory growth from 20% to 100% of the calls


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _rows(op=None):
    df = commpatch.log()
    return df if op is None else df[df["op"] == op]


def _equal(torch, a, b) -> bool:
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(torch, x, y) for x, y in zip(a, b))
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a.cpu(), b.cpu()))


def both(run, out_dir):
    """``run()`` with commpatch off, then on (writing under out_dir): (off result, on result, on log)."""
    commpatch.disable()
    off = run()
    commpatch.reset()
    commpatch.enable(output=os.path.join(out_dir, "rank{rank}.csv"))
    on = run()
    df = commpatch.log()
    commpatch.disable()
    return off, on, df


class Checks:
    def __init__(self, args, torch, dist, out_dir):
        self.args, self.torch, self.dist, self.out = args, torch, dist, out_dir
        self.dry = args.dry_run_cpu
        self.dev = torch.device("cpu") if self.dry else torch.device("cuda", 0)

    def sync(self):
        if not self.dry:
            self.torch.cuda.synchronize()

    # ---- CUDA graph capture
    def graph_capture(self):
        name = "graph capture: NCCL all_reduce + all_gather in a CUDA graph, replayed"
        if self.dry:
            return [row("graph_capture", name, "skip", "no CUDA graphs on CPU", "-")]
        torch, dist = self.torch, self.dist
        replays = 10

        def run():
            g = torch.Generator(device="cpu").manual_seed(3)
            inputs = [torch.randn(1 << 16, generator=g).to(self.dev) for _ in range(replays)]
            static = inputs[0].clone()
            gathered = torch.empty(1 << 16, device=self.dev)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):  # warm-up outside the capture (NCCL's and the allocator's first calls)
                    y = static * 2
                    dist.all_reduce(y)
                    dist.all_gather_into_tensor(gathered, y)
            torch.cuda.current_stream().wait_stream(side)
            self.sync()
            before = len(commpatch.log()) if commpatch.is_enabled() else 0
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                y = static * 2
                dist.all_reduce(y)
                dist.all_gather_into_tensor(gathered, y)
                out = gathered.sin() + 1
            self.sync()
            captured = commpatch.log().iloc[before:] if commpatch.is_enabled() else None
            results = []
            for x in inputs:
                static.copy_(x)
                graph.replay()
                results.append(out.clone())
            self.sync()
            after = len(commpatch.log()) if commpatch.is_enabled() else 0
            return results, captured, after - before

        try:
            (off, _, _), (on, captured, added), _ = both(run, self.out)
            same = _equal(torch, off, on)
            ops = captured["op"].astype(str).tolist()
            timings = sorted(set(captured["timing"].astype(str)))
            ok = same and sorted(ops) == ["all_gather_into_tensor", "all_reduce"] and timings == ["none"] and added == 2
            return [
                row(
                    "graph_capture",
                    name,
                    "pass" if ok else "fail",
                    f"{replays} replays equal bit for bit: {same}; captured calls recorded: {ops} timing {timings}; "
                    f"rows added by capture + replays: {added}",
                    "equal; each captured call once, timing=none; replays add no row",
                    ops=ops,
                    timings=timings,
                    rows_added=added,
                )
            ]
        except Exception as exc:  # noqa: BLE001
            return [failed_row("graph_capture", name, exc)]

    # ---- captures begun with measurements in flight
    def capture_race(self):
        """A query of an event during a (global-mode) capture breaks it: 30 times, 300 timed
        collectives are issued (in flight, resolved every 64) and a graph holding an all_reduce is
        captured at once, then replayed; every capture must succeed, every replay equal the plain
        computation, and the measurements in flight resolve after the captures."""
        name = "graph capture with timed collectives in flight: 30 captures"
        if self.dry:
            return [row("capture_race", name, "skip", "no CUDA graphs on CPU", "-")]
        torch, dist = self.torch, self.dist
        try:
            commpatch.reset()
            commpatch.enable(output="none")
            tm = commpatch.session.default().timing
            x = torch.ones(1 << 12, device=self.dev)
            static = torch.randn(1 << 12, device=self.dev)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    y = static * 2
                    dist.all_reduce(y)
            torch.cuda.current_stream().wait_stream(side)
            self.sync()
            failures, equal, in_flight = [], 0, 0
            for i in range(30):
                for _ in range(300):
                    dist.all_reduce(x)
                in_flight = max(in_flight, tm.in_flight())
                graph = torch.cuda.CUDAGraph()
                try:
                    with torch.cuda.graph(graph):
                        y = static * 2
                        dist.all_reduce(y)
                        out = y + 1
                    static.copy_(torch.full_like(static, float(i)))
                    graph.replay()
                    self.sync()
                    equal += bool(torch.equal(out, static * 2 + 1))
                except Exception as exc:  # noqa: BLE001
                    failures.append(f"{type(exc).__name__}: {str(exc)[:200]}")
                    self.sync()
            df = commpatch.log()
            commpatch.disable()
            timed = int((df["timing"].astype(str) == "device_event").sum())
            ok = not failures and equal == 30 and timed == 30 * 300 + 3
            return [
                row(
                    "capture_race",
                    name,
                    "pass" if ok else "fail",
                    f"captures failed: {len(failures)} {failures[:2]}; replays equal: {equal} of 30; at most "
                    f"{in_flight} measurements in flight as a capture began; rows timed by device events: {timed}",
                    f"every capture succeeds, every replay equal, every timed call resolved ({30 * 300 + 3})",
                    failures=failures,
                )
            ]
        except Exception as exc:  # noqa: BLE001
            commpatch.disable()
            return [failed_row("capture_race", name, exc)]

    # ---- torch.compile reduce-overhead with a functional collective
    def compile_graphs(self):
        name = 'compile: mode="reduce-overhead", functional all_reduce in the model'
        torch = self.torch
        mode = None if self.dry else "reduce-overhead"
        try:
            import torch.distributed._functional_collectives as funcol

            group = self.dist.group.WORLD

            class Net(torch.nn.Module):
                def __init__(self):
                    super().__init__()
                    self.lin = torch.nn.Linear(256, 256)

                def forward(self, x):
                    y = funcol.all_reduce(self.lin(x), "sum", group)
                    return torch.relu(y) * 0.5

            def run():
                torch.manual_seed(0)
                torch._dynamo.reset()
                net = Net().to(self.dev)
                fn = torch.compile(net, mode=mode)
                g = torch.Generator(device="cpu").manual_seed(4)
                outs = []
                with torch.no_grad():
                    for _ in range(6):
                        x = torch.randn(32, 256, generator=g).to(self.dev)
                        outs.append(fn(x).clone())
                self.sync()
                return outs

            off, on, df = both(run, self.out)
            same = _equal(torch, off, on)
            ops = df["op"].astype(str).value_counts().to_dict()
            return [
                row(
                    "compile_graphs",
                    name,
                    "pass" if same else "fail",
                    f"6 calls equal bit for bit: {same}; rows recorded {ops} (a collective inside a compiled "
                    "graph is recorded only where the docs say so)",
                    "equal with / without commpatch",
                    rows=ops,
                )
            ]
        except Exception as exc:  # noqa: BLE001
            return [failed_row("compile_graphs", name, exc)]

    # ---- a real model's DDP step
    def _transformer_step(self, seed=0):
        torch = self.torch
        from torch.nn.parallel import DistributedDataParallel as DDP

        d, layers, batch, seq = (
            (64, 1, 2, 16) if self.dry else (1024, 4, 8, 512) if not self.args.quick else (512, 2, 8, 256)
        )
        torch.manual_seed(seed)
        layer = torch.nn.TransformerEncoderLayer(d, nhead=8, dim_feedforward=4 * d, batch_first=True)
        net = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        net = net.to(self.dev, dtype=torch.float32 if self.dry else torch.bfloat16)
        ddp = DDP(net, device_ids=None if self.dry else [0], bucket_cap_mb=25)
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
        g = torch.Generator(device="cpu").manual_seed(seed + 1)
        x = torch.randn(batch, seq, d, generator=g).to(self.dev, dtype=next(net.parameters()).dtype)

        def step():
            with self._math_attention():  # the default (flash) attention's backward is not deterministic
                loss = ddp(x).float().pow(2).mean()
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        step.net = net
        step.config = {"d_model": d, "layers": layers, "batch": batch, "seq": seq, "dtype": str(x.dtype)}
        return step

    def _math_attention(self):
        import contextlib

        if self.dry:
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(SDPBackend.MATH)

    def ddp_bf16(self):
        name = "DDP bf16 transformer (1 rank, NCCL): overhead and host syncs"
        torch = self.torch
        out = []
        try:
            # results: the same losses with / without commpatch
            def run():
                step = self._transformer_step()
                losses = [step() for _ in range(4)]
                self.sync()
                return torch.stack(losses), [p.detach().clone() for p in step.net.parameters()]

            commpatch.disable()
            control = run()  # the plain job twice: is it deterministic at all?
            (loss_off, p_off), (loss_on, p_on), df = both(run, self.out)
            steady = _equal(torch, control[0], loss_off) and _equal(torch, control[1], p_off)
            same = _equal(torch, loss_off, loss_on) and _equal(torch, p_off, p_on)
            buckets = int((df["op"].astype(str) == "ddp_bucket_allreduce").sum()) if "op" in df else 0
            out.append(
                row(
                    "ddp_bf16",
                    name + ": results",
                    "pass" if steady and same and buckets > 0 else "fail",
                    f"4 steps: the plain job twice equal: {steady}; with / without commpatch equal bit for bit: "
                    f"{same}; DDP bucket rows: {buckets}",
                    "plain job deterministic; equal; buckets recorded",
                )
            )
            steps = {"plain": self._transformer_step(), "commpatch": self._transformer_step()}
            n, rounds = (3, 2) if self.dry else (10, 6) if self.args.quick else (20, 10)
            times = {"plain": [], "commpatch": []}
            for r in range(rounds + 1):  # round 0 warms both up
                for kind in ("plain", "commpatch") if r % 2 else ("commpatch", "plain"):
                    if kind == "commpatch":
                        commpatch.enable(output=os.path.join(self.out, "rank{rank}.csv"))
                    else:
                        commpatch.disable()
                    self.sync()
                    t0 = time.perf_counter()
                    for _ in range(n):
                        steps[kind]()
                    self.sync()
                    if r:
                        times[kind].append((time.perf_counter() - t0) * 1e3 / n)
            commpatch.disable()
            ratios = [c / p for c, p in zip(times["commpatch"], times["plain"])]
            ratio = statistics.median(ratios)
            out.append(
                row(
                    "ddp_bf16",
                    name + ": step time",
                    "pass" if ratio <= STEP_RATIO_MAX or self.dry else "fail",
                    f"x{ratio:.4f} (plain {statistics.median(times['plain']):.3f} ms, commpatch "
                    f"{statistics.median(times['commpatch']):.3f} ms per step; round ratios "
                    f"{min(ratios):.4f}-{max(ratios):.4f}; {rounds} rounds x {n} steps)",
                    f"median paired ratio <= {STEP_RATIO_MAX}",
                    ratios=ratios,
                    times_ms=times,
                    model=steps["plain"].config,
                )
            )
            counts = {}
            for kind in ("plain", "commpatch"):
                if kind == "commpatch":
                    commpatch.enable(output=os.path.join(self.out, "rank{rank}.csv"))
                else:
                    commpatch.disable()
                for _ in range(2):
                    steps[kind]()
                self.sync()
                from torch.profiler import ProfilerActivity, profile

                acts = [ProfilerActivity.CPU] + ([] if self.dry else [ProfilerActivity.CUDA])
                with profile(activities=acts) as prof, kit.count_python_syncs(torch) as py:
                    with torch.profiler.record_function(kit.LOOP_LABEL):
                        for _ in range(5):
                            steps[kind]()
                    frozen = dict(py)
                    self.sync()
                counts[kind] = {"runtime": kit.runtime_syncs(prof), "python": frozen}
            commpatch.disable()
            launches = counts["plain"]["runtime"].pop("_launches") + counts["commpatch"]["runtime"].pop("_launches")
            equal = counts["plain"] == counts["commpatch"]
            out.append(
                row(
                    "ddp_bf16",
                    name + ": host syncs",
                    "pass" if equal and (launches or self.dry) else "fail",
                    f"5 steps, synchronize calls plain {counts['plain']} / commpatch {counts['commpatch']}; "
                    f"runtime calls seen {launches}",
                    "equal with and without commpatch; runtime calls visible",
                    counts=counts,
                )
            )
        except Exception as exc:  # noqa: BLE001
            out.append(failed_row("ddp_bf16", name, exc))
        return out

    # ---- FSDP2 and DTensor
    def fsdp2_dtensor(self):
        name = "FSDP2 fully_shard (1 rank) and DTensor on " + self.dev.type
        torch = self.torch
        try:
            from torch.distributed.device_mesh import init_device_mesh

            try:
                from torch.distributed.fsdp import fully_shard
            except ImportError:
                from torch.distributed._composable.fsdp import fully_shard
            try:
                from torch.distributed.tensor import Replicate, Shard, distribute_tensor
            except ImportError:
                from torch.distributed._tensor import Replicate, Shard, distribute_tensor
            mesh = init_device_mesh(self.dev.type, (self.dist.get_world_size(),))

            def run():
                torch.manual_seed(0)
                net = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)]).to(self.dev)
                for block in net:
                    fully_shard(block, mesh=mesh)
                fully_shard(net, mesh=mesh)
                opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
                g = torch.Generator(device="cpu").manual_seed(5)
                losses = []
                for _ in range(4):
                    x = torch.randn(16, 512, generator=g).to(self.dev)
                    loss = net(x).pow(2).mean()
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    losses.append(loss.detach())
                a = distribute_tensor(torch.randn(64, 64, generator=g).to(self.dev), mesh, [Shard(0)])
                b = distribute_tensor(torch.randn(64, 64, generator=g).to(self.dev), mesh, [Replicate()])
                c = (a.redistribute(mesh, [Replicate()]) @ b).full_tensor()
                self.sync()
                return torch.stack(losses), c

            (l_off, c_off), (l_on, c_on), df = both(run, self.out)
            same = _equal(torch, l_off, l_on) and _equal(torch, c_off, c_on)
            ops = df["op"].astype(str).value_counts().to_dict()
            # rows against what ran: the profiler's count of c10d collectives in the same job
            seen = any("all_gather" in o for o in ops) and any("reduce_scatter" in o for o in ops)
            none_ran = False
            if not seen and self.dist.get_world_size() == 1:
                seen = none_ran = _fsdp_issues_none(torch, run)  # torch skips FSDP2's collectives on 1 rank
            return [
                row(
                    "fsdp2_dtensor",
                    name,
                    "pass" if same and seen else "fail",
                    f"4 steps + DTensor matmul equal bit for bit: {same}; rows {ops}"
                    + ("; FSDP2 ran no all-gather / reduce-scatter on 1 rank (torch.profiler)" if none_ran else ""),
                    "equal; FSDP2's all-gathers and reduce-scatters recorded",
                    rows=ops,
                )
            ]
        except Exception as exc:  # noqa: BLE001
            return [failed_row("fsdp2_dtensor", name, exc)]

    # ---- host cost per call
    def call_overhead(self):
        """Host time per sync all_gather_into_tensor (8 KiB) with commpatch, without, and under
        torch.profiler (CPU + CUDA activities), in alternating rounds: what each adds per call."""
        name = "host time added per call: commpatch vs torch.profiler"
        torch, dist = self.torch, self.dist
        try:
            from torch.profiler import ProfilerActivity, profile

            n = 200 if self.dry else 2000
            inp = torch.zeros(2048 // self.dist.get_world_size(), device=self.dev)
            out = torch.empty(2048, device=self.dev)
            times = {"plain": [], "commpatch": [], "profiler": []}
            acts = [ProfilerActivity.CPU] + ([] if self.dry else [ProfilerActivity.CUDA])
            for r in range(9):
                for kind in ("plain", "commpatch", "profiler") if r % 2 else ("profiler", "commpatch", "plain"):
                    commpatch.disable()
                    if kind == "commpatch":
                        commpatch.reset()
                        commpatch.enable(output="none")
                    ctx = profile(activities=acts) if kind == "profiler" else None
                    if ctx is not None:
                        ctx.__enter__()
                    self.sync()
                    t0 = time.perf_counter()
                    for _ in range(n):
                        dist.all_gather_into_tensor(out, inp)
                    per = (time.perf_counter() - t0) * 1e6 / n
                    self.sync()
                    if ctx is not None:
                        ctx.__exit__(None, None, None)
                    if r:
                        times[kind].append(per)
            commpatch.disable()
            med = {k: statistics.median(v) for k, v in times.items()}
            ours = statistics.median([c - p for c, p in zip(times["commpatch"], times["plain"])])
            theirs = statistics.median([c - p for c, p in zip(times["profiler"], times["plain"])])
            ok = ours <= 0.5 * theirs or self.dry
            return [
                row(
                    "call_overhead",
                    name,
                    "pass" if ok else "fail",
                    f"plain {med['plain']:.2f} us per call; commpatch +{ours:.2f} us, torch.profiler +{theirs:.2f} us "
                    f"(x{ours / theirs if theirs > 0 else float('nan'):.2f}; 8 rounds x {n} calls)",
                    "commpatch adds at most half of what torch.profiler adds",
                    times_us=times,
                )
            ]
        except Exception as exc:  # noqa: BLE001
            commpatch.disable()
            return [failed_row("call_overhead", name, exc)]

    # ---- many calls
    def many_calls(self):
        total = 10_000 if self.dry else 100_000
        name = f"{total:,} timed calls: events and memory flat"
        torch, dist = self.torch, self.dist
        try:
            commpatch.reset()
            commpatch.enable(output=os.path.join(self.out, "many-rank{rank}.csv"))
            t = torch.ones(256, device=self.dev)
            out = torch.empty(256 * self.dist.get_world_size(), device=self.dev)
            marks = {}
            for i in range(1, total + 1):
                if i % 2:
                    dist.all_reduce(t)
                else:
                    dist.all_gather_into_tensor(out, t)
                if i % (total // 5) == 0:
                    self.sync()
                    gc.collect()
                    marks[i] = {
                        "rss_mb": _rss_mb(),
                        "device_mb": (torch.cuda.memory_allocated() / 2**20) if not self.dry else 0.0,
                        "events_created": commpatch.session.default().timing.created,
                    }
            df = commpatch.log()
            timed = int((df["timing"].astype(str) == ("device_event" if not self.dry else "host")).sum())
            commpatch.disable()
            first, last = marks[total // 5], marks[total]
            growth = last["rss_mb"] - first["rss_mb"]
            dgrowth = last["device_mb"] - first["device_mb"]
            events = [m["events_created"] for m in marks.values()]
            tm = commpatch.session.default().timing
            # every event created is back in the pool or a group's last end once the log was read
            accounted = sum(len(p) for p in tm.pools.values()) + 2 * tm.in_flight() + len(tm.last_end)
            # in flight: what the device lags (a resolve when the pool runs dry, at twice what the last
            # one left): a bound, not the calls made
            flat_events = events[-1] <= EVENTS_MAX and accounted == tm.created
            ok = growth <= RSS_GROWTH_MAX_MB and dgrowth <= 1.0 and flat_events and len(df) == total
            return [
                row(
                    "many_calls",
                    name,
                    "pass" if ok else "fail",
                    f"rows {len(df)}, timed {timed}; host RSS +{growth:.1f} MB and device +{dgrowth:.2f} MB from "
                    f"{total // 5:,} to {total:,} calls; events created {events}, accounted for {accounted}",
                    f"RSS growth <= {RSS_GROWTH_MAX_MB} MB, device <= 1 MB, events <= {EVENTS_MAX} and none lost, "
                    "every call a row",
                    marks=marks,
                )
            ]
        except Exception as exc:  # noqa: BLE001
            commpatch.disable()
            return [failed_row("many_calls", name, exc)]


def _fsdp_issues_none(torch, run) -> bool:
    """True when the job, run under torch.profiler with commpatch off, ran no all-gather or
    reduce-scatter at all (FSDP2 on one rank copies instead): commpatch then has nothing to record."""
    from torch.profiler import ProfilerActivity, profile

    commpatch.disable()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    names = {e.name for e in prof.events()}
    return not any(("all_gather" in n or "reduce_scatter" in n or "allgather" in n) for n in names)


# ---------------------------------------------------------------- 2 ranks through gloo with CUDA tensors
def gloo_worker(rank, world, store_dir, out_dir, delayed, enabled, result_path, dry):
    import torch
    import torch.distributed as dist

    dev = torch.device("cpu") if dry else torch.device("cuda", 0)
    dist.init_process_group("gloo", init_method=f"file://{store_dir}/store", rank=rank, world_size=world)
    if enabled:
        commpatch.enable(output="none")
    torch.manual_seed(rank)
    w = torch.randn(1024, 1024, device=dev)
    acc = torch.zeros(1024, device=dev)
    # the job's own clock (one machine: one clock) before each collective: the evidence the verdict is
    # held to, measured without commpatch
    times = []
    for _ in range(40):
        if delayed and rank == 1:
            time.sleep(DELAY_MS / 1e3)
        x = torch.tanh(w @ torch.randn(1024, device=dev, generator=None) * 0.01)
        t = {"all_reduce": time.time_ns()}
        dist.all_reduce(x)
        t["all_reduce_async"] = time.time_ns()
        work = dist.all_reduce(acc, async_op=True)
        work.wait()
        acc += x
        t["barrier"] = time.time_ns()
        dist.barrier()
        times.append(t)
        if enabled:
            commpatch.step()
    if not dry:
        torch.cuda.synchronize()
    if enabled:
        commpatch.export_csv(os.path.join(out_dir, f"rank{rank}.csv"))
        commpatch.disable()
    torch.save({"acc": acc.cpu(), "times": times}, result_path.format(rank=rank))
    dist.destroy_process_group()


def _late_truth(times, threshold_us, skip=2):
    """Which rank the other waited for, from the two workers' own clocks (``gloo_worker``), with the
    verdict's own definition and none of commpatch's data: per step, at each collective the last rank
    held it up from the other's issue to its own (no rooted collective in this job: nothing to take
    out for a later release, ``matching.releases``); its figure for the step is its longest hold-up.
    A rank is the one waited for when it held longer in at least half the steps by a median above
    the verdict's noise threshold. (rank or None, its median us, share)."""
    import statistics

    held = [[], []]
    for s in range(skip, min(len(times[0]), len(times[1]))):
        h = [0.0, 0.0]
        for op in ("all_reduce", "all_reduce_async", "barrier"):
            arrive = [times[r][s][op] for r in (0, 1)]
            last = 0 if arrive[0] > arrive[1] else 1
            h[last] = max(h[last], (arrive[last] - arrive[1 - last]) / 1e3)
        held[0].append(h[0])
        held[1].append(h[1])
    for rank in (0, 1):
        share = sum(a > b for a, b in zip(held[rank], held[1 - rank])) / len(held[rank])
        med = statistics.median(held[rank])
        if share >= 0.5 and med > threshold_us:
            return rank, med, share
    longer = 0 if statistics.median(held[0]) >= statistics.median(held[1]) else 1
    return (
        None,
        statistics.median(held[longer]),
        sum(a > b for a, b in zip(held[longer], held[1 - longer])) / len(held[longer]),
    )


def gloo_cuda(args, torch):
    name = f"gloo with CUDA tensors, 2 ranks on one GPU, rank 1 {DELAY_MS:.0f} ms late per step"
    import torch.multiprocessing as mp

    out = []
    try:
        runs = {}
        for label, delayed, enabled in (("delayed", True, True), ("symmetric", False, True), ("off", True, False)):
            tmp = tempfile.mkdtemp(prefix=f"commpatch-gloo-{label}-")
            logs = os.path.join(tmp, "logs")
            os.makedirs(logs)
            result = os.path.join(tmp, "acc{rank}.pt")
            mp.start_processes(
                gloo_worker,
                args=(2, tmp, logs, delayed, enabled, result, args.dry_run_cpu),
                nprocs=2,
                join=True,
                start_method="spawn",
            )
            runs[label] = (logs, [torch.load(result.format(rank=r)) for r in range(2)])
            runs[label] = (logs, [r["acc"] for r in runs[label][1]], [r["times"] for r in runs[label][1]])
            if getattr(args, "logs", None):
                shutil.copytree(logs, os.path.join(args.logs, f"gloo-{label}"), dirs_exist_ok=True)
        same = all(torch.equal(a, b) for a, b in zip(runs["delayed"][1], runs["off"][1]))
        verdicts, timings, truths = {}, {}, {}
        for label in ("delayed", "symmetric"):
            df = commpatch.read_csv(runs[label][0])
            timings[label] = df["timing"].astype(str).value_counts().to_dict()
            with commpatch.open(runs[label][0]) as run:
                rep = run.to_dict()
            verdicts[label] = v = rep["headline"].get("straggler") or {}
            truths[label] = _late_truth(runs[label][2], v.get("threshold_us") or 0.0)
        v, s = verdicts["delayed"], verdicts["symmetric"]
        named = v.get("verdict") == "straggler" and v.get("rank") == 1
        said = s.get("rank") if s.get("verdict") == "straggler" else None
        # the symmetric job shares one GPU between its ranks, which need not wait for each other
        # equally: its verdict must agree with which rank the other really waited for (the workers'
        # own clocks), not with an assumption that nobody did
        agrees = said == truths["symmetric"][0] and truths["delayed"][0] == 1
        device_timed = "device_event" in timings["delayed"] or args.dry_run_cpu
        ok = same and named and agrees and device_timed
        t = truths["symmetric"]
        out.append(
            row(
                "gloo_cuda",
                name,
                "pass" if ok else "fail",
                f"results equal with / without commpatch: {same}; timings {timings['delayed']}; delayed job: "
                f"{_said(v)}; symmetric job: {_said(s)}; its ranks' own clocks: "
                + (f"rank {t[0]} held the other up" if t[0] is not None else "neither rank held the other up")
                + f" (the longer: a median {t[1]:.1f} us per step, longer in {t[2]:.0%} of the steps)",
                "equal; device-event rows; rank 1 named; the symmetric job's verdict agrees with the ranks' own clocks",
                verdicts=verdicts,
                timings=timings,
                truth={k: list(x) for k, x in truths.items()},
            )
        )
    except Exception as exc:  # noqa: BLE001
        out.append(failed_row("gloo_cuda", name, exc))
    return out


def _said(v) -> str:
    if not v:
        return "no verdict"
    if v.get("verdict") == "straggler":
        return f"straggler rank {v.get('rank')} (held the others {v.get('late_median_us', 0) / 1e3:.1f} ms per step)"
    return f"no straggler (reason: {v.get('reason')}; p {v.get('p_value', 1):.2g})"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--dry-run-cpu", action="store_true")
    p.add_argument("--only", default="", help="comma-separated check names")
    p.add_argument("--logs", metavar="DIR", help="copy the gloo jobs' commpatch logs here (one folder per job)")
    args = p.parse_args(argv)
    import torch
    import torch.distributed as dist

    if not args.dry_run_cpu and not torch.cuda.is_available():
        print("extras.py: CUDA is not available; NOTHING VALIDATED (try --dry-run-cpu)")
        return 0
    only = set(filter(None, args.only.split(",")))
    store = tempfile.mkdtemp(prefix="commpatch-extras-")
    out_dir = os.path.join(store, "logs")
    os.makedirs(out_dir)
    rows = []
    if not only or "gloo_cuda" in only:
        rows += gloo_cuda(args, torch)  # first: its processes must not inherit an initialized CUDA context
    if args.dry_run_cpu:
        dist.init_process_group("gloo", init_method=f"file://{store}/store", rank=0, world_size=1)
    else:
        torch.cuda.set_device(0)
        kit.init_group(torch, dist, "nccl", store, device=torch.device("cuda", 0))
    checks = Checks(args, torch, dist, out_dir)
    checks_run = ("graph_capture", "capture_race", "compile_graphs", "ddp_bf16", "fsdp2_dtensor", "call_overhead")
    for check in (*checks_run, "many_calls"):
        if only and check not in only:
            continue
        t0 = time.perf_counter()
        try:
            got = getattr(checks, check)()
        except Exception as exc:  # noqa: BLE001
            got = [failed_row(check, check, exc)]
        for r in got:
            r["data"]["seconds"] = round(time.perf_counter() - t0, 2)
        rows += got
        print(render_table(got), flush=True)
    dist.destroy_process_group()
    status, closing = verdict(rows)
    env = kit.environment(torch, 1)
    print(render_table(rows))
    if args.dry_run_cpu:
        raised = [r for r in rows if r["data"].get("raised")]
        status = 1 if raised else 0
        closing = f"DRY RUN: {len(raised)} checks raised; NOTHING VALIDATED."
    if args.json:
        with open(args.json, "w") as f:
            data = {"environment": env, "checks": rows, "exit_status": status, "summary": closing}
            json.dump(clean(data), f, indent=1, default=str, allow_nan=False)
    print(closing)
    return status


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        sys.exit(1)
