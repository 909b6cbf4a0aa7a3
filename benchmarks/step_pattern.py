"""How long finding steps from the pattern of collectives takes on one large rank.

    python benchmarks/step_pattern.py                 # 1M rows, 5 rounds
    python benchmarks/step_pattern.py --rows 4000000

One rank's log with no step boundary, built like commpatch.testing's logs: a set-up prefix
then a 26-call iteration (12 identical layers of 2 all-reduces and a head: the layer block is a
candidate period too) repeated to ``--rows``; and an aperiodic log of the same size (random calls
among 20 kinds: refused); and the periodic log with its steps recorded (the check that finds
no stepless rank: what every log with steps pays). Times ``analysis.pattern.with_pattern_steps`` on the DataFrame (the
keys, the idle gaps, the search and the renumbering), median of the rounds; the load average is
printed too (shared machine).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def rank_frame(rows: int, periodic: bool, seed: int = 0):
    import pandas as pd

    from commpatch.data.schema import SCHEMA

    rng = np.random.default_rng(seed)
    if periodic:
        block = np.array([1024, 32] * 12 + [4000, 16], np.int64)
        nbytes = np.r_[np.array([1 << 16, 1 << 10, 64]), np.tile(block, rows // len(block) + 1)][:rows]
        compute = np.r_[np.zeros(3), np.tile(np.r_[1000.0, np.zeros(len(block) - 1)], rows // len(block) + 1)][:rows]
    else:
        nbytes = (1 << rng.integers(0, 20, rows)).astype(np.int64)
        compute = rng.uniform(0, 1000, rows)
    dur = rng.uniform(20, 80, rows)
    start_ns = (1e15 + (np.cumsum(compute + 10.0) + np.r_[0, np.cumsum(dur)[:-1]]) * 1e3).astype(np.int64)
    cols = {
        "seq": np.arange(rows),
        "rank": np.zeros(rows, np.int64),
        "op": pd.Categorical(np.full(rows, "all_reduce")),
        "group": pd.Categorical(np.full(rows, "0")),
        "bytes": nbytes,
        "start_ns": start_ns,
        "host_us": dur,
        "step": np.zeros(rows, np.int64),
        "step_source": pd.Categorical(np.full(rows, "none")),
    }
    assert set(cols) <= {c.name for c in SCHEMA}
    return pd.DataFrame(cols)


def main() -> None:
    from commpatch.analysis.pattern import with_pattern_steps

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    for kind in ("periodic", "aperiodic", "stepped"):
        df = rank_frame(a.rows, kind != "aperiodic")
        if kind == "stepped":
            df["step"] = np.arange(a.rows) // 26
        times = []
        for _ in range(a.rounds):
            t = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out = with_pattern_steps(df)
            times.append(time.perf_counter() - t)
        found = out.attrs.get("step_pattern", {0: "steps recorded: left as they are"})[0]
        print(
            f"{kind}: {a.rows:,} rows, median {statistics.median(times) * 1e3:.1f} ms "
            f"(min {min(times) * 1e3:.0f}, max {max(times) * 1e3:.0f}) -> {found}"
        )
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
