"""Where commpatch's host time per GPU collective goes: the raw CUDA / torch calls its device timing
makes, each timed alone (elapsed_time and query also on events that just completed), then sync
all_gather_into_tensor (8 KiB, 1 rank, NCCL) per call plain, with commpatch timing=host and timing=auto,
and under torch.profiler, in alternating rounds; a cProfile of the commpatch calls, and the same with the device
kept 100 ms behind the host (measurements pile up unresolved).

    python benchmarks/gpu/percall.py [--json PATH]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import commpatch  # noqa: E402


def per_call(fn, n=5000, rounds=5):
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t0) * 1e6 / n)
    return statistics.median(out)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    args = p.parse_args()
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl", init_method=f"file://{tempfile.mkdtemp()}/s", rank=0, world_size=1, device_id=torch.device("cuda", 0)
    )
    res = {}
    dev = torch.device("cuda", 0)
    ev0, ev1 = torch.Event(device=dev, enable_timing=True), torch.Event(device=dev, enable_timing=True)
    ev0.record()
    ev1.record()
    torch.cuda.synchronize()
    stream = torch.accelerator.current_stream(dev)
    raw = {
        "torch.Event.record()": ev0.record,
        "torch.Event.record(stream)": lambda: ev0.record(stream),
        "torch.accelerator.current_stream(dev)": lambda: torch.accelerator.current_stream(dev),
        "torch.cuda.current_stream()": torch.cuda.current_stream,
        "torch._C._cuda_isCurrentStreamCapturing()": torch._C._cuda_isCurrentStreamCapturing,
        "torch._C._cuda_getDevice()": torch._C._cuda_getDevice,
        "torch.Event.query()": ev1.query,
        "torch.Event.elapsed_time()": lambda: ev0.elapsed_time(ev1),
        "torch.Event(device, enable_timing=True)": lambda: torch.Event(device=dev, enable_timing=True),
    }
    res["raw_us"] = {}
    for name, fn in raw.items():
        if name == "torch.Event.elapsed_time()":
            ev0.record()
            ev1.record()
            torch.cuda.synchronize()
        res["raw_us"][name] = per_call(fn, n=2000)
        print(f"{name:45s} {res['raw_us'][name]:8.2f} us", flush=True)
    inp, out = torch.zeros(2048, device=dev), torch.empty(2048, device=dev)

    def call():
        dist.all_gather_into_tensor(out, inp)

    # fresh events: what the resolver pays per call (the timestamps read once)
    fresh = [torch.Event(device=dev, enable_timing=True) for _ in range(4000)]
    for e in fresh:
        e.record()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for e in fresh[:2000]:
        e.query()
    res["raw_us"]["torch.Event.query() fresh"] = (time.perf_counter() - t0) * 1e6 / 2000
    t0 = time.perf_counter()
    for a, b in zip(fresh[2000::2], fresh[2001::2]):
        a.elapsed_time(b)
    res["raw_us"]["torch.Event.elapsed_time() fresh"] = (time.perf_counter() - t0) * 1e6 / 1000
    print({k: round(v, 2) for k, v in res["raw_us"].items() if "fresh" in k}, flush=True)
    from torch.profiler import ProfilerActivity, profile

    configs = {
        "plain": None,
        "timing=host": {"timing": "host"},
        "timing=auto": {},
        "torch.profiler": "profiler",
    }
    calls = {k: [] for k in configs}
    for r in range(9):
        for k, cfg in configs.items() if r % 2 else list(configs.items())[::-1]:
            commpatch.disable()
            if isinstance(cfg, dict):
                commpatch.reset()
                commpatch.enable(output="none", **cfg)
            torch.cuda.synchronize()
            if cfg == "profiler":
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
                    v = per_call(call, n=2000, rounds=1)
            else:
                v = per_call(call, n=2000, rounds=1)
            torch.cuda.synchronize()
            if r:
                calls[k].append(v)
    commpatch.disable()
    res["call_us"] = {k: statistics.median(v) for k, v in calls.items()}
    res["added_us"] = {k: v - res["call_us"]["plain"] for k, v in res["call_us"].items() if k != "plain"}
    res["ratio_to_profiler"] = {
        k: v / res["added_us"]["torch.profiler"] for k, v in res["added_us"].items() if k != "torch.profiler"
    }

    print("per sync all_gather (8 KiB):", {k: round(v, 2) for k, v in res["call_us"].items()}, flush=True)
    # the device 50 ms behind: 3000 async calls queued behind a sleep, host time per call
    behind = {}
    for k, cfg in (("plain", None), ("timing=auto", {})):
        commpatch.disable()
        if cfg is not None:
            commpatch.reset()
            commpatch.enable(output="none", **cfg)
        torch.cuda.synchronize()
        torch.cuda._sleep(100_000_000)  # far longer than the calls take to issue
        t0 = time.perf_counter()
        for _ in range(3000):
            dist.all_gather_into_tensor(out, inp, async_op=True)
        behind[k] = (time.perf_counter() - t0) * 1e6 / 3000
        torch.cuda.synchronize()
    commpatch.disable()
    res["behind_call_us"] = behind
    print("device behind, per async call:", {k: round(v, 2) for k, v in behind.items()}, flush=True)
    commpatch.reset()
    commpatch.enable(output="none")
    for _ in range(200):
        call()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(3000):
        call()
    pr.disable()
    commpatch.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
    res["profile"] = s.getvalue()
    print(res["profile"][:3500])
    dist.destroy_process_group()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
