"""Bounded memory over a long run: 10 million collectives with COMMPATCH_MAX_ROWS set.

Prints resident memory after 1M and 10M calls (and the unbounded log's growth for contrast),
and checks that every row reached the per-rank file.
Usage: python benchmarks/long_run.py [--calls 10000000] [--max-rows 100000]
"""

import argparse
import os
import resource
import sys
import tempfile
import time

import torch
import torch.distributed as dist

import commpatch
from _util import fake_world, rss_mb
from commpatch import session as _session


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=10_000_000)
    parser.add_argument("--max-rows", type=int, default=100_000)
    args = parser.parse_args()
    fake_world(8)
    out = tempfile.mkdtemp()
    commpatch.enable(output=os.path.join(out, "rank{rank}.csv"), max_rows=args.max_rows)
    t = torch.ones(1)
    for _ in range(20_000):          # warm up: pandas/pyarrow imported by the first flushes
        dist.all_reduce(t)
    base = rss_mb()
    start = time.perf_counter()
    marks = {1_000_000, args.calls}
    for i in range(1, args.calls + 1):
        dist.all_reduce(t)
        if i in marks:
            print(f"{i:>11,} calls: RSS {rss_mb():7.1f} MB (+{rss_mb() - base:6.1f} MB since warm-up), "
                  f"rows in memory {len(_session.default().log):,}, on disk {_session.default().log.flushed:,}, "
                  f"{time.perf_counter() - start:.0f} s", flush=True)
    df = commpatch.log()
    total = args.calls + 20_000
    print(f"log() rows {len(df):,} of {total:,}; seq contiguous: {bool((df['seq'].diff().dropna() == 1).all())}; "
          f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3:.0f} MB; "
          f"file {os.path.getsize(_session.default().log.stream_path) / 1e9:.2f} GB")
    commpatch.disable()
    dist.destroy_process_group()
    return 0 if len(df) == total else 1


if __name__ == "__main__":
    sys.exit(main())
