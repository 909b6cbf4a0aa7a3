"""Side by side with the tools users would pick instead, in one run.

Per tool, against no instrumentation measured in the same run (alternating rounds, median of
paired differences):
  1. added host time per 1-element all_reduce on the fake backend (world 8);
  2. time from run to a per-call table: record N calls, then build a per-call table
     (a DataFrame, or the closest thing the tool offers);
  3. (--ddp) step-time overhead of the demo model trained with DDP on 2 gloo processes.

Tools: commpatch; torch.profiler (CPU activities, record_shapes=True); CommDebugMode; the
common hand-written recipe (time each call and synchronize after it; on CPU the synchronize
is `work.wait()` for async calls and a no-op otherwise); DeepSpeed's comms logger when
deepspeed imports (its calls go through `deepspeed.comm`, so it sees only those).

Usage: python benchmarks/compare.py [--rounds 9] [--calls 10000] [--ddp]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist

import commpatch

HERE = os.path.dirname(os.path.abspath(__file__))


# ---- the tools, each as (enter recording, call, build per-call table) --------------------
class Tool:
    name = ""
    sizes = True  # records message sizes per call
    scale = 1  # run 1/scale of the calls (tools costing milliseconds per call)

    def start(self):
        pass

    def stop(self):
        pass

    def call(self, t):
        dist.all_reduce(t)

    def table(self):
        return None


class NoTool(Tool):
    name = "none"
    sizes = None


class Commpatch(Tool):
    name = "commpatch"

    def start(self):
        commpatch.enable(output="none")

    def stop(self):
        commpatch.disable()

    def table(self):
        df = commpatch.log()
        commpatch.reset()
        return df


class Profiler(Tool):
    name = "torch.profiler (record_shapes)"

    def start(self):
        from torch.profiler import ProfilerActivity, profile

        self.prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
        self.prof.__enter__()

    def stop(self):
        self.prof.__exit__(None, None, None)

    def table(self):
        import pandas as pd

        rows = [
            (e.name, e.input_shapes, e.time_range.start, e.time_range.elapsed_us())
            for e in self.prof.events()
            if "all_reduce" in e.name or "allreduce" in e.name
        ]
        return pd.DataFrame(rows, columns=["name", "shapes", "start_us", "duration_us"])


class CommDebug(Tool):
    name = "CommDebugMode"
    sizes = False

    def start(self):
        from torch.distributed.tensor.debug import CommDebugMode

        self.mode = CommDebugMode()
        self.mode.__enter__()

    def stop(self):
        self.mode.__exit__(None, None, None)

    def table(self):
        import pandas as pd

        counts = self.mode.get_comm_counts()  # counts only: no per-call rows, no time, no bytes
        return pd.DataFrame([(str(k), v) for k, v in counts.items()], columns=["op", "count"])


class SyncWrapper(Tool):
    """The recipe found in blog posts: wrap dist.all_reduce, time it, synchronize after each call."""

    name = "sync-after-each-call wrapper"

    def start(self):
        self.records = []
        self.orig = dist.all_reduce
        records, orig = self.records, self.orig

        def all_reduce(tensor, *args, **kwargs):
            t0 = time.perf_counter()
            work = orig(tensor, *args, **kwargs)
            if work is not None:
                work.wait()
            if tensor.is_cuda:
                torch.cuda.synchronize()
            records.append(
                {
                    "op": "all_reduce",
                    "numel": tensor.numel(),
                    "dtype": str(tensor.dtype),
                    "bytes": tensor.numel() * tensor.element_size(),
                    "start": t0,
                    "duration_s": time.perf_counter() - t0,
                }
            )
            return work

        dist.all_reduce = all_reduce

    def stop(self):
        dist.all_reduce = self.orig

    def table(self):
        import pandas as pd

        df = pd.DataFrame(self.records)
        self.records.clear()
        return df


class DeepSpeed(Tool):
    name = "DeepSpeed comms logger"
    scale = 50

    @staticmethod
    def available() -> bool:
        try:
            import deepspeed.comm  # noqa: F401
        except Exception:  # noqa: BLE001 - not installed / does not import here
            return False
        return True

    def start(self):
        import deepspeed.comm as dscomm

        self.dscomm = dscomm
        if not getattr(dscomm, "cdb", None):
            dscomm.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)
        dscomm.configure(enabled=True, prof_all=True, verbose=False)

    def stop(self):
        self.dscomm.configure(enabled=False)

    def call(self, t):
        self.dscomm.all_reduce(t)

    def table(self):
        import pandas as pd

        logger = self.dscomm.comms_logger
        rows = [
            (op, size, lat)
            for op, by_size in logger.comms_dict.items()
            for size, vals in by_size.items()
            for lat in vals[1]
        ]
        logger.comms_dict.clear()
        return pd.DataFrame(rows, columns=["op", "msg_size", "latency_ms"])


def per_call(tools, rounds: int, calls: int) -> dict:
    t = torch.ones(1)

    def timed(tool) -> float:
        n = max(calls // tool.scale, 100)
        tool.start()
        start = time.thread_time_ns()
        for _ in range(n):
            tool.call(t)
        elapsed = (time.thread_time_ns() - start) / n
        tool.stop()
        tool.table()
        return elapsed

    for tool in tools:
        timed(tool)  # warm-up
    samples = {tool.name: [] for tool in tools}
    for _ in range(rounds):
        base = timed(tools[0])
        samples[tools[0].name].append(0.0)
        for tool in tools[1:]:
            samples[tool.name].append(timed(tool) - base)
    return {name: statistics.median(v) / 1e3 for name, v in samples.items()}


def to_table(tools, calls: int) -> dict:
    """Seconds from the first call to a per-call table (record N calls + build it), per 100k calls."""
    t = torch.ones(1)
    out = {}
    for tool in tools:
        n = max(calls // tool.scale, 100)
        tool.start()
        start = time.perf_counter()
        for _ in range(n):
            tool.call(t)
        tool.stop()
        table = tool.table()
        rows = 0 if table is None else len(table)
        out[tool.name] = ((time.perf_counter() - start) * 100_000 / n, rows * calls // n)
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=10000)
    parser.add_argument("--table-calls", type=int, default=100000)
    parser.add_argument("--ddp", action="store_true", help="also the DDP step-time comparison (2 gloo processes)")
    args = parser.parse_args()
    print(
        f"# {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d')}"
    )
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    tools = [NoTool(), Commpatch(), Profiler(), CommDebug(), SyncWrapper()]
    if DeepSpeed.available():
        tools.append(DeepSpeed())
    else:
        print("# deepspeed does not import here: its comms logger is not in the table")
    added = per_call(tools, args.rounds, args.calls)
    tables = to_table(tools, args.table_calls)
    print(
        f"\n| tool | records sizes | added per all_reduce (us, fake backend) | record + build a per-call table, per 100k calls (s) | table rows per {args.table_calls:,} calls |"
    )
    print("|---|---|---:|---:|---:|")
    for tool in tools:
        seconds, rows = tables[tool.name]
        sizes = "-" if tool.sizes is None else "yes" if tool.sizes else "no"
        print(f"| {tool.name} | {sizes} | {added[tool.name]:.2f} | {seconds:.2f} | {rows:,} |")
    dist.destroy_process_group()
    if args.ddp:
        import subprocess

        subprocess.run([sys.executable, os.path.join(HERE, "ddp_step.py"), "--compare"], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
