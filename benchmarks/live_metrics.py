"""What the live Prometheus metrics cost the training thread: a 1-element all_reduce on the `fake`
backend (world 8), wall time per call, with commpatch writing its log (the flusher running)
without and with COMMPATCH_METRICS_FILE (the metrics are computed by the flusher thread: their cost
reaches the training thread only through the GIL); alternating rounds, a step every 100 calls.
Also the flusher's time in the metrics per row recorded.
Usage: python benchmarks/live_metrics.py [--rounds 9] [--calls 40000]
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _util import fake_world  # noqa: E402

import commpatch  # noqa: E402
from commpatch import session  # noqa: E402


def one_round(tmp: str, n: int, calls: int, metrics: bool) -> tuple[float, float]:
    """(wall ns per call, flusher ns in the metrics per row) of one round."""
    s = session.new_default()
    extra = {"metrics_file": os.path.join(tmp, f"m{n}_rank{{rank}}.prom")} if metrics else {}
    s.enable(output=os.path.join(tmp, f"r{n}", "rank{rank}.csv"), **extra)
    spent = [0]
    if s.metrics is not None:
        update = s.metrics.update

        def timed_update(final=False):
            t0 = time.perf_counter_ns()
            update(final)
            spent[0] += time.perf_counter_ns() - t0

        s.metrics.update = timed_update
    t = torch.ones(1)
    start = time.perf_counter_ns()
    for i in range(calls):
        if i % 100 == 0:
            commpatch.step()
        dist.all_reduce(t)
    wall = (time.perf_counter_ns() - start) / calls
    time.sleep(0.5)  # the flusher's last passes
    s.close()
    return wall, spent[0] / calls


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=40000)
    args = parser.parse_args()
    fake_world()
    base, with_metrics, per_row = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        one_round(tmp, 0, args.calls // 10, True)  # warm up
        for r in range(args.rounds):
            base.append(one_round(tmp, 2 * r + 1, args.calls, False)[0])
            wall, spent = one_round(tmp, 2 * r + 2, args.calls, True)
            with_metrics.append(wall)
            per_row.append(spent)
    dist.destroy_process_group()
    d = [m - b for m, b in zip(with_metrics, base)]
    print(
        f"fake backend, world 8: log only {statistics.median(base) / 1e3:.2f} us/call | with metrics "
        f"{statistics.median(with_metrics) / 1e3:.2f} us/call (paired difference {statistics.median(d) / 1e3:+.2f} us, "
        f"x{statistics.median(m / b for m, b in zip(with_metrics, base)):.3f}) | flusher time in the metrics "
        f"{statistics.median(per_row):.0f} ns per row; median of {args.rounds} paired rounds x {args.calls} calls"
    )


if __name__ == "__main__":
    sys.exit(main())
