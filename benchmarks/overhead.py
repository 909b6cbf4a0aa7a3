"""Added host time per collective call: commpatch vs unpatched vs torch.profiler, one run.

1-element all_reduce on the `fake` backend (FakeStore, world 8) isolates instrumentation cost
from transport; then the same on a real 1-rank gloo group. Rounds alternate (unpatched,
commpatch, commpatch's pure-Python fallback when the C recorder is built, profiler with
record_shapes=True, ...); the figure is the median over rounds of the paired per-call difference
against the unpatched round beside it. Issue 11's target: commpatch's added time at most 1.1x
the profiler's in the same run (printed).

``--instructions``: instead, the instructions each call runs on the calling thread, counted by
valgrind's callgrind (fake backend; unpatched, commpatch, its pure-Python fallback, the profiler;
one process, each counted over the same calls after a warm-up): a count that the machine's load
and its timer do not move, where the timed figure scatters by a factor of two between runs on a
shared 2-core machine. Needs valgrind, its ``valgrind/callgrind.h`` and a C compiler; ~2 minutes.
Usage: python benchmarks/overhead.py [--rounds 15] [--calls 20000] [--instructions]
"""

import argparse
import ctypes
import glob
import os
import platform
import re
import shutil
import statistics
import subprocess
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


# Zero callgrind's counters, and write them out under a name: its client requests, from C.
_MARKS_C = """#include <valgrind/callgrind.h>
void cp_zero(void) { CALLGRIND_ZERO_STATS; }
void cp_dump(const char *name) { CALLGRIND_DUMP_STATS_AT(name); }
"""
MODES = ("unpatched", "commpatch", "pure Python", "torch.profiler")


def counted_child(marks: str, calls: int) -> None:
    """Inside callgrind: each mode's calls between a zero and a dump named after the mode."""
    from torch.profiler import ProfilerActivity, profile
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from commpatch.record import rows

    lib = ctypes.CDLL(marks)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    c_rows = rows.C_ROWS
    for mode in MODES:
        if mode == "pure Python" and not c_rows:
            continue
        prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True) if mode == "torch.profiler" else None
        if mode in ("commpatch", "pure Python"):
            rows.C_ROWS = c_rows and mode == "commpatch"
            commpatch.enable(output="none")
        if prof is not None:
            prof.start()
        timed(call, max(calls // 10, 100))  # warm-up: first-call work (registries, caches) left out
        lib.cp_zero()
        timed(call, calls)
        lib.cp_dump(mode.encode())
        if prof is not None:
            prof.stop()
        commpatch.disable()
        commpatch.reset()
        rows.C_ROWS = c_rows


def instructions(calls: int) -> int:
    """Instructions per call on the calling thread, each mode against the unpatched calls."""
    header = "/usr/include/valgrind/callgrind.h"
    cc = shutil.which("cc") or shutil.which("gcc")
    if not (shutil.which("valgrind") and os.path.exists(header) and cc):
        print(f"--instructions needs valgrind, {header} and a C compiler (apt-get install valgrind gcc)")
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        src, lib = os.path.join(tmp, "marks.c"), os.path.join(tmp, "marks.so")
        with open(src, "w") as f:
            f.write(_MARKS_C)
        subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", lib, src], check=True)
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
        cmd = ["valgrind", "--tool=callgrind", "--separate-threads=yes", f"--callgrind-out-file={tmp}/cg"]
        cmd += [sys.executable, os.path.abspath(__file__), "--counted-child", lib, "--calls", str(calls)]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode:
            print(f"callgrind run failed ({done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
            return 1
        per_call = {}
        for path in glob.glob(f"{tmp}/cg.*-01"):  # thread 1: the calling thread
            with open(path) as f:
                text = f.read()
            mode = re.search(r"^desc: Trigger: Client Request: (.*)$", text, re.M)
            if mode and mode.group(1) in MODES:
                per_call[mode.group(1)] = int(re.search(r"^summary: (\d+)", text, re.M).group(1)) / calls
    base = per_call["unpatched"]
    added = {m: per_call[m] - base for m in MODES[1:] if m in per_call}
    print(f"instructions per call on the calling thread (callgrind, fake backend, world 8, {calls} calls each):")
    print(f"  unpatched {base:,.0f}")
    for mode, n in added.items():
        print(f"  {mode:15s} +{n:,.0f}")
    print(f"  commpatch's added instructions / the profiler's: {added['commpatch'] / added['torch.profiler']:.2f}")
    return 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--instructions", action="store_true", help="count instructions with callgrind instead")
    parser.add_argument("--counted-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.counted_child:
        return counted_child(args.counted_child, args.calls)
    if args.instructions:
        return instructions(args.calls)
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
