"""The durable rank log: memory over a long run with default settings, and conversion speed.

Usage: python benchmarks/durable.py [--calls 10000000] [--convert-rows 1000000]
Prints
- RSS after 1M calls and after --calls calls with the default output (a binary log file written
  from the first row): the target is flat (within 10%);
- bytes of the binary log per row;
- seconds to convert a 1M-row rank log to CSV (target <= 1.5 s) and to Parquet (<= 0.5 s), each
  in a fresh process as `commpatch convert` runs it, and to read it back as a DataFrame.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from _util import fake_world, rss_mb

import commpatch
from commpatch import session as _session


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=10_000_000)
    parser.add_argument("--convert-rows", type=int, default=1_000_000)
    args = parser.parse_args()
    out = tempfile.mkdtemp()
    fake_world(8)
    commpatch.enable(output=os.path.join(out, "rank{rank}.csv"))
    t = torch.ones(1)
    marks = sorted({min(args.convert_rows, args.calls), args.calls})
    done, rss, start = 0, {}, time.perf_counter()
    for mark in marks:
        for i in range(mark - done):
            dist.all_reduce(t, async_op=(i % 10 == 0))
        done = mark
        _session.default().log.flush()
        rss[mark] = rss_mb()
        print(
            f"{mark:>11,} calls: RSS {rss[mark]:.0f} MB, in memory {len(_session.default().log.buf)} B unflushed "
            f"({time.perf_counter() - start:.0f} s)",
            flush=True,
        )
    first, last = rss[marks[0]], rss[marks[-1]]
    print(
        f"RSS growth from {marks[0]:,} to {marks[-1]:,} calls: {100 * (last - first) / first:+.1f}% (target within 10%)"
    )
    path = _session.default().log.sink.path
    print(f"binary log: {os.path.getsize(path) / done:.1f} bytes/row")
    commpatch.disable()
    dist.destroy_process_group()

    # a rank log of exactly --convert-rows rows, converted as `commpatch convert` does
    fake_world(8)
    small = tempfile.mkdtemp()
    commpatch.enable(output=os.path.join(small, "rank{rank}.csv"))
    for i in range(args.convert_rows):
        dist.all_reduce(t, async_op=(i % 10 == 0))
    commpatch.disable()
    src = _session.default().log.sink.path
    # each conversion as `commpatch convert` runs it: in a fresh process, the median of 3
    times = {
        suffix: sorted(_convert_in_fresh_process(src, os.path.join(small, f"c{i}.{suffix}")) for i in range(3))[1]
        for suffix in ("csv", "parquet")
    }
    t2 = time.perf_counter()
    df = commpatch.read_csv(src)
    t3 = time.perf_counter()
    print(
        f"{len(df):,} rows, each conversion in a fresh process (median of 3): to CSV {times['csv'][0]:.2f} s "
        f"(target <= 1.5), to Parquet {times['parquet'][0]:.2f} s (target <= 0.5); importing pyarrow first "
        f"{times['csv'][1]:.2f} s; read as a DataFrame {t3 - t2:.2f} s"
    )
    dist.destroy_process_group()


def _convert_in_fresh_process(src: str, out: str) -> tuple:
    """(seconds converting, seconds importing pyarrow first) in a new process (commpatch's and
    numpy's imports not counted)."""
    code = (
        "import sys, time; from commpatch.io import writer; t0 = time.perf_counter(); "
        "import pyarrow, pyarrow.csv, pyarrow.parquet; t1 = time.perf_counter(); "
        "writer.convert(sys.argv[1], sys.argv[2]); print(time.perf_counter() - t1, t1 - t0)"
    )
    res = subprocess.run([sys.executable, "-c", code, src, out], capture_output=True, text=True, check=True)
    convert, imports = res.stdout.strip().splitlines()[-1].split()
    return float(convert), float(imports)


if __name__ == "__main__":
    sys.exit(main())
