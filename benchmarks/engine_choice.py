"""DuckDB or Polars for the cross-rank report: the same three heavy queries on the same data.

    python benchmarks/engine_choice.py --ranks 64            # needs duckdb and polars installed
    python benchmarks/engine_choice.py --ranks 256 --rows 100000

Generates binary rank logs (commpatch.testing.write_binary_run), reduces them as the engine
path does (commpatch.analysis.engine.stage: one Parquet file of integer columns per rank), then
runs, each engine in a fresh process: the match of every collective by (group, sequence number)
with first / last arrival and the straggler; the join of every row with its collective for the
time each rank waited (the ranks table); the summary with exact p50 / p95. DuckDB reads the
Parquet files with read_parquet; Polars with scan_parquet and its streaming engine. Prints wall
time per query and the process's peak RSS; the load average is printed too (shared machine).
"""

from __future__ import annotations

import argparse
import functools
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(which: str, directory: str) -> None:
    pattern = os.path.join(directory, "*.parquet")
    t0 = time.perf_counter()
    if which == "duckdb":
        import duckdb

        con = duckdb.connect()
        src = f"read_parquet('{pattern}')"
        con.execute(f"""CREATE TABLE coll AS SELECT "group" AS g, cseq, count(*) AS n, min(start_ns) AS fs,
            max(start_ns) AS ls, arg_max(rank, start_ns::HUGEINT * 1048576 + rank) AS straggler,
            min(hash(op, dtype, bytes)) <> max(hash(op, dtype, bytes)) AS differs
            FROM {src} WHERE cseq >= 0 GROUP BY ALL""")
        t1 = time.perf_counter()
        top = con.execute(f"""SELECT r.rank, count(*), sum(least((c.ls - r.start_ns) / 1e3, r.dur)) AS wait
            FROM {src} r JOIN coll c ON r."group" = c.g AND r.cseq = c.cseq GROUP BY r.rank ORDER BY wait""").fetchone()
        t2 = time.perf_counter()
        con.execute(f"""SELECT k0, k1, count(*), sum(dur), quantile_cont(dur, 0.5), quantile_cont(dur, 0.95)
            FROM {src} GROUP BY ALL""").fetchall()
    else:
        import polars as pl

        lf = pl.scan_parquet(pattern)
        coll = (
            lf.filter(pl.col("cseq") >= 0)
            .group_by("group", "cseq")
            .agg(
                n=pl.len(),
                fs=pl.col("start_ns").min(),
                ls=pl.col("start_ns").max(),
                straggler=pl.col("rank").sort_by(["start_ns", "rank"]).last(),
                differs=pl.struct("op", "dtype", "bytes").n_unique() > 1,
            )
            .collect(engine="streaming")
        )
        t1 = time.perf_counter()
        top = (
            lf.join(coll.lazy(), on=["group", "cseq"])
            .group_by("rank")
            .agg(n=pl.len(), wait=pl.min_horizontal((pl.col("ls") - pl.col("start_ns")) / 1e3, pl.col("dur")).sum())
            .sort("wait")
            .collect(engine="streaming")
            .row(0)
        )
        t2 = time.perf_counter()
        lf.group_by("k0", "k1").agg(
            n=pl.len(),
            total=pl.col("dur").sum(),
            p50=pl.col("dur").quantile(0.5, "linear"),
            p95=pl.col("dur").quantile(0.95, "linear"),
        ).collect(engine="streaming")
    t3 = time.perf_counter()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(
        f"| {which} | {t1 - t0:.2f} | {t2 - t1:.2f} | {t3 - t2:.2f} | {t3 - t0:.2f} | {peak:.2f} | "
        f"{int(top[0])} | {os.getloadavg()[0]:.1f} |",
        flush=True,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--run", nargs=2, metavar=("ENGINE", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        run(*args.run)
        return 0
    sys.path.insert(0, ROOT)
    from commpatch import io
    from commpatch.analysis import engine
    from commpatch.testing import write_binary_run

    base = tempfile.mkdtemp(prefix="commpatch_engine_choice_")
    try:
        write_binary_run(os.path.join(base, "logs"), args.ranks, args.rows)
        staged = os.path.join(base, "staged")
        stage = functools.partial(engine.stage, directory=staged, by=["collective", "size_bucket"])
        for _ in io.read_ranks(os.path.join(base, "logs"), stage, columns=None, workers=2):
            pass
        print(
            f"{args.ranks} ranks x {args.rows} rows, the engine's staged Parquet (s; straggler: the rank "
            "that waited least)\n\n| engine | match | ranks (join) | summary | total | peak RSS (GiB) | straggler | load |"
            "\n|---|---:|---:|---:|---:|---:|---:|---:|",
            flush=True,
        )
        for which in ("duckdb", "polars"):
            subprocess.run([sys.executable, __file__, "--run", which, os.path.join(staged, "rows")], check=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
