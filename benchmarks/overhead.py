"""Added host time per collective call: commpatch vs unpatched vs torch.profiler, one run.

1-element all_reduce on the `fake` backend (FakeStore, world 8) isolates instrumentation cost
from transport; then the same on a real 1-rank gloo group. Rounds alternate (unpatched,
commpatch, commpatch's pure-Python fallback when the C recorder is built, profiler with
record_shapes=True, ...); the figure is the median over rounds of the paired per-call difference
against the unpatched round beside it. Issue 11's target: commpatch's added time at most 1.1x
the profiler's in the same run (printed).
Usage: python benchmarks/overhead.py [--rounds 15] [--calls 20000]
"""

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

import commpatch

CLOCK = {"clock": time.thread_time_ns}


def timed(fn, calls: int) -> float:
    """ns per call. Fake backend: CPU time of this thread (robust to other load on the machine);
    gloo: wall time (the collective runs on gloo's threads while this one waits)."""
    clock = CLOCK["clock"]
    t = torch.ones(1)
    start = clock()
    for _ in range(calls):
        fn(t)
    return (clock() - start) / calls


def call(t):
    dist.all_reduce(t)


def patched_round(calls: int, c_rows: bool) -> float:
    from commpatch.record import rows

    saved, rows.C_ROWS = rows.C_ROWS, c_rows and rows.C_ROWS
    try:
        commpatch.enable(output="none")
        return timed(call, calls)
    finally:
        commpatch.disable()
        commpatch.reset()
        rows.C_ROWS = saved


def run(label: str, rounds: int, calls: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from commpatch.record import rows

    for _ in range(3):  # warm up every path once
        timed(call, calls // 10)
    base, patched, pure, prof = [], [], [], []
    for _ in range(rounds):
        base.append(timed(call, calls))
        patched.append(patched_round(calls, True))
        if rows.C_ROWS:  # the pure-Python fallback, for comparison
            pure.append(patched_round(calls, False))
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True):
            prof.append(timed(call, calls))
    d_cp = [p - b for p, b in zip(patched, base)]
    d_pr = [p - b for p, b in zip(prof, base)]
    out = {
        "hot_path": "C recorder" if rows.C_ROWS else "pure Python",
        "pure_python_added_us": statistics.median(p - b for p, b in zip(pure, base)) / 1e3 if pure else None,
        "added_ratio_to_profiler": statistics.median(d_cp) / statistics.median(d_pr)
        if statistics.median(d_pr) > 0
        else float("inf"),
        "label": label,
        "unpatched_us": statistics.median(base) / 1e3,
        "commpatch_added_us": statistics.median(d_cp) / 1e3,
        "commpatch_ratio": statistics.median(p / b for p, b in zip(patched, base)),
        "profiler_added_us": statistics.median(d_pr) / 1e3,
        "profiler_ratio": statistics.median(p / b for p, b in zip(prof, base)),
    }
    print(
        f"{label:28s} unpatched {out['unpatched_us']:7.2f} us/call | commpatch +{out['commpatch_added_us']:.2f} us "
        f"(x{out['commpatch_ratio']:.3f}) | torch.profiler(record_shapes) +{out['profiler_added_us']:.2f} us "
        f"(x{out['profiler_ratio']:.3f})",
        flush=True,
    )
    pure_text = f"; pure-Python fallback +{out['pure_python_added_us']:.2f} us" if pure else ""
    print(
        f"{'':28s} hot path: {out['hot_path']}{pure_text}; commpatch's added time / the profiler's: "
        f"{out['added_ratio_to_profiler']:.2f} (target <= 1.1)",
        flush=True,
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args()
    print(
        f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}; median of {args.rounds} paired rounds x {args.calls} calls"
    )
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    run("fake backend, world 8", args.rounds, args.calls)
    dist.destroy_process_group()
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        CLOCK["clock"] = time.perf_counter_ns
        run("gloo, world 1 (wall time)", args.rounds, args.calls // 4)
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
