"""How long reading a binary rank log takes: the parse (frames, registries and the checks of every
row that make a damaged or hostile file safe to read: docs/decisions/damaged-logs.md) and the
Arrow table built from it.

    python benchmarks/log_parse.py                    # 1M rows, 5 rounds
    python benchmarks/log_parse.py --rows 4000000

The log is rank 0's of ``commpatch.testing.write_binary_run`` (framed as the recorder writes it).
Medians of the rounds; the load average is printed too (shared machine).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    from commpatch.data.frame import arrow_table, parse_log
    from commpatch.testing import write_binary_run

    with tempfile.TemporaryDirectory() as tmp:
        path = write_binary_run(tmp, 2, args.rows, straggler=None, mismatch=None)[0]
        with open(path, "rb") as f:
            data = f.read()
    parse_s, arrow_s = [], []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        parsed = parse_log(data)
        t1 = time.perf_counter()
        arrow_table(parsed)
        parse_s.append(t1 - t0)
        arrow_s.append(time.perf_counter() - t1)
    rows = len(parsed.rows)
    print(
        f"{rows:,} rows ({len(data) / 1e6:.0f} MB): parse {statistics.median(parse_s):.3f} s, "
        f"Arrow table {statistics.median(arrow_s):.3f} s (medians of {args.rounds}; load {os.getloadavg()[0]:.1f})"
    )


if __name__ == "__main__":
    main()
