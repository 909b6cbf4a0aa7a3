"""Merge at scale: read N ranks x M rows of per-rank CSVs and produce the full cross-rank report.

    python benchmarks/merge_scale.py                       # 64 ranks x 100,000 rows (target: <= 30 s, < 4 GB)
    python benchmarks/merge_scale.py --ranks 8 --rows 10000
    python benchmarks/merge_scale.py --dir /tmp/logs --keep   # reuse / keep the generated logs

The logs are synthetic (commpatch.synthetic: a data-parallel step pattern with a straggler and a
planted mismatch), written one rank at a time. The measured part runs in a fresh child process
(what `commpatch report DIR` does: read every file, summary, per-step, cross-rank matching,
stragglers, mismatches, text rendering), so its peak RSS is the child's alone.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

MEASURE = r"""
import sys, time
t0 = time.perf_counter()
from commpatch import merge, report
df = merge.read_logs(sys.argv[1], columns=report.REPORT_COLUMNS)
t1 = time.perf_counter()
cross = merge.cross_rank(df)
text = report.render_report_text(report.build_report(df, cross=cross))
t2 = time.perf_counter()
assert cross.ranks["rank"].iloc[0] == int(sys.argv[2]), "straggler not found"
assert len(cross.mismatches) >= 1, "planted mismatch not found"
print(f"{len(df)} {t1 - t0:.2f} {t2 - t1:.2f}")
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--rows", type=int, default=100_000, help="rows per rank (rounded to whole steps)")
    parser.add_argument("--dir", help="where the logs are (generated when empty or missing)")
    parser.add_argument("--keep", action="store_true", help="keep generated logs")
    args = parser.parse_args()

    from commpatch.synthetic import PATTERN, write_rank_files

    straggler = min(3, args.ranks - 1)
    directory = args.dir or tempfile.mkdtemp(prefix="commpatch_merge_scale_")
    generated = not (os.path.isdir(directory) and os.listdir(directory))
    try:
        if generated:
            t = time.perf_counter()
            steps = max(1, args.rows // len(PATTERN))
            write_rank_files(directory, args.ranks, steps, straggler=straggler, mismatch=(1, 7))
            size = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))
            print(f"generated {args.ranks} ranks x {steps * len(PATTERN)} rows ({size / 1e9:.2f} GB of CSV) "
                  f"in {time.perf_counter() - t:.1f} s (not measured)", file=sys.stderr)
        t = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", MEASURE, directory, str(straggler)],
                             check=True, capture_output=True, text=True).stdout.split()
        wall = time.perf_counter() - t
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024   # KiB on Linux
        rows, read_s, analyse_s = int(out[0]), float(out[1]), float(out[2])
        print(f"merge_scale: {args.ranks} ranks, {rows} rows: {wall:.1f} s total "
              f"(read {read_s:.1f} s, analysis + report {analyse_s:.1f} s, interpreter start and imports "
              f"the rest), peak RSS {peak / 2**30:.2f} GiB")
    finally:
        if generated and not args.keep:
            shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
