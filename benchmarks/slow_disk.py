"""Step time of a training loop whose rank log sits on a slow disk (issue 24, item 5).

A disk where every write() to a `.cplog` blocks 2 s (an LD_PRELOAD shim, tests/faults/slowwrite.c,
built here with gcc: a hung NFS mount) against a normal disk, in the same run, rounds alternating:
the job is a loop of steps (a small matmul, then 20 all_reduce on the `fake` backend, world 8), long
enough for several of the recording thread's 16,384-call maintenance passes. Printed per disk: the
median, mean and worst step, and the loop's total; the target is the slow disk's within 5% of the
normal one's (the training thread never waits for the disk), past the bound rows being dropped
and counted (printed too).
On a machine shared with other work the loop's total moves with the scheduler: the count of
steps that took at least half a write's delay is the robust sign of a wait. ``--before DIR`` adds
the slow disk under another checkout of commpatch (the previous commit), in the same rounds.
Usage: python benchmarks/slow_disk.py [--steps 3000] [--rounds 3] [--delay-ms 2000] [--before DIR]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SHIM = os.path.join(ROOT, "tests", "faults", "slowwrite.c")
CALLS_PER_STEP = 20


def child(steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, HERE)
    from _util import fake_world

    import commpatch

    fake_world(8)
    commpatch.enable(output=os.path.join(out, "rank{rank}.csv"))
    a = torch.randn(96, 96)
    t = torch.ones(256)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        (a @ a).sum()
        for _ in range(CALLS_PER_STEP):
            dist.all_reduce(t)
        times.append(time.perf_counter() - start)
    dropped = commpatch.internal_errors().get("export.dropped", 0)
    print(json.dumps({"times": times, "dropped": dropped}), flush=True)
    os._exit(0)  # the exit's own flush (seconds on the slow disk) is not part of the loop


def run(steps: int, out: str, shim: str | None, delay_ms: int, root: str = ROOT) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMMPATCH")}
    env["PYTHONPATH"] = root
    if shim:
        env.update(LD_PRELOAD=shim, SHIM_DELAY_MS=str(delay_ms))
    res = subprocess.run(
        [sys.executable, __file__, "--child", out, "--steps", str(steps)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    if res.returncode:
        raise SystemExit(res.stderr[-3000:])
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--delay-ms", type=int, default=2000)
    p.add_argument("--before", help="another commpatch checkout, run on the slow disk too")
    p.add_argument("--child")
    a = p.parse_args()
    if a.child:
        return child(a.steps, a.child)
    slow = f"{a.delay_ms / 1000:g} s per write"
    ways = {"normal disk": (None, ROOT), slow: (True, ROOT)}
    if a.before:
        ways[f"{slow}, --before"] = (True, os.path.abspath(a.before))
    with tempfile.TemporaryDirectory() as tmp:
        shim = os.path.join(tmp, "slowwrite.so")
        subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", shim, SHIM, "-ldl"], check=True)
        results = {name: [] for name in ways}
        for r in range(a.rounds):
            for i, (name, (slowed, root)) in enumerate(ways.items()):
                out = os.path.join(tmp, f"{r}-{i}")
                results[name].append(run(a.steps, out, shim if slowed else None, a.delay_ms, root))
    print(
        f"# {a.steps} steps x {CALLS_PER_STEP} all_reduce (fake backend, world 8), {a.rounds} alternating rounds; "
        f"median over rounds"
    )
    half = a.delay_ms / 2e3
    totals = {}
    for name, runs in results.items():
        med = statistics.median(statistics.median(x["times"]) for x in runs) * 1e3
        worst = statistics.median(max(x["times"]) for x in runs)
        waits = statistics.median(sum(t >= half for t in x["times"]) for x in runs)
        totals[name] = statistics.median(sum(x["times"]) for x in runs)
        dropped = statistics.median(x["dropped"] for x in runs)
        print(
            f"{name:<26} step median {med:6.3f} ms  worst {worst:6.2f} s  steps >= {half:g} s: {waits:3.0f}  "
            f"loop {totals[name]:6.2f} s  rows dropped {dropped:.0f}"
        )
    names = list(totals)
    for name in names[1:]:
        print(f"{name} / normal disk, loop time: {totals[name] / totals[names[0]]:.3f} (target <= 1.05)")


if __name__ == "__main__":
    main()
