"""Memory per recorded call at 1M calls, and the time from log to DataFrame to CSV / Parquet.

Usage: python benchmarks/memory.py [--calls 1000000] [--out DIR]
Prints: bytes per row held by the live log (and the process RSS growth per row), then the
seconds to build the DataFrame, write CSV (pyarrow, and pandas' own to_csv for comparison
on a 100k-row slice) and write Parquet; then ``commpatch.log()`` + ``commpatch.export_csv()`` (which
reads the log again) against a plain pyarrow write of the same frame (``Table.from_pandas`` +
``pyarrow.csv.write_csv``), alternating, 3 rounds (goal: <= 2x).
"""

import argparse
import os
import resource
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
    parser.add_argument("--calls", type=int, default=1_000_000)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    fake_world(8)
    t = torch.ones(1)
    for _ in range(1000):
        dist.all_reduce(t)
    commpatch.enable(output="none")
    rss0 = rss_mb()
    start = time.perf_counter()
    for _ in range(args.calls):
        dist.all_reduce(t, async_op=False)
    record_s = time.perf_counter() - start
    rss1 = rss_mb()
    n = len(_session.default().log)
    print(f"recorded {n:,} calls in {record_s:.1f} s")
    print(
        f"live log: {_session.default().log.nbytes() / n:.1f} bytes/row (packed rows + late timings); "
        f"process RSS growth {1e6 * (rss1 - rss0) / n:.1f} bytes/row"
    )

    t0 = time.perf_counter()
    df = commpatch.log()
    t1 = time.perf_counter()
    out = args.out or tempfile.mkdtemp()
    csv = commpatch.export_csv(os.path.join(out, "rank{rank}.csv"), df=df)
    t2 = time.perf_counter()
    parquet = commpatch.export_csv(os.path.join(out, "rank{rank}.parquet"), df=df)
    t3 = time.perf_counter()
    sample = df.head(100_000)
    t4 = time.perf_counter()
    sample.to_csv(os.path.join(out, "pandas_sample.csv"), index=False)
    t5 = time.perf_counter()
    print(
        f"DataFrame build: {t1 - t0:.2f} s; + CSV (pyarrow) {t2 - t1:.2f} s = {t2 - t0:.2f} s for {len(df):,} rows "
        f"({os.path.getsize(csv) / 1e6:.0f} MB)"
    )
    print(
        f"Parquet: {t3 - t2:.2f} s ({os.path.getsize(parquet) / 1e6:.0f} MB); pandas to_csv on 100k rows: {t5 - t4:.2f} s "
        f"(x{(t5 - t4) * len(df) / 100_000 / max(t2 - t1, 1e-9):.1f} the pyarrow time, extrapolated)"
    )
    import pyarrow as pa
    import pyarrow.csv as pacsv

    ratios = []
    for r in range(3):
        t0 = time.perf_counter()
        frame = commpatch.log()
        commpatch.export_csv(os.path.join(out, f"again{r}-rank{{rank}}.csv"))
        t1 = time.perf_counter()
        pacsv.write_csv(pa.Table.from_pandas(frame, preserve_index=False), os.path.join(out, f"plain{r}.csv"))
        t2 = time.perf_counter()
        ratios.append((t1 - t0) / (t2 - t1))
        print(
            f"log() + export_csv(): {t1 - t0:.2f} s; a plain pyarrow write of the frame: {t2 - t1:.2f} s (x{ratios[-1]:.2f})"
        )
    print(f"log() + export_csv() against a plain pyarrow write: x{sorted(ratios)[1]:.2f} (median of 3; goal <= 2)")
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3:.0f} MB")
    commpatch.disable()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
